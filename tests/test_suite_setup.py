"""The suite's own set-up (tests/conftest.py): plain pytest, without xdist workers, still runs, and
a pytest that a test starts leaves the session's figures (tests/suite_figures.py) alone."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pytest_in_one_process_collects_the_grouped_tests_and_a_nested_session_writes_no_figures():
    """The compose tests carry an xdist group; collected without workers (`make test TEST_WORKERS=0` does)
    their ids stay as they are, and collecting only starts no Docker set-up."""
    figures = ROOT / "runs" / "test-suite.json"
    before = figures.read_bytes() if figures.exists() else None
    env = {**os.environ, "CENTERLINE_TEST_SESSION": os.environ.get("CENTERLINE_TEST_SESSION", "outer")}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider", "tests/compose/test_compose.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ids = [line for line in out.stdout.splitlines() if line.startswith("tests/")]
    assert ids and all(i.startswith("tests/compose/test_compose.py::test_") and "@" not in i for i in ids), ids
    assert (figures.read_bytes() if figures.exists() else None) == before

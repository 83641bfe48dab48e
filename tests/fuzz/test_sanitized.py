"""The C scanner built with AddressSanitizer and UBSan, run under the proxy's fuzz target
(``fuzz/sanitized.py``): a memory error or undefined behaviour in the code that parses untrusted
bytes fails the suite. Bounded to a few seconds; longer runs: ``python -m fuzz.sanitized --runs N``."""

from __future__ import annotations

import subprocess
import sys
import sysconfig

import pytest

from tests.processes import ENV, REPO

RUNS = 1500
pytestmark = pytest.mark.integration  # gcc, then a child interpreter with libasan preloaded


def test_the_c_scanner_passes_the_proxy_fuzz_target_under_asan_and_ubsan():
    cmd = [sys.executable, "-m", "fuzz.sanitized", "--canary", "--runs", str(RUNS)]
    out = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    lines = out.stdout.splitlines()
    module = REPO / "build" / "asan" / ("_rowscan" + sysconfig.get_config_var("EXT_SUFFIX"))
    assert lines[:3] == [
        "canary: overread(16) caught (heap-buffer-overflow, exit 1)",
        "canary: overflow(1) caught (runtime error: signed integer overflow, exit 1)",
        f"sanitized scanner: {module}",
    ]
    assert lines[3].startswith(f"ran {RUNS} inputs through the target in ") and lines[3].endswith(" s, no finding")

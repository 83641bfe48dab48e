"""`centerline up` end to end: every service as a real process, a few steps, then the report."""

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
@pytest.mark.slow
def test_up_runs_steps_and_writes_the_report(tmp_path):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "centerline", "up", "--steps", "3", "--workers", "2", "--trainer-ranks", "2",
            "--prompts-per-step", "2", "--rollout-n", "2", "--eval-prompts", "8", "--eval-every", "2",
            "--model-dir", str(tmp_path / "models"), "--run-dir", str(run_dir)]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]

    steps = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["gate_accepted"] == 2 and s["gate_rejected"] == {} and s["samples"] == 4 for s in steps)
    evals = [orjson.loads(line)["step"] for line in (run_dir / "eval.jsonl").read_bytes().splitlines()]
    assert evals == [0, 2, 3]
    # Non-TTY progress: one JSON line per step and per evaluation on stdout.
    printed = [orjson.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["step"] for r in printed if "loss" in r] == [1, 2, 3]

    page = (run_dir / "report.html").read_text()
    plots = {"reward", "accuracy", "sc_correction", "head_mass", "tail_ratio", "kl", "staleness", "gate"}
    assert {p.stem for p in (run_dir / "plots").glob("*.png")} == plots
    assert all((run_dir / "plots" / f"{name}.png").read_bytes().startswith(PNG_MAGIC) for name in plots)
    assert page.count("data:image/png;base64,") == len(plots)
    assert "batches accepted / rejected</td><td>6 / 0" in page
    assert "rollout_top_logprobs_num = 128" in page  # the resolved configuration

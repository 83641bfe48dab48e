"""`centerline up` end to end: every service as a real process, a few steps, then the report."""


import orjson
import pytest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
@pytest.mark.slow
def test_up_runs_steps_and_writes_the_report(up_run):
    run_dir = up_run.run_dir
    steps = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["gate_accepted"] == 3 and s["gate_rejected"] == {} and s["samples"] == 6 for s in steps)
    evals = [orjson.loads(line)["step"] for line in (run_dir / "eval.jsonl").read_bytes().splitlines()]
    assert evals == [0, 2, 3]
    # Non-TTY progress: one JSON line per step and per evaluation on stdout.
    printed = [orjson.loads(line) for line in up_run.stdout.splitlines() if line.startswith("{")]
    assert [r["step"] for r in printed if "loss" in r] == [1, 2, 3]

    page = (run_dir / "report.html").read_text()
    plots = {"reward", "accuracy", "sc_correction", "head_mass", "tail_ratio", "kl", "staleness", "gate"}
    assert {p.stem for p in (run_dir / "plots").glob("*.png")} == plots
    assert all((run_dir / "plots" / f"{name}.png").read_bytes().startswith(PNG_MAGIC) for name in plots)
    assert page.count("data:image/png;base64,") == len(plots)
    assert "batches accepted / rejected</td><td>9 / 0" in page
    assert "rollout_top_logprobs_num = 128" in page  # the resolved configuration

"""`centerline experiment staleness` end to end: a tiny grid of real `centerline up` runs, then the comparison page."""

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
@pytest.mark.slow
def test_experiment_runs_each_pair_and_writes_the_comparison(tmp_path):
    out = tmp_path / "exp"
    argv = [
        sys.executable,
        "-m",
        "centerline",
        "experiment",
        "staleness",
        "--steps",
        "2",
        "--staleness",
        "2",
        "--losses",
        "score_centering,reinforce",
        "--out",
        str(out),
        # passed through to every `centerline up` run
        "--workers",
        "1",
        "--trainer-ranks",
        "1",
        "--prompts-per-step",
        "2",
        "--rollout-n",
        "2",
        "--eval-prompts",
        "8",
        "--model-dir",
        str(tmp_path / "models"),
    ]
    run = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]

    # one staleness, two losses: each run starts its own SGLang server, router and trainer (~50 s here)
    names = ["score_centering-s2", "reinforce-s2"]
    results = orjson.loads((out / "results.json").read_bytes())
    assert [r["name"] for r in results] == names
    for r in results:
        steps = [orjson.loads(line) for line in (out / "runs" / r["name"] / "metrics.jsonl").read_bytes().splitlines()]
        assert [s["step"] for s in steps] == [1, 2]
        assert r["accuracy_before"] is not None and r["accuracy_after"] is not None
        assert r["staleness_max"] <= r["staleness"]
    config = (out / "runs" / "reinforce-s2" / "config.toml").read_text()
    assert 'loss = "reinforce"' in config and "max_inflight_steps = 2" in config and "max_staleness = 2" in config

    plots = {"reward", "kl", "staleness", "accuracy"}
    assert {p.stem for p in (out / "plots").glob("*.png")} == plots
    assert all((out / "plots" / f"{name}.png").read_bytes().startswith(PNG_MAGIC) for name in plots)
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(plots)
    assert all(f"<td>{name}</td>" in page for name in names)

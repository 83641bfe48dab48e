"""A run's headline figures as data (centerline/runs/run_figures.py): what README's prose about a run quotes."""

import json

import pytest

from centerline.runs.run_figures import commit, digest, run_figures, stamped, write_bench_figures


def step(n: int, **over) -> dict:
    record = {
        "step": n,
        "samples": 4,
        "trained_tokens": 10,
        "step_s": 0.5,
        "gather_s": 0.1,
        "reward_mean": n / 10,
        "train_rollout_kl": 0.001 * n,
        "staleness_mean": 1.0,
        "staleness_max": 1,
        "token_kv_unverified_share": 0.0,
        "gate_accepted": 2,
        "gate_rejected": {},
        "gate_resampled": 0,
    }
    return {**record, **over}


# the held-out record as this release writes it, and as an earlier release did (read the same)
@pytest.mark.parametrize(("heldout_file", "key"), [("heldout_metrics.jsonl", "heldout"), ("eval.jsonl", "eval")])
def test_the_figures_of_a_run_are_its_metrics_summed_and_averaged_at_both_ends(tmp_path, heldout_file, key):
    steps = [step(n) for n in range(1, 41)]
    steps[5] = step(6, gate_rejected={"stale": 1}, gate_resampled=1, staleness_max=2, token_kv_unverified_share=0.5)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    heldout = [{"step": 0, f"{key}_accuracy": 0.125, f"{key}_rows": 8}, {"step": 40, f"{key}_accuracy": 0.5}]
    (tmp_path / heldout_file).write_text("".join(json.dumps(h) + "\n" for h in heldout))
    figures = run_figures(tmp_path)
    assert figures == {
        "steps": 40,
        "samples": 160,
        "steps_wall_s": 20.0,
        "window_steps": 30,
        "reward_first": pytest.approx(1.55),  # steps 1..30: mean 15.5 / 10
        "reward_last": pytest.approx(2.55),  # steps 11..40
        "heldout": [{"step": 0, "value": 0.125}, {"step": 40, "value": 0.5}],
        "train_rollout_kl_mean": 0.0205,
        "train_rollout_kl_max": 0.04,
        "train_rollout_kl_first": 0.0155,
        "train_rollout_kl_last": 0.0255,
        "staleness_mean": 1.0,
        "staleness_max": 2,
        "token_kv_unverified_share": 0.0125,  # 5 of 400 trained tokens
        "gather_s_mean": 0.1,
        "step_s_mean": 0.5,
        "batches_accepted": 80,
        "batches_rejected": 1,
        "tasks_republished": 1,
    }


def test_a_run_whose_sessions_offered_tools_has_the_share_of_calls_that_parsed_at_each_end(tmp_path):
    """calls parsed / (calls parsed + replies whose markup did not parse), over the 30-step windows."""
    steps = [step(n, tool_calls=3, tool_call_parse_errors=1 if n <= 10 else 0) for n in range(1, 41)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    figures = run_figures(tmp_path)
    assert figures["well_formed_calls_first"] == round(90 / 100, 4)  # steps 1..30: 10 errors
    assert figures["well_formed_calls_last"] == 1.0  # steps 11..40
    assert figures["tool_calls_per_sample_first"] == figures["tool_calls_per_sample_last"] == 0.75  # 3 of 4 samples
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(step(n)) + "\n" for n in range(1, 5)))
    assert "well_formed_calls_first" not in run_figures(tmp_path)  # no session offered tools


def test_a_run_without_steps_has_no_figures(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no steps"):
        run_figures(tmp_path)


@pytest.mark.integration
def test_up_writes_its_figures_with_the_command_commit_and_machine(up_run):
    written = json.loads((up_run.run_dir / "figures.json").read_text())
    assert {k: v for k, v in written.items() if k not in ("command", "commit", "machine", "digest")} == run_figures(
        up_run.run_dir
    )
    assert written["digest"] == digest(written)
    assert written["command"].startswith("centerline up --task copy --steps 3 ")
    assert written["steps"] == up_run.steps and len(written["commit"]) == 40
    assert set(written["machine"]) == {"hostname", "cpu_model", "nproc", "measured_at"}


def test_stamped_figures_carry_their_provenance_and_a_digest_of_it_all():
    doc = stamped({"tokens": 4096, "ms": 0.418}, "centerline bench wire --json")
    assert list(doc) == ["tokens", "ms", "command", "commit", "machine", "digest"]
    assert doc["command"] == "centerline bench wire --json" and doc["commit"] == commit() and len(doc["commit"]) == 40
    assert set(doc["machine"]) == {"hostname", "cpu_model", "nproc", "measured_at"}
    assert doc["digest"] == digest(doc) == digest({k: v for k, v in doc.items() if k != "digest"})
    assert digest({**doc, "ms": 0.419}) != doc["digest"]
    assert digest({**doc, "command": "centerline bench wire"}) != doc["digest"]


def test_a_bench_prints_its_figures_and_writes_them_stamped(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["centerline", "bench", "loss", "--out", str(tmp_path / "loss.json")])
    write_bench_figures({"reinforce_ms": 220.5}, tmp_path / "loss.json")
    assert json.loads(capsys.readouterr().out) == {"reinforce_ms": 220.5}
    written = json.loads((tmp_path / "loss.json").read_text())
    assert written["reinforce_ms"] == 220.5 and written["digest"] == digest(written)
    assert written["command"] == f"centerline bench loss --out {tmp_path / 'loss.json'}"

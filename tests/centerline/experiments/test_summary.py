"""An experiment's numbers (centerline/experiments/summary.py): each setting's t-interval over its
seeds, differences to REINFORCE paired by seed, the table, the plots, a run's own numbers."""

import math

import orjson
import pytest

from centerline.experiments.report import render_plots
from centerline.experiments.summary import aggregate, markdown_table, summarise

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _result(method: str, seed: int, reward_last: float, accuracy_after, kl_max: float) -> dict:
    loss, _, is_mode = method.partition("+")
    return {
        "method": method,
        "loss": loss,
        "is_mode": is_mode or "none",
        "staleness": 4,
        "seed": seed,
        "staleness_mean": 3.0,
        "reward_first": 0.3,
        "reward_last": reward_last,
        "accuracy_before": 0.3,
        "accuracy_after": accuracy_after,
        "kl_max": kl_max,
    }


def test_aggregate_reports_each_setting_with_the_t_interval_over_its_seeds():
    results = [
        _result("score_centering+tis", 0, 0.4, 0.40, 0.1),
        _result("reinforce", 0, 0.2, None, 0.6),
        _result("score_centering+tis", 1, 0.5, 0.42, 0.1),
        _result("score_centering+tis", 2, 0.6, 0.44, 0.1),
    ]
    tis, reinforce = aggregate(results)
    assert (tis["method"], tis["is_mode"], tis["seeds"]) == ("score_centering+tis", "tis", [0, 1, 2])
    # sd 0.1 over 3 seeds: half-width t(0.975, 2) * 0.1 / sqrt(3) = 0.24841377
    half = 0.1 * math.sqrt(2 * 0.9025 / 0.0975 / 3)
    assert tis["reward_last"] == pytest.approx({"mean": 0.5, "low": 0.5 - half, "high": 0.5 + half})
    assert tis["accuracy_after"] == pytest.approx({"mean": 0.42, "low": 0.42 - half / 5, "high": 0.42 + half / 5})
    assert tis["kl_max"] == pytest.approx({"mean": 0.1, "low": 0.1, "high": 0.1})
    assert reinforce["reward_last"] == {"mean": 0.2, "low": None, "high": None}
    assert reinforce["accuracy_after"] is None
    table = markdown_table([tis, reinforce]).splitlines()
    assert table[0].count(" | ") == table[2].count(" | ") and "\\|kl\\| max" in table[0]  # pipes escaped
    assert table[2].startswith("| score_centering+tis | 4 | 3 | 3 | 0.300 [0.300, 0.300] | 0.500 [0.252, 0.748] |")
    assert table[3].startswith("| reinforce | 4 | 1 | 3 | 0.300 | 0.200 | – | 0.600 |")


def test_differences_to_reinforce_are_paired_by_seed():
    results = [
        _result("reinforce", 0, 0.10, 0.05, 0.6),
        _result("reinforce", 1, 0.30, 0.20, 0.6),
        _result("reinforce", 2, 0.50, None, 0.6),  # no evaluation: that seed's pair is left out
        _result("tis", 0, 0.15, 0.10, 0.1),
        _result("tis", 1, 0.34, 0.26, 0.1),
        _result("tis", 2, 0.56, 0.40, 0.1),
    ]
    reinforce, tis = aggregate(results)
    assert reinforce["reward_last_vs_reinforce"] is None and reinforce["accuracy_after_vs_reinforce"] is None
    # reward: differences 0.05, 0.04, 0.06 (mean 0.05, sd 0.01) although the seeds' own rewards spread 0.15-0.56
    half = 0.01 * math.sqrt(2 * 0.9025 / 0.0975 / 3)
    assert tis["reward_last_vs_reinforce"] == pytest.approx({"mean": 0.05, "low": 0.05 - half, "high": 0.05 + half})
    assert tis["reward_last"]["high"] - tis["reward_last"]["low"] > 20 * 2 * half
    # held-out: seeds 0 and 1 only (0.05 and 0.06)
    t1 = 12.706204736174698  # t(0.975, 1)
    assert tis["accuracy_after_vs_reinforce"] == pytest.approx(
        {"mean": 0.055, "low": 0.055 - t1 * 0.005, "high": 0.055 + t1 * 0.005}
    )
    header = markdown_table([reinforce, tis]).splitlines()[0]
    assert header.endswith("| reward last ¼ − reinforce, same seed | held-out after − reinforce, same seed |")


def test_the_paired_differences_get_their_own_plot_when_reinforce_ran():
    with_baseline = [
        {**_result(method, seed, 0.1 + seed / 10, 0.2, 0.1), "steps": []}
        for method in ("reinforce", "tis")
        for seed in (0, 1)
    ]
    plots = render_plots(with_baseline, aggregate(with_baseline))
    assert set(plots) == {"reward", "kl", "staleness", "final", "paired"}
    assert plots["paired"][0].startswith("Difference to reinforce, paired by seed: mean over seeds")
    assert plots["paired"][1].startswith(PNG_MAGIC)
    without = [r for r in with_baseline if r["method"] == "tis"]
    assert set(render_plots(without, aggregate(without))) == {
        "reward",
        "kl",
        "staleness",
        "final",
    }


# the held-out record as this release writes it, and as an earlier release did (read the same)
@pytest.mark.parametrize(("heldout_file", "key"), [("heldout_metrics.jsonl", "heldout"), ("eval.jsonl", "eval")])
def test_a_run_of_sessions_is_summarised_by_its_held_out_reward(tmp_path, heldout_file, key):
    step = {"staleness_mean": 1.0, "staleness_max": 1, "reward_mean": 0.5, "train_rollout_kl": 0.01, "loss": 0.1}
    (tmp_path / "metrics.jsonl").write_text("".join(orjson.dumps({"step": s, **step}).decode() + "\n" for s in (1, 2)))
    evals = [{"step": 0, f"{key}_reward": 0.66}, {"step": 2, f"{key}_reward": 0.71}]
    (tmp_path / heldout_file).write_text("".join(orjson.dumps(e).decode() + "\n" for e in evals))
    summary = summarise({"name": "chain"}, tmp_path, None)
    assert (summary["accuracy_before"], summary["accuracy_after"]) == (0.66, 0.71)

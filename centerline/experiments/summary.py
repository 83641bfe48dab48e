"""An experiment's numbers: each run's from what it wrote (``summarise``), each setting's over its
seeds (``aggregate``), as ``interval.py``'s mean and Student-t interval, and the per-setting table
(``markdown_table``).

Seeds differ most in where they start (each its own SFT model), so the final reward and held-out
accuracy are also given as differences to REINFORCE's run of the same seed and staleness, with
the same interval over those paired differences: what the method adds, without the seed's luck.
"""

from __future__ import annotations

from pathlib import Path

from centerline.experiments.interval import format_interval, interval
from centerline.runs.report import load_steps
from shared.heldout_record import ACCURACY, REWARD

# the per-run numbers summarised across seeds, with the header each table gives them
FINAL = (("reward_last", "reward last ¼"), ("accuracy_after", "held-out after"), ("kl_max", "|kl| max"))
BASELINE = "reinforce"  # the paired differences' reference method
PAIRED = ("reward_last", "accuracy_after")  # numbers also reported as differences to BASELINE, seed by seed


def summarise(run: dict, run_dir: Path, wall_s: float | None) -> dict:
    """``run`` (a ``staleness.grid`` entry) with what its ``metrics.jsonl`` and held-out record say."""
    steps = load_steps(run_dir)
    trained = [s for s in steps if "loss" in s]
    # the held-out figure: exact-match accuracy, or a run of sessions' mean reward
    evals = [s.get(ACCURACY, s.get(REWARD)) for s in steps if {ACCURACY, REWARD} & set(s)]
    rewards = [s["reward_mean"] for s in trained]
    tail = max(1, len(rewards) // 4)
    return {
        **run,
        "run_dir": str(run_dir),
        "wall_s": None if wall_s is None else round(wall_s, 1),
        "steps": trained,
        "staleness_mean": sum(s["staleness_mean"] for s in trained) / len(trained),
        "staleness_max": max(s["staleness_max"] for s in trained),
        "reward_first": sum(rewards[:tail]) / tail,
        "reward_last": sum(rewards[-tail:]) / tail,
        "kl_mean": sum(abs(s["train_rollout_kl"]) for s in trained) / len(trained),
        "kl_max": max(abs(s["train_rollout_kl"]) for s in trained),
        "accuracy_before": evals[0] if evals else None,
        "accuracy_after": evals[-1] if len(evals) > 1 else None,
    }


def aggregate(results: list[dict]) -> list[dict]:
    """One entry per setting (method, staleness), in grid order: its seeds, and for each number
    in ``FINAL`` (and the reward's and accuracy's starting points) ``{"mean", "low", "high"}``
    over the seeds; ``low``/``high`` are None with one seed, the whole entry None with no values."""
    settings: dict[tuple[str, int], list[dict]] = {}
    for r in results:
        settings.setdefault((r["method"], r["staleness"]), []).append(r)
    summary = []
    for (method, staleness), runs in settings.items():
        entry = {
            "method": method,
            "loss": runs[0]["loss"],
            "is_mode": runs[0]["is_mode"],
            "staleness": staleness,
            "seeds": [r["seed"] for r in runs],
            "staleness_mean": sum(r["staleness_mean"] for r in runs) / len(runs),
        }
        for key in ("reward_first", "accuracy_before", *(key for key, _ in FINAL)):
            entry[key] = interval([r[key] for r in runs])
        # Paired by seed: a seed's runs share their SFT start and data order, so the difference to
        # REINFORCE's run of the same seed and staleness leaves out how good that start was.
        baseline = {r["seed"]: r for r in settings.get((BASELINE, staleness), [])}
        for key in PAIRED:
            pairs = [
                r[key] - baseline[r["seed"]][key]
                for r in runs
                if r["seed"] in baseline and r[key] is not None and baseline[r["seed"]][key] is not None
            ]
            entry[f"{key}_vs_{BASELINE}"] = None if method == BASELINE else interval(pairs)
        summary.append(entry)
    return summary


def fmt(value) -> str:
    return "–" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


SUMMARY_COLUMNS = [
    ("method", "method"),
    ("max_inflight_steps", "staleness"),
    ("seeds", "seeds"),
    ("staleness mean", "staleness_mean"),
    ("reward first ¼", "reward_first"),
    *((title, key) for key, title in FINAL),
    ("held-out before", "accuracy_before"),
    *((f"{title} − {BASELINE}, same seed", f"{key}_vs_{BASELINE}") for key, title in FINAL if key in PAIRED),
]


def summary_cells(entry: dict) -> list[str]:
    cells = []
    for _, key in SUMMARY_COLUMNS:
        value = entry[key]
        if key == "seeds":
            cells.append(str(len(value)))
        elif isinstance(value, dict) or value is None:
            cells.append(format_interval(value))
        else:
            cells.append(fmt(value))
    return cells


def markdown_table(summary: list[dict]) -> str:
    """The per-setting table, ready for the README."""
    lines = [
        "| " + " | ".join(title.replace("|", "\\|") for title, _ in SUMMARY_COLUMNS) + " |",
        "|" + "---|" * len(SUMMARY_COLUMNS),
        *("| " + " | ".join(summary_cells(entry)) + " |" for entry in summary),
    ]
    return "\n".join(lines)

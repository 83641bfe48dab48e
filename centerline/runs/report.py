"""`centerline report RUN_DIR`: the page people look at after a run.

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object per trainer step) and, when present,
``RUN_DIR/heldout_metrics.jsonl`` (the trainer's held-out evaluation, ``shared/heldout_record.py``, in
any deployment: ``{step, heldout_accuracy, ...}`` on exact-match rows such as the toy tasks',
``{step, heldout_reward, ...}`` otherwise; a run of an earlier release has ``RUN_DIR/eval.jsonl``,
its keys ``eval_*``, read the same; a `centerline up` run on a user's task also writes
``RUN_DIR/heldout.json``, which says which rows were held out, if any), and writes
``RUN_DIR/report.html`` (self-contained: plots inlined as PNG, no network) plus each plot
as ``RUN_DIR/plots/<name>.png``. A run on multi-turn sessions (any step with injected tokens)
also gets the sessions' plot: turns per sample, and sampled and injected tokens per sample; the
table counts the samples by finish reason, and the tool calls parsed and the replies whose calls did
not parse. The resolved configuration (``RUN_DIR/config.toml``) is
shown at the end when the run wrote one.

    centerline report runs/2026-11-29-2130

Left out on purpose: interactive plots (they would need a JavaScript bundle to stay
offline) and comparisons across runs (`centerline experiment` writes its own page).
"""

from __future__ import annotations

import argparse
import html
import sys
from pathlib import Path

import orjson

from centerline.runs.page import figure_png, image, page, pyplot, row, write_plots
from shared import heldout_record

STYLE = (
    "body{font-family:sans-serif;max-width:70em;margin:2em auto;color:#222}"
    "img{max-width:100%}table{border-collapse:collapse}td{padding:2px 12px;border-bottom:1px solid #ddd}"
    ".grid{display:grid;grid-template-columns:1fr 1fr;gap:1em}"
    "pre{background:#f6f6f6;padding:1em}"
)
# (file name, title, [(metric key, legend label)]) for each line plot, in page order.
LINE_PLOTS = [
    ("reward", "Reward (mean over the step's samples)", [("reward_mean", "train reward")]),
    ("accuracy", "Held-out accuracy", [(heldout_record.ACCURACY, "held-out exact match")]),
    (
        "heldout_reward",
        "Held-out mean reward (one sample per held-out row)",
        [(heldout_record.REWARD, "held-out reward")],
    ),
    (
        "sc_correction",
        "Score-centering correction: signed term sum_H c log p, and L1 mass sum_H |c|",
        [("sc_correction", "sc_correction"), ("sc_residual_l1", "sc_residual_l1")],
    ),
    (
        "head_mass",
        "Head mass: trainer P_H vs sampler Q_H",
        [("sc_train_head_mass", "train P_H"), ("sc_rollout_head_mass", "rollout Q_H")],
    ),
    ("tail_ratio", "Tail ratio rho = (1 - Q_H) / (1 - P_H)", [("sc_tail_ratio", "sc_tail_ratio")]),
    ("kl", "Train-rollout KL (k3 on sampled tokens)", [("train_rollout_kl", "train_rollout_kl")]),
    (
        "staleness",
        "Staleness (weight versions behind the trainer)",
        [("staleness_mean", "mean"), ("staleness_max", "max")],
    ),
]


def _read_jsonl(path: Path) -> list[dict]:
    records = []
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if line.strip():
            try:
                records.append(orjson.loads(line))
            except orjson.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number} is not JSON ({exc})") from None
    return records


def load_steps(run_dir: Path) -> list[dict]:
    """Trainer step records, with held-out evaluations merged in by step (step 0 = before training)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a trainer --run-dir?")
    by_step = {record["step"]: record for record in _read_jsonl(path)}
    for record in load_heldout(run_dir):
        figures = {k: v for k, v in record.items() if k in (heldout_record.ACCURACY, heldout_record.REWARD)}
        by_step.setdefault(record["step"], {"step": record["step"]}).update(figures)
    return [by_step[step] for step in sorted(by_step)]


def load_heldout(run_dir: Path) -> list[dict]:
    """The run's held-out records (``shared/heldout_record.py``), [] when it has none: an earlier
    release's ``eval.jsonl`` first, its ``eval_*`` keys spelled ``heldout_*``, then ``heldout_metrics.jsonl``."""
    records = []
    old, new = run_dir / heldout_record.OLD_FILE, run_dir / heldout_record.FILE
    if old.exists():
        records += [{_new_key(k): v for k, v in record.items()} for record in _read_jsonl(old)]
    if new.exists():
        records += _read_jsonl(new)
    return records


def _new_key(key: str) -> str:
    """A key of an earlier release's held-out record as this release spells it (``eval_s``: ``heldout_s``)."""
    return heldout_record.PREFIX + key.removeprefix("eval_") if key.startswith("eval_") else key


def render_plots(steps: list[dict]) -> dict[str, tuple[str, bytes]]:
    """name -> (title, PNG bytes) for every plot that has data."""
    plt = pyplot()
    plots = {}
    for name, title, series in LINE_PLOTS:
        lines = [
            (label, [(s["step"], s[key]) for s in steps if isinstance(s.get(key), (int, float))])
            for key, label in series
        ]
        lines = [(label, points) for label, points in lines if points]
        if not lines:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.2))
        for label, points in lines:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", markersize=3, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=8)
        plots[name] = (title, figure_png(fig))
        plt.close(fig)
    sessions = [s for s in steps if s.get("injected_tokens")]
    if sessions:  # a run on multi-turn sessions
        fig, ax = plt.subplots(figsize=(6.4, 3.2))
        xs = [s["step"] for s in sessions]
        ax.plot(xs, [s["turns_mean"] for s in sessions], marker="o", markersize=3, label="turns per sample")
        ax.set_ylabel("turns")
        tokens = ax.twinx()
        for key, label, color in (("sampled_tokens", "sampled", "C1"), ("injected_tokens", "injected", "C2")):
            per_sample = [s[key] / max(s.get("samples", 1), 1) for s in sessions]
            tokens.plot(xs, per_sample, "--", color=color, label=f"{label} tokens per sample")
        tokens.set_ylabel("tokens per sample")
        ax.set_title("Sessions: turns; sampled (trained) and injected tokens", fontsize=10)
        ax.set_xlabel("step")
        fig.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0.1, 0.12))
        plots["sessions"] = ("Sessions", figure_png(fig))
        plt.close(fig)
    components = sorted({name for s in steps for name in (s.get("reward_components") or {})})
    if components:  # weighted reward components (rollout_worker/rewards.py), each its own line
        fig, ax = plt.subplots(figsize=(6.4, 3.2))
        for name in components:
            points = [
                (s["step"], s["reward_components"][name]) for s in steps if name in (s.get("reward_components") or {})
            ]
            ax.plot(*zip(*points), marker="o", markersize=3, label=name)
        ax.set_title("Reward components (each its own value, mean over the step's groups)", fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        plots["reward_components"] = ("Reward components", figure_png(fig))
        plt.close(fig)
    gate = _gate_series(steps)
    if gate:
        fig, ax = plt.subplots(figsize=(6.4, 3.2))
        xs = [s["step"] for s in steps if "gate_accepted" in s]
        bottom = [0] * len(xs)
        for label, counts in gate.items():
            ax.bar(xs, counts, bottom=bottom, label=label)
            bottom = [b + c for b, c in zip(bottom, counts)]
        ax.set_title("Batches at the gate: accepted, and rejected by rule", fontsize=10)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        plots["gate"] = ("Batches at the gate", figure_png(fig))
        plt.close(fig)
    return plots


def _gate_series(steps: list[dict]) -> dict[str, list[int]]:
    rules = sorted({rule for s in steps for rule in (s.get("gate_rejected") or {})})
    steps = [s for s in steps if "gate_accepted" in s]
    if not steps:
        return {}
    series = {"accepted": [int(s.get("gate_accepted", 0)) for s in steps]}
    for rule in rules:
        series[f"rejected: {rule}"] = [int((s.get("gate_rejected") or {}).get(rule, 0)) for s in steps]
    return series


def summary(steps: list[dict], heldout: dict | None = None) -> list[tuple[str, str]]:
    """The table at the top; ``heldout``: a user task's ``heldout.json``."""
    trained = [s for s in steps if "loss" in s or "gate_accepted" in s] or steps
    first, last = trained[0], trained[-1]
    rows = [("steps", str(len(trained)))]
    if heldout is not None:
        rows.append(("held-out rows", f"{heldout['rows']}: {heldout['source']} (reward {heldout['reward']})"))
    for key in ("reward_mean", heldout_record.ACCURACY, heldout_record.REWARD, "train_rollout_kl", "sc_correction"):
        values = [s[key] for s in steps if isinstance(s.get(key), (int, float))]
        if values:
            rows.append((key, f"{values[0]:.4g} → {values[-1]:.4g}"))
    for name in sorted({name for s in steps for name in (s.get("reward_components") or {})}):
        values = [s["reward_components"][name] for s in steps if name in (s.get("reward_components") or {})]
        rows.append((f"reward component {name}", f"{values[0]:.4g} → {values[-1]:.4g}"))
    sessions = [s for s in trained if s.get("injected_tokens")]
    if sessions:
        turns = sum(s["turns_mean"] * s.get("samples", 0) for s in sessions) / max(
            sum(s.get("samples", 0) for s in sessions), 1
        )
        sampled, injected = sum(s["sampled_tokens"] for s in trained), sum(s["injected_tokens"] for s in trained)
        rows.append(("turns per sample (sessions)", f"{turns:.3g}"))
        rows.append(("tokens sampled / injected", f"{sampled} / {injected}"))
    finish: dict[str, int] = {}
    for s in trained:
        for reason, n in (s.get("finish") or {}).items():
            finish[reason] = finish.get(reason, 0) + n
    if finish:
        rows.append(("samples by finish reason", ", ".join(f"{k} {v}" for k, v in sorted(finish.items()))))
    if any("tool_calls" in s for s in trained):  # sessions whose requests offered tools
        calls, errors = (sum(s.get(key, 0) for s in trained) for key in ("tool_calls", "tool_call_parse_errors"))
        rows.append(("tool calls parsed / replies whose calls did not parse", f"{calls} / {errors}"))
    rejected = sum(sum((s.get("gate_rejected") or {}).values()) for s in steps)
    rows.append(("batches accepted / rejected", f"{sum(int(s.get('gate_accepted', 0)) for s in steps)} / {rejected}"))
    rows.append(("weight version", f"{first.get('version', '?')} → {last.get('version', '?')}"))
    return rows


def write_report(run_dir: Path) -> Path:
    steps = load_steps(run_dir)
    if not steps:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no steps yet")
    plots = render_plots(steps)
    write_plots(run_dir, plots)
    config = run_dir / "config.toml"
    heldout = orjson.loads((run_dir / "heldout.json").read_bytes()) if (run_dir / "heldout.json").exists() else None
    body = [
        f"<h1>centerline run: {html.escape(run_dir.name)}</h1><table>",
        *(row(cells) for cells in summary(steps, heldout)),
        "</table><div class='grid'>",
        *(f"<figure>{image(title, png)}</figure>" for title, png in plots.values()),
        "</div>",
    ]
    if config.exists():
        body.append(f"<h2>Resolved configuration</h2><pre>{html.escape(config.read_text())}</pre>")
    out = run_dir / "report.html"
    out.write_text(page("centerline run report", STYLE, body))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="centerline report", description="Write RUN_DIR/report.html and RUN_DIR/plots/*.png from a run's metrics."
    )
    parser.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        out = write_report(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"centerline report: {exc}", file=sys.stderr)
        return 2
    print(out)
    return 0

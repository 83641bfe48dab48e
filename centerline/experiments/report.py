"""An experiment's comparison: ``OUT/report.html`` (self-contained) with ``OUT/plots/*.png``
(curves averaged over seeds, the final numbers with their intervals as error bars, the paired
differences to REINFORCE), ``OUT/summary.json`` (each setting's numbers), ``OUT/results.json``
(each run's own) and the per-setting table on stdout.
"""

from __future__ import annotations

import html
from pathlib import Path

import orjson

from centerline.experiments.interval import CONFIDENCE, INTERVAL
from centerline.experiments.summary import (
    BASELINE,
    FINAL,
    PAIRED,
    SUMMARY_COLUMNS,
    aggregate,
    fmt,
    markdown_table,
    summary_cells,
)
from centerline.runs.page import figure_png, image, page, pyplot, row, write_plots

SMOOTH = 5  # steps in the moving average drawn over the raw reward
STYLE = (
    "body{font-family:sans-serif;max-width:80em;margin:2em auto;color:#222}img{max-width:100%}"
    "table{border-collapse:collapse}td,th{padding:2px 10px;border-bottom:1px solid #ddd;"
    "text-align:right}"
)
RUN_COLUMNS = [
    ("run", "name"),
    ("method", "method"),
    ("max_inflight_steps", "staleness"),
    ("seed", "seed"),
    ("staleness mean", "staleness_mean"),
    ("staleness max", "staleness_max"),
    ("reward first ¼", "reward_first"),
    ("reward last ¼", "reward_last"),
    ("|kl| mean", "kl_mean"),
    ("|kl| max", "kl_max"),
    ("held-out before", "accuracy_before"),
    ("held-out after", "accuracy_after"),
    ("wall s", "wall_s"),
]


def _smooth(values: list[float]) -> list[float]:
    return [
        sum(values[max(0, i - SMOOTH + 1) : i + 1]) / len(values[max(0, i - SMOOTH + 1) : i + 1])
        for i in range(len(values))
    ]


def _mean_curve(runs: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and the mean of ``key`` over the runs that reached each step."""
    by_step: dict[int, list[float]] = {}
    for r in runs:
        for s in r["steps"]:
            by_step.setdefault(s["step"], []).append(s[key])
    steps = sorted(by_step)
    return steps, [sum(by_step[step]) / len(by_step[step]) for step in steps]


def render_plots(results: list[dict], summary: list[dict]) -> dict[str, tuple[str, bytes]]:
    """name -> (title, PNG): curves (mean over seeds) with one panel per staleness and one line per
    method, and the final numbers as bars with their intervals as error bars."""
    plt = pyplot()
    stalenesses = sorted({r["staleness"] for r in results})
    methods = list(dict.fromkeys(r["method"] for r in results))
    colors = {method: f"C{i}" for i, method in enumerate(methods)}
    n_seeds = max(len(s["seeds"]) for s in summary)
    over = f"mean of {n_seeds} seeds" if n_seeds > 1 else "one seed"
    plots = {}
    for name, key, title, smooth in [
        ("reward", "reward_mean", f"Train reward ({SMOOTH}-step moving average, {over})", True),
        ("kl", "train_rollout_kl", f"train_rollout_kl (k3 on sampled tokens, {over})", False),
        ("staleness", "staleness_mean", f"Recorded staleness (mean over the step's samples, {over})", False),
    ]:
        fig, axes = plt.subplots(1, len(stalenesses), figsize=(4.2 * len(stalenesses), 3.2), sharey=True, squeeze=False)
        for ax, staleness in zip(axes[0], stalenesses):
            for method in methods:
                runs = [r for r in results if r["staleness"] == staleness and r["method"] == method]
                if runs:
                    xs, ys = _mean_curve(runs, key)
                    ax.plot(xs, _smooth(ys) if smooth else ys, color=colors[method], label=method)
            ax.set_title(f"max_inflight_steps = {staleness}", fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(title, fontsize=11)
        plots[name] = (title, figure_png(fig))
        plt.close(fig)
    title = "At the end of training: " + (INTERVAL if n_seeds > 1 else "one seed, no interval")
    fig, axes = plt.subplots(1, len(FINAL), figsize=(4.6 * len(FINAL), 3.4), squeeze=False)
    for ax, (key, label) in zip(axes[0], FINAL):
        _bars(ax, summary, key, methods, stalenesses, colors)
        if key == "accuracy_after":
            before = [s["accuracy_before"]["mean"] for s in summary if s["accuracy_before"] is not None]
            if before:
                ax.axhline(sum(before) / len(before), color="k", linestyle="--", linewidth=1, label="before training")
        ax.set_title(label, fontsize=10)
    handles, labels = axes[0][[key for key, _ in FINAL].index("accuracy_after")].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, bbox_to_anchor=(0.5, -0.1))
    fig.suptitle(title, fontsize=10, y=1.04)
    plots["final"] = (title, figure_png(fig))
    plt.close(fig)
    others = [m for m in methods if m != BASELINE]
    if BASELINE in methods and others:
        title = f"Difference to {BASELINE}, paired by seed: " + (INTERVAL if n_seeds > 1 else "one seed, no interval")
        fig, axes = plt.subplots(1, len(PAIRED), figsize=(4.6 * len(PAIRED), 3.4), squeeze=False)
        for ax, key in zip(axes[0], PAIRED):
            _bars(ax, summary, f"{key}_vs_{BASELINE}", others, stalenesses, colors)
            ax.axhline(0, color="k", linewidth=1)
            ax.set_title(f"{dict(FINAL)[key]} − {BASELINE}", fontsize=10)
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, bbox_to_anchor=(0.5, -0.1))
        fig.suptitle(title, fontsize=10, y=1.04)
        plots["paired"] = (title, figure_png(fig))
        plt.close(fig)
    return plots


def _bars(ax, summary: list[dict], key: str, methods: list[str], stalenesses: list[int], colors: dict) -> None:
    """``key``'s mean per (staleness, method) as grouped bars, its interval as error bars."""
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        rows = [s for s in summary if s["method"] == method and s[key] is not None]
        means = [s[key]["mean"] for s in rows]
        errors = [0.0 if s[key]["low"] is None else s[key]["mean"] - s[key]["low"] for s in rows]
        xs = [stalenesses.index(s["staleness"]) + i * width for s in rows]
        ax.bar(xs, means, width, yerr=errors, capsize=3, color=colors[method], label=method)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(stalenesses))], [f"s = {s}" for s in stalenesses])
    ax.grid(axis="y", alpha=0.3)


def write_report(out: Path, results: list[dict], up_flags: list[str]) -> Path:
    """The comparison of ``results`` (``summary.summarise``'s, one per run) into ``out`` (module
    docstring); ``up_flags``, the flags every run got, are named on the page."""
    summary = aggregate(results)
    plots = render_plots(results, summary)
    write_plots(out, plots)
    n_seeds = max(len(s["seeds"]) for s in summary)
    body = [
        "<h1>centerline experiment: staleness</h1>",
        f"<p>{len(results)} runs of <code>centerline up</code>, {len(summary)} settings (method, staleness) "
        f"with up to {n_seeds} seed(s) each; extra flags: <code>{html.escape(' '.join(up_flags) or '(none)')}</code>. "
        + (
            f"Per setting: the {html.escape(INTERVAL)}.</p>"
            if n_seeds > 1
            else "Each setting ran once: no interval, and differences of a few points are noise.</p>"
        ),
        "<h2>Per setting</h2><table>",
        row((title for title, _ in SUMMARY_COLUMNS), "th"),
        *(row(summary_cells(s)) for s in summary),
        "</table><h2>Per run</h2><table>",
        row((title for title, _ in RUN_COLUMNS), "th"),
        *(row(fmt(r[key]) for _, key in RUN_COLUMNS) for r in results),
        "</table>",
        *(f"<h2>{html.escape(title)}</h2>{image(title, png)}" for title, png in plots.values()),
    ]
    (out / "results.json").write_bytes(
        orjson.dumps([{k: v for k, v in r.items() if k != "steps"} for r in results], option=orjson.OPT_INDENT_2)
    )
    (out / "summary.json").write_bytes(
        orjson.dumps({"interval": INTERVAL, "confidence": CONFIDENCE, "settings": summary}, option=orjson.OPT_INDENT_2)
    )
    print(f"Per setting: the {INTERVAL} ([low, high]; the mean alone with one seed).\n", flush=True)
    print(markdown_table(summary), flush=True)
    written = out / "report.html"
    written.write_text(page("centerline experiment: staleness", STYLE, body))
    return written

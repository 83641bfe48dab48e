"""`centerline experiment staleness`: score centering against its baselines as batches go stale.

Runs `centerline up` once per (method, staleness, seed), in sequence, each into
``OUT/runs/<method>-s<staleness>-seed<seed>``. The methods are plain REINFORCE (``reinforce``),
REINFORCE with TIS (``tis``) and score centering with each of its importance weights
(``score_centering``: none, ``score_centering+tis``, ``score_centering+mis``). Staleness ``s`` is
made the way an asynchronous job makes it: ``--max-inflight-steps s`` publishes prompt tasks up
to ``s`` steps ahead, so a batch can be sampled by weights up to ``s - 1`` versions behind the
trainer, and ``--max-staleness s`` lets the gate accept it. The staleness each run really had is
read back from its ``metrics.jsonl``. ``--seeds N`` runs each setting with seeds 0..N-1 (or
``--seed-list``); the seed sets the SFT start, the data order and the sampling.

Per setting (method, staleness), the final train reward (mean of the last quarter of steps),
the held-out greedy accuracy after training and the ``train_rollout_kl`` maximum are reported as
the mean over seeds and its 95% Student-t interval, mean +- t(0.975, n-1) * sd / sqrt(n)
(``centerline/interval.py``): in ``OUT/summary.json``, a Markdown table on stdout, and
``OUT/report.html`` (self-contained) with ``OUT/plots/*.png`` (curves averaged over seeds, the
final numbers with error bars). ``OUT/results.json`` has each run's own numbers. Seeds differ
most in where they start (each its own SFT model), so the final reward and held-out accuracy
are also given as differences to REINFORCE's run of the same seed and staleness, with the same
interval over those paired differences: what the method adds, without the seed's luck.

Each run is a variant of one run spec (``centerline/up/run_spec.py``): the spec of the other flags
(``--steps`` among them, 40 unless given), with the run's loss, importance weight, seed, staleness and
run directory, run as ``centerline up --config OUT/runs/<name>.toml`` (its progress lines in
``OUT/runs/<name>.progress.jsonl``). A run whose
directory already holds a finished run of the same spec (its report written, its ``config.toml``
equal but for what ``up`` filled in as it started: ports, addresses) is kept, not run again: an interrupted grid goes on
where it stopped, and a wider grid into the same ``--out`` runs only what is new.

    centerline experiment staleness --steps 40 --staleness 1,4,8 --seeds 3 --out runs/staleness

Any other flag is a `centerline up` flag of the spec every run derives from (``--learning-rate
1e-3``, ``--task copy``, ``--config FILE``...); ``--seed`` is refused, since the experiment sets
it. Left out on purpose: running settings in parallel (they would share the CPUs and change each
other's staleness).
"""

from __future__ import annotations

import argparse
import base64
import html
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import orjson

from centerline.interval import mean_interval
from centerline.runs.report import _figure_png, load_steps
from centerline.up import run_spec
from centerline.up.processes import PYTHON
from centerline.up.run_spec import RunSpec
from shared.config import ConfigError, load_toml

LOSSES = ("score_centering", "reinforce", "tis")
IS_MODES = ("none", "tis", "mis")  # score centering's importance weights (--score-centering-is)
CONFIDENCE = 0.95
INTERVAL = "mean over seeds and its 95% Student-t interval, mean +- t(0.975, n-1) * sd / sqrt(n)"
# the per-run numbers summarised across seeds, with the header each table gives them
FINAL = (("reward_last", "reward last ¼"), ("accuracy_after", "held-out after"), ("kl_max", "|kl| max"))
# `up`'s settings whose default differs for the experiment (its flags override them)
EXPERIMENT_DEFAULTS = {"trainer": {"steps": 40}}
SMOOTH = 5  # steps in the moving average drawn over the raw reward
BASELINE = "reinforce"  # the paired differences' reference method
PAIRED = ("reward_last", "accuracy_after")  # numbers also reported as differences to BASELINE, seed by seed


def _int_list(text: str, minimum: int = 1) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < minimum or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated distinct integers >= {minimum} expected")
    return values


def _choice_list(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        if not values or set(values) - set(choices):
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)}")
        return list(dict.fromkeys(values))

    return parse


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(
        prog="centerline experiment staleness",
        description=__doc__.split("\n")[0],
        epilog="Other flags go to every `centerline up` run (--steps too, 40 here by default).",
        allow_abbrev=False,  # `--seed` must not read as `--seeds`
    )
    parser.add_argument(
        "--staleness", type=_int_list, default=[1, 4, 8], help="max_inflight_steps values (= max_staleness)"
    )
    parser.add_argument("--losses", type=_choice_list(LOSSES), default=list(LOSSES), help="losses to compare")
    parser.add_argument(
        "--score-centering-is",
        type=_choice_list(IS_MODES),
        default=list(IS_MODES),
        help="score centering's importance weights to compare, one setting each",
    )
    parser.add_argument("--seeds", type=int, default=1, help="runs per setting, with seeds 0..N-1")
    parser.add_argument(
        "--seed-list", type=lambda text: _int_list(text, 0), default=None, help="the seeds, instead of --seeds"
    )
    parser.add_argument("--out", type=Path, default=None, help="default: runs/staleness-<date-time>")
    args, up_flags = parser.parse_known_args(argv)
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: at least 1")
    if any(flag == "--seed" or flag.startswith("--seed=") for flag in up_flags):
        parser.error("--seed: the experiment sets each run's seed; use --seeds N or --seed-list 0,1,2")
    args.seed_list = args.seed_list or list(range(args.seeds))
    return args, up_flags


def method_name(loss: str, is_mode: str) -> str:
    """``score_centering+tis`` for score centering with TIS weights; the loss itself otherwise."""
    return f"{loss}+{is_mode}" if loss == "score_centering" and is_mode != "none" else loss


def grid(stalenesses: list[int], losses: list[str], is_modes: list[str], seeds: list[int]) -> list[dict]:
    """Every run's setting, seed by seed, so an experiment stopped early has whole seeds."""
    runs = []
    for seed in seeds:
        for staleness in stalenesses:
            for loss in losses:
                for is_mode in is_modes if loss == "score_centering" else ["none"]:
                    method = method_name(loss, is_mode)
                    runs.append(
                        {
                            "name": f"{method}-s{staleness}-seed{seed}",
                            "method": method,
                            "loss": loss,
                            "is_mode": is_mode,
                            "staleness": staleness,
                            "seed": seed,
                        }
                    )
    return runs


class Stopped(Exception):
    """A signal asked the experiment to stop."""


def variant(spec: RunSpec, run: dict, out: Path) -> RunSpec:
    """The spec of one ``grid`` run: the user's ``spec`` with the run's setting, evaluated after its
    last step (and before its first)."""
    return spec.derive(
        cfg={
            "loss": run["loss"],
            "score_centering_is": run["is_mode"],
            "seed": run["seed"],
            "max_inflight_steps": run["staleness"],
            "max_staleness": run["staleness"],
        },
        up={"run_dir": out / "runs" / run["name"]},
        trainer={"eval_every": spec.trainer.steps},
    )


def run_all(args, spec: RunSpec, stopping: list[str]) -> list[dict]:
    """Each run of the grid, in order, as a variant of ``spec``; a summary dict per run (see ``summarise``)."""
    runs = grid(args.staleness, args.losses, args.score_centering_is, args.seed_list)
    results = []
    for i, run in enumerate(runs):
        variant_spec = variant(spec, run, args.out)
        run_dir = variant_spec.up.run_dir
        if finished(run_dir, variant_spec):
            print(
                f"centerline experiment: run {i + 1}/{len(runs)}: {run['name']}: finished before with these "
                "settings, kept",
                file=sys.stderr,
                flush=True,
            )
            results.append(summarise(run, run_dir, None))
            continue
        print(f"centerline experiment: run {i + 1}/{len(runs)}: {run['name']}", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        run_dir.mkdir(parents=True, exist_ok=True)
        up(variant_spec, args.out / "runs" / run["name"], stopping)
        results.append(summarise(run, run_dir, time.monotonic() - t0))
        print(orjson.dumps({k: v for k, v in results[-1].items() if k != "steps"}).decode(), flush=True)
    return results


def up(spec: RunSpec, name: Path, stopping: list[str]) -> None:
    """``centerline up --config NAME.toml`` of ``spec`` to its end, its progress lines into
    ``NAME.progress.jsonl``, its messages on stderr. Raises ``Stopped`` once ``stopping`` gets an entry
    (``up`` stops every service it started on SIGTERM, as on the Ctrl-C it gets with this process)."""
    config = name.with_name(name.name + ".toml")
    spec.write(config)
    # the spec resolved the settings variables already; left in, they would beat its file
    env = {k: v for k, v in os.environ.items() if k not in run_spec.setting_variables()}
    with open(name.with_name(name.name + ".progress.jsonl"), "wb") as progress:
        proc = subprocess.Popen([PYTHON, "-m", "centerline", "up", "--config", str(config)], stdout=progress, env=env)
    try:
        while proc.poll() is None:
            if stopping:
                proc.send_signal(signal.SIGTERM)
                proc.wait()
                raise Stopped(stopping[0])
            time.sleep(0.5)  # polling interval, for ``stopping``
    finally:
        proc.wait()  # Ctrl-C reached up too: it stops its services, then exits
    if proc.returncode != 0:
        raise RuntimeError(f"centerline up --config {config} exited with status {proc.returncode}")


def finished(run_dir: Path, spec: RunSpec) -> bool:
    """Whether ``run_dir`` holds a finished `centerline up` run (its report written) of exactly this
    spec: a grid run again into the same ``--out`` keeps it instead of running it again."""
    if not (run_dir / "report.html").exists() or not (run_dir / "config.toml").exists():
        return False
    saved = load_toml(str(run_dir / "config.toml"))
    return run_spec.without_launch_settings(saved) == run_spec.without_launch_settings(tomllib.loads(spec.to_toml()))


def summarise(run: dict, run_dir: Path, wall_s: float | None) -> dict:
    """``run`` (a ``grid`` entry) with what its ``metrics.jsonl`` and ``eval.jsonl`` say."""
    steps = load_steps(run_dir)
    trained = [s for s in steps if "loss" in s]
    # the held-out figure: exact-match accuracy, or a run of sessions' mean reward
    evals = [s.get("eval_accuracy", s.get("eval_reward")) for s in steps if {"eval_accuracy", "eval_reward"} & set(s)]
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
            entry[key] = _interval([r[key] for r in runs])
        # Paired by seed: a seed's runs share their SFT start and data order, so the difference to
        # REINFORCE's run of the same seed and staleness leaves out how good that start was.
        baseline = {r["seed"]: r for r in settings.get((BASELINE, staleness), [])}
        for key in PAIRED:
            pairs = [
                r[key] - baseline[r["seed"]][key]
                for r in runs
                if r["seed"] in baseline and r[key] is not None and baseline[r["seed"]][key] is not None
            ]
            entry[f"{key}_vs_{BASELINE}"] = None if method == BASELINE else _interval(pairs)
        summary.append(entry)
    return summary


def _interval(values: list) -> dict | None:
    """``{"mean", "low", "high"}`` of the values that are not None; None if there are none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    mean, low, high = mean_interval(values, CONFIDENCE)
    return {"mean": mean, "low": low, "high": high}


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        plots[name] = (title, _figure_png(fig))
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
    plots["final"] = (title, _figure_png(fig))
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
        plots["paired"] = (title, _figure_png(fig))
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


def _fmt(value) -> str:
    return "–" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def _fmt_interval(value: dict | None) -> str:
    """``0.424 [0.39, 0.46]``, or the mean alone with one seed."""
    if value is None:
        return "–"
    if value["low"] is None:
        return f"{value['mean']:.3f}"
    return f"{value['mean']:.3f} [{value['low']:.3f}, {value['high']:.3f}]"


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


def _summary_cells(entry: dict) -> list[str]:
    cells = []
    for _, key in SUMMARY_COLUMNS:
        value = entry[key]
        if key == "seeds":
            cells.append(str(len(value)))
        elif isinstance(value, dict) or value is None:
            cells.append(_fmt_interval(value))
        else:
            cells.append(_fmt(value))
    return cells


def markdown_table(summary: list[dict]) -> str:
    """The per-setting table, ready for the README."""
    lines = [
        "| " + " | ".join(title.replace("|", "\\|") for title, _ in SUMMARY_COLUMNS) + " |",
        "|" + "---|" * len(SUMMARY_COLUMNS),
        *("| " + " | ".join(_summary_cells(entry)) + " |" for entry in summary),
    ]
    return "\n".join(lines)


def write_report(out: Path, results: list[dict], up_flags: list[str]) -> Path:
    summary = aggregate(results)
    plots = render_plots(results, summary)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    for name, (_, png) in plots.items():
        (out / "plots" / f"{name}.png").write_bytes(png)
    columns = [
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
    n_seeds = max(len(s["seeds"]) for s in summary)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>centerline experiment: staleness</title>",
        "<style>body{font-family:sans-serif;max-width:80em;margin:2em auto;color:#222}img{max-width:100%}"
        "table{border-collapse:collapse}td,th{padding:2px 10px;border-bottom:1px solid #ddd;"
        "text-align:right}</style></head><body>",
        "<h1>centerline experiment: staleness</h1>",
        f"<p>{len(results)} runs of <code>centerline up</code>, {len(summary)} settings (method, staleness) "
        f"with up to {n_seeds} seed(s) each; extra flags: <code>{html.escape(' '.join(up_flags) or '(none)')}</code>. "
        + (
            f"Per setting: the {html.escape(INTERVAL)}.</p>"
            if n_seeds > 1
            else "Each setting ran once: no interval, and differences of a few points are noise.</p>"
        ),
        "<h2>Per setting</h2><table><tr>",
        *(f"<th>{html.escape(title)}</th>" for title, _ in SUMMARY_COLUMNS),
        "</tr>",
        *("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in _summary_cells(s)) + "</tr>" for s in summary),
        "</table><h2>Per run</h2><table><tr>",
        *(f"<th>{html.escape(title)}</th>" for title, _ in columns),
        "</tr>",
        *("<tr>" + "".join(f"<td>{html.escape(_fmt(r[key]))}</td>" for _, key in columns) + "</tr>" for r in results),
        "</table>",
        *(
            f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' "
            f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
            for title, png in plots.values()
        ),
        "</body></html>",
    ]
    (out / "results.json").write_bytes(
        orjson.dumps([{k: v for k, v in r.items() if k != "steps"} for r in results], option=orjson.OPT_INDENT_2)
    )
    (out / "summary.json").write_bytes(
        orjson.dumps({"interval": INTERVAL, "confidence": CONFIDENCE, "settings": summary}, option=orjson.OPT_INDENT_2)
    )
    print(f"Per setting: the {INTERVAL} ([low, high]; the mean alone with one seed).\n", flush=True)
    print(markdown_table(summary), flush=True)
    page = out / "report.html"
    page.write_text("\n".join(parts))
    return page


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "staleness":
        print(
            "usage: centerline experiment staleness [--steps N --staleness 1,4,8 --losses "
            "score_centering,reinforce,tis --score-centering-is none,tis,mis --seeds N | --seed-list 0,1,2 "
            "--out DIR] [up flags]",
            file=sys.stderr,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    args, up_flags = parse(argv[1:])
    args.out = args.out or Path("runs") / time.strftime("staleness-%Y-%m-%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        spec = run_spec.parse(up_flags, EXPERIMENT_DEFAULTS)  # a bad flag fails now, not after the first runs
        stopping: list[str] = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))  # so each run stops its services
        results = run_all(args, spec, stopping)
    except ConfigError as exc:
        print(f"centerline experiment: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Stopped):
        print("\ncenterline experiment: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"\ncenterline experiment: {exc}", file=sys.stderr)
        return 1
    print(f"centerline experiment: report {write_report(args.out, results, up_flags)}", file=sys.stderr)
    return 0

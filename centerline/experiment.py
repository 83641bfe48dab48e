"""`centerline experiment staleness`: score centering against its baselines as batches go stale.

Runs `centerline up` once per (loss, staleness) pair, in sequence, each into
``OUT/runs/<loss>-s<staleness>``. Staleness ``s`` is made the way an asynchronous job makes
it: ``--max-inflight-steps s`` publishes prompt tasks up to ``s`` steps ahead, so a batch
can be sampled by weights up to ``s - 1`` versions behind the trainer, and
``--max-staleness s`` lets the gate accept it. The staleness each run really had is read
back from its ``metrics.jsonl``. Then ``OUT/report.html`` (self-contained) and
``OUT/plots/*.png`` compare, per (loss, staleness): train reward and ``train_rollout_kl``
over steps, the recorded staleness, and held-out greedy accuracy before and after.

    centerline experiment staleness --steps 40 --staleness 1,4,8 --losses score_centering,reinforce,tis --out
    runs/staleness

Any other flag is passed to every `centerline up` run unchanged (``--learning-rate 1e-3``,
``--task copy``...). Left out on purpose: repeated seeds and confidence intervals (each
pair runs once; read small differences as noise), running pairs in parallel.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import html
import signal
import sys
import time
from pathlib import Path

import orjson

from centerline import launcher
from centerline.report import _figure_png, load_steps

LOSSES = ("score_centering", "reinforce", "tis")
SMOOTH = 5  # steps in the moving average drawn over the raw reward


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: comma-separated integers >= 1 expected")
    return values


def _loss_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    unknown = sorted(set(values) - set(LOSSES))
    if not values or unknown:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(LOSSES)}")
    return values


def parse(argv: list[str]):
    parser = argparse.ArgumentParser(
        prog="centerline experiment staleness",
        description=__doc__.split("\n")[0],
        epilog="Other flags go to every `centerline up` run.",
    )
    parser.add_argument("--steps", type=int, default=40, help="trainer steps of each run")
    parser.add_argument(
        "--staleness", type=_int_list, default=[1, 4, 8], help="max_inflight_steps values (= max_staleness)"
    )
    parser.add_argument("--losses", type=_loss_list, default=list(LOSSES), help="losses to compare")
    parser.add_argument("--out", type=Path, default=None, help="default: runs/staleness-<date-time>")
    return parser.parse_known_args(argv)


def run_all(args, up_flags: list[str], stopping: list[str]) -> list[dict]:
    """Each pair's run, in order; a summary dict per run (see ``summarise``)."""
    results = []
    for staleness in args.staleness:
        for loss in args.losses:
            name = f"{loss}-s{staleness}"
            argv = [
                *up_flags,
                "--steps",
                str(args.steps),
                "--eval-every",
                str(args.steps),
                "--loss",
                loss,
                "--max-inflight-steps",
                str(staleness),
                "--max-staleness",
                str(staleness),
                "--run-dir",
                str(args.out / "runs" / name),
            ]
            up_args, cfg = launcher.parse(argv)
            print(
                f"centerline experiment: run {len(results) + 1}/{len(args.staleness) * len(args.losses)}: {name}",
                file=sys.stderr,
                flush=True,
            )
            t0 = time.monotonic()
            (args.out / "runs" / name).mkdir(parents=True, exist_ok=True)
            with (
                open(args.out / "runs" / f"{name}.progress.jsonl", "w") as progress,
                contextlib.redirect_stdout(progress),
            ):
                run_dir = launcher.launch(up_args, cfg, stopping)
            results.append(summarise(name, loss, staleness, run_dir, time.monotonic() - t0))
            print(orjson.dumps({k: v for k, v in results[-1].items() if k != "steps"}).decode(), flush=True)
    return results


def summarise(name: str, loss: str, staleness: int, run_dir: Path, wall_s: float) -> dict:
    steps = load_steps(run_dir)
    trained = [s for s in steps if "loss" in s]
    evals = [s["eval_accuracy"] for s in steps if "eval_accuracy" in s]
    rewards = [s["reward_mean"] for s in trained]
    tail = max(1, len(rewards) // 4)
    return {
        "name": name,
        "loss": loss,
        "staleness": staleness,
        "run_dir": str(run_dir),
        "wall_s": round(wall_s, 1),
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


def _smooth(values: list[float]) -> list[float]:
    return [
        sum(values[max(0, i - SMOOTH + 1) : i + 1]) / len(values[max(0, i - SMOOTH + 1) : i + 1])
        for i in range(len(values))
    ]


def render_plots(results: list[dict]) -> dict[str, tuple[str, bytes]]:
    """name -> (title, PNG): one panel per staleness, one line per loss, plus held-out accuracy bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stalenesses = sorted({r["staleness"] for r in results})
    losses = list(dict.fromkeys(r["loss"] for r in results))
    colors = {loss: f"C{i}" for i, loss in enumerate(losses)}
    plots = {}
    for name, key, title, smooth in [
        ("reward", "reward_mean", f"Train reward ({SMOOTH}-step moving average)", True),
        ("kl", "train_rollout_kl", "train_rollout_kl (k3 on sampled tokens)", False),
        ("staleness", "staleness_mean", "Recorded staleness (mean over the step's samples)", False),
    ]:
        fig, axes = plt.subplots(1, len(stalenesses), figsize=(4.2 * len(stalenesses), 3.2), sharey=True, squeeze=False)
        for ax, staleness in zip(axes[0], stalenesses):
            for r in results:
                if r["staleness"] == staleness:
                    xs = [s["step"] for s in r["steps"]]
                    ys = [s[key] for s in r["steps"]]
                    ax.plot(xs, _smooth(ys) if smooth else ys, color=colors[r["loss"]], label=r["loss"])
            ax.set_title(f"max_inflight_steps = {staleness}", fontsize=10)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=8)
        fig.suptitle(title, fontsize=11)
        plots[name] = (title, _figure_png(fig))
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    width = 0.8 / len(losses)
    for i, loss in enumerate(losses):
        rows = [r for r in results if r["loss"] == loss]
        ax.bar(
            [stalenesses.index(r["staleness"]) + i * width for r in rows],
            [r["accuracy_after"] or 0 for r in rows],
            width,
            color=colors[loss],
            label=loss,
        )
    before = [r["accuracy_before"] for r in results if r["accuracy_before"] is not None]
    if before:
        ax.axhline(sum(before) / len(before), color="k", linestyle="--", linewidth=1, label="before training")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(stalenesses))], [f"s = {s}" for s in stalenesses])
    ax.set_title("Held-out greedy accuracy after training", fontsize=10)
    ax.legend(fontsize=8)
    plots["accuracy"] = ("Held-out greedy accuracy after training", _figure_png(fig))
    plt.close(fig)
    return plots


def _fmt(value) -> str:
    return "–" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def write_report(out: Path, results: list[dict], up_flags: list[str]) -> Path:
    plots = render_plots(results)
    (out / "plots").mkdir(parents=True, exist_ok=True)
    for name, (_, png) in plots.items():
        (out / "plots" / f"{name}.png").write_bytes(png)
    columns = [
        ("run", "name"),
        ("loss", "loss"),
        ("max_inflight_steps", "staleness"),
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
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>centerline experiment: staleness</title>",
        "<style>body{font-family:sans-serif;max-width:80em;margin:2em auto;color:#222}img{max-width:100%}"
        "table{border-collapse:collapse}td,th{padding:2px 10px;border-bottom:1px solid #ddd;"
        "text-align:right}</style></head><body>",
        "<h1>centerline experiment: staleness</h1>",
        f"<p>{len(results)} runs of <code>centerline up</code>, one per (loss, staleness); extra flags: "
        f"<code>{html.escape(' '.join(up_flags) or '(none)')}</code>. Each pair ran once: differences of a few points "
        "are noise.</p>",
        "<table><tr>",
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
    page = out / "report.html"
    page.write_text("\n".join(parts))
    return page


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "staleness":
        print(
            "usage: centerline experiment staleness [--steps N --staleness 1,4,8 --losses "
            "score_centering,reinforce,tis --out DIR] [up flags]",
            file=sys.stderr,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    args, up_flags = parse(argv[1:])
    args.out = args.out or Path("runs") / time.strftime("staleness-%Y-%m-%d-%H%M%S")
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        launcher.parse(up_flags)  # a bad flag fails now, not after the first runs
        stopping: list[str] = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))  # so each run stops its services
        results = run_all(args, up_flags, stopping)
    except launcher.shared_config.ConfigError as exc:
        print(f"centerline experiment: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, launcher.Stopped):
        print("\ncenterline experiment: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"\ncenterline experiment: {exc}", file=sys.stderr)
        return 1
    print(f"centerline experiment: report {write_report(args.out, results, up_flags)}", file=sys.stderr)
    return 0

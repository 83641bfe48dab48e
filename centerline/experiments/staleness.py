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
(``summary.py``, ``interval.py``), also as differences to REINFORCE's run of the same seed: in
``OUT/summary.json``, a Markdown table on stdout, and ``OUT/report.html`` with ``OUT/plots/*.png``
(``report.py``). ``OUT/results.json`` has each run's own numbers.

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
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import orjson

from centerline.experiments.report import write_report
from centerline.experiments.summary import summarise
from centerline.up import run_spec
from centerline.up.processes import PYTHON
from centerline.up.run_spec import RunSpec
from shared.config import IMPORTANCE_WEIGHTS, LOSS_NAMES, ConfigError, load_toml

LOSSES = LOSS_NAMES
IS_MODES = IMPORTANCE_WEIGHTS  # score centering's importance weights (--score-centering-is)
# `up`'s settings whose default differs for the experiment (its flags override them)
EXPERIMENT_DEFAULTS = {"trainer": {"steps": 40}}


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
        trainer={"heldout_every": spec.trainer.steps},
    )


def run_all(args, spec: RunSpec, stopping: list[str]) -> list[dict]:
    """Each run of the grid, in order, as a variant of ``spec``; a summary dict per run (``summary.summarise``)."""
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

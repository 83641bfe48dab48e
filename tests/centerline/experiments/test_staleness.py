"""`centerline experiment staleness`: the grid of settings and seeds, each run a variant of the spec,
finished runs kept, and end to end a tiny grid of real `centerline up` runs, then the comparison page."""

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from centerline.experiments import staleness as experiment
from centerline.up.prepare import Prepared
from centerline.up.run_spec import parse, with_launch_settings

ROOT = Path(__file__).resolve().parents[3]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
METHODS = ["score_centering", "score_centering+tis", "score_centering+mis", "reinforce", "tis"]


def test_the_default_grid_has_score_centering_with_each_importance_weight_beside_reinforce_and_tis():
    args, up_flags = experiment.parse([])
    runs = experiment.grid(args.staleness, args.losses, args.score_centering_is, args.seed_list)
    assert up_flags == [] and args.seed_list == [0]
    assert [r["name"] for r in runs] == [f"{m}-s{s}-seed0" for s in (1, 4, 8) for m in METHODS]


def test_seeds_repeat_the_whole_grid_seed_by_seed():
    args, _ = experiment.parse(["--seeds", "3", "--staleness", "1,4", "--learning-rate", "1e-3"])
    runs = experiment.grid(args.staleness, args.losses, args.score_centering_is, args.seed_list)
    assert len(runs) == 3 * 2 * 5
    assert [r["seed"] for r in runs] == [0] * 10 + [1] * 10 + [2] * 10
    assert runs[10] == {
        "name": "score_centering-s1-seed1",
        "method": "score_centering",
        "loss": "score_centering",
        "is_mode": "none",
        "staleness": 1,
        "seed": 1,
    }
    assert {(r["method"], r["staleness"]) for r in runs[:10]} == {(m, s) for m in METHODS for s in (1, 4)}


def test_seed_list_and_a_subset_of_importance_weights_choose_the_runs():
    args, _ = experiment.parse(["--seed-list", "5,7", "--losses", "score_centering,tis", "--score-centering-is", "mis"])
    runs = experiment.grid(args.staleness, args.losses, args.score_centering_is, args.seed_list)
    assert [r["name"] for r in runs if r["staleness"] == 4] == [
        "score_centering+mis-s4-seed5",
        "tis-s4-seed5",
        "score_centering+mis-s4-seed7",
        "tis-s4-seed7",
    ]


def test_a_seed_passed_to_up_is_refused_since_the_experiment_sets_it(capsys):
    with pytest.raises(SystemExit):
        experiment.parse(["--seed", "3"])
    assert "--seeds N or --seed-list" in capsys.readouterr().err


def test_each_run_is_a_variant_of_the_spec_with_its_loss_importance_weight_seed_and_staleness(tmp_path):
    run = experiment.grid([4], ["score_centering"], ["mis"], [2])[0]
    base = parse(["--learning-rate", "1e-3", "--loss", "tis", "--task", "copy", "--steps", "10"])
    spec = experiment.variant(base, run, tmp_path)
    cfg, up, trainer = spec.cfg, spec.up, spec.trainer
    assert (cfg.loss.name, cfg.loss.is_mode, cfg.training.seed) == ("score_centering", "mis", 2)
    assert (cfg.training.max_inflight_steps, cfg.training.max_staleness, cfg.training.learning_rate) == (4, 4, 1e-3)
    assert (trainer.steps, trainer.heldout_every, up.run_dir, up.task) == (
        10,
        10,
        tmp_path / "runs" / run["name"],
        "copy",
    )
    # nothing else of the spec changes
    changed = {"loss", "score_centering_is", "seed", "max_inflight_steps", "max_staleness"}
    unchanged = lambda cfg: {k: v for k, v in cfg.model_dump().items() if k not in changed}  # noqa: E731
    assert unchanged(spec.cfg) == unchanged(base.cfg)
    assert spec.up == base.up.model_copy(update={"run_dir": tmp_path / "runs" / run["name"]})
    assert (spec.trainer, spec.worker, spec.proxy) == (
        base.trainer.model_copy(update={"heldout_every": 10}),
        base.worker,
        base.proxy,
    )


def test_the_experiment_runs_40_steps_unless_ups_steps_flag_says_otherwise():
    args, up_flags = experiment.parse(["--steps", "7", "--task", "copy"])
    assert up_flags == ["--steps", "7", "--task", "copy"]
    assert parse(up_flags, experiment.EXPERIMENT_DEFAULTS).trainer.steps == 7
    assert parse([], experiment.EXPERIMENT_DEFAULTS).trainer.steps == 40


def test_a_finished_run_of_the_same_settings_is_kept_and_any_other_is_run(tmp_path):
    run = {"name": "tis-s4-seed1", "method": "tis", "loss": "tis", "is_mode": "none", "staleness": 4, "seed": 1}
    base = parse(["--task", "copy", "--steps", "40"])
    spec = experiment.variant(base, run, tmp_path)
    run_dir = tmp_path / "runs" / run["name"]
    run_dir.mkdir(parents=True)
    # what `centerline up` wrote: the spec with the launch settings of where it ran (ports, model, dataset),
    # then the report last
    task = Prepared(Path("models/sft-copy-seed1"), run_dir / "train.jsonl", False, run_dir / "heldout.jsonl")
    launched = with_launch_settings(
        spec,
        task,
        nats_url="nats://127.0.0.1:4999",
        replicas=1,
        engine_urls=["http://127.0.0.1:5000"],
        router_url="http://127.0.0.1:5001",
        proxy_url="http://127.0.0.1:5002",
    )
    launched.write(run_dir / "config.toml")
    assert not experiment.finished(run_dir, spec)  # no report: it did not finish
    (run_dir / "report.html").write_text("<html></html>")
    assert experiment.finished(run_dir, spec)
    for other in (
        experiment.variant(base.derive(trainer={"steps": 80}), run, tmp_path),  # more steps
        experiment.variant(parse(["--task", "upper", "--steps", "40"]), run, tmp_path),  # another task
        experiment.variant(parse(["--task", "copy", "--steps", "40", "--learning-rate", "1e-3"]), run, tmp_path),
        experiment.variant(base, {**run, "seed": 2}, tmp_path).derive(up={"run_dir": run_dir}),  # another seed
        spec.derive(worker={"concurrency": 3}),  # a service's setting
    ):
        assert not experiment.finished(run_dir, other), other


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(600)  # several seeds of training; a full suite beside it slows it down
def test_experiment_runs_each_seed_and_writes_the_comparison_with_intervals(tmp_path, toy_models):
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
        "score_centering",
        "--score-centering-is",
        "mis",
        "--seeds",
        "2",
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
        "--heldout-prompts",
        "8",
        "--model-dir",
        str(toy_models),
    ]
    run = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]

    # one setting, two seeds: each run starts its own SGLang server, router and trainer (~50 s here)
    names = ["score_centering+mis-s2-seed0", "score_centering+mis-s2-seed1"]
    results = orjson.loads((out / "results.json").read_bytes())
    assert [r["name"] for r in results] == names
    for r in results:
        steps = [orjson.loads(line) for line in (out / "runs" / r["name"] / "metrics.jsonl").read_bytes().splitlines()]
        assert [s["step"] for s in steps] == [1, 2]
        assert r["accuracy_before"] is not None and r["accuracy_after"] is not None
        assert r["staleness_max"] <= r["staleness"]
    config = (out / "runs" / names[1] / "config.toml").read_text()
    assert 'score_centering_is = "mis"' in config and "seed = 1" in config and "max_staleness = 2" in config

    summary = orjson.loads((out / "summary.json").read_bytes())
    assert summary["confidence"] == 0.95 and "Student-t" in summary["interval"]
    [setting] = summary["settings"]
    assert (setting["method"], setting["staleness"], setting["seeds"]) == ("score_centering+mis", 2, [0, 1])
    for key in ("reward_last", "accuracy_after", "kl_max"):
        assert setting[key]["low"] <= setting[key]["mean"] <= setting[key]["high"]
    assert "| score_centering+mis | 2 | 2 |" in run.stdout

    plots = {"reward", "kl", "staleness", "final"}
    assert {p.stem for p in (out / "plots").glob("*.png")} == plots
    assert all((out / "plots" / f"{name}.png").read_bytes().startswith(PNG_MAGIC) for name in plots)
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(plots)
    assert all(f"<td>{name}</td>" in page for name in names)

    # The same command again: both runs are kept (no process started), the comparison rewritten from them.
    again = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [line for line in again.stderr.splitlines() if line.startswith("centerline experiment: run")] == [
        f"centerline experiment: run {i}/2: {name}: finished before with these settings, kept"
        for i, name in enumerate(names, 1)
    ]
    assert orjson.loads((out / "summary.json").read_bytes()) == summary

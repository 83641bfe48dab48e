"""`centerline up`'s wiring, without starting anything: what each child process is given."""

import argparse
import dataclasses
import os
import sys
import tomllib
from pathlib import Path

import pytest

from centerline import nats_users
from centerline.up import launcher
from centerline.up.prepare import Prepared
from centerline.up.processes import service_env
from centerline.up.run_spec import LAUNCH_SETTINGS, UP_TRAINER_FLAGS, load, parse, with_launch_settings
from shared.config import add_arguments, parse_args
from shared.settings import ProxySettings, TrainerSettings, WorkerSettings
from trainer_service.service import write_run_config

PASSWORDS = {"admin": "pa", "trainer": "pt", "worker": "pw", "proxy": "pp"}
# What a launcher's own environment may hold: somebody else's credentials, among ordinary variables.
BASE = {
    "PATH": "/usr/bin",
    "CENTERLINE_SEED": "3",
    "CENTERLINE_FAILPOINTS": "trainer.train=crash@2",
    "CENTERLINE_NATS_USER": "admin",
    "CENTERLINE_NATS_PASSWORD": "x",
    "CENTERLINE_NATS_PASSWORD_FILE": "/f",
    **nats_users.server_env({u: "x" for u in nats_users.USERS}),
}


def nats_variables(env: dict) -> dict:
    return {k: v for k, v in env.items() if "NATS" in k}


def test_each_service_gets_its_own_nats_user_and_password_only():
    got = {user: nats_variables(service_env(BASE, user, PASSWORDS)) for user in ("trainer", "worker", "proxy")}
    assert got == {
        "trainer": {"CENTERLINE_NATS_USER": "trainer", "CENTERLINE_NATS_PASSWORD": "pt"},
        "worker": {"CENTERLINE_NATS_USER": "worker", "CENTERLINE_NATS_PASSWORD": "pw"},
        "proxy": {"CENTERLINE_NATS_USER": "proxy", "CENTERLINE_NATS_PASSWORD": "pp"},
    }


def test_a_service_gets_no_credentials_nor_settings_variables_and_keeps_the_rest_of_the_environment():
    env = service_env(BASE, None, PASSWORDS)
    assert nats_variables(env) == {}
    assert "CENTERLINE_SEED" not in env  # a setting: the run spec holds it, and the file must not be beaten
    assert (env["PATH"], env["CENTERLINE_FAILPOINTS"], env["HF_HUB_OFFLINE"]) == (
        "/usr/bin",
        "trainer.train=crash@2",
        "1",
    )


def _with_launch_settings(tmp_path: Path, argv: list[str]):
    spec = parse(argv)
    run_dir = spec.up.run_dir
    task = Prepared(tmp_path / "model", run_dir / "train.jsonl", True, run_dir / "heldout.jsonl")
    return with_launch_settings(
        spec,
        task,
        nats_url="nats://127.0.0.1:4999",
        replicas=1,
        engine_urls=["http://127.0.0.1:5000"],
        router_url="http://127.0.0.1:5001",
        proxy_url="http://127.0.0.1:5002",
    )


def _as_started(argv: list[str], section, env: dict):
    """What a service started with ``argv`` resolves, as its own parser does."""
    parser = argparse.ArgumentParser()
    add_arguments(parser, section)
    return parse_args(parser, argv[argv.index("--config") :], env, section=section)


def test_up_writes_one_config_toml_with_every_table_and_starts_each_service_with_it_and_its_identity_only(
    tmp_path, monkeypatch
):
    given = tmp_path / "given.toml"
    given.write_text("learning_rate = 0.002\n\n[proxy]\nupstream_timeout = 60.0\n\n[probe]\nk = 4\n")
    # A user's variables reach every service through the spec; the run's own addresses beat theirs.
    monkeypatch.setenv("CENTERLINE_WORKER_CONCURRENCY", "3")
    monkeypatch.setenv("CENTERLINE_TRAINER_MAX_GRAD_NORM", "0.5")
    monkeypatch.setenv("CENTERLINE_NATS_URL", "nats://elsewhere:4222")
    run_dir = tmp_path / "run"
    flags = ["--steps", "7", "--workers", "2", "--trainer-ranks", "2", "--prompts-per-step", "3"]
    spec = _with_launch_settings(tmp_path, ["--config", str(given), *flags, "--run-dir", str(run_dir)])
    config = run_dir / "config.toml"
    run_dir.mkdir()
    spec.write(config)

    data = tomllib.loads(config.read_text())
    assert {k for k, v in data.items() if isinstance(v, dict)} == {"up", "trainer", "worker", "proxy", "probe"}
    # the file's learning rate over up's job default, which applies where no source sets one
    assert (data["learning_rate"], data["rollout_n"], data["nats_url"], data["engine_urls"]) == (
        0.002,
        8,
        "nats://127.0.0.1:4999",
        ["http://127.0.0.1:5000"],
    )
    trainer = data["trainer"]
    assert (trainer["model"], trainer["dataset"], trainer["run_dir"]) == (
        str(tmp_path / "model"),
        str(run_dir / "train.jsonl"),
        str(run_dir),
    )
    assert (trainer["steps"], trainer["prompts_per_step"], trainer["max_grad_norm"], trainer["keep_checkpoints"]) == (
        7,
        3,
        0.5,
        2,
    )
    # the held-out rows up prepared, evaluated by the trainer every --heldout-every steps (docs/design.md section 9)
    assert (trainer["heldout_dataset"], trainer["heldout_every"]) == (str(run_dir / "heldout.jsonl"), 25)
    assert (data["worker"]["concurrency"], data["worker"]["chat_template"]) == (3, True)
    assert (data["proxy"]["upstream"], data["proxy"]["port"], data["proxy"]["upstream_timeout"]) == (
        "http://127.0.0.1:5001",
        5002,
        60.0,
    )
    assert data["probe"] == {"k": 4} and "steps" not in data["up"]  # the trainer's, in its table only

    argv = launcher.service_argv(spec, config)
    py, file = sys.executable, ["--config", str(config)]
    assert argv == {
        "proxy": [py, "-m", "centerline", "proxy", *file],
        "worker-0": [py, "-m", "centerline", "worker", *file, "--worker-id", "worker-0"],
        "worker-1": [py, "-m", "centerline", "worker", *file, "--worker-id", "worker-1"],
        "trainer": [py, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "centerline", "trainer", *file],
    }
    engine = launcher.engine_argv(spec, "http://127.0.0.1:5000")
    assert engine == [py, "-m", "centerline", "sglang", "--model", str(tmp_path / "model"), "--port", "5000", "--"]
    on_gpu = dataclasses.replace(spec, up=spec.up.model_copy(update={"engine_device": "cuda"}))
    assert launcher.engine_argv(on_gpu, "http://127.0.0.1:5000")[-4:] == ["5000", "--device", "cuda", "--"]

    # Each service, in the environment up gives it, resolves exactly the spec's settings.
    env = service_env(os.environ, "worker", PASSWORDS)
    _, cfg, proxy = _as_started(argv["proxy"], ProxySettings, env)
    _, _, worker = _as_started(argv["worker-1"], WorkerSettings, env)
    args, _, trainer = _as_started(argv["trainer"], TrainerSettings, env)
    assert cfg == spec.cfg and proxy == spec.proxy and trainer == spec.trainer
    assert worker == spec.worker.model_copy(update={"worker_id": "worker-1"})
    # The trainer finds the file saying what it resolved, and leaves it as up wrote it.
    before = config.stat()
    write_run_config(config, args, cfg, trainer)
    after = config.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_a_run_of_sessions_defaults_to_a_third_of_the_learning_rate_and_any_source_overrides_it(tmp_path, monkeypatch):
    monkeypatch.delenv("CENTERLINE_LEARNING_RATE", raising=False)
    rate = lambda *argv: parse(list(argv)).cfg.training.learning_rate  # noqa: E731
    assert rate() == rate("--task", "copy") == 3e-4
    assert (
        rate("--task", "chain")
        == rate("--environment", "tests.rollout_worker.session_environments:three_turns")
        == 1e-4
    )
    assert rate("--task", "chain", "--learning-rate", "3e-4") == 3e-4
    config = tmp_path / "run.toml"
    config.write_text("learning_rate = 2e-4\n")
    assert rate("--task", "chain", "--config", str(config)) == 2e-4
    monkeypatch.setenv("CENTERLINE_LEARNING_RATE", "5e-5")
    assert rate("--task", "chain") == 5e-5


def test_the_tool_task_calc_defaults_to_turns_long_enough_for_a_call_and_any_source_overrides_it(monkeypatch):
    monkeypatch.delenv("CENTERLINE_ROLLOUT_MAX_NEW_TOKENS", raising=False)
    limit = lambda *argv: parse(list(argv)).cfg.rollout.max_new_tokens  # noqa: E731
    assert limit("--task", "calc") == 80 and limit("--task", "chain") == limit("--task", "copy") == 8
    assert limit("--task", "calc", "--rollout-max-new-tokens", "96") == 96
    monkeypatch.setenv("CENTERLINE_ROLLOUT_MAX_NEW_TOKENS", "90")
    assert limit("--task", "calc") == 90


def test_up_takes_the_trainers_weight_update_as_a_flag_above_its_table_and_writes_it_for_the_trainer(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("CENTERLINE_TRAINER_WEIGHT_UPDATE", raising=False)
    update = lambda *argv: parse(list(argv)).trainer.weight_update  # noqa: E731
    assert update() == "retract"
    config = tmp_path / "run.toml"
    config.write_text('[trainer]\nweight_update = "in_place"\n')
    assert update("--config", str(config)) == "in_place"
    assert update("--config", str(config), "--weight-update", "drain") == "drain"
    spec = parse(["--weight-update", "drain"])
    spec.write(tmp_path / "config.toml")
    assert load(tmp_path / "config.toml").trainer.weight_update == "drain"  # what the trainer reads
    with pytest.raises(SystemExit) as exc:
        parse(["--weight-update", "pause"])
    assert exc.value.code == 2


def test_up_takes_as_flags_the_trainer_settings_marked_up_flag_and_no_other(tmp_path, capsys):
    assert UP_TRAINER_FLAGS == (
        "steps",
        "train_seconds",
        "prompts_per_step",
        "heldout_every",
        "weight_update",
        "weight_transport",
    )
    values = {"steps": 7, "train_seconds": 5.0, "prompts_per_step": 3, "heldout_every": 2}
    values |= {"weight_update": "drain", "weight_transport": "distributed"}
    argv = [item for name, value in values.items() for item in (f"--{name.replace('_', '-')}", str(value))]
    spec = parse(argv)
    assert {name: getattr(spec.trainer, name) for name in UP_TRAINER_FLAGS} == values
    spec.write(tmp_path / "config.toml")
    assert {name: getattr(load(tmp_path / "config.toml").trainer, name) for name in values} == values
    with pytest.raises(SystemExit) as exc:
        parse(["--max-grad-norm", "0.5"])  # a trainer setting without the mark: its [trainer] table only
    assert exc.value.code == 2
    assert "unrecognized arguments: --max-grad-norm 0.5" in capsys.readouterr().err


def test_with_launch_settings_changes_exactly_the_settings_marked_launched(tmp_path):
    """``LAUNCH_SETTINGS`` is read from the fields' marks; the launcher fills in each, and nothing else."""
    spec = parse(["--run-dir", str(tmp_path / "run")])
    task = Prepared(tmp_path / "model", tmp_path / "train.jsonl", True, tmp_path / "heldout.jsonl")
    launched = with_launch_settings(
        spec,
        task,
        nats_url="nats://127.0.0.1:4999",
        replicas=3,  # every value unlike the spec's, so that each shows as changed
        engine_urls=["http://127.0.0.1:5000"],
        router_url="http://127.0.0.1:5001",
        proxy_url="http://127.0.0.1:5002",
    )
    before, after = tomllib.loads(spec.to_toml()), tomllib.loads(launched.to_toml())
    changed = {"": {k for k, v in after.items() if not isinstance(v, dict) and before.get(k) != v}}
    changed |= {
        table: {k for k, v in values.items() if before[table].get(k) != v}
        for table, values in after.items()
        if isinstance(values, dict)
    }
    assert {table: names for table, names in changed.items() if names} == {
        table: set(names) for table, names in LAUNCH_SETTINGS.items()
    }
    assert LAUNCH_SETTINGS == {
        "": ("nats_url", "nats_stream_replicas", "proxy_url", "engine_urls"),
        "trainer": ("model", "dataset", "run_dir", "heldout_dataset"),
        "worker": ("chat_template",),
        "proxy": ("upstream", "port"),
    }


def test_up_trains_300_steps_of_16_prompts_where_the_trainer_alone_defaults_to_100_of_8_and_any_source_wins(
    tmp_path, monkeypatch
):
    for name in ("STEPS", "PROMPTS_PER_STEP", "HELDOUT_EVERY", "EVAL_EVERY", "TRAIN_SECONDS"):
        monkeypatch.delenv(f"CENTERLINE_TRAINER_{name}", raising=False)
    trainer = lambda *argv: parse(list(argv)).trainer  # noqa: E731
    assert (TrainerSettings().steps, TrainerSettings().prompts_per_step) == (100, 8)
    assert (trainer().steps, trainer().prompts_per_step, trainer().heldout_every, trainer().train_seconds) == (
        300,
        16,
        25,
        None,
    )
    flags = trainer("--steps", "5", "--prompts-per-step", "3", "--heldout-every", "2", "--train-seconds", "30")
    assert (flags.steps, flags.prompts_per_step, flags.heldout_every, flags.train_seconds) == (5, 3, 2, 30.0)
    config = tmp_path / "run.toml"
    config.write_text("[trainer]\nsteps = 40\n")
    assert (trainer("--config", str(config)).steps, trainer("--config", str(config), "--steps", "6").steps) == (40, 6)
    monkeypatch.setenv("CENTERLINE_TRAINER_STEPS", "50")
    assert (trainer().steps, trainer("--config", str(config)).steps, trainer().prompts_per_step) == (50, 50, 16)


def test_the_trainers_settings_in_ups_table_or_variables_are_refused_naming_where_they_are_now(
    tmp_path, monkeypatch, capsys
):
    config = tmp_path / "run.toml"
    config.write_text("[up]\nsteps = 40\n")
    with pytest.raises(SystemExit) as exc:
        parse(["--config", str(config)])
    assert exc.value.code == 2
    assert "steps is the trainer's setting; set trainer.steps in the TOML file, CENTERLINE_TRAINER_STEPS" in (
        capsys.readouterr().err
    )
    monkeypatch.setenv("CENTERLINE_UP_EVAL_EVERY", "5")
    with pytest.raises(SystemExit):
        parse([])
    assert "CENTERLINE_UP_EVAL_EVERY: eval_every is the trainer's setting" in capsys.readouterr().err


def test_ups_old_held_out_flags_set_the_heldout_settings_with_a_note(tmp_path, capsys, monkeypatch):
    for name in ("HELDOUT_EVERY", "EVAL_EVERY"):
        monkeypatch.delenv(f"CENTERLINE_TRAINER_{name}", raising=False)
    data = tmp_path / "d.jsonl"
    spec = parse(["--dataset", str(data), "--eval-dataset", "h.jsonl", "--eval-prompts", "5", "--eval-every", "4"])
    assert (spec.up.heldout_dataset, spec.up.heldout_prompts, spec.trainer.heldout_every) == (Path("h.jsonl"), 5, 4)
    assert [line.split(": ", 1)[1] for line in capsys.readouterr().err.splitlines()] == [
        "warning: --eval-dataset is deprecated; use --heldout-dataset",
        "warning: --eval-prompts is deprecated; use --heldout-prompts",
        "warning: --eval-every is deprecated; use --heldout-every",
    ]

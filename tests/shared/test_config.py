"""Configuration: flags over environment over TOML, and start-up refusals that name the flag."""

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from shared import nats_auth
from shared.config import (
    Config,
    ConfigError,
    add_arguments,
    check_section,
    env_name,
    load_toml,
    resolve,
    resolve_section,
    to_toml,
)
from shared.settings import SECTIONS, ProxySettings, ReplaySettings, TrainerSettings, WorkerSettings
from trainer_service.service import write_run_config

ROOT = Path(__file__).resolve().parents[2]


def parse(argv, env=None):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve(parser.parse_args(argv), env=env or {})


def test_defaults_are_the_embedded_toy_job():
    cfg = parse([])
    assert (
        cfg.rollout.top_logprobs_num,
        cfg.rollout.temperature,
        cfg.rollout.logprobs_mode,
        cfg.loss.is_mode,
    ) == (128, 1.0, "selected", "none")


def test_flags_override_the_environment_which_overrides_the_toml_file(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text(
        'rollout_top_logprobs_num = 64\nrollout_temperature = 0.7\nseed = 3\nnats_url = "nats://file:4222"\n'
    )
    env = {
        "CENTERLINE_ROLLOUT_TOP_LOGPROBS_NUM": "32",
        "CENTERLINE_ROLLOUT_TEMPERATURE": "0.5",
        "CENTERLINE_MAX_STALENESS": "5",
        "CENTERLINE_NATS_URL": "nats://env:4222",
    }
    cfg = parse(["--config", str(toml), "--rollout-temperature", "0.9"], env)
    # flag > environment > file > default, setting by setting
    assert (
        cfg.rollout.temperature,
        cfg.rollout.top_logprobs_num,
        cfg.training.seed,
        cfg.training.max_inflight_steps,
    ) == (0.9, 32, 3, 2)
    assert (cfg.training.max_staleness, cfg.services.nats_url) == (5, "nats://env:4222")
    assert parse(["--config", str(toml), "--nats-url", "nats://flag:4222"], env).services.nats_url == "nats://flag:4222"
    assert parse(["--config", str(toml)], {}).services.nats_url == "nats://file:4222"


# Each source beats the next one: (flags, variables, file) and the value that wins.
SOURCE_PAIRS = {
    "flag over environment": (["1"], "2", None, 1),
    "flag over file": (["1"], None, "3", 1),
    "environment over file": ([], "2", "3", 2),
    "file over default": ([], None, "3", 3),
}


@pytest.mark.parametrize("flag_value, variable, file_value, expected", SOURCE_PAIRS.values(), ids=SOURCE_PAIRS)
def test_a_shared_setting_takes_the_first_source_that_gives_it(tmp_path, flag_value, variable, file_value, expected):
    toml = tmp_path / "run.toml"
    toml.write_text(f"seed = {file_value}\n" if file_value else "")
    argv = ["--config", str(toml), *(["--seed", *flag_value] if flag_value else [])]
    assert parse(argv, {"CENTERLINE_SEED": variable} if variable else {}).training.seed == expected


@pytest.mark.parametrize("flag_value, variable, file_value, expected", SOURCE_PAIRS.values(), ids=SOURCE_PAIRS)
def test_a_command_setting_takes_the_first_source_that_gives_it(tmp_path, flag_value, variable, file_value, expected):
    toml = tmp_path / "run.toml"
    # the worker's max_deliver, in its table and its variable, is another setting
    toml.write_text("[worker]\nmax_deliver = 9\n" + (f"[trainer]\nmax_deliver = {file_value}\n" if file_value else ""))
    argv = [*TRAINER, "--config", str(toml), *(["--max-deliver", *flag_value] if flag_value else [])]
    env = {"CENTERLINE_WORKER_MAX_DELIVER": "8", **({"CENTERLINE_TRAINER_MAX_DELIVER": variable} if variable else {})}
    assert parse_section(TrainerSettings, argv, env).max_deliver == expected


def test_an_unset_setting_keeps_its_default():
    assert parse([], {}).training.seed == 0 and parse_section(TrainerSettings, TRAINER).max_deliver == 20


def test_list_settings_come_from_flags_and_comma_separated_environment():
    assert parse(["--engine-urls", "http://a:1", "http://b:2"]).services.engine_urls == ["http://a:1", "http://b:2"]
    assert parse([], {"CENTERLINE_ENGINE_URLS": "http://a:1,http://b:2"}).services.engine_urls == [
        "http://a:1",
        "http://b:2",
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rollout-temperature", "0"], "--rollout-temperature 0.0: greedy decoding has no sampling distribution"),
        (["--rollout-top-logprobs-num", "0"], "--rollout-top-logprobs-num 0: K must be positive"),
        (["--rollout-min-p", "0.05"], "--rollout-min-p 0.05: min-p is not supported"),
        (
            ["--rollout-top-p", "0.9"],
            "--rollout-logprobs-mode selected: filtered sampling (top-p < 1 or top-k set) needs "
            "--rollout-logprobs-mode support",
        ),
        (["--rollout-top-k", "50"], "--rollout-logprobs-mode selected: filtered sampling"),
        (
            ["--rollout-logprobs-mode", "support", "--rollout-top-k", "200"],
            "--rollout-top-k 200: support mode records the whole support in K=128 slots",
        ),
        (
            ["--rollout-logprobs-mode", "support", "--rollout-top-p", "0.9"],
            "--rollout-top-k -1: support mode records the whole support",
        ),
        (
            ["--score-centering-mis-low", "6"],
            "--score-centering-mis-low 6.0: needs 0 <= --score-centering-mis-low < --score-centering-mis-high",
        ),
        (["--max-inflight-steps", "0"], "--max-inflight-steps 0: must be >= 1"),
        (
            ["--rollout-session-max-tokens", "65536", "--max-sample-bytes", "67108864"],
            "--max-sample-bytes 67108864: a sample of --rollout-session-max-tokens 65536 tokens at K=128 is up to "
            "67964928 bytes and could never be trained",
        ),
    ],
)
def test_settings_that_cannot_be_honoured_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError) as info:
        parse(argv)
    assert str(info.value).startswith(message)


def test_support_mode_with_top_k_within_k_is_accepted():
    cfg = parse(["--rollout-logprobs-mode", "support", "--rollout-top-k", "50", "--rollout-top-p", "0.95"])
    assert cfg.rollout.filtered and cfg.rollout.top_k == 50


@pytest.mark.parametrize(
    "variable, value, field, expected",
    [
        ("CENTERLINE_ADVANTAGE_STD_NORM", "true", "advantage_std_norm", True),
        ("CENTERLINE_ADVANTAGE_STD_NORM", "0", "advantage_std_norm", False),
        ("CENTERLINE_SCORE_CENTERING_TIS_CLIP", "1.5", "score_centering_tis_clip", 1.5),
        ("CENTERLINE_ROLLOUT_CHAT_TEMPLATE", "t.jinja", "rollout_chat_template", "t.jinja"),
        ("CENTERLINE_ROLLOUT_CHAT_TEMPLATE", "", "rollout_chat_template", ""),  # set, to the empty string
        ("CENTERLINE_ENGINE_URLS", "http://a:1", "engine_urls", ["http://a:1"]),
    ],
)
def test_a_variable_is_read_as_its_setting_s_type(variable, value, field, expected):
    assert parse([], {variable: value}).model_dump()[field] == expected  # by its public name


@pytest.mark.parametrize(
    "variable, value, field, expected",
    [
        ("CENTERLINE_TRAINER_HELDOUT_DATASET", "h.jsonl", "heldout_dataset", Path("h.jsonl")),
        ("CENTERLINE_TRAINER_TRAIN_SECONDS", "60", "train_seconds", 60.0),
        ("CENTERLINE_TRAINER_TENSORBOARD", "false", "tensorboard", False),
        ("CENTERLINE_TRAINER_STRATEGY", "fsdp2", "strategy", "fsdp2"),
    ],
)
def test_a_command_variable_is_read_as_its_setting_s_type(variable, value, field, expected):
    assert getattr(parse_section(TrainerSettings, TRAINER, {variable: value}), field) == expected


def test_a_variable_counts_only_spelled_in_capitals():
    assert parse([], {"centerline_seed": "5", "Centerline_Seed": "6", "CENTERLINE_seed": "7"}).training.seed == 0


def test_a_variable_of_another_table_or_the_shared_prefix_is_not_a_command_setting():
    env = {"CENTERLINE_WORKER_THREADS": "5", "CENTERLINE_THREADS": "6"}
    assert parse_section(TrainerSettings, TRAINER, env).threads == 1


@pytest.mark.parametrize(
    "variable, value, message",
    [
        (
            "CENTERLINE_TRAINER_HELDOUT_EVERY",
            "0",
            "--heldout-every '0': must be >= 1 (also settable as CENTERLINE_TRAINER_HELDOUT_EVERY or "
            "trainer.heldout_every "
            "in the TOML file)",
        ),
        (
            "CENTERLINE_TRAINER_METRICS_PORT",
            "",
            "--metrics-port '': Input should be a valid integer, unable to parse string as an integer (also "
            "settable as CENTERLINE_TRAINER_METRICS_PORT or trainer.metrics_port in the TOML file)",
        ),
        (
            "CENTERLINE_TRAINER_WANDB",
            "yes",
            "--wandb 'yes': Input should be 'off', 'offline' or 'online' (also settable as CENTERLINE_TRAINER_WANDB "
            "or trainer.wandb in the TOML file)",
        ),
    ],
)
def test_a_bad_command_variable_names_the_flag_the_value_the_fix_and_the_variable(variable, value, message):
    with pytest.raises(ConfigError) as info:
        parse_section(TrainerSettings, TRAINER, {variable: value})
    assert str(info.value) == message


def test_a_model_built_in_code_reads_no_variable(monkeypatch):
    monkeypatch.setenv("CENTERLINE_SEED", "5")
    monkeypatch.setenv("CENTERLINE_TRAINER_THREADS", "3")
    monkeypatch.setenv("THREADS", "4")
    assert Config().training.seed == 0 and TrainerSettings().threads == 1
    assert resolve().training.seed == 5  # resolve's variables are os.environ's when it is given none


def test_credential_variables_are_no_settings_and_refuse_nothing():
    env = {nats_auth.PASSWORD_ENV: "secret", nats_auth.PASSWORD_FILE_ENV: "/run/secret", "CENTERLINE_TRAINER_X": "1"}
    cfg, settings = parse([], env), parse_section(TrainerSettings, TRAINER, env)
    assert "secret" not in to_toml(cfg, settings) and (cfg, settings) == (
        parse([]),
        parse_section(TrainerSettings, TRAINER),
    )


def test_no_dotenv_file_is_read(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CENTERLINE_SEED", raising=False)
    (tmp_path / ".env").write_text("CENTERLINE_SEED=5\nSEED=6\n")
    assert resolve().training.seed == 0 and Config().training.seed == 0


def test_resolved_settings_are_frozen():
    cfg, settings = parse([]), parse_section(TrainerSettings, TRAINER)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.training = cfg.training
    with pytest.raises(ValidationError, match="frozen"):
        cfg.training.seed = 1
    with pytest.raises(ValidationError, match="frozen"):
        settings.threads = 2


def test_bad_environment_value_names_the_flag_and_the_variable():
    with pytest.raises(ConfigError, match=r"--max-staleness 'many': .*CENTERLINE_MAX_STALENESS"):
        parse([], {"CENTERLINE_MAX_STALENESS": "many"})


def test_unknown_toml_key_is_refused(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("rollout_top_logprob_num = 64\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['rollout_top_logprob_num'\]"):
        parse(["--config", str(toml)])


def test_resolved_config_round_trips_through_toml(tmp_path):
    cfg = parse(["--engine-urls", "http://a:1", "--advantage-std-norm", "--rollout-temperature", "0.7"])
    toml = tmp_path / "resolved.toml"
    toml.write_text(to_toml(cfg))
    assert parse(["--config", str(toml)]) == cfg


def test_config_command_prints_the_error_and_exits_2():
    run = subprocess.run(
        [sys.executable, "-m", "centerline", "config", "--rollout-temperature", "-1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert run.returncode == 2
    assert "--rollout-temperature -1.0: greedy decoding" in run.stderr


def test_config_reference_is_generated_from_the_schema():
    run = subprocess.run(
        [sys.executable, "scripts/gen_config_docs.py", "--check"], capture_output=True, text=True, cwd=ROOT
    )
    assert run.returncode == 0, run.stderr
    doc = (ROOT / "docs" / "config.md").read_text()
    assert all(f"`--{name.replace('_', '-')}`" in doc for name in Config.public_fields())
    for cls in SECTIONS.values():
        part = doc.split(f"## `{cls.command}`")[1].split("\n## ")[0]
        assert f"`[{cls.name}]`" in part
        assert all(f"`--{name.replace('_', '-')}`" in part for name in cls.model_fields)


@pytest.mark.parametrize(
    "argv",
    [
        ["config"],
        ["trainer", "--model", "m", "--dataset", "d.jsonl", "--run-dir", "r"],
        ["worker"],
        ["proxy", "--upstream", "http://127.0.0.1:1"],
        ["up"],
    ],
)
def test_every_service_refuses_a_bad_setting_at_start_with_exit_2_naming_the_flag(argv):
    run = subprocess.run(
        [sys.executable, "-m", "centerline", *argv, "--rollout-temperature", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 2
    assert (
        run.stderr
        == f"centerline {argv[0]}: --rollout-temperature 0.0: greedy decoding has no sampling distribution to centre; "
        "use a temperature > 0\n"
    )


# ------------------------------------------------------------------ each command's own settings


def parse_section(section, argv, env=None):
    parser = argparse.ArgumentParser()
    add_arguments(parser, section)
    args = parser.parse_args(argv)
    return resolve_section(section, args, env or {}, resolve(args, env or {}))


TRAINER = ["--model", "m", "--dataset", "d.jsonl", "--run-dir", "r"]


def test_a_command_setting_is_a_flag_a_key_of_its_table_and_a_variable(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('loss = "tis"\n\n[trainer]\nmax_grad_norm = 0.5\nthreads = 3\n')
    env = {
        "CENTERLINE_TRAINER_MAX_GRAD_NORM": "0.25",
        "CENTERLINE_TRAINER_THREADS": "2",
        "CENTERLINE_TRAINER_STEPS": "7",
    }
    settings = parse_section(TrainerSettings, [*TRAINER, "--config", str(toml), "--threads", "4"], env)
    assert (settings.threads, settings.max_grad_norm, settings.steps, settings.strategy) == (4, 0.25, 7, "ddp")
    assert settings.model == Path("m")


def test_a_required_setting_may_come_from_the_environment():
    env = {"CENTERLINE_TRAINER_MODEL": "m", "CENTERLINE_TRAINER_DATASET": "d", "CENTERLINE_TRAINER_RUN_DIR": "r"}
    assert parse_section(TrainerSettings, [], env).run_dir == Path("r")


def test_a_missing_required_setting_names_the_flag_the_key_and_the_variable():
    with pytest.raises(ConfigError) as info:
        parse_section(TrainerSettings, ["--model", "m", "--dataset", "d"])
    assert str(info.value) == (
        "--run-dir is required: pass it, or set trainer.run_dir in the TOML file or CENTERLINE_TRAINER_RUN_DIR"
    )


@pytest.mark.parametrize(
    "argv, env, message",
    [
        (
            ["--prompts-per-step", "0"],
            {},
            "--prompts-per-step 0: must be >= 1 (also settable as "
            "CENTERLINE_TRAINER_PROMPTS_PER_STEP or trainer.prompts_per_step in the TOML file)",
        ),
        ([], {"CENTERLINE_TRAINER_ACK_WAIT": "0"}, "--ack-wait '0': must be > 0"),
        (["--max-grad-norm", "-1"], {}, "--max-grad-norm -1.0: must be >= 0"),
        (["--max-deliver", "0"], {}, "--max-deliver 0: must be at least 1, or -1 for no limit"),
        (
            ["--strategy", "fsdp2"],
            {"CENTERLINE_TRAINER_THREADS": "two"},
            "--threads 'two': Input should be a valid integer",
        ),
    ],
)
def test_a_bad_command_setting_names_the_flag_the_value_and_the_fix(argv, env, message):
    with pytest.raises(ConfigError) as info:
        parse_section(TrainerSettings, [*TRAINER, *argv], env)
    assert str(info.value).startswith(message)


def test_a_check_across_shared_and_command_settings_names_both():
    with pytest.raises(ConfigError, match=r"^--rollout-top-logprobs-num 128: above --max-top-logprobs-num 64;"):
        parse_section(ProxySettings, ["--upstream", "http://u:1", "--max-top-logprobs-num", "64"])


def test_a_store_cap_below_the_steps_in_flight_is_refused_naming_the_flag_the_value_and_the_fix():
    with pytest.raises(ConfigError) as info:
        parse_section(TrainerSettings, [*TRAINER, "--rollouts-max-bytes", "1000"])
    assert str(info.value).startswith(
        "--rollouts-max-bytes 1000: must hold the steps in flight, --max-inflight-steps + 1 = 3 steps of 8 x 4 "
        "samples of up to "
    )
    assert str(info.value).endswith("; raise it, or lower --rollout-session-max-tokens or K")


def test_unknown_key_of_a_command_table_is_refused(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[trainer]\nmax_grad_nrom = 1.0\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['trainer.max_grad_nrom'\]"):
        load_toml(str(toml))


def test_an_unknown_key_of_a_command_table_stops_the_command_naming_the_key(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[worker]\nconcurency = 4\n")
    with pytest.raises(ConfigError) as info:
        parse_section(WorkerSettings, ["--config", str(toml)])
    assert str(info.value) == (
        f"--config {toml}: unknown key(s) ['worker.concurency']; see docs/config.md for the settings"
    )


def test_a_table_of_the_wrong_kind_is_refused(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("trainer = 3\n")
    with pytest.raises(ConfigError, match=r"trainer must be a table \(\[trainer\]\)$"):
        parse(["--config", str(toml)])


def test_the_run_config_holds_the_command_settings_and_keeps_the_other_tables(tmp_path):
    given = tmp_path / "given.toml"
    given.write_text("rollout_n = 2\n\n[worker]\nconcurrency = 5\n\n[trainer]\nthreads = 9\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser, TrainerSettings)
    args = parser.parse_args([*TRAINER, "--config", str(given), "--threads", "3", "--max-grad-norm", "0.5"])
    cfg = resolve(args, {})
    settings = resolve_section(TrainerSettings, args, {}, cfg)
    written = tmp_path / "config.toml"
    write_run_config(written, args, cfg, settings)
    data = load_toml(str(written))
    assert data["rollout_n"] == 2 and data["worker"] == {"concurrency": 5}
    assert (
        data["trainer"]["threads"] == 3 and data["trainer"]["max_grad_norm"] == 0.5 and data["trainer"]["model"] == "m"
    )
    again = argparse.Namespace(config=str(written))
    assert resolve(again, {}) == cfg and resolve_section(TrainerSettings, again, {}, cfg) == settings


def test_the_run_config_is_left_alone_when_it_says_what_was_resolved_and_rewritten_when_not(tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser, TrainerSettings)
    written = tmp_path / "config.toml"

    def write(*flags: str) -> os.stat_result:
        args = parser.parse_args([*TRAINER, "--config", str(written), *flags])
        cfg = resolve(args, {})
        write_run_config(written, args, cfg, resolve_section(TrainerSettings, args, {}, cfg))
        return written.stat()

    written.write_text("rollout_n = 2\n\n[worker]\nconcurrency = 5\n")
    first = write()
    again = write()  # started with the file it would write: the run spec `centerline up` wrote
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)
    changed = write("--threads", "4")
    assert changed.st_ino != first.st_ino
    data = load_toml(str(written))
    assert (data["trainer"]["threads"], data["rollout_n"], data["worker"]) == (4, 2, {"concurrency": 5})


def test_no_two_settings_share_a_variable_or_a_flag_of_one_command():
    shared = {env_name(name) for name in Config.public_fields()}
    for cls in SECTIONS.values():
        assert not shared & {env_name(name, cls) for name in cls.model_fields}, cls.name
        assert not set(Config.public_fields()) & set(cls.model_fields), cls.name


def test_a_proxy_cap_every_answer_of_the_settings_would_pass_is_refused_at_start_naming_it():
    cfg = parse(["--rollout-n", "16", "--rollout-max-new-tokens", "8192", "--rollout-session-max-tokens", "16384"])
    with pytest.raises(ConfigError) as info:
        check_section(ProxySettings(upstream="http://u"), cfg)
    assert str(info.value) == (
        "--max-upstream-response-bytes 268435456: an answer of --rollout-n 16 x --rollout-max-new-tokens 8192 "
        "tokens at K=128 is about 507248640 bytes and would be cut off every time; raise it, or lower them"
    )
    wide = ProxySettings(upstream="http://u", max_upstream_response_bytes=1 << 30)
    assert check_section(wide, cfg) is wide


def test_a_job_default_sits_under_every_source_and_the_rules_see_the_merged_settings(tmp_path):
    job = {"rollout_max_new_tokens": 8, "seed": 4}
    toml = tmp_path / "run.toml"
    toml.write_text("seed = 5\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    # 12 is refused over the field default 16, and accepted over the job's 8
    cfg = resolve(parser.parse_args(["--rollout-session-max-tokens", "12"]), {}, defaults=job)
    assert (cfg.rollout.session_max_tokens, cfg.rollout.max_new_tokens, cfg.training.seed) == (12, 8, 4)
    assert resolve(parser.parse_args(["--config", str(toml)]), {}, defaults=job).training.seed == 5
    with pytest.raises(ConfigError, match=r"^--rollout-session-max-tokens 12: a session's budget"):
        resolve(parser.parse_args(["--rollout-session-max-tokens", "12"]), {})


def test_a_rule_across_a_command_s_own_settings_names_the_flag_the_value_and_the_fix():
    with pytest.raises(ConfigError) as info:
        parse_section(ReplaySettings, ["--steps-from", "m.jsonl", "--batches-per-step", "2"])
    assert str(info.value) == (
        "--batches-per-step 2: --steps-from groups the batches as the original run did; drop --batches-per-step"
    )
    with pytest.raises(ConfigError) as info:
        parse_section(WorkerSettings, [], {"CENTERLINE_WORKER_MAX_DELIVER": "-2"})
    assert str(info.value) == "--max-deliver -2: must be at least 1, or -1 for no limit"


# ------------------------------------------------------------------ renamed settings (CommandSettings.renamed)


def test_an_old_flag_sets_the_renamed_setting_with_a_note(capsys):
    settings = parse_section(TrainerSettings, [*TRAINER, "--eval-every", "3", "--eval-timeout", "60"])
    assert (settings.heldout_every, settings.heldout_timeout) == (3, 60.0)
    assert capsys.readouterr().err.splitlines() == [
        f"{Path(sys.argv[0]).name}: warning: --eval-every is deprecated; use --heldout-every",
        f"{Path(sys.argv[0]).name}: warning: --eval-timeout is deprecated; use --heldout-timeout",
    ]


def test_an_old_variable_sets_the_renamed_setting_with_a_warning_and_the_new_one_wins():
    with pytest.warns(
        FutureWarning, match=r"^CENTERLINE_TRAINER_EVAL_EVERY is deprecated; use CENTERLINE_TRAINER_HELDOUT_EVERY"
    ):
        assert parse_section(TrainerSettings, TRAINER, {"CENTERLINE_TRAINER_EVAL_EVERY": "4"}).heldout_every == 4
    both = {"CENTERLINE_TRAINER_EVAL_EVERY": "4", "CENTERLINE_TRAINER_HELDOUT_EVERY": "6"}
    with pytest.warns(FutureWarning):
        assert parse_section(TrainerSettings, TRAINER, both).heldout_every == 6


def test_an_old_key_of_a_table_sets_the_renamed_setting_with_a_warning(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[trainer]\neval_every = 7\n")
    with pytest.warns(FutureWarning, match=rf"^trainer.eval_every in {toml} is deprecated; use trainer.heldout_every"):
        assert parse_section(TrainerSettings, [*TRAINER, "--config", str(toml)]).heldout_every == 7


def test_an_old_and_a_new_key_of_one_setting_are_refused(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("[up]\neval_prompts = 7\nheldout_prompts = 8\n")
    with pytest.raises(ConfigError) as info:
        load_toml(str(toml))
    assert str(info.value) == f"--config {toml}: up.eval_prompts is the old name of up.heldout_prompts; keep one"

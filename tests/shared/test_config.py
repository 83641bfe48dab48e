"""Configuration: flags over TOML over environment, and start-up refusals that name the flag."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import Config, ConfigError, add_arguments, resolve, to_toml

ROOT = Path(__file__).resolve().parents[2]


def parse(argv, env=None):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return resolve(parser.parse_args(argv), env=env or {})


def test_defaults_are_the_embedded_toy_job():
    cfg = parse([])
    assert (
        cfg.rollout_top_logprobs_num,
        cfg.rollout_temperature,
        cfg.rollout_logprobs_mode,
        cfg.score_centering_is,
    ) == (128, 1.0, "selected", "none")


def test_flags_override_toml_which_overrides_environment(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text("rollout_top_logprobs_num = 64\nrollout_temperature = 0.7\n")
    env = {
        "CENTERLINE_ROLLOUT_TOP_LOGPROBS_NUM": "32",
        "CENTERLINE_ROLLOUT_TEMPERATURE": "0.5",
        "CENTERLINE_MAX_STALENESS": "5",
    }
    cfg = parse(["--config", str(toml), "--rollout-temperature", "0.9"], env)
    assert (cfg.rollout_top_logprobs_num, cfg.rollout_temperature, cfg.max_staleness) == (64, 0.9, 5)


def test_list_settings_come_from_flags_and_comma_separated_environment():
    assert parse(["--engine-urls", "http://a:1", "http://b:2"]).engine_urls == ["http://a:1", "http://b:2"]
    assert parse([], {"CENTERLINE_ENGINE_URLS": "http://a:1,http://b:2"}).engine_urls == ["http://a:1", "http://b:2"]


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
    ],
)
def test_settings_that_cannot_be_honoured_are_refused_naming_the_flag(argv, message):
    with pytest.raises(ConfigError) as info:
        parse(argv)
    assert str(info.value).startswith(message)


def test_support_mode_with_top_k_within_k_is_accepted():
    cfg = parse(["--rollout-logprobs-mode", "support", "--rollout-top-k", "50", "--rollout-top-p", "0.95"])
    assert cfg.filtered and cfg.rollout_top_k == 50


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
    assert all(f"`--{name.replace('_', '-')}`" in doc for name in Config.model_fields)


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

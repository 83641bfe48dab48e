"""The shared ``Config`` in four groups, each read whole by its users, while every source, the
TOML it writes and its refusals speak the flat public names users write (shared/settings.py)."""

import argparse

import pytest
from pydantic import ValidationError

from centerline.up import run_spec
from shared.config import Config, ConfigError, add_arguments, resolve
from shared.sampling import Sampling
from shared.settings import LossSettings, RolloutSettings, ServiceSettings, TrainingSettings


def test_each_setting_is_read_in_its_group_by_the_name_users_write():
    cfg = Config(
        rollout_top_logprobs_num=32,
        max_sample_bytes=1 << 30,
        loss="tis",
        score_centering_is="mis",
        advantage_std_norm=True,
        seed=3,
        nats_url="nats://x:1",
    )
    assert (cfg.rollout.top_logprobs_num, cfg.rollout.max_sample_bytes) == (32, 1 << 30)
    assert (cfg.loss.name, cfg.loss.is_mode, cfg.loss.advantage_std_norm) == ("tis", "mis", True)
    assert (cfg.training.seed, cfg.services.nats_url) == (3, "nats://x:1")
    assert cfg.loss == LossSettings(name="tis", is_mode="mis", advantage_std_norm=True)


def test_the_public_names_are_the_flat_ones_each_in_one_group_in_the_file_s_order():
    groups = (RolloutSettings, LossSettings, TrainingSettings, ServiceSettings)
    names = [name for group in groups for name in group.public_fields()]
    assert list(Config.public_fields()) == names == list(Config().model_dump())
    assert len(names) == len(set(names)) == 29
    assert names[:2] == ["rollout_top_logprobs_num", "rollout_temperature"] and names[-1] == "engine_urls"
    assert [n for n in names if not n.startswith("rollout_")][:3] == ["max_sample_bytes", "loss", "score_centering_is"]


def test_a_config_dumps_its_public_names_and_builds_back_from_them():
    cfg = Config(rollout_n=6, loss="reinforce", engine_urls=["http://a:1", "http://b:2"], learning_rate=0.5)
    dumped = cfg.model_dump()
    assert (dumped["rollout_n"], dumped["loss"], dumped["engine_urls"], dumped["learning_rate"]) == (
        6,
        "reinforce",
        ["http://a:1", "http://b:2"],
        0.5,
    )
    assert Config(**dumped) == cfg


def test_a_group_built_in_code_takes_its_field_names_or_their_public_names():
    assert LossSettings(name="tis", is_mode="mis", tis_clip=3.0) == LossSettings(
        loss="tis", score_centering_is="mis", score_centering_tis_clip=3.0
    )
    assert RolloutSettings(n=2).n == RolloutSettings(rollout_n=2).n == 2


def test_the_rollout_group_states_the_sampling_contract():
    cfg = Config(rollout_top_k=8, rollout_top_p=0.9, rollout_logprobs_mode="support", rollout_temperature=0.7)
    assert cfg.rollout.sampling == Sampling(k=128, temperature=0.7, top_p=0.9, top_k=8, mode="support")
    assert cfg.rollout.filtered and not Config().rollout.filtered


def test_a_group_s_name_given_as_a_setting_is_refused_not_dropped(tmp_path):
    spec = run_spec.parse(["--run-dir", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"^--rollout 3: not a setting; see docs/config.md for the settings$"):
        spec.derive(cfg={"rollout": 3})
    with pytest.raises(ValidationError, match="not a setting"):
        Config(training={"seed": 1})


def test_a_loss_table_in_the_file_is_a_bad_loss_name_as_before(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[loss]\nname = "tis"\n')
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError) as info:
        resolve(parser.parse_args(["--config", str(toml)]), {})
    assert str(info.value) == (
        "--loss {'name': 'tis'}: Input should be 'score_centering', 'reinforce' or 'tis' "
        "(also settable as CENTERLINE_LOSS or loss in the TOML file)"
    )


def test_a_bad_item_of_a_grouped_list_names_the_list_s_flag():
    with pytest.raises(ConfigError) as info:
        resolve(env={}, defaults={"engine_urls": [3]})
    assert str(info.value) == (
        "--engine-urls 3: Input should be a valid string "
        "(also settable as CENTERLINE_ENGINE_URLS or engine_urls in the TOML file)"
    )


def test_a_rule_of_the_loss_group_names_its_flag():
    with pytest.raises(ConfigError, match=r"^--score-centering-mis-low 6.0: needs 0 <= --score-centering-mis-low <"):
        resolve(env={"CENTERLINE_SCORE_CENTERING_MIS_LOW": "6"})


def test_a_setting_read_by_its_flat_name_says_which_group_holds_it():
    cfg = Config(rollout_n=8)
    with pytest.raises(AttributeError) as info:
        cfg.rollout_n  # noqa: B018
    assert (
        str(info.value) == "Config has no attribute 'rollout_n': the setting lives in a group, read it as cfg.rollout.n"
    )
    with pytest.raises(AttributeError, match=r"read it as cfg\.rollout\.session_max_tokens$"):
        cfg.session_max_tokens  # noqa: B018
    with pytest.raises(AttributeError, match=r"^'Config' object has no attribute 'no_such_setting'$"):
        cfg.no_such_setting  # noqa: B018

"""The loss's typed interface: ``loss(logits, TokenRows, LossSettings)``, the settings the run's
``Config.loss`` whole, and the tests' call by name
(``tests/trainer_service/cases.py``: ``by_name``) that the other loss tests use."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from shared.config import LOSS_NAMES, Config
from tests.trainer_service.cases import LOSSES as BY_NAME
from tests.trainer_service.cases import fresh, make_case
from trainer_service.loss import LOSSES, LossSettings, TokenRows


def rows_of(case, **row_fields):
    return TokenRows(**{k: v for k, v in case.items() if k != "logits"}, **row_fields)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_the_typed_call_equals_the_call_by_name_bit_for_bit(name):
    case = make_case(5, mode="support", n=10, vocab=30, k=6, dtype=torch.float32, padded_rows=(2,))
    by_name, typed = fresh(case), fresh(case)
    options = {"is_mode": "mis", "mis_low": 0.25}
    loss_a, metrics_a = BY_NAME[name](
        **by_name, mode="support", temperature=0.7, token_count=40, chunk_size=3, **options
    )
    rows = rows_of(typed, mode="support", temperature=0.7, token_count=40)
    loss_b, metrics_b = LOSSES[name](typed["logits"], rows, LossSettings(name=name, **options), chunk_size=3)
    loss_a.backward()
    loss_b.backward()
    assert torch.equal(loss_a, loss_b) and metrics_a == metrics_b
    assert torch.equal(by_name["logits"].grad, typed["logits"].grad)


def test_settings_and_options_by_name_together_are_refused():
    case = fresh(make_case(6))
    with pytest.raises(TypeError, match=r"score_centering_loss: \['tis_clip'\] given by name beside a LossSettings"):
        BY_NAME["score_centering"](case["logits"], rows_of(case), LossSettings(), tis_clip=3.0)


def test_a_field_name_neither_record_has_is_refused():
    with pytest.raises(ValidationError, match="temprature\n  Extra inputs are not permitted"):
        BY_NAME["reinforce"](**fresh(make_case(6)), temprature=0.7)


def test_the_mode_comes_from_the_rows():
    case = fresh(make_case(6))
    with pytest.raises(ValueError, match="mode='top_k'; expected one of"):
        LOSSES["score_centering"](case["logits"], rows_of(case, mode="top_k"), LossSettings())


def test_the_loss_table_has_every_configurable_loss_and_no_other():
    assert tuple(LOSSES) == LOSS_NAMES
    with pytest.raises(ValidationError, match=r"\nloss\n  Input should be 'score_centering', 'reinforce' or 'tis'"):
        LossSettings(loss="ppo")


def test_the_loss_settings_are_the_config_s_loss_section_whole():
    cfg = Config(
        loss="tis",
        score_centering_is="mis",
        score_centering_tis_clip=3.0,
        score_centering_mis_low=0.25,
        score_centering_mis_high=4.0,
    )
    assert cfg.loss == LossSettings(name="tis", is_mode="mis", tis_clip=3.0, mis_low=0.25, mis_high=4.0)

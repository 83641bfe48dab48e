"""The trainer refuses to start with a K that SGLang cannot be asked for (shared.contract.k_above_vocab)."""

from __future__ import annotations

import logging

from shared.config import Config
from trainer_service.service import candidates_fit


def test_k_above_the_vocabulary_does_not_fit_and_the_log_says_why(caplog):
    with caplog.at_level(logging.ERROR):
        assert not candidates_fit(Config(rollout_top_logprobs_num=300), 260)
    assert [r.getMessage() for r in caplog.records] == [
        "--rollout-top-logprobs-num: K=300 is above the model's vocabulary of 260: SGLang takes its server down on a "
        "top_logprobs_num above the vocabulary, so nothing is sent; lower K to at most 260"
    ]


def test_k_at_most_the_vocabulary_or_in_support_mode_fits(caplog):
    assert candidates_fit(Config(rollout_top_logprobs_num=260), 260)
    assert candidates_fit(Config(rollout_top_logprobs_num=300, rollout_logprobs_mode="support", rollout_top_k=300), 260)
    assert not caplog.records

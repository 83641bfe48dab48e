"""Staleness per trained token in the step's metrics (trainer_service/commit.py ``token_staleness``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from trainer_service.commit import token_staleness


def batch(versions, mask):
    return SimpleNamespace(token_versions=np.array(versions, np.int32), loss_mask=np.array(mask, np.uint8))


def test_each_trained_token_counts_by_its_own_version_and_untrained_ones_not_at_all():
    # a response that spans an update (versions 3 then 4), and a session whose template tokens are version 0, untrained
    spanning = batch([3, 3, 4, 4], [1, 1, 1, 1])
    session = batch([2, 0, 0, 5], [1, 0, 0, 1])
    assert token_staleness([spanning, session], 5) == {
        "token_staleness_mean": (2 + 2 + 1 + 1 + 3 + 0) / 6,
        "token_staleness_max": 3,
        "token_stale_share": 3 / 6,  # versions 3, 3 and 2 are more than one behind 5
    }


def test_no_trained_token_is_no_staleness():
    assert token_staleness([batch([0, 0], [0, 0])], 4) == {
        "token_staleness_mean": 0.0,
        "token_staleness_max": 0,
        "token_stale_share": 0.0,
    }

"""Fixtures of the rollout worker's tests."""

from __future__ import annotations

import pytest

from rollout_worker.session_transport import TRANSPORTS


@pytest.fixture(params=TRANSPORTS)
def transport(request) -> str:
    """A test that drives a session through its OpenAI client runs over each transport: the answers,
    the failures kept and the session are the same in process and over loopback HTTP."""
    return request.param

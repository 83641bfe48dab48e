"""Fixtures for tests that need a real nats-server."""

import pytest

from centerline.nats_server import EmbeddedNats


@pytest.fixture
def nats_server(tmp_path):
    """A fresh embedded nats-server (JetStream store in ``tmp_path``), stopped after the test."""
    server = EmbeddedNats(tmp_path / "nats").start()
    yield server
    server.stop()

"""The proxy in front of the session's SGLang server, shared by every reliability test; each test brings its own NATS
server."""

import pytest

from tests.reliability.topology import Topology, Upstream


@pytest.fixture(scope="package")
def upstream(tmp_path_factory, sglang_server, model_dir):
    up = Upstream(tmp_path_factory.mktemp("upstream"), sglang_server.serve(model_dir), model_dir)
    yield up
    up.close()


@pytest.fixture
def topology(upstream, sglang, tmp_path):
    """``sglang``: the server alive and at the initial weights again (the last trainer loaded its own)."""
    topo = Topology(tmp_path, upstream)
    yield topo
    topo.close()

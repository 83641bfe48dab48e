"""The engine and proxy every reliability test shares; each test brings its own NATS server."""

import pytest

from tests.reliability.topology import Topology, Upstream


@pytest.fixture(scope="package")
def upstream(tmp_path_factory):
    up = Upstream(tmp_path_factory.mktemp("upstream"))
    yield up
    up.close()


@pytest.fixture
def topology(upstream, tmp_path):
    topo = Topology(tmp_path, upstream)
    yield topo
    topo.close()

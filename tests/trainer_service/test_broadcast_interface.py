"""The network interface the trainer's end of a weight group binds (trainer_service/broadcast.py):
the one its route to the engine leaves by, so that on a host with several networks (compose's
trainer) an engine can reach it. The engine's side is SGLang's own ``init_custom_process_group``,
in a process of its own, as ``POST /init_weights_update_group`` runs it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch

from tests.processes import ENV, REPO
from trainer_service.broadcast import GLOO_INTERFACE, Group, buckets, interface_towards

ENGINE = textwrap.dedent(
    """
    import json, sys, torch, torch.distributed as dist
    from sglang.srt.utils.common import init_custom_process_group
    print("imported", flush=True)
    for line in sys.stdin:  # one group a line: "port name"
        port, name = line.split()
        group = init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{int(port)}", world_size=2, rank=1, group_name=name
        )
        flat = torch.empty(4)
        dist.broadcast(flat, src=0, group=group)
        print(json.dumps(flat.tolist()), flush=True)
    """
)


def _interface_holding(address: str) -> str:
    (name,) = [
        name
        for name, addresses in psutil.net_if_addrs().items()
        if any(a.family == socket.AF_INET and a.address == address for a in addresses)
    ]
    return name


def test_the_interface_towards_an_address_is_the_one_its_route_leaves_by():
    assert interface_towards("127.0.0.1") == _interface_holding("127.0.0.1")
    assert interface_towards("localhost") == _interface_holding("127.0.0.1")
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                assert interface_towards(a.address) == name, a.address
    assert interface_towards("no-such-engine.invalid") is None


@pytest.fixture(scope="module")
def engine():
    """An engine's end of weight groups, joining one per line it reads (it imports SGLang first:
    a minute on a busy machine, longer than a group's deadline)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE],
        cwd=REPO,
        env=ENV,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "imported\n", proc.stderr.read()
        yield proc
    finally:
        proc.kill()
        proc.communicate()


def _broadcast_to(engine, interface: str | None, name: str) -> list[float]:
    """One bucket from a trainer ``Group`` bound to ``interface`` to ``engine``: what it received."""
    group = Group("127.0.0.1", "gloo", 60.0, name, interface)
    try:
        engine.stdin.write(f"{group.port} {name}\n")
        engine.stdin.flush()
        group.join()
        (bucket,) = buckets({"w": torch.arange(4, dtype=torch.float32)}, 1 << 20)
        group.send(bucket)
        return json.loads(engine.stdout.readline())
    finally:
        group.close()


@pytest.mark.integration
def test_the_trainers_end_binds_the_interface_it_is_given_and_leaves_the_variable_as_it_was(engine):
    assert GLOO_INTERFACE not in os.environ
    loopback = interface_towards("127.0.0.1")
    assert _broadcast_to(engine, loopback, "interface-given") == [0.0, 1.0, 2.0, 3.0]
    assert GLOO_INTERFACE not in os.environ
    # an interface that does not exist fails the join by its name: the binding is gloo's own
    with pytest.raises(RuntimeError, match="no-such-if0"):
        Group("127.0.0.1", "gloo", 5.0, "interface-missing", "no-such-if0").join()
    assert GLOO_INTERFACE not in os.environ


@pytest.mark.integration
def test_an_operators_gloo_interface_is_kept(engine, monkeypatch):
    """GLOO_SOCKET_IFNAME set by the operator wins over the route's interface."""
    loopback = interface_towards("127.0.0.1")
    monkeypatch.setenv(GLOO_INTERFACE, loopback)
    assert _broadcast_to(engine, "no-such-if0", "interface-operator") == [0.0, 1.0, 2.0, 3.0]
    assert os.environ[GLOO_INTERFACE] == loopback

"""Ports for servers started at run time come from below the kernel's ephemeral range, where no
outgoing connection can take them between the pick and the server's bind."""

from __future__ import annotations

import socket

from centerline.ports import HIGH, LOW, ephemeral_low, free_port


def test_a_free_port_is_below_the_ephemeral_range_and_bindable():
    ports = {free_port() for _ in range(50)}
    assert all(LOW <= port <= min(HIGH, ephemeral_low() - 1) for port in ports), sorted(ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # raises if the port was not free


def test_a_port_in_use_is_never_picked():
    listeners = []
    try:
        for _ in range(200):
            sock = socket.socket()
            sock.bind(("127.0.0.1", free_port()))
            sock.listen()
            listeners.append(sock)
        in_use = {sock.getsockname()[1] for sock in listeners}
        assert len(in_use) == 200  # each pick was free while the others listened
        assert not in_use & {free_port() for _ in range(50)}
    finally:
        for sock in listeners:
            sock.close()

"""Free TCP ports on this machine, for servers started at run time (`centerline up`, tests, benches)."""

from __future__ import annotations

import random
import socket

# Below the kernel's ephemeral range (bind(0) and every outgoing connection take their local port
# from there, so a port picked there can be taken by any client before its server binds it: SGLang
# then failed to start with "address already in use"), and below SGLang's own pick for its
# internal port (22000-29999, sglang.srt.utils.network.get_free_port_below_ephemeral).
LOW, HIGH = 10000, 21999
ATTEMPTS = 64


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at the moment of the call, drawn at random below the ephemeral
    range. Another process may still take it before the caller binds it; callers that cannot
    retry pass their port to one server only. Where that range is too small to draw from, the
    OS's pick."""
    high = min(HIGH, ephemeral_low() - 1)
    if high - LOW + 1 >= ATTEMPTS:
        for port in random.sample(range(LOW, high + 1), ATTEMPTS):
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]

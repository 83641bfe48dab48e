"""`centerline record`: save NATS messages, headers included, to a record file.

Two sources. ``--subject``: a live core-NATS subscription, until Ctrl-C/SIGTERM, ``--count``
messages or ``--timeout`` seconds. ``--stream``: a JetStream sequence range, read one
message at a time with the stream's message-get API (no consumer, so nothing is acked or
redelivered and the trainer's durable consumer is untouched; deleted sequences are
skipped; a ``--to-seq`` past the stream's last sequence stops there, and says so on
stderr). ``--jsonl`` prints one summary line per message (``summary``; a part carried in
pieces as one batch, at its last piece) as well, or instead when no ``--out`` is given; the
record file keeps every piece as stored. Replay a file with ``centerline replay``.

    centerline record --stream ROLLOUTS --from-seq 1 --to-seq 40 --out seg.clrec --nats-url nats://127.0.0.1:4222
    centerline record --subject rollouts.batches --out live.clrec --count 100
    centerline record --stream ROLLOUTS --jsonl

Record file, version 1 (``.clrec``). All integers big-endian::

    offset 0  b"CLREC"   magic, 5 bytes
    offset 5  0x01       format version, 1 byte
    offset 6  frames to the end of the file, each a uint32 length L then L bytes of msgpack:
              frame 0    the file header, a map {"created": unix s, "source": {...how it was recorded}}
              frame 1..  one message each, a map {"subject": str, "seq": int (stream sequence, 0 = live),
                         "time": float (unix s: stored at, or received at when live),
                         "headers": {str: str} (Nats-Msg-Id included), "data": bin (the bytes, unchanged)}

Unknown keys in a map are ignored; a reader refuses another magic or version, and names
the offset and what it expected for anything malformed (``RecordFileError``).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgpack
import orjson

from shared.nats_auth import CredentialsError, redact

MAGIC = b"CLREC"
VERSION = 1
PREAMBLE = len(MAGIC) + 1
LENGTH = 4  # bytes of a frame's length prefix


class RecordFileError(ValueError):
    """A record file that cannot be read; the message names the file, the offset and what was expected."""


@dataclass(frozen=True, slots=True)
class Message:
    subject: str
    seq: int  # JetStream stream sequence; 0 = recorded live (no sequence)
    time: float  # unix seconds
    headers: dict[str, str]
    data: bytes


class RecordWriter:
    """Appends messages to a new record file; each frame is flushed, so an interrupted live
    recording keeps every message written before it."""

    def __init__(self, path: Path, source: dict):
        self.path, self.count = Path(path), 0
        self.fh = open(self.path, "wb")
        self.fh.write(MAGIC + bytes([VERSION]))
        self._frame({"created": time.time(), "source": source})

    def _frame(self, doc: dict) -> None:
        body = msgpack.packb(doc, use_bin_type=True)
        self.fh.write(len(body).to_bytes(LENGTH, "big") + body)
        self.fh.flush()

    def write(self, msg: Message) -> None:
        self._frame(
            {
                "subject": msg.subject,
                "seq": msg.seq,
                "time": msg.time,
                "headers": dict(msg.headers),
                "data": bytes(msg.data),
            }
        )
        self.count += 1

    def close(self) -> None:
        self.fh.close()


def read_record(path: Path) -> tuple[dict, list[Message]]:
    """The file header and every message of a record file, in recorded order."""
    raw = Path(path).read_bytes()
    where = f"{path}"
    if raw[: len(MAGIC)] != MAGIC:
        raise RecordFileError(
            f"{where}: offset 0: expected the magic {MAGIC!r} of a centerline record file, found {raw[: len(MAGIC)]!r}"
        )
    if len(raw) < PREAMBLE or raw[len(MAGIC)] != VERSION:
        found = raw[len(MAGIC)] if len(raw) > len(MAGIC) else "end of file"
        raise RecordFileError(f"{where}: offset {len(MAGIC)}: expected format version {VERSION}, found {found}")
    frames, pos = [], PREAMBLE
    while pos < len(raw):
        if pos + LENGTH > len(raw):
            raise RecordFileError(
                f"{where}: offset {pos}: expected a {LENGTH}-byte frame length, "
                f"{len(raw) - pos} bytes left (truncated file)"
            )
        n = int.from_bytes(raw[pos : pos + LENGTH], "big")
        start = pos + LENGTH
        if start + n > len(raw):
            raise RecordFileError(
                f"{where}: offset {pos}: frame length says {n} bytes, {len(raw) - start} left (truncated file)"
            )
        try:
            doc = msgpack.unpackb(raw[start : start + n], raw=False)
        except (ValueError, msgpack.UnpackException) as exc:
            raise RecordFileError(f"{where}: offset {start}: expected a msgpack map of {n} bytes ({exc})") from None
        if not isinstance(doc, dict):
            raise RecordFileError(f"{where}: offset {start}: expected a msgpack map, found {type(doc).__name__}")
        frames.append((start, doc))
        pos = start + n
    if not frames:
        raise RecordFileError(f"{where}: offset {PREAMBLE}: expected the file header frame, found end of file")
    return frames[0][1], [_message(where, offset, doc) for offset, doc in frames[1:]]


_FIELDS = {"subject": (str,), "seq": (int,), "time": (float, int), "headers": (dict,), "data": (bytes,)}


def _message(where: str, offset: int, doc: dict) -> Message:
    for name, kinds in _FIELDS.items():
        value = doc.get(name)
        if not isinstance(value, kinds) or isinstance(value, bool):
            want = " or ".join({"dict": "map", "bytes": "bin"}.get(k.__name__, k.__name__) for k in kinds)
            raise RecordFileError(
                f"{where}: offset {offset}: message field {name!r} is "
                f"{type(value).__name__ if name in doc else 'missing'}, expected {want}"
            )
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in doc["headers"].items()):
        raise RecordFileError(f"{where}: offset {offset}: message headers must map str to str")
    return Message(doc["subject"], doc["seq"], float(doc["time"]), doc["headers"], doc["data"])


def joined(messages: list[Message]) -> list[Message]:
    """``messages`` with the pieces of each part larger than a message put together (docs/design.md
    section 3): one message where its last piece was, with its first piece's sequence and the part's
    batch_id as ``Nats-Msg-Id``, as the gate admits it. Pieces that make no whole stay as they are: the
    gate's rules (``wire``) refuse them."""
    from types import SimpleNamespace

    from trainer_service.pieces import Broken, Pieces, Whole

    gathering, out, views = Pieces(max_bytes=1 << 62), [], {}
    for msg in messages:
        seq = SimpleNamespace(stream=msg.seq)
        view = SimpleNamespace(
            headers=msg.headers, data=msg.data, metadata=SimpleNamespace(sequence=seq, num_delivered=1)
        )
        views[id(view)] = msg
        got = gathering.add(view, 0.0)
        if isinstance(got, Whole):
            first = views[id(got.pieces[0])]
            out.append(Message(msg.subject, first.seq, msg.time, got.headers, got.data))
        elif isinstance(got, Broken):
            out += [views[id(v)] for v in got.msgs]
        elif got is view:
            out.append(msg)
    return out + [views[id(v)] for v in gathering.release()]


def summary(msg: Message) -> dict:
    """One message for people: where it came from and, for a wire-format batch, what it holds."""
    from shared.contract import oldest_trained_version, sample_turns
    from shared.msgpack_arrays import WireError
    from shared.wire import decode_batch

    out = {"subject": msg.subject, "seq": msg.seq, "time": msg.time, "headers": msg.headers, "bytes": len(msg.data)}
    try:
        b = decode_batch(msg.data)
    except WireError as exc:
        return {**out, "batch": None, "not_a_batch": str(exc)}
    rewards = [float(r) for r in b.rewards]
    out["batch"] = {
        "batch_id": b.batch_id,
        "producer": b.producer,
        "task_id": b.task_id,
        "attempt": b.attempt,
        "parts": b.parts,
        "weight_version": b.weight_version,
        "oldest_trained_version": oldest_trained_version(b),
        "mode": b.mode,
        "k": b.k,
        "samples": b.num_samples,
        "tokens": b.num_tokens,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        # a session's shape: its prompt is the first turn's, its response the rest (docs/design.md section 12)
        "prompt_tokens": int(b.prompt_ids.shape[0]),
        "sampled_tokens": int(b.loss_mask.sum()),
        "injected_tokens": int(b.loss_mask.size - b.loss_mask.sum()),
        "turns": sample_turns(b),
        "finish_reasons": b.finish_reasons,
    }
    return out


def print_summary(msg: Message) -> None:
    sys.stdout.buffer.write(orjson.dumps(summary(msg)) + b"\n")
    sys.stdout.flush()


class JoinedSummaries:
    """``print_summary`` of each message as it comes, but a part carried in pieces once, as its batch,
    when its last piece comes (``joined``); ``close`` prints the pieces that made no whole."""

    def __init__(self):
        from shared.pieces import OF_HEADER

        self.of, self.pending = OF_HEADER, {}

    def __call__(self, msg: Message) -> None:
        bid = msg.headers.get(self.of)
        if bid is None:
            print_summary(msg)
            return
        got = self.pending.setdefault(bid, [])
        got.append(msg)
        out = joined(got)
        if any(self.of not in m.headers for m in out):  # the part, whole
            del self.pending[bid]
            for m in out:
                print_summary(m)

    def close(self) -> None:
        for rest in self.pending.values():
            for m in rest:
                print_summary(m)
        self.pending = {}


# ---------------------------------------------------------------------------- sources


async def ignore_client_errors(exc: Exception) -> None:
    """NATS client error callback: a tool reports one clear error, not nats-py's tracebacks."""


async def record_stream(url: str, stream: str, first: int | None, last: int | None, sink) -> dict:
    """Messages ``first..last`` (default: the whole stream) of ``stream``, by sequence, up to the
    stream's last sequence when the recording starts; the summary names it (``stream_last_seq``)."""
    from nats.js.errors import NotFoundError

    from shared.nats_client import connect

    nc = await connect(url, name="centerline-record", max_reconnect_attempts=3, error_cb=ignore_client_errors)
    try:
        js = nc.jetstream()
        try:
            state = (await js.stream_info(stream)).state
        except NotFoundError:
            raise SystemExit(f"centerline record: stream {stream!r} not found at {url}") from None
        first = state.first_seq if first is None else first
        if last is not None and last > state.last_seq:  # asked one at a time, it would never end
            print(
                f"centerline record: --to-seq {last} is past the last sequence of stream {stream!r}, "
                f"{state.last_seq}: recording up to {state.last_seq}",
                file=sys.stderr,
                flush=True,
            )
        last = state.last_seq if last is None else min(last, state.last_seq)
        missing = 0
        for seq in range(first, last + 1):
            try:
                m = await js.get_msg(stream, seq)
            except NotFoundError:  # deleted, or aged out of the stream
                missing += 1
                continue
            stamp = m.time.timestamp() if m.time is not None else 0.0
            sink(Message(m.subject, m.seq, stamp, dict(m.headers or {}), m.data or b""))
        return {
            "stream": stream,
            "from_seq": first,
            "to_seq": last,
            "stream_last_seq": state.last_seq,
            "missing": missing,
        }
    finally:
        await nc.close()


async def record_live(url: str, subject: str, count: int | None, timeout: float | None, sink) -> dict:
    """Messages published on ``subject`` from now until a signal, ``count`` messages or ``timeout`` s."""
    from shared.nats_client import connect

    done, seen = asyncio.Event(), [0]

    async def closed() -> None:  # reconnects gave up: the recording ends with what it has
        done.set()

    nc = await connect(
        url, name="centerline-record", max_reconnect_attempts=10, error_cb=ignore_client_errors, closed_cb=closed
    )
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, done.set)

    async def on_message(msg) -> None:
        if count is not None and seen[0] >= count:
            return
        sink(Message(msg.subject, 0, time.time(), dict(msg.headers or {}), msg.data))
        seen[0] += 1
        if count is not None and seen[0] >= count:
            done.set()

    sub = await nc.subscribe(subject, cb=on_message)
    await nc.flush()  # the server has the subscription: what is published from now on is recorded
    print(f"centerline record: recording {subject} from {url}", file=sys.stderr, flush=True)
    try:
        await asyncio.wait_for(done.wait(), timeout)
    except TimeoutError:
        pass
    await sub.unsubscribe()
    await nc.close()
    return {"subject": subject, "live": True}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="centerline record", description=__doc__.split("\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--subject", help="record live messages of this subject (core NATS)")
    source.add_argument("--stream", help="record this JetStream stream's messages by sequence")
    parser.add_argument("--from-seq", type=int, default=None, help="first sequence (--stream; default: the first)")
    parser.add_argument("--to-seq", type=int, default=None, help="last sequence (--stream; default: the last)")
    parser.add_argument("--count", type=int, default=None, help="stop after this many messages (--subject)")
    parser.add_argument("--timeout", type=float, default=None, help="stop after this many seconds (--subject)")
    parser.add_argument("--out", type=Path, default=None, help="record file to write")
    parser.add_argument("--jsonl", action="store_true", help="print one summary JSON line per message")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    args = parser.parse_args(argv)
    if args.out is None and not args.jsonl:
        parser.error("give --out FILE, --jsonl, or both")
    if args.stream and (args.count is not None or args.timeout is not None):
        parser.error("--count and --timeout apply to --subject; a --stream range ends at --to-seq")
    if args.subject and (args.from_seq is not None or args.to_seq is not None):
        parser.error("--from-seq and --to-seq apply to --stream")
    source = (
        {"stream": args.stream, "from_seq": args.from_seq, "to_seq": args.to_seq}
        if args.stream
        else {"subject": args.subject}
    ) | {"nats_url": redact(args.nats_url)}
    writer = RecordWriter(args.out, source) if args.out else None
    summaries = JoinedSummaries()

    def sink(msg: Message) -> None:
        if writer is not None:
            writer.write(msg)
        if args.jsonl:
            summaries(msg)

    from nats.errors import NoServersError

    try:
        if args.stream:
            done = asyncio.run(record_stream(args.nats_url, args.stream, args.from_seq, args.to_seq, sink))
        else:
            done = asyncio.run(record_live(args.nats_url, args.subject, args.count, args.timeout, sink))
    except NoServersError:
        print(f"centerline record: no NATS server at {redact(args.nats_url)} (--nats-url)", file=sys.stderr)
        return 1
    except CredentialsError as exc:
        print(f"centerline record: {exc}", file=sys.stderr)
        return 1
    finally:
        summaries.close()
        if writer is not None:
            writer.close()
    if writer is not None:
        print(orjson.dumps({"out": str(args.out), "messages": writer.count, **done}).decode(), file=sys.stderr)
    return 0

"""`centerline bench long-sample`: a sample longer than one NATS message, published by the worker's
path and admitted by the trainer's gate, beside a sample that fits one message, in one run.

The stack, every part real: an embedded ``nats-server`` (``centerline/nats_server.py``: fsync
before every PubAck, ``--max-payload`` the embedded server's 8 MiB by default) with centerline's
streams (``shared/streams.py``), the worker's packing and publisher and the trainer's gate on its
durable consumer. Two samples, each the whole group of its task (``--rollout-n 1``): the long one of
``--tokens`` response tokens (21,000 by default: at K=128 a token is 13 + 8K = 1,037 bytes, so over
20 MiB, the long agent session of docs/design.md section 3) and one of ``--fits-tokens`` (4,096)
that fits one message. Each is packed as the worker packs a sampled trajectory
(``rollout_worker/packing.py``), its rows a valid block of ``centerline/synth.py`` repeated to length
(the contract checks every row alike); every repeat is a new task, the two samples taking turns.

Per sample, medians of ``--repeats``:

- ``publish_s``: ``rollout_worker/publish.py`` ``publish_batch``, every message's PubAck awaited:
  encode, cut into pieces with the part's sha256 (``shared/pieces.py``), publish. ``pack_s``: the
  part of it before the first publish (``split_batch`` and ``pieces.cut``, no I/O).
- ``admit_s``: ``Gate.gather`` (``trainer_service/gate.py``) from its first fetch until the group is
  held: every piece fetched, put back together and checked against its digest
  (``trainer_service/pieces.py``), decoded and checked by the contract and the trainer's settings
  (``trainer_service/admission.py``). ``check_s``: the last of these alone on the whole part, no NATS
  (``admission``: decode, contract, settings). ``ack_s``: ``Gate.commit``, every message acked.
- ``wire_bytes``: the encoded sample; ``messages``: what it was published as, ``ceil(wire_bytes /
  piece_bytes)`` pieces of at most ``piece_bytes = max_payload - HEADER_ROOM``, or 1 where it fits;
  ``stream_bytes``: what ROLLOUTS stored for it (the last repeat), headers included.

The baseline, the same bytes in the same run (``centerline/bench/baselines.py``): copied once in
memory (``memcpy_s``) and sent once through a loopback TCP socket (``loopback_s``); ``*_to_loopback``
divide by the latter. ``long_to_fits_per_byte``: the long sample's seconds per byte over the
fitting one's, what carrying a sample in pieces costs per byte. The bench checks what it measured
and records it: each sample held as published (``sha256``, ``admitted_sha256``: the last repeat's),
``gate_counts`` (every repeat accepted, nothing else), ``unacked`` and ``dead_letters`` at the end.

    centerline bench long-sample --json
    centerline bench long-sample --tokens 65536 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from centerline.bench import add_out_flag
from centerline.bench.baselines import loopback_gbps
from centerline.nats_server import DEFAULT_MAX_PAYLOAD, EmbeddedNats
from centerline.runs.run_figures import write_bench_figures
from centerline.synth import make_batch
from rollout_worker.packing import Trajectory, pack_trajectories
from rollout_worker.publish import publish_batch, split_batch
from shared import names, pieces
from shared.config import Config
from shared.nats_client import connect, pull_consumer
from shared.streams import ensure_streams
from shared.task import PromptTask
from shared.wire import Batch
from trainer_service.admission import HOLD, GateSettings, admission
from trainer_service.gate import Gate
from trainer_service.ledger import GroupLedger

BLOCK = 512  # distinct rows made by centerline/synth.py, repeated to a sample's length
ACK_WAIT = 30.0  # the trainer's default --ack-wait
GATHER_LIMIT_S = 120.0  # a sample the gate has not held by then is a failure, not a figure
MOST_PAYLOAD = 64 << 20  # nats-server refuses a larger max_payload
SAMPLES = ("long", "fits")


def trajectory(tokens: int, prompt_tokens: int, k: int, vocab: int) -> Trajectory:
    """A sampled response of ``tokens`` tokens after a prompt of ``prompt_tokens``, K candidates a token."""
    block = make_batch(samples=1, tokens_per_sample=min(tokens, BLOCK), k=k, vocab_size=vocab, prompt_len=prompt_tokens)
    rows = np.arange(tokens) % block.num_tokens
    return Trajectory(
        prompt_ids=block.prompt_ids,
        response_ids=block.response_ids[rows],
        sampled_logprobs=block.sampled_logprobs[rows],
        loss_mask=np.ones(tokens, np.uint8),
        token_versions=np.zeros(tokens, np.int32),
        cand_ids=block.cand_ids[rows],
        cand_logprobs=block.cand_logprobs[rows],
        finish_reason="length",
    )


def group(t: Trajectory, step: int, index: int, cfg: Config) -> Batch:
    """The whole group of task ``bench/<step>/<index>``: the one sample ``t``, as the worker packs it."""
    task_id = f"bench/{step}/{index}"
    task = PromptTask(task_id=task_id, group_id=task_id, prompt="", answer="", reward="exact", n=1, step=step)
    one = np.ones(1, np.float32)
    return pack_trajectories(task, [t], one, 0 * one, producer="bench", sampling=cfg.rollout.sampling)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="centerline bench long-sample",
        description="seconds and bytes of a sample larger than one NATS message, published and admitted, "
        "beside one that fits",
    )
    parser.add_argument("--tokens", type=int, default=21000, help="response tokens of the long sample")
    parser.add_argument("--fits-tokens", type=int, default=4096, help="response tokens of the sample that fits")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="prompt tokens of each sample")
    parser.add_argument("--k", type=int, default=128, help="candidates per token K")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size")
    parser.add_argument(
        "--max-payload", type=int, default=DEFAULT_MAX_PAYLOAD, help="the nats-server's max_payload, bytes"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    add_out_flag(parser, "long-sample")
    return parser


def _positive(parser: argparse.ArgumentParser, args) -> None:
    for flag in ("tokens", "fits_tokens", "prompt_tokens", "k", "vocab", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if not 2 * pieces.HEADER_ROOM <= args.max_payload <= MOST_PAYLOAD:
        parser.error(
            f"--max-payload {args.max_payload}: nats-server takes at most {MOST_PAYLOAD} (64 MiB), and a message "
            f"keeps {pieces.HEADER_ROOM} bytes for headers; pick one in [{2 * pieces.HEADER_ROOM}, {MOST_PAYLOAD}]"
        )


def _fitting(parser: argparse.ArgumentParser, args, samples: dict[str, Trajectory], cfg: Config) -> None:
    """Refuse sizes under which the figure would not be the one named: the long sample in pieces, the
    other in one message (checked before any server starts)."""
    limit = args.max_payload - pieces.HEADER_ROOM
    for name, flag, value in (("long", "--tokens", args.tokens), ("fits", "--fits-tokens", args.fits_tokens)):
        size = len(split_batch(group(samples[name], 0, 0, cfg), limit)[0].data)
        if size > cfg.rollout.max_sample_bytes:
            parser.error(
                f"{flag} {value} makes a sample of {size} bytes, above the {cfg.rollout.max_sample_bytes} bytes of "
                "--max-sample-bytes the worker sends and the trainer takes at most: lower it"
            )
        if (size > limit) != (name == "long"):
            fix = "raise it or lower --max-payload" if name == "long" else "lower it or raise --max-payload"
            parser.error(
                f"{flag} {value} makes a sample of {size} bytes, which {'fits' if size <= limit else 'is over'} "
                f"one message of --max-payload {args.max_payload} ({limit} bytes besides headers); the {name} "
                f"sample must {'not ' if name == 'long' else ''}fit: {fix}"
            )


def _seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def _measure(args, samples: dict[str, Trajectory], cfg: Config, store: Path) -> dict:
    """Publish and admit each sample ``--repeats`` times, in turns; each sample's raw figures."""
    seen = {name: {"publish_s": [], "admit_s": [], "ack_s": [], "counts": Counter()} for name in samples}
    with EmbeddedNats(store, max_payload=args.max_payload) as server:
        nc = await connect(server.url, name="centerline-bench-long-sample")
        try:
            js = nc.jetstream()
            await ensure_streams(js)
            consumer = await pull_consumer(
                js,
                names.ROLLOUTS_STREAM,
                names.TRAINER_CONSUMER,
                filter_subject=names.ROLLOUTS_SUBJECT,
                ack_wait=ACK_WAIT,
            )
            gate = Gate(js, consumer, vocab_size=args.vocab, cfg=cfg, ledger={}, ack_wait=ACK_WAIT)
            for step in range(args.repeats):
                for index, (name, t) in enumerate(samples.items()):
                    figures, batch = seen[name], group(t, step, index, cfg)
                    stored = (await js.stream_info(names.ROLLOUTS_STREAM)).state.bytes
                    t0 = time.perf_counter()
                    acks = await publish_batch(
                        js, batch, max_payload=nc.max_payload, max_sample_bytes=cfg.rollout.max_sample_bytes
                    )
                    figures["publish_s"].append(time.perf_counter() - t0)
                    figures["stream_bytes"] = (await js.stream_info(names.ROLLOUTS_STREAM)).state.bytes - stored
                    figures["messages"] = len(acks)
                    t0 = time.perf_counter()
                    try:
                        held = await asyncio.wait_for(
                            gate.gather(1, 0, timeout=GATHER_LIMIT_S, stopping=asyncio.Event()), GATHER_LIMIT_S
                        )
                    except TimeoutError:
                        raise RuntimeError(
                            f"the gate held nothing of task {batch.task_id!r} within {GATHER_LIMIT_S:g}s; "
                            f"its counts: {dict(gate.counts)}"
                        ) from None
                    figures["admit_s"].append(time.perf_counter() - t0)
                    (part,) = held  # a group of one sample is one part
                    figures["admitted"] = bytes(part.msg.data)
                    t0 = time.perf_counter()
                    await gate.commit(step)
                    figures["ack_s"].append(time.perf_counter() - t0)
                    figures["counts"] += gate.take_counts()
                    figures["batch"] = batch
            info = await js.consumer_info(names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER)
            dead = (await js.stream_info(names.DLQ_STREAM)).state.messages
        finally:
            await nc.close()
    return {"samples": seen, "unacked": info.num_ack_pending + info.num_pending, "dead_letters": dead}


def sample_figures(raw: dict, tokens: int, args, cfg: Config) -> dict:
    """One sample's figures from its raw measurements, with the same bytes' baselines measured now."""
    limit = args.max_payload - pieces.HEADER_ROOM
    (part,) = split_batch(raw["batch"], limit)
    data, nbytes = part.data, len(part.data)
    view = memoryview(data)
    pack_s = _seconds(lambda: [pieces.cut(p.data, p.batch_id, limit) for p in split_batch(raw["batch"], limit)], 3)
    settings = GateSettings(args.vocab, cfg)
    verdict = admission(data, 1, 0, groups=GroupLedger({}), settings=settings)
    if verdict.action != HOLD:
        raise RuntimeError(f"the gate's admission refused the sample it held: {verdict.rule}: {verdict.reason}")
    check_s = _seconds(lambda: admission(data, 1, 0, groups=GroupLedger({}), settings=settings), 3)
    memcpy_s = _seconds(lambda: bytes(view), max(5, args.repeats))
    loopback_s = statistics.median([nbytes / loopback_gbps(nbytes) / 1e9 for _ in range(max(3, args.repeats))])
    publish_s, admit_s, ack_s = (statistics.median(raw[key]) for key in ("publish_s", "admit_s", "ack_s"))
    return {
        "tokens": tokens,
        "prompt_tokens": args.prompt_tokens,
        "wire_bytes": nbytes,
        "messages": raw["messages"],
        "stream_bytes": raw["stream_bytes"],
        "publish_s": publish_s,
        "pack_s": pack_s,
        "admit_s": admit_s,
        "check_s": check_s,
        "ack_s": ack_s,
        "memcpy_s": memcpy_s,
        "loopback_s": loopback_s,
        "publish_to_loopback": publish_s / loopback_s,
        "admit_to_loopback": admit_s / loopback_s,
        "publish_mb_per_s": nbytes / publish_s / 1e6,
        "admit_mb_per_s": nbytes / admit_s / 1e6,
        "sha256": hashlib.sha256(data).hexdigest(),
        "admitted_sha256": hashlib.sha256(raw["admitted"]).hexdigest(),
        "gate_counts": dict(raw["counts"]),
    }


def bench_long_sample(argv: list[str]) -> int:
    """Seconds and bytes of a sample over one NATS message, published and admitted, beside one that fits."""
    parser = _parser()
    args = parser.parse_args(argv)
    _positive(parser, args)
    cfg = Config(rollout_n=1, rollout_top_logprobs_num=args.k)
    tokens = {"long": args.tokens, "fits": args.fits_tokens}
    samples = {name: trajectory(tokens[name], args.prompt_tokens, args.k, args.vocab) for name in SAMPLES}
    _fitting(parser, args, samples, cfg)
    with tempfile.TemporaryDirectory(prefix="centerline-bench-long-sample-") as store:
        raw = asyncio.run(_measure(args, samples, cfg, Path(store)))
    figures = {name: sample_figures(raw["samples"][name], tokens[name], args, cfg) for name in SAMPLES}
    long, fits = figures["long"], figures["fits"]
    result = {
        "bench": "long-sample",
        "k": args.k,
        "vocab": args.vocab,
        "max_payload": args.max_payload,
        "piece_bytes": args.max_payload - pieces.HEADER_ROOM,
        "repeats": args.repeats,
        "samples": figures,
        "long_to_fits_per_byte": {
            key: (long[key] / long["wire_bytes"]) / (fits[key] / fits["wire_bytes"])
            for key in ("publish_s", "admit_s", "ack_s")
        },
        "unacked": raw["unacked"],
        "dead_letters": raw["dead_letters"],
    }
    write_bench_figures(result, args.out)
    return 0

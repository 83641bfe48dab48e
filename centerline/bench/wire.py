"""`centerline bench wire` and `centerline bench contract`: the cost of moving and checking a batch.

Both build a valid batch of N response tokens with K candidates (default N=4096, K=128:
4 MiB of candidates) and report medians over repeats, next to a baseline measured in the
same run: memcpy of the same bytes (wire) and the naive nested-list msgpack layout.

    centerline bench wire --json
    centerline bench contract --json --tokens 16384
"""

from __future__ import annotations

import argparse
import statistics
import time

import msgpack
import numpy as np

from centerline.bench import add_out_flag
from centerline.runs.run_figures import write_bench_figures
from centerline.synth import make_batch
from shared.contract import check_batch
from shared.wire import decode_batch, encode_batch


def _median_seconds(fn, *, repeats: int, inner: int = 1) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def _parser(target: str, doc: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"centerline bench {target}", description=doc)
    parser.add_argument("--tokens", type=int, default=4096, help="response tokens N in the batch")
    parser.add_argument("--k", type=int, default=128, help="candidates per token K")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size")
    parser.add_argument("--samples", type=int, default=16, help="samples B the tokens are split into")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--sizes", default="256,16384", help="extra token counts to report (bench wire), comma-separated; '' for none"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    add_out_flag(parser, target)
    return parser


def _batch(args):
    per_sample = max(1, args.tokens // args.samples)
    return make_batch(samples=args.samples, tokens_per_sample=per_sample, k=args.k, vocab_size=args.vocab, seed=0)


def wire_figures(batch, repeats: int) -> dict:
    data = encode_batch(batch)
    nbytes = batch.nbytes()
    roundtrip = _median_seconds(lambda: decode_batch(encode_batch(batch)), repeats=repeats)
    # The baseline is what any encoder must do at least: copy the payload into a newly
    # allocated buffer (decoding can be free). A copy into a warm preallocated buffer is
    # reported too; no encoder that returns fresh bytes can reach it.
    view = memoryview(data)
    memcpy = _median_seconds(lambda: bytes(view), repeats=repeats, inner=5)
    src = np.frombuffer(data, np.uint8)
    dst = np.empty_like(src)
    memcpy_prealloc = _median_seconds(lambda: np.copyto(dst, src), repeats=repeats, inner=5)

    def nested():
        doc = {
            name: getattr(batch, name).tolist()
            for name in ("response_ids", "sampled_logprobs", "cand_ids", "cand_logprobs")
        }
        back = msgpack.unpackb(msgpack.packb(doc))
        return {name: np.asarray(value, dtype=getattr(batch, name).dtype) for name, value in back.items()}

    naive = _median_seconds(nested, repeats=3)
    return {
        "tokens": batch.num_tokens,
        "k": batch.k,
        "message_bytes": len(data),
        "encode_decode_gbps": nbytes / roundtrip / 1e9,
        "encode_decode_ms": roundtrip * 1e3,
        "memcpy_gbps": len(data) / memcpy / 1e9,
        "memcpy_prealloc_gbps": len(data) / memcpy_prealloc / 1e9,
        "ratio_to_memcpy": (nbytes / roundtrip) / (len(data) / memcpy),
        "nested_list_msgpack_gbps": nbytes / naive / 1e9,
    }


def bench_wire(argv: list[str]) -> int:
    """Encode+decode throughput of wire format v2 against memcpy and nested-list msgpack."""
    args = _parser("wire", bench_wire.__doc__).parse_args(argv)
    result = {"bench": "wire", **wire_figures(_batch(args), args.repeats)}
    sizes = [int(n) for n in args.sizes.split(",") if n.strip()]
    result["sizes"] = [
        wire_figures(make_batch(samples=4, tokens_per_sample=n // 4, k=args.k, vocab_size=args.vocab), args.repeats)
        for n in sizes
    ]
    write_bench_figures(result, args.out)
    return 0


def bench_contract(argv: list[str]) -> int:
    """Cost of the full completeness contract on one batch (selected and support mode)."""
    args = _parser("contract", bench_contract.__doc__).parse_args(argv)
    batch = _batch(args)
    seconds = _median_seconds(
        lambda: check_batch(batch, vocab_size=args.vocab, current_version=0, max_staleness=1, seen=()),
        repeats=args.repeats,
    )
    per_sample = max(1, args.tokens // args.samples)
    support = make_batch(
        samples=args.samples,
        tokens_per_sample=per_sample,
        k=args.k,
        vocab_size=args.vocab,
        mode="support",
        top_k=args.k,
    )
    support_s = _median_seconds(lambda: check_batch(support, vocab_size=args.vocab), repeats=args.repeats)
    result = {
        "bench": "contract",
        "tokens": batch.num_tokens,
        "k": batch.k,
        "batch_mb": batch.nbytes() / 2**20,
        "ms_per_batch": seconds * 1e3,
        "rows_per_s": batch.num_tokens / seconds,
        "mb_per_s": batch.nbytes() / 2**20 / seconds,
        "support_ms_per_batch": support_s * 1e3,
    }
    write_bench_figures(result, args.out)
    return 0

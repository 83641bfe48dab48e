"""`centerline bench loss`: what score centering costs over REINFORCE, forward+backward.

Both losses run on the same float32 logits [N, V] (default N=2048, V=32768, K=128, the
production candidate width) and report median wall time over repeats and peak memory:

    centerline bench loss --json
    centerline bench loss --json --tokens 64 --vocab 512 --k 16 --repeats 2   # tiny, for tests

Peak memory is the maximum, over the forward+backward call, of the bytes held by torch's
CPU allocator beyond what was allocated before the call. It is read from the profiler's
memory events (`torch.profiler` with `profile_memory=True`): the CPU allocator reports
every allocation and free to it with a running "Total Allocated" that starts at 0 when
profiling starts. This sees every tensor, including kernels' internal temporaries and the
gradient buffer, which `tracemalloc` (Python heap only) and saved-tensor hooks (only what
autograd saves) cannot. `extra_peak_mb` is sc_peak - reinforce_peak.

Also reported, for context: REINFORCE written the obvious autograd way
(`log_softmax(logits/T).gather(a)`), which is what the efficient kernel shared by both
losses replaces. Not measured: the model forward/backward, which dwarfs either loss.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time

import torch

from centerline.bench import add_out_flag
from centerline.runs.run_figures import write_bench_figures
from shared.config import IMPORTANCE_WEIGHTS
from trainer_service.loss import LossSettings, TokenRows, reinforce_loss, score_centering_loss


def make_inputs(tokens: int, vocab: int, k: int, mode: str = "selected", temperature: float = 1.0, seed: int = 0):
    """Trainer logits [N, V], and the rows of a sampler distribution close to them with its top-K as candidates
    (in ``support`` mode the top-K renormalised, a full support per row)."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(tokens, vocab, generator=g)
    lq = torch.log_softmax(logits + 0.5 * torch.randn(tokens, vocab, generator=g), 1)
    cand_logprobs, cand_ids = lq.topk(k, dim=1)
    del lq
    if mode == "support":
        cand_logprobs = torch.log_softmax(cand_logprobs, 1)
    pick = torch.randint(0, k, (tokens,), generator=g)
    pick[::7] = 0  # keep some variety in the sampled position without leaving the head
    rows = TokenRows(
        response_ids=cand_ids.gather(1, pick[:, None]).squeeze(1),
        sampled_logprobs=cand_logprobs.gather(1, pick[:, None]).squeeze(1),
        cand_ids=cand_ids.to(torch.int32),
        cand_logprobs=cand_logprobs,
        advantages=torch.randn(tokens, generator=g),
        loss_mask=torch.ones(tokens, dtype=torch.bool),
        mode=mode,
        temperature=temperature,
    )
    return logits.requires_grad_(), rows


def autograd_reinforce(logits, rows: TokenRows, settings: LossSettings):
    """REINFORCE the obvious way, for reference only: materialises log_softmax [N, V]."""
    logp = torch.log_softmax(logits / rows.temperature, dim=1).gather(1, rows.response_ids[:, None]).squeeze(1)
    return (-(rows.advantages * logp)[rows.loss_mask]).sum() / rows.loss_mask.sum(), {}


def _forward_backward(fn, logits, rows, settings):
    logits.grad = None
    loss, _ = fn(logits, rows, settings)
    loss.backward()
    logits.grad = None


def median_ms(runs: dict, logits, rows: TokenRows, repeats: int) -> dict:
    """Median milliseconds per forward+backward for each ``name: (fn, settings)``.

    The candidates are timed in alternation, so a load change on a shared machine hits
    all of them alike rather than skewing their ratio."""
    times = {name: [] for name in runs}
    for fn, settings in runs.values():
        _forward_backward(fn, logits, rows, settings)  # warm up
    for _ in range(repeats):
        for name, (fn, settings) in runs.items():
            start = time.perf_counter()
            _forward_backward(fn, logits, rows, settings)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def peak_mb(fn, logits, rows: TokenRows, settings: LossSettings) -> float:
    """Peak bytes allocated by torch on the CPU during one forward+backward, in MiB."""
    logits.grad = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        loss, _ = fn(logits, rows, settings)
        loss.backward()
        del loss
        logits.grad = None  # freed while profiling, so the allocator's running total returns to its start
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            events = json.load(fh)["traceEvents"]
    events = sorted(
        (e for e in events if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0),
        key=lambda e: e["ts"],
    )
    if not events:
        return 0.0
    # The running total is process-wide; measure from its value just before the first event.
    start = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
    return (max(e["args"]["Total Allocated"] for e in events) - start) / 2**20


def bench_loss(argv: list[str]) -> int:
    """Score-centering loss vs REINFORCE, forward+backward: time and peak memory."""
    parser = argparse.ArgumentParser(prog="centerline bench loss", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="trained tokens N")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size V")
    parser.add_argument("--k", type=int, default=128, help="candidates per token K")
    parser.add_argument("--mode", default="selected", choices=("selected", "support"))
    parser.add_argument("--is-mode", default="none", choices=IMPORTANCE_WEIGHTS)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--chunk-size", type=int, default=None, help="rows per [rows, V] pass (default: auto)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-autograd-reference", action="store_true", help="skip the naive autograd REINFORCE")
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    add_out_flag(parser, "loss")
    args = parser.parse_args(argv)

    logits, rows = make_inputs(args.tokens, args.vocab, args.k, args.mode, args.temperature)
    reinforce, sc = LossSettings(name="reinforce"), LossSettings(is_mode=args.is_mode)
    reinforce_fn = functools.partial(reinforce_loss, chunk_size=args.chunk_size)
    sc_fn = functools.partial(score_centering_loss, chunk_size=args.chunk_size)
    figures = {
        "tokens": args.tokens,
        "vocab": args.vocab,
        "k": args.k,
        "mode": args.mode,
        "is_mode": args.is_mode,
        "threads": torch.get_num_threads(),
    }
    ms = median_ms({"reinforce": (reinforce_fn, reinforce), "sc": (sc_fn, sc)}, logits, rows, args.repeats)
    figures["reinforce_ms"], figures["sc_ms"] = ms["reinforce"], ms["sc"]
    figures["time_ratio"] = figures["sc_ms"] / figures["reinforce_ms"]
    figures["reinforce_peak_mb"] = peak_mb(reinforce_fn, logits, rows, reinforce)
    figures["sc_peak_mb"] = peak_mb(sc_fn, logits, rows, sc)
    figures["extra_peak_mb"] = figures["sc_peak_mb"] - figures["reinforce_peak_mb"]
    figures["logits_mb"] = logits.numel() * 4 / 2**20
    if not args.no_autograd_reference:
        figures["autograd_reinforce_ms"] = median_ms(
            {"ref": (autograd_reinforce, reinforce)}, logits, rows, max(1, args.repeats // 2)
        )["ref"]
        figures["autograd_reinforce_peak_mb"] = peak_mb(autograd_reinforce, logits, rows, reinforce)
    write_bench_figures(figures, args.out)
    return 0

"""`centerline bench step`: peak memory of one training step at a real LM-head shape, on the CPU.

The model is Qwen2.5-1.5B's shape (hidden 1536, MLP 8960, 12 heads, 2 KV heads, vocabulary
151,936, tied embeddings) cut to ``--layers`` decoder layers (default 2), randomly
initialised; the batch is one session of ``--tokens`` tokens (a 64-token prompt, the rest
trained response tokens with K = 128 candidates). Each case is one AdamW step of
``trainer_service.step.train_step``, run in a fresh child process, one at a time:

- ``chunked``: the trainer now, the LM head and loss from the hidden states a chunk
  (``--chunk``, 1024 tokens) at a time, activation checkpointing on, float32 or bfloat16.
- ``dense``: the step at f6a6570, measured in the same run as the baseline: logits
  ``[tokens, vocab]`` held whole (``trainer_service.step.response_logits``), float32, no
  activation checkpointing.

Peak memory is the child's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``
just before the step: every allocation, torch's included, which ``tracemalloc`` does not see):
``peak_mb`` over the whole step, ``backward_peak_mb`` over the forward and backward passes
(read when the step calls the optimizer; the optimizer's own temporaries come after, the same
on either path). The floor is the resident set once the parameters, their gradients and
AdamW's two states exist (measured before the step, the gradients then dropped; the step makes
them again), plus the checkpointed activations (each decoder layer's input and the final
hidden states, ``(layers + 1) x tokens x hidden`` float32, computed). ``above_floor_mb`` is
``backward_peak_mb`` minus that floor: the head, the loss and the layer recomputed. A case whose estimate
(``estimate_mb``) exceeds ``--max-gib``, or the memory available less 2 GiB, is not run: its
figures say ``"run": false`` and why, with the estimate. The estimate scales the
forward+backward peak above the floor of the largest smaller case of the same path and dtype
measured in the run linearly with the tokens, else it is ``estimate_mb``'s count of tensors.
Linear scaling is no bound: without checkpointing the dense step's figure grows faster than
its tokens (docs/results.md), so the 2 GiB kept free are the margin.

    centerline bench step --out docs/bench/step.json
    centerline bench step --tokens 64 --layers 1 --hidden 32 --intermediate 64 --heads 4 --kv-heads 2 \\
        --vocab 512 --chunk 16   # tiny, for tests
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import psutil

from centerline.bench import add_out_flag
from centerline.runs.run_figures import write_bench_figures

MiB = 2**20
PROMPT = 64
K = 128


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / MiB


def _peak_mb() -> float:
    """This process's peak resident set since the last ``_reset_peak``."""
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # resets VmHWM to the current resident set (proc(5))


def _batch(tokens: int, vocab: int):
    """One sample: a ``PROMPT``-token prompt and ``tokens - PROMPT`` trained tokens, K candidates each.
    Ids come from the first ``2 K`` of the vocabulary (a valid batch for any larger vocabulary)."""
    from centerline.synth import make_batch

    prompt = min(PROMPT, tokens // 2)
    batch = make_batch(
        samples=1, tokens_per_sample=tokens - prompt, k=K, vocab_size=min(2 * K, vocab), seed=0, prompt_len=prompt
    )
    return replace(batch, advantages=np.ones(1, np.float32))


def child(case: dict) -> dict:
    """Run one case in this process; return its figures."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer_service.loss import LOSSES, LossSettings
    from trainer_service.step import (
        Memory,
        make_optimizer,
        micro_batch_inputs,
        prepare_model,
        response_logits,
        train_step,
    )

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=case["vocab"],
        hidden_size=case["hidden"],
        intermediate_size=case["intermediate"],
        num_hidden_layers=case["layers"],
        num_attention_heads=case["heads"],
        num_key_value_heads=case["kv_heads"],
        max_position_embeddings=max(case["tokens"], 64),
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config).train()
    dense = case["path"] == "dense"
    memory = Memory(
        dtype=case["dtype"], activation_checkpointing=not dense, loss_chunk_tokens=case["chunk"], packed=not dense
    )
    prepare_model(model, memory)
    optimizer = make_optimizer(model, "adamw", 1e-6)
    for p in model.parameters():  # the floor: parameters, gradients and AdamW's two states
        p.grad = torch.zeros_like(p)
    optimizer.step()
    floor = _rss_mb()
    optimizer.zero_grad(set_to_none=True)
    batch = _batch(case["tokens"], case["vocab"])
    backward_peak, real_step = [], optimizer.step

    def step_after_reading_the_peak(*args, **kwargs):
        backward_peak.append(_peak_mb())
        return real_step(*args, **kwargs)

    optimizer.step = step_after_reading_the_peak
    _reset_peak()
    t0 = time.perf_counter()
    if dense:  # f6a6570's step: logits held whole, then the loss on them
        x = micro_batch_inputs(batch, range(1), "cpu")
        rows = replace(x.rows, token_count=x.trained_tokens)
        loss, _ = LOSSES["score_centering"](response_logits(model, x), rows, LossSettings())
        loss.backward()
        del loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    else:
        train_step(model, optimizer, batch, LossSettings(), micro_batch_tokens=case["tokens"], memory=memory)
    seconds = time.perf_counter() - t0
    peak = _peak_mb()
    params = sum(p.numel() for p in model.parameters())
    checkpointed = (case["layers"] + 1) * case["tokens"] * case["hidden"] * 4 / MiB
    return {
        "run": True,
        "params": params,
        "floor_mb": floor,
        "checkpointed_mb": checkpointed,
        "peak_mb": peak,
        "backward_peak_mb": backward_peak[0],
        "above_floor_mb": backward_peak[0] - floor - checkpointed,
        "step_s": seconds,
    }


def estimate_mb(case: dict, params: int) -> float:
    """A generous estimate of a case's peak, to decide whether to run it (not a figure of merit)."""
    t, d, i, v, layers = case["tokens"], case["hidden"], case["intermediate"], case["vocab"], case["layers"]
    act_bytes = 2 if case["dtype"] == "bfloat16" else 4
    layer = t * (16 * d + 8 * i) * act_bytes  # one decoder layer's saved tensors and their gradients
    floor = 16 * params + 1024 * MiB  # float32 weights, gradients, AdamW states; the interpreter and torch
    if case["path"] == "dense":
        return (floor + layers * layer + 4 * t * v * 4) / MiB  # logits, their selection, grad, softmax
    return (floor + (layers + 1) * t * d * 4 + layer + 2 * case["chunk"] * v * 4 + 2 * v * d * 4) / MiB


def _scaled(case: dict, results: list[dict]) -> float | None:
    """The peak of ``case`` estimated from the largest measured smaller case of its path and
    dtype, its above-floor figure scaled linearly with the tokens; None without one."""
    same = [
        r
        for r in results
        if r["run"] and (r["path"], r["dtype"]) == (case["path"], case["dtype"]) and r["tokens"] < case["tokens"]
    ]
    if not same:
        return None
    r = max(same, key=lambda r: r["tokens"])
    checkpointed = (case["layers"] + 1) * case["tokens"] * case["hidden"] * 4 / MiB
    return r["floor_mb"] + checkpointed + max(r["above_floor_mb"], 0.0) * case["tokens"] / r["tokens"]


def _params(case: dict) -> int:
    d, i, v, layers = case["hidden"], case["intermediate"], case["vocab"], case["layers"]
    kv = d * case["kv_heads"] // case["heads"]
    per_layer = d * d * 2 + 2 * d * kv + 2 * d + 2 * kv + d + 3 * d * i + 2 * d
    return v * d + layers * per_layer + d


def bench_step(argv: list[str]) -> int:
    """Peak memory of one training step, chunked head and loss vs f6a6570's dense logits."""
    parser = argparse.ArgumentParser(prog="centerline bench step", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="2048,8192,32768", help="session lengths, comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="training dtypes of the chunked path")
    parser.add_argument("--paths", default="dense,chunked", help="dense (f6a6570) and/or chunked")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--intermediate", type=int, default=8960)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk", type=int, default=1024, help="tokens per LM-head chunk (--loss-chunk-tokens)")
    parser.add_argument("--max-gib", type=float, default=24.0, help="do not run a case estimated above this")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print one JSON object (the default output too)")
    add_out_flag(parser, "step")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "intermediate", "heads", "kv_heads", "vocab", "chunk")}
    cases = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for path in args.paths.split(","):
            for dtype in args.dtypes.split(",") if path == "chunked" else ("float32",):
                cases.append({**shape, "tokens": tokens, "path": path, "dtype": dtype})
    results = []
    for case in cases:
        estimate = _scaled(case, results) or estimate_mb(case, _params(case))
        room = min(args.max_gib * 1024, psutil.virtual_memory().available / MiB - 2048)
        out = {"tokens": case["tokens"], "path": case["path"], "dtype": case["dtype"], "estimate_mb": estimate}
        if estimate > room:
            out.update(run=False, why=f"estimated {estimate:,.0f} MiB > {room:,.0f} MiB")
        else:
            proc = subprocess.run(
                [sys.executable, "-m", "centerline", "bench", "step", "--child", json.dumps(case)],
                capture_output=True,
                text=True,
                env=os.environ,
            )
            if proc.returncode != 0:
                out.update(run=False, why=f"the case's process exited {proc.returncode}: {proc.stderr[-500:]}")
            else:
                out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(out), file=sys.stderr)
        results.append(out)
    figures = {
        **shape,
        "prompt": PROMPT,
        "k": K,
        "chunk_mb": args.chunk * args.vocab * 4 / MiB,
        "max_gib": args.max_gib,
        "cases": results,
    }
    write_bench_figures(figures, args.out)
    return 0

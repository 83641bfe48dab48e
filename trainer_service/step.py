"""One training step on one global batch, on 1 process or many under `torchrun`.

Rank r trains its shard of the global ``shared.wire.Batch``: the samples
``shared.batch_algebra.assign_shards`` gives it, balanced by tokens; the trainer sends each rank
only its shard (``local=True``), tests may hand every rank the global batch. The shard is cut
into micro-batches of consecutive samples
(``micro_batches``): as many as fit in ``micro_batch_tokens`` tokens, one at least; their
gradients accumulate into the step's. A packed micro-batch (``Memory.packed``, the default)
is its samples end to end in one row, positions counting from 0 in each, which the model's
attention masks per sample (docs/design.md section 6, Memory); a padded one has prompts
left-padded and responses right-padded so every response starts at the same position. The
final hidden states at the positions that predict response tokens go to the loss with the LM
head (``trainer_service.head``), which computes logits a chunk at a time. ``Memory`` also
holds the training dtype (bfloat16: autocast over float32 weights) and activation
checkpointing. The loss is divided by the GLOBAL
trained-token count (an all_reduce), so the summed gradient is the same as one process on the
whole batch. DDP and FSDP2 average gradients over ranks; the backward pass multiplies by the
world size to undo that. Gradients are synchronised on the last micro-batch only. A step whose
loss or total gradient norm is not finite on any rank (advantages are user code: a huge finite
one overflows them) changes nothing: every rank skips the optimizer step (docs/design.md section 6).

Padding changes nothing but the order of float sums: left pads are masked out of attention
and positions count from each sample's first token; right pads come after every response
token, so causal attention never lets a trained position see them, and their rows never reach
the loss. One forward per sample (``micro_batch_tokens`` 1) computes the same step to float32
rounding, and more slowly: a forward per sample instead of one per micro-batch.

Left out on purpose: checkpoints of the optimizer state, and the batch gate (the trainer runs
the contract before a batch gets here).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from shared.batch_algebra import assign_shards, select_samples
from shared.settings import LOSS_CHUNK_TOKENS, MICRO_BATCH_TOKENS
from trainer_service.distributed import rank_and_world
from trainer_service.head import HeadLogits
from trainer_service.loss import LOSSES, LossSettings, TokenRows
from trainer_service.model import unwrap

DTYPES = {"float32": None, "bfloat16": torch.bfloat16}  # None: no autocast


@dataclass(frozen=True)
class Memory:
    """How a step spends memory (docs/design.md section 6, Memory); the trainer's settings
    ``dtype``, ``activation_checkpointing``, ``loss_chunk_tokens`` and ``pack_samples``."""

    dtype: str = "float32"  # float32 | bfloat16: autocast, weights and optimizer state stay float32
    activation_checkpointing: bool = False  # applied when the model is loaded (``prepare_model``)
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS
    packed: bool = True

    @classmethod
    def from_settings(cls, settings) -> Memory:
        """The memory settings of a ``shared.settings.TrainerSettings``."""
        return cls(settings.dtype, settings.activation_checkpointing, settings.loss_chunk_tokens, settings.pack_samples)


def prepare_model(model, memory: Memory):
    """Turn on activation checkpointing (each decoder layer recomputed in the backward pass)."""
    if memory.dtype not in DTYPES:
        raise ValueError(f"dtype={memory.dtype!r}; expected one of {tuple(DTYPES)} (--dtype)")
    if memory.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _autocast(device, memory: Memory):
    dtype = DTYPES[memory.dtype]
    return contextlib.nullcontext() if dtype is None else torch.autocast(torch.device(device).type, dtype=dtype)


METRICS = (
    "sc_correction",
    "sc_residual_l1",
    "sc_train_head_mass",
    "sc_rollout_head_mass",
    "sc_tail_ratio",
    "sc_importance_weight",
    "train_rollout_kl",
    "train_rollout_logprob_abs_diff",
)


@dataclass(frozen=True)
class MicroBatch:
    """A micro-batch's padded model inputs and the loss rows of its response tokens."""

    input_ids: torch.Tensor  # [B, T]: padded, or [1, T] packed
    attention_mask: torch.Tensor | None  # None without left pads
    position_ids: torch.Tensor | None  # packed: counting from 0 in each sample
    positions: torch.Tensor  # [P] the positions whose outputs are kept (those predicting responses)
    responses: torch.Tensor  # [B, P] bool: True where the kept position predicts a response token
    rows: TokenRows  # row for row in the batch's order

    @property
    def trained_tokens(self) -> int:
        return int(self.rows.loss_mask.sum())


def micro_batches(batch, samples: range, budget: int, packed: bool = False) -> list[range]:
    """``samples`` cut into runs of consecutive samples whose size is at most ``budget`` tokens;
    a sample larger alone is its own run. Size: packed, the samples' tokens; padded, samples x
    (longest prompt + longest response)."""
    runs, start, longest_prompt, longest_response, total = [], samples.start, 0, 0, 0
    for i in samples:
        prompt = int(batch.prompt_offsets[i + 1] - batch.prompt_offsets[i])
        response = int(batch.offsets[i + 1] - batch.offsets[i])
        p, r = max(longest_prompt, prompt), max(longest_response, response)
        total = (total if i > start else 0) + prompt + response
        if i > start and (total if packed else (i - start + 1) * (p + r)) > budget:
            runs.append(range(start, i))
            start, p, r, total = i, prompt, response, prompt + response
        longest_prompt, longest_response = p, r
    if len(samples):
        runs.append(range(start, samples.stop))
    return runs


def micro_batch_inputs(batch, samples: range, device, packed: bool = False) -> MicroBatch:
    """The model inputs of consecutive ``samples``, padded or packed, and the loss inputs of
    their response tokens, row for row in the batch's order (each sample's advantage broadcast
    to its tokens)."""
    prompts = [batch.prompt_ids[int(batch.prompt_offsets[i]) : int(batch.prompt_offsets[i + 1])] for i in samples]
    responses = [batch.response_ids[batch.sample_slice(i)] for i in samples]
    for i, prompt in zip(samples, prompts):
        if len(prompt) == 0:
            raise ValueError(
                f"sample {batch.sample_ids[i]!r} has an empty prompt; the first response token has no "
                "position predicting it"
            )
    rows = slice(int(batch.offsets[samples.start]), int(batch.offsets[samples.stop]))
    lengths = np.array([len(r) for r in responses])
    as_tensor = lambda a, dtype: torch.as_tensor(np.array(a), dtype=dtype, device=device)  # noqa: E731 (copies a read-only view)
    if packed:
        input_ids = np.concatenate([np.concatenate([p, r]) for p, r in zip(prompts, responses)])[None]
        position_ids = np.concatenate([np.arange(len(p) + len(r)) for p, r in zip(prompts, responses)])[None]
        starts = np.cumsum([0] + [len(p) + len(r) for p, r in zip(prompts, responses)])[:-1]
        positions = np.concatenate([s + len(p) - 1 + np.arange(len(r)) for s, p, r in zip(starts, prompts, responses)])
        layout = {
            # No attention mask: the model masks attention per sample from position_ids.
            "attention_mask": None,
            "position_ids": as_tensor(position_ids, torch.int64) if len(prompts) > 1 else None,
            "positions": as_tensor(positions, torch.int64),
            "responses": torch.ones((1, len(positions)), dtype=torch.bool, device=device),
        }
    else:
        width_p, width_r = max(map(len, prompts)), max(map(len, responses))
        input_ids = np.zeros((len(samples), width_p + width_r), dtype=np.int64)  # pads: any id, never seen
        attention = np.zeros_like(input_ids)
        for k, (prompt, response) in enumerate(zip(prompts, responses)):
            start, end = width_p - len(prompt), width_p + len(response)
            input_ids[k, start:width_p], input_ids[k, width_p:end] = prompt, response
            attention[k, start:end] = 1
        left_padded = len({len(p) for p in prompts}) > 1
        layout = {
            # Without left pads the model runs unmasked (causal attention already hides right pads).
            "attention_mask": as_tensor(attention, torch.int64) if left_padded else None,
            "position_ids": as_tensor(np.maximum(attention.cumsum(1) - 1, 0), torch.int64) if left_padded else None,
            "positions": torch.arange(width_p - 1, width_p + width_r - 1, device=device),
            "responses": as_tensor(np.arange(width_r)[None] < lengths[:, None], torch.bool),
        }
    return MicroBatch(
        input_ids=as_tensor(input_ids, torch.int64),
        **layout,
        rows=TokenRows(
            response_ids=as_tensor(batch.response_ids[rows], torch.int64),
            sampled_logprobs=as_tensor(batch.sampled_logprobs[rows], torch.float32),
            cand_ids=as_tensor(batch.cand_ids[rows], torch.int32),
            cand_logprobs=as_tensor(batch.cand_logprobs[rows], torch.float32),
            advantages=as_tensor(np.repeat(batch.advantages[samples.start : samples.stop], lengths), torch.float32),
            loss_mask=as_tensor(batch.loss_mask[rows], torch.bool),
            mode=batch.mode,
            temperature=batch.temperature,
        ),
    )


def response_logits(model, x: MicroBatch) -> torch.Tensor:
    """Logits [N, V] at the positions predicting each of a micro-batch's N response tokens,
    held whole: the dense path, kept as the benchmark's baseline (centerline/bench/step.py)."""
    # logits_to_keep skips the LM head on prompt positions that predict nothing we train on.
    logits = model(**_model_inputs(x)).logits
    return logits[x.responses]


def response_head(model, x: MicroBatch) -> HeadLogits:
    """The final hidden states [N, D] at the positions predicting a micro-batch's N response
    tokens, with the LM head's weight (and bias): the loss computes the logits chunk by chunk.

    The model runs whole (so DDP's and FSDP2's hooks run as usual); a hook on the LM head takes
    its input and hands it an empty one, so the head itself computes nothing."""
    head = unwrap(model).get_output_embeddings()
    taken = {}

    def take(module, args):
        taken["hidden"], taken["weight"], taken["bias"] = args[0], module.weight, module.bias
        return (args[0][:, :0],)

    handle = head.register_forward_pre_hook(take)
    try:
        model(**_model_inputs(x))
    finally:
        handle.remove()
    return HeadLogits(taken["hidden"][x.responses], taken["weight"], taken["bias"])


def _model_inputs(x: MicroBatch) -> dict:
    # use_cache False: with a cache the model would not read packed samples from position_ids.
    return {
        "input_ids": x.input_ids,
        "attention_mask": x.attention_mask,
        "position_ids": x.position_ids,
        "logits_to_keep": x.positions,
        "use_cache": False,
    }


def _sync_context(model, sync: bool):
    """Gradient synchronisation on (last micro-batch) or off, for DDP, FSDP2 or a bare model."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return contextlib.nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def _micro_batch_count(model, local: int, world: int) -> int:
    """FSDP2 all-gathers parameters in every forward and backward, so all ranks must run the
    same number of micro-batches: the largest shard's. DDP communicates once, at the sync."""
    if world == 1 or not hasattr(model, "set_requires_gradient_sync"):
        return local
    count = torch.tensor([local], device=next(model.parameters()).device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def train_step(
    model,
    optimizer,
    batch,
    settings: LossSettings = LossSettings(),
    *,
    max_grad_norm: float | None = 1.0,
    micro_batch_tokens: int = MICRO_BATCH_TOKENS,
    local: bool = False,
    memory: Memory = Memory(),
):
    """One optimizer step on the global batch; returns metrics identical on every rank.

    ``batch``: the global batch, of which this rank trains its shard; with ``local`` it is this
    rank's shard already (``trainer_service.shards``), and the global counts come by all-reduce.

    Metrics: ``loss`` (global sum / global trained tokens), ``grad_norm`` (before clipping),
    ``step_skipped_nonfinite`` (1 when the loss or ``grad_norm`` is not finite on some rank: the
    optimizer did not step, the weights and its state are as before; else 0), ``trained_tokens``,
    ``samples``, ``reward_mean`` and the loss's ``sc_*``/``train_rollout_*`` metrics as means over
    the global trained tokens.
    """
    rank, world = rank_and_world()
    device = next(model.parameters()).device
    loss_fn = LOSSES[settings.name]
    if not local and world > 1:
        batch = select_samples(batch, assign_shards(batch, world)[rank])
    mine = range(batch.num_samples)
    runs = micro_batches(batch, mine, micro_batch_tokens, memory.packed)
    inputs = [micro_batch_inputs(batch, run, device, memory.packed) for run in runs]
    # Every collective's tensor lives on the rank's device, the model's (docs/design.md section 6).
    rewards = np.asarray(batch.rewards, dtype=np.float64)
    local_counts = [float(sum(x.trained_tokens for x in inputs)), float(batch.num_samples), float(rewards.sum())]
    counts = torch.tensor(local_counts, dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(counts)
    global_count, global_samples, reward_sum = int(counts[0].item()), int(counts[1].item()), float(counts[2].item())
    # sums[0]: loss; sums[1:]: metric * trained tokens, so the all_reduce yields global means.
    sums = torch.zeros(1 + len(METRICS), dtype=torch.float64, device=device)
    steps = _micro_batch_count(model, len(inputs), world)
    for j in range(steps):
        with _sync_context(model, sync=j == steps - 1):
            if j >= len(inputs):  # FSDP2 padding step: same collectives, zero gradient
                with _autocast(device, memory):
                    head = response_head(model, inputs[0])
                zero = head.hidden.sum() + head.weight.sum() + (head.bias.sum() if head.bias is not None else 0.0)
                (zero * 0.0).backward()
                continue
            x = inputs[j]
            rows = replace(x.rows, token_count=global_count)
            with _autocast(device, memory):  # the model only: the loss computes in float32 itself
                head = response_head(model, x)
            loss, metrics = loss_fn(head, rows, settings, chunk_size=memory.loss_chunk_tokens)
            (loss * world).backward()  # DDP/FSDP2 divide the summed gradient by world
        n = inputs[j].trained_tokens
        sums[0] += float(loss.detach())
        sums[1:] += torch.tensor([metrics.get(name, 0.0) * n for name in METRICS], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(sums)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm if max_grad_norm else float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP2 returns a DTensor
        grad_norm = grad_norm.full_tensor()
    skipped = nonfinite(float(sums[0]), float(grad_norm), device, world)
    if not skipped:  # a non-finite step would write NaN weights, and every later step fail on them
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    out = {
        "loss": float(sums[0]),
        "grad_norm": float(grad_norm),
        "step_skipped_nonfinite": int(skipped),
        "trained_tokens": global_count,
        "samples": global_samples,
        "reward_mean": reward_sum / global_samples if global_samples else 0.0,
    }
    for k, name in enumerate(METRICS):
        if settings.name == "score_centering" or not name.startswith("sc_") or name == "sc_importance_weight":
            out[name] = float(sums[1 + k]) / global_count if global_count else 0.0
    return out


def nonfinite(loss: float, grad_norm: float, device, world: int) -> bool:
    """True when the step's loss or total gradient norm is not finite on any rank: every rank
    takes the same decision from one all-reduced flag (a rank that stepped alone would diverge)."""
    flag = torch.tensor([0.0 if math.isfinite(loss) and math.isfinite(grad_norm) else 1.0], device=device)
    if world > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def make_optimizer(model, name: str = "adamw", lr: float = 1e-5):
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr)
    raise ValueError(f"optimizer={name!r}; expected adamw or sgd")

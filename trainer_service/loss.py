"""Score-centering loss and its two baselines (docs/design.md section 6).

For a trained position with sampled token ``a``, candidate set ``H`` (the non-empty slots,
``cand_ids >= 0``), detached advantage ``A``, sampler probabilities ``q_v = exp(cand_logprobs)``,
``q_a = exp(sampled_logprobs)`` and trainer log-probs ``log p = logits/T - logsumexp(logits/T)``:

    l = -A * ( f(p_a/q_a) * log p_a - sum_{v in H} (q_v * f(p_v/q_v) - alpha * p_v) * log p_v )   (6.1)

with every coefficient detached; ``f`` is 1 (``none``), ``min(r, c)`` (``tis``) or ``r`` on
``[lo, hi]`` and 0 elsewhere (``mis``). ``selected`` mode models the vocabulary outside ``H``
with a proportional tail: ``rho = max(1 - Q_H, eps) / max(1 - P_H, eps)``,
``alpha = rho * f(1/rho)``. ``support`` mode renormalises ``p`` over ``H`` and has no tail.
The loss is the sum of ``l`` over trained tokens divided by ``token_count``.

Memory: every loss here is linear in trainer log-probs at a few ids per row, so its logit
gradient is closed-form, ``sum_j c_j e_{id_j} - (sum_j c_j) * softmax``. ``_SparseScoreLoss``
(trainer_service/head.py)
computes it chunk by chunk straight into the gradient buffer, so besides the logits and
their gradient nothing of size [N, V] is ever held; REINFORCE and TIS use the same kernel.
Given a ``trainer_service.head.HeadLogits`` (hidden states and the LM head) instead of logits,
the same gradient (``GradTerms``) is folded chunk by chunk into the hidden states' and the
head's gradients, and no [N, V] tensor is held at all.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from shared.settings import LossName, LossSettings
from trainer_service.head import attach

EPS = 1e-6  # tail-mass floor of docs/design.md section 6
MODES = ("selected", "support")
KL_LOG_RATIO_CLAMP = 20.0  # |log p_a/q_a| bound of the train_rollout_kl metric, as miles clamps it
_CHUNK_ELEMENTS = 1 << 22  # default chunk: ~16 MiB of float32 temporaries per chunk


class NonFiniteInput(ValueError):
    """A loss input holds NaN/inf at a trained position. The message names tensor and index."""


@dataclass(frozen=True)
class TokenRows:
    """The N response tokens a loss trains on, row for row, and how they were sampled.

    Shapes: ``response_ids`` [N] int, ``sampled_logprobs`` [N] float, ``cand_ids`` [N, K] int
    (-1 = empty slot), ``cand_logprobs`` [N, K] float (-inf = empty slot), ``advantages`` [N]
    (per token), ``loss_mask`` [N] bool. Rows with ``loss_mask`` False may hold anything
    (padding): they contribute exactly 0 to the loss and the gradient. ``mode`` is the batch's
    candidate mode and ``temperature`` its sampling temperature. ``token_count`` is the divisor
    (default: the trained tokens of these rows; the trainer passes the global count).
    """

    response_ids: torch.Tensor
    sampled_logprobs: torch.Tensor
    cand_ids: torch.Tensor
    cand_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    mode: str = "selected"  # selected | support
    temperature: float = 1.0  # --rollout-temperature
    token_count: int | None = None


def score_centering_loss(logits, rows: TokenRows, settings: LossSettings, chunk_size: int | None = None):
    """Score-centering loss (6.1) and its metrics.

    ``logits`` [N, V] (float32/bfloat16/float64, requires grad) are the trainer's at the N
    ``rows`` (``TokenRows``), or a ``trainer_service.head.HeadLogits`` that computes them chunk
    by chunk from the final hidden states and never holds them whole. ``settings`` is the run's
    ``Config.loss``, its options' bounds checked as it was built (shared/settings.py);
    ``settings.is_mode`` picks ``f``. ``chunk_size``: rows per ``[rows, V]`` pass, None: about 4M
    logits per chunk. Computation is in float32 (float64 for float64 logits).

    Returns ``(loss, metrics)``; metrics are plain floats, means over the trained tokens of
    this call (0.0 when there are none):
    ``sc_correction``: mean ``sum_{v in H} c_v log p_v`` with ``c_v = q_v f(p_v/q_v) - alpha p_v``,
    the signed centering term of (6.1) as miles and vime log it (``log p`` renormalised on ``H``
    in support mode); ``sc_residual_l1``: mean ``sum_{v in H} |c_v|``, the L1 mass of the
    centering coefficients (both 0 when trainer and sampler agree, at ``f = none``);
    ``sc_train_head_mass``: mean ``P_H`` (in support mode the trainer's un-renormalised mass
    on the support); ``sc_rollout_head_mass``: mean ``Q_H``; ``sc_tail_ratio``: mean ``rho``
    (0.0 in support mode, which has no tail); ``sc_importance_weight``: mean ``f(p_a/q_a)``;
    ``train_rollout_kl``: mean k3 ``r - 1 - log r`` with ``log r = log p_a - log q_a`` clamped to
    ``[-20, 20]`` first (as miles does), so one extreme token cannot make it inf;
    ``train_rollout_logprob_abs_diff``: mean ``|log p_a - log q_a|``.

    Raises ``NonFiniteInput`` for a NaN/inf advantage, log-prob or logit of a trained row
    (``-inf`` in an empty candidate slot is allowed) and ``ValueError`` for a bad mode,
    temperature, shapes or ids (in support mode the sampled token must be in the support; in selected mode a
    trained row must hold exactly ``min(K, V)`` candidates, as the contract's ``short_row``).
    """
    mode = rows.mode
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}; expected one of {MODES}")
    f = _weight_fn(settings.is_mode, settings)
    g = _prepare(logits, rows, chunk_size, with_candidates=True)
    mask, valid = g.mask, g.valid
    if (
        mode == "selected"
    ):  # the contract's short_row rule again: a caller that skips the gate cannot train a padded row
        need = min(rows.cand_ids.shape[1], logits.shape[1])
        counts = valid.sum(1)
        short = mask & (counts != need)
        if bool(short.any()):
            i = int(short.nonzero()[0, 0])
            raise ValueError(
                f"selected mode: trained row {i} holds {int(counts[i])} candidates, expected min(K, vocab) = {need}; "
                "a truncated or padded candidate set is never trained on"
            )
    lq_a, lq_h, logp_a, logp_h = g.lq_a, g.lq_h, g.logp_a, g.logp_h
    q_h = lq_h.exp()  # 0 in empty slots

    if mode == "support":
        in_support = ((g.cand_ids == g.ids_a[:, None]) & valid).any(1) | ~mask
        if not bool(in_support.all()):
            i = int((~in_support).nonzero()[0, 0])
            raise ValueError(
                f"support mode: sampled token response_ids[{i}] = {int(g.ids_a[i])} is not "
                f"in the recorded support cand_ids[{i}]; the batch violates the support contract"
            )
        log_head = torch.where(mask, logp_h.logsumexp(1), 0.0)  # log P_H; renormalise over H
        logp_a = logp_a - log_head
        logp_h = logp_h - log_head[:, None]
    p_h = logp_h.exp()
    p_head = p_h.sum(1) if mode == "selected" else log_head.exp()
    q_head = q_h.sum(1)
    w_a = f((logp_a - lq_a).exp())
    qf_h = torch.where(valid, q_h * f((logp_h - lq_h).exp()), 0.0)
    if mode == "selected":
        rho = (1 - q_head).clamp_min(EPS) / (1 - p_h.sum(1)).clamp_min(EPS)
        alpha = rho * f(1 / rho)
        c_h = qf_h - alpha[:, None] * p_h
    else:
        rho = torch.zeros_like(q_head)
        c_h = qf_h
    c_h = torch.where(valid & mask[:, None], c_h, 0.0)
    adv = g.adv
    count = _count(rows.token_count, mask)
    centering = torch.where(valid, c_h * logp_h, 0.0).sum(1)  # sum_{v in H} c_v log p_v
    per_token = -adv * (w_a * logp_a - centering)
    loss_value = torch.where(mask, per_token, 0.0).sum() / count
    # d loss / d log p at each id; for support mode the renormaliser's softmax lives on H.
    coef_a = torch.where(mask, -adv * w_a / count, 0.0)
    coef_h = adv[:, None] * c_h / count
    total = coef_a + coef_h.sum(1)
    if mode == "selected":
        dense = -total
    else:
        dense = torch.zeros_like(total)
        coef_h = coef_h - total[:, None] * p_h
    loss = attach(
        logits,
        loss_value,
        g.ids_a,
        coef_a,
        g.cand_ids,
        coef_h,
        dense,
        mask,
        float(rows.temperature),
        g.chunk,
    )
    metrics = _sampled_metrics(logp_a, lq_a, w_a, mask)
    metrics.update(_mean(centering, mask, "sc_correction"))
    metrics.update(_mean(c_h.abs().sum(1), mask, "sc_residual_l1"))
    metrics.update(_mean(p_head, mask, "sc_train_head_mass"))
    metrics.update(_mean(q_head, mask, "sc_rollout_head_mass"))
    metrics.update(_mean(rho, mask, "sc_tail_ratio"))
    return loss, metrics


def reinforce_loss(logits, rows: TokenRows, settings: LossSettings, chunk_size: int | None = None):
    """Plain policy gradient ``l = -A * log p_a``, same arguments, checks and reduction as
    ``score_centering_loss``; ``mode``, ``is_mode`` and candidates are unused (candidates are
    still checked). Metrics: the sampled-token ones (``sc_importance_weight`` is 1.0)."""
    return _sampled_token_loss(logits, rows, chunk_size, _weight_fn("none", settings))


def tis_loss(logits, rows: TokenRows, settings: LossSettings, chunk_size: int | None = None):
    """REINFORCE with a truncated importance weight: ``l = -A * min(p_a/q_a, tis_clip) * log p_a``
    (weight detached). Same arguments, checks and reduction as ``score_centering_loss``."""
    return _sampled_token_loss(logits, rows, chunk_size, _weight_fn("tis", settings))


# every name of shared.settings.LossName, and no other (tests/trainer_service/test_loss.py)
LOSSES: dict[LossName, object] = {"score_centering": score_centering_loss, "reinforce": reinforce_loss, "tis": tis_loss}


def _sampled_token_loss(logits, rows: TokenRows, chunk_size, f):
    g = _prepare(logits, rows, chunk_size, with_candidates=False)
    mask, adv = g.mask, g.adv
    logp_a = g.logp_a
    w_a = f((logp_a - g.lq_a).exp())
    count = _count(rows.token_count, mask)
    loss_value = torch.where(mask, -adv * w_a * logp_a, 0.0).sum() / count
    coef_a = torch.where(mask, -adv * w_a / count, 0.0)
    loss = attach(logits, loss_value, g.ids_a, coef_a, None, None, -coef_a, mask, float(rows.temperature), g.chunk)
    return loss, _sampled_metrics(logp_a, g.lq_a, w_a, mask)


def _weight_fn(is_mode, settings: LossSettings):
    """``f`` of (6.1) on a detached ratio tensor; ``LossSettings`` bounds the clip and the mask."""
    tis_clip, mis_low, mis_high = settings.tis_clip, settings.mis_low, settings.mis_high
    if is_mode == "none":
        return torch.ones_like
    if is_mode == "tis":
        return lambda r: r.clamp_max(tis_clip)
    return lambda r: torch.where((r >= mis_low) & (r <= mis_high), r, 0.0)  # mis


@dataclass(frozen=True)
class _Gathered:
    """What (6.1) needs of the rows, detached, in the compute dtype; 0 (or -inf) where untrained."""

    mask: torch.Tensor  # [N] bool, the trained rows
    ids_a: torch.Tensor  # [N] int64 sampled ids (0 where untrained)
    chunk: int  # rows per [rows, V] pass
    logp_a: torch.Tensor  # [N] trainer log p of the sampled token
    adv: torch.Tensor  # [N] advantages
    lq_a: torch.Tensor  # [N] sampler log q of the sampled token
    valid: torch.Tensor | None = None  # [N, K] filled slots of trained rows (with candidates only)
    cand_ids: torch.Tensor | None = None  # [N, K] as given
    logp_h: torch.Tensor | None = None  # [N, K] trainer log p of each candidate, -inf in empty slots
    lq_h: torch.Tensor | None = None  # [N, K] sampler log q of each candidate, -inf in empty slots


def _prepare(logits, rows: TokenRows, chunk_size, *, with_candidates) -> _Gathered:
    """Validate inputs and gather everything (6.1) needs, detached, in the compute dtype."""
    response_ids, sampled_logprobs, advantages = rows.response_ids, rows.sampled_logprobs, rows.advantages
    cand_ids, cand_logprobs, loss_mask, temperature = (
        rows.cand_ids,
        rows.cand_logprobs,
        rows.loss_mask,
        rows.temperature,
    )
    if logits.dim() != 2:
        raise ValueError(f"logits has shape {tuple(logits.shape)}, expected [N, V]")
    n, vocab = logits.shape
    k = cand_ids.shape[1] if cand_ids.dim() == 2 else -1
    for name, t, shape in (
        ("response_ids", response_ids, (n,)),
        ("sampled_logprobs", sampled_logprobs, (n,)),
        ("advantages", advantages, (n,)),
        ("loss_mask", loss_mask, (n,)),
        ("cand_ids", cand_ids, (n, k)),
        ("cand_logprobs", cand_logprobs, (n, k)),
    ):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape} for logits of shape {(n, vocab)}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature}; it must be > 0 (--rollout-temperature)")
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    mask = loss_mask.to(torch.bool)
    ids = response_ids.to(torch.int64)
    _raise_first("response_ids", mask & ((ids < 0) | (ids >= vocab)), ids, f"a token id in [0, {vocab})", ValueError)
    _raise_first("advantages", mask & ~torch.isfinite(advantages), advantages)
    _raise_first("sampled_logprobs", mask & ~torch.isfinite(sampled_logprobs), sampled_logprobs)
    valid = cand_ids >= 0
    empty_ok = ~valid & (cand_logprobs == -torch.inf)
    _raise_first(
        "cand_logprobs",
        mask[:, None] & ~torch.isfinite(cand_logprobs) & ~empty_ok,
        cand_logprobs,
        "finite (-inf only in empty slots, cand_ids == -1)",
    )
    if with_candidates:
        _raise_first(
            "cand_ids", mask[:, None] & (cand_ids >= vocab), cand_ids, f"-1 or a token id < {vocab}", ValueError
        )
    if chunk_size is None:
        chunk_size = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    ids_a = torch.where(mask, ids, 0)
    ids_h = cand_ids.clamp_min(0).to(torch.int64) if with_candidates else None
    inv_t = 1.0 / float(temperature)
    logp_a = torch.empty(n, dtype=dtype, device=logits.device)
    logp_h = torch.empty(ids_h.shape, dtype=dtype, device=logits.device) if with_candidates else None
    with torch.no_grad():
        buf = None
        for s in range(0, n, chunk_size):
            if isinstance(logits, torch.Tensor):
                block = logits[s : s + chunk_size].detach()
            else:  # a HeadLogits block is fresh: its log-softmax may overwrite it
                block = logits.rows(
                    s, s + chunk_size, out=buf if buf is not None and buf.dtype == logits.dtype else None
                )
                buf = block if block.dtype == dtype else buf
            buf = _log_softmax_rows(block, dtype, inv_t, buf)
            logp_a[s : s + chunk_size] = buf.gather(1, ids_a[s : s + chunk_size, None]).squeeze(1)
            if with_candidates:
                logp_h[s : s + chunk_size] = buf.gather(1, ids_h[s : s + chunk_size])
        del buf
        _check_logits(logits, "the sampled token", logp_a, mask, ids_a[:, None])
        out = _Gathered(
            mask=mask,
            ids_a=ids_a,
            chunk=chunk_size,
            logp_a=torch.where(mask, logp_a, 0.0),
            adv=torch.where(mask, advantages.to(dtype), 0.0),
            lq_a=torch.where(mask, sampled_logprobs.to(dtype), 0.0),
        )
        if with_candidates:
            valid = valid & mask[:, None]
            _check_logits(logits, "every candidate", torch.where(valid, logp_h, 0.0), mask, ids_h)
            out = replace(
                out,
                valid=valid,
                cand_ids=cand_ids,
                logp_h=torch.where(valid, logp_h, -torch.inf),
                lq_h=torch.where(valid, cand_logprobs.to(dtype), -torch.inf),
            )
    return out


def _log_softmax_rows(block, dtype, inv_t, buf):
    """log_softmax(block / T) in ``dtype``, written into ``buf`` (reused across chunks)."""
    if buf is None or buf.shape != block.shape:
        buf = torch.empty(block.shape, dtype=dtype, device=block.device)
    if inv_t == 1.0 and block.dtype == dtype:
        return torch.ops.aten._log_softmax.out(block, 1, False, out=buf)
    torch.mul(block.to(dtype), inv_t, out=buf)
    # In place is safe: the kernel reduces a row (max, sum) before writing any of it.
    return torch.ops.aten._log_softmax.out(buf, 1, False, out=buf)


def _check_logits(logits, where, gathered, mask, columns):
    """A NaN/+inf logit makes its row's log-softmax NaN; a -inf logit gives -inf at its column."""
    bad = mask[:, None] & ~torch.isfinite(gathered.reshape(mask.shape[0], -1))
    if bool(bad.any()):
        i, slot = (int(x) for x in bad.nonzero()[0])
        row = logits[i].detach() if isinstance(logits, torch.Tensor) else logits.rows(i, i + 1)[0]
        nan_or_inf = torch.isnan(row) | (row == torch.inf)
        j = int(nan_or_inf.nonzero()[0, 0]) if bool(nan_or_inf.any()) else int(columns[i, slot])
        raise NonFiniteInput(
            f"logits[{i}, {j}] is {float(row[j])} at a trained position (loss_mask[{i}] is True); "
            f"the trainer's log-probs must be finite at {where}"
        )


def _raise_first(name, bad, values, expected="finite", exc=NonFiniteInput):
    """Raise ``exc`` naming ``name`` and the first index where ``bad`` holds."""
    if bool(bad.any()):
        index = tuple(int(x) for x in bad.nonzero()[0])
        raise exc(
            f"{name}[{', '.join(map(str, index))}] is {values[index].item()} at a trained position "
            f"(loss_mask[{index[0]}] is True); expected {expected}"
        )


def _count(token_count, mask):
    count = int(mask.sum()) if token_count is None else int(token_count)
    if count < 0:
        raise ValueError(f"token_count={token_count}; it must be >= 0")
    return max(count, 1)


def _mean(values, mask, name):
    n = int(mask.sum())
    return {name: float(torch.where(mask, values, 0.0).sum()) / n if n else 0.0}


def _sampled_metrics(logp_a, lq_a, w_a, mask):
    log_r = (logp_a - lq_a).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    out = _mean(w_a, mask, "sc_importance_weight")
    out.update(_mean(log_r.exp() - 1 - log_r, mask, "train_rollout_kl"))
    out.update(_mean((logp_a - lq_a).abs(), mask, "train_rollout_logprob_abs_diff"))
    return out

"""The closed-form logit gradient of the losses of trainer_service/loss.py, applied chunk by
chunk: to a ``[N, V]`` logits tensor (``_SparseScoreLoss``), or through the LM head from the
final hidden states, where no ``[tokens, vocab]`` tensor is ever held whole (docs/design.md
section 6, "Memory").

``HeadLogits(hidden, weight, bias)`` stands for the logits ``hidden @ weight.T + bias`` of N
rows. The losses of ``trainer_service.loss`` take it in place of a ``[N, V]`` tensor: they read
it ``chunk`` rows at a time (``rows``) to gather the log-probs they need, compute their
coefficients on ``[N]`` and ``[N, K]`` tensors, and ``attach`` the loss value to the graph
through ``_HeadLoss``, whose backward recomputes each chunk's logits, turns them in place into
the closed-form logit gradient (``GradTerms``, which ``_SparseScoreLoss`` uses too) and folds
that into ``grad_hidden`` (``g @ W``) and ``grad_weight`` (``g.T @ h``) before the next chunk. What is held
above the hidden states is one ``[chunk, V]`` buffer and the head's weight gradient.

The head runs in the weight's dtype: float32 master weights under bfloat16 autocast (the
trainer's ``dtype`` setting), so the log-probs that enter the importance ratios are float32
ones and no bfloat16 copy of the ``[V, D]`` head is made.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


class HeadLogits:
    """The logits ``hidden @ weight.T (+ bias)`` of N rows, computed only a block at a time.

    ``hidden`` [N, D] (requires grad), ``weight`` [V, D] (a parameter: tied embeddings are
    one), ``bias`` [V] or None. ``shape``, ``dtype``, ``device`` and ``dim()`` describe the
    logits as a tensor would."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
        if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
            raise ValueError(
                f"hidden {tuple(hidden.shape)} and head weight {tuple(weight.shape)}: expected [N, D] and [V, D]"
            )
        self.hidden, self.weight, self.bias = hidden, weight, bias
        self.shape = torch.Size((hidden.shape[0], weight.shape[0]))
        self.dtype, self.device = weight.dtype, weight.device

    def dim(self) -> int:
        return 2

    def rows(self, s: int, e: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The detached logits of rows ``s:e`` (written into ``out`` when its shape fits)."""
        with torch.no_grad():
            return _linear(self.hidden[s:e].detach(), self.weight.detach(), self.bias, out)

    def attach(self, loss_value, ids_a, coef_a, cand_ids, coef_h, dense, mask, temperature, chunk):
        """``loss_value`` with the loss's closed-form gradient flowing into hidden, weight, bias."""
        cand = () if cand_ids is None else (cand_ids, coef_h)
        return _HeadLoss.apply(
            loss_value, self.hidden, self.weight, self.bias, (ids_a, coef_a, dense, mask, cand), temperature, chunk
        )


def _linear(h, weight, bias, out):
    """``h @ weight.T + bias`` in the weight's dtype, outside any autocast region."""
    no_autocast = (
        torch.autocast(h.device.type, enabled=False) if torch.amp.is_autocast_available(h.device.type) else None
    )
    with no_autocast or contextlib.nullcontext():
        h = h.to(weight.dtype)
        rows = (h.shape[0], weight.shape[0])
        if out is None or tuple(out.shape) != rows:
            out = torch.empty(rows, dtype=weight.dtype, device=weight.device)
        torch.mm(h, weight.T, out=out)
        if bias is not None:
            out.add_(bias.detach().to(weight.dtype))
        return out


class _HeadLoss(torch.autograd.Function):
    """Returns the precomputed ``loss_value``; the backward pass is the chain rule through the
    head, one chunk of rows at a time."""

    @staticmethod
    def forward(ctx, loss_value, hidden, weight, bias, terms, temperature, chunk):
        ids_a, coef_a, dense, mask, cand = terms
        ctx.save_for_backward(hidden, weight, bias, ids_a, coef_a, dense, mask, *cand)
        ctx.temperature, ctx.chunk = temperature, chunk
        return loss_value.clone()

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias, ids_a, coef_a, dense, mask, *cand = ctx.saved_tensors
        inv_t = 1.0 / ctx.temperature
        terms = GradTerms(ids_a, coef_a, dense, mask, tuple(cand), grad_out.to(coef_a.dtype) * inv_t, inv_t)
        need_h, need_w, need_b = ctx.needs_input_grad[1:4]
        w = weight.detach()
        grad_h = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=w.dtype, device=w.device) if need_w else None
        grad_b = torch.zeros(w.shape[0], dtype=w.dtype, device=w.device) if need_b and bias is not None else None
        buf = part = None
        with torch.no_grad():
            for s in range(0, hidden.shape[0], ctx.chunk):
                e = min(s + ctx.chunk, hidden.shape[0])
                h = hidden[s:e].detach().to(w.dtype)
                if not bool(mask[s:e].all()):  # untrained rows add nothing, whatever they hold
                    h = h.masked_fill(~mask[s:e, None], 0.0)
                buf = _linear(h, w, bias, buf)
                # The logit gradient overwrites the logits when their dtypes agree (float32, float64).
                part = buf if buf.dtype == coef_a.dtype else _like(part, buf, coef_a.dtype)
                g = terms.write(buf, part, s, e).to(w.dtype)
                if grad_h is not None:
                    grad_h[s:e] = g @ w
                if grad_w is not None:
                    grad_w.addmm_(g.T, h)
                if grad_b is not None:
                    grad_b += g.sum(0)
        return None, grad_h, grad_w, grad_b, None, None, None


def _like(buf, shape_of, dtype):
    return buf if buf is not None and buf.shape == shape_of.shape else torch.empty_like(shape_of, dtype=dtype)


def attach(logits, *args):
    """The loss value carrying the closed-form gradient: through ``_SparseScoreLoss`` for a
    [N, V] tensor, through ``HeadLogits.attach`` for hidden states."""
    if isinstance(logits, torch.Tensor):
        return _SparseScoreLoss.apply(logits, *args)
    return logits.attach(*args)


class _SparseScoreLoss(torch.autograd.Function):
    """Returns the precomputed detached ``loss_value``; its gradient w.r.t. ``logits`` is

        (1/T) * [ sum_j coef_j e_{id_j} + dense * softmax(logits/T) ]   per row,

    written chunk by chunk into the gradient buffer (the only [N, V] allocation)."""

    @staticmethod
    def forward(ctx, logits, loss_value, ids_a, coef_a, cand_ids, coef_h, dense, mask, temperature, chunk):
        ctx.save_for_backward(logits, ids_a, coef_a, dense, mask, *(() if cand_ids is None else (cand_ids, coef_h)))
        ctx.temperature, ctx.chunk = temperature, chunk
        return loss_value.clone()

    @staticmethod
    def backward(ctx, grad_out):
        logits, ids_a, coef_a, dense, mask, *cand = ctx.saved_tensors
        dtype, inv_t = coef_a.dtype, 1.0 / ctx.temperature
        terms = GradTerms(ids_a, coef_a, dense, mask, tuple(cand), grad_out.to(dtype) * inv_t, inv_t)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        buf = None
        for s in range(0, logits.shape[0], ctx.chunk):
            e = min(s + ctx.chunk, logits.shape[0])
            # Work in place in the gradient buffer when the dtypes agree, else in a reused chunk buffer.
            if logits.dtype == dtype:
                part = grad[s:e]
            else:
                buf = part = (
                    buf
                    if buf is not None and buf.shape[0] == e - s
                    else torch.empty((e - s, logits.shape[1]), dtype=dtype, device=logits.device)
                )
            terms.write(logits[s:e].detach(), part, s, e)
            if part.data_ptr() != grad[s:e].data_ptr():
                grad[s:e].copy_(part)
        return grad, None, None, None, None, None, None, None, None, None


@dataclass(frozen=True)
class GradTerms:
    """What the logit gradient of a loss here needs, per row: ``scale * [sum_j coef_j e_{id_j} +
    dense * softmax(logits/T)]`` with ``scale = grad_out / T`` (docs/design.md section 6, Memory)."""

    ids_a: torch.Tensor  # [N] sampled ids
    coef_a: torch.Tensor  # [N] d loss / d log p at the sampled id
    dense: torch.Tensor  # [N] coefficient of the softmax
    mask: torch.Tensor  # [N] trained rows
    cand: tuple  # () or (cand_ids [N, K], coef_h [N, K])
    scale: torch.Tensor  # grad_out / T
    inv_t: float

    def write(self, block, part, s: int, e: int):
        """d loss / d logits of rows ``s:e`` (``block``: their detached logits) into ``part``
        ([e - s, V], the compute dtype; it may be ``block`` itself, overwritten)."""
        dtype, sl = part.dtype, slice(s, e)
        if bool((self.dense[sl] != 0).any()):
            if self.inv_t == 1.0 and block.dtype == dtype:
                torch.ops.aten._softmax.out(block, 1, False, out=part)
            else:
                torch.mul(block.to(dtype), self.inv_t, out=part)
                # In place is safe: the kernel reduces a row (max, sum) before writing any of it.
                torch.ops.aten._softmax.out(part, 1, False, out=part)
            part.mul_((self.dense[sl] * self.scale)[:, None])
            if not bool(self.mask[sl].all()):
                part.masked_fill_(~self.mask[sl, None], 0.0)  # padded rows may hold inf/NaN logits
        else:
            part.zero_()
        part.scatter_add_(1, self.ids_a[sl, None], (self.coef_a[sl] * self.scale)[:, None])
        if self.cand:
            cand_ids, coef_h = self.cand
            part.scatter_add_(1, cand_ids[sl].clamp_min(0).to(torch.int64), coef_h[sl] * self.scale)
        return part

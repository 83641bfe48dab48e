"""Seeded loss inputs shared by the loss tests and the golden-fixture generator.

Each case is the keyword arguments of a loss call: trainer logits (a leaf requiring grad),
a sampler distribution q that differs from the trainer's by `noise`, and the candidates a
batch would carry in `selected` (top-K of q) or `support` (a strict-subset support, q
renormalised over it) mode.
"""

from __future__ import annotations

import functools
from dataclasses import fields

import torch

from trainer_service import loss as _loss
from trainer_service.loss import LossSettings, TokenRows

_ROW_FIELDS = tuple(f.name for f in fields(TokenRows))


def by_name(loss):
    """``loss(logits, rows, settings, chunk_size)``, also callable as ``loss(logits, **fields)`` with
    the fields of ``TokenRows`` and ``LossSettings`` by name, as the cases here are keyword arguments."""

    @functools.wraps(loss)
    def call(logits, rows: TokenRows | None = None, settings: LossSettings | None = None, chunk_size=None, **named):
        if rows is None:
            rows = TokenRows(**{name: named.pop(name) for name in _ROW_FIELDS if name in named})
        if settings is None:
            settings = LossSettings(**named)
        elif named:
            raise TypeError(f"{loss.__name__}: {sorted(named)} given by name beside a LossSettings")
        return loss(logits, rows, settings, chunk_size=chunk_size)

    return call


score_centering_loss = by_name(_loss.score_centering_loss)
reinforce_loss = by_name(_loss.reinforce_loss)
tis_loss = by_name(_loss.tis_loss)
LOSSES = {"score_centering": score_centering_loss, "reinforce": reinforce_loss, "tis": tis_loss}


def make_case(
    seed,
    *,
    mode="selected",
    n=12,
    vocab=40,
    k=8,
    noise=0.8,
    dtype=torch.float64,
    outside_head_every=3,
    tiny_tail=False,
    padded_rows=(),
    full_vocab=False,
):
    """Loss inputs for one seed.

    selected: rows ``i % outside_head_every == 0`` sample a token outside the head.
    support: rows ``i % 4 == 1`` have 3 empty slots (a smaller support), the rest K ids.
    tiny_tail: head mass of both p and q is within 1e-7 of 1 (below the eps floor).
    padded_rows: loss_mask False, with -1 ids, -inf/NaN log-probs and NaN logits there.
    full_vocab: K = vocab, every token a candidate (exact centering).
    """
    g = torch.Generator().manual_seed(seed)
    k = vocab if full_vocab else k
    trainer = 1.5 * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    sampler = trainer + noise * torch.randn(n, vocab, generator=g, dtype=torch.float64)
    if tiny_tail:
        # Per row, a random head of K tokens; the rest sits 21 nats lower: tail ~ 32 * e^-21 ~ 2.4e-8.
        for i in range(n):
            tail = torch.randperm(vocab, generator=g)[k:]
            sampler[i, tail] -= 21.0
            trainer[i, tail] -= 21.0
    lq = torch.log_softmax(sampler, dim=1)
    cand_ids = torch.full((n, k), -1, dtype=torch.int32)
    cand_lp = torch.full((n, k), -torch.inf, dtype=torch.float32 if dtype != torch.float64 else torch.float64)
    response = torch.empty(n, dtype=torch.int64)
    sampled_lp = torch.empty(n, dtype=cand_lp.dtype)
    for i in range(n):
        order = torch.argsort(lq[i], descending=True)
        if mode == "selected":
            head = order[:k]
            cand_ids[i] = head.to(torch.int32)
            cand_lp[i] = lq[i, head].to(cand_lp.dtype)
            if outside_head_every and i % outside_head_every == 0 and k < vocab:
                a = int(order[k + int(torch.randint(vocab - k, (1,), generator=g))])
            else:
                a = int(torch.multinomial(lq[i].exp(), 1, generator=g))
            response[i] = a
            sampled_lp[i] = lq[i, a].to(cand_lp.dtype)
        else:
            size = k - 3 if (i % 4 == 1 and k > 3 and not full_vocab) else k
            support = order[:size]
            lq_s = lq[i, support] - torch.logsumexp(lq[i, support], 0)
            cand_ids[i, :size] = support.to(torch.int32)
            cand_lp[i, :size] = lq_s.to(cand_lp.dtype)
            j = int(torch.multinomial(lq_s.exp(), 1, generator=g))
            response[i] = int(support[j])
            sampled_lp[i] = lq_s[j].to(cand_lp.dtype)
    advantages = torch.randn(n, generator=g, dtype=torch.float64).to(cand_lp.dtype)
    mask = torch.ones(n, dtype=torch.bool)
    for i in padded_rows:
        mask[i] = False
        response[i] = -1
        cand_ids[i] = -1
        cand_lp[i] = -torch.inf
        sampled_lp[i] = torch.nan
        advantages[i] = torch.nan
        trainer[i] = torch.nan
    return {
        "logits": trainer.to(dtype).requires_grad_(),
        "response_ids": response,
        "sampled_logprobs": sampled_lp,
        "cand_ids": cand_ids,
        "cand_logprobs": cand_lp,
        "advantages": advantages,
        "loss_mask": mask,
    }


def fresh(case):
    """The same case with a new logits leaf (so gradients do not accumulate across calls)."""
    out = dict(case)
    out["logits"] = case["logits"].detach().clone().requires_grad_()
    return out


def in_dtype(case, dtype):
    """The same inputs with every floating-point tensor cast to ``dtype``: from float32 to float64
    the values are identical, so the two computations differ only in their own rounding."""
    out = {key: value.detach().to(dtype) if value.is_floating_point() else value for key, value in case.items()}
    out["logits"].requires_grad_()
    return out

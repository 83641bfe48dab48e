"""Independent dense reference for docs/design.md section 6, in float64.

Written to be obviously right rather than fast: a Python loop over tokens, the full
softmax over the whole vocabulary, Python-float coefficients, the tail as an explicit sum
over the tokens outside the head (not `1 - P_H`), and the gradient from autograd through
the dense log-softmax. It shares no code with `trainer_service/loss.py`.

Beside each figure it returns the figure's *magnitude*, which sets how far a floating-point
computation of it may stray (tests/rounding.py): the sum, over the terms the figure adds up, of
each term's first-order rounding sensitivity in units of the unit roundoff. Per trained row, ``m``
bounds every log-domain operand (``|z|``, ``logsumexp z``, ``|log q|``): a log-prob formed from
them is off by about ``u m`` absolutely, and ``p = exp(log p)`` by ``u m`` relatively. The tail
ratio divides by ``1 - P_H``, which cancels: its relative sensitivity is ``m P_H / (1 - P_H)``
(floored at ``EPS``, as the loss floors it) plus ``Q_H / (1 - Q_H)``.
"""

from __future__ import annotations

import math

import torch

EPS = 1e-6


def weight(is_mode, r, clip=2.0, low=0.5, high=5.0):
    if is_mode == "none":
        return 1.0
    if is_mode == "tis":
        return min(r, clip)
    return r if low <= r <= high else 0.0


def chain_length(case) -> int:
    """The longest chain of accumulations behind a figure: a log-sum-exp over the vocabulary, a
    sum over the K candidate slots, a sum over the tokens."""
    n, vocab = case["logits"].shape
    return vocab + case["cand_ids"].shape[1] + n


def oracle(
    case,
    *,
    loss="score_centering",
    mode="selected",
    is_mode="none",
    temperature=1.0,
    tis_clip=2.0,
    mis_low=0.5,
    mis_high=5.0,
    token_count=None,
):
    """Returns (loss: float, grad: float64 [N, V] tensor, metrics: dict of floats, magnitudes:
    dict of floats with a key per metric, ``loss``, ``grad_abs_sum`` and ``grad_norm``, and
    ``grad_rows``, a float64 [N] tensor bounding the L1 rounding sensitivity of each gradient row)."""
    logits = case["logits"].detach().to(torch.float64).clone().requires_grad_()
    n, vocab = logits.shape
    mask = case["loss_mask"].tolist()
    count = sum(mask) if token_count is None else token_count
    weighting = is_mode if loss == "score_centering" else ("tis" if loss == "tis" else "none")

    def w(r):
        return weight(weighting, r, tis_clip, mis_low, mis_high)

    total = torch.zeros((), dtype=torch.float64)
    sums = dict.fromkeys(
        (
            "sc_correction",
            "sc_residual_l1",
            "sc_train_head_mass",
            "sc_rollout_head_mass",
            "sc_tail_ratio",
            "sc_importance_weight",
            "train_rollout_kl",
            "train_rollout_logprob_abs_diff",
        ),
        0.0,
    )
    mags = dict.fromkeys((*sums, "loss", "grad_abs_sum"), 0.0)
    grad_rows = torch.zeros(n, dtype=torch.float64)
    for i in range(n):
        if not mask[i]:
            continue
        z = logits[i] / temperature
        full = z - torch.log(torch.sum(torch.exp(z - z.max()))) - z.max()  # log-softmax, whole vocabulary
        head = [int(v) for v in case["cand_ids"][i].tolist() if v >= 0]
        q = {
            v: math.exp(float(case["cand_logprobs"][i, j]))
            for j, v in enumerate(case["cand_ids"][i].tolist())
            if v >= 0
        }
        a = int(case["response_ids"][i])
        q_a = math.exp(float(case["sampled_logprobs"][i]))
        A = float(case["advantages"][i])
        if loss == "score_centering" and mode == "support":
            head_z = torch.stack([z[v] for v in head])
            logp = {v: z[v] - torch.log(torch.sum(torch.exp(head_z))) for v in head}  # renormalised on H
        else:
            logp = {v: full[v] for v in range(vocab)}
        p = {v: math.exp(float(lp.detach())) for v, lp in logp.items()}
        r_a = p[a] / q_a
        w_a = w(r_a)
        term = w_a * logp[a]
        z_values = z.detach()
        m = 1.0 + float(z_values.abs().max()) + abs(float(torch.logsumexp(z_values, 0)))
        m += max(abs(float(case["sampled_logprobs"][i])), *(abs(math.log(q_v)) for q_v in q.values()))
        if loss == "score_centering" and mode == "support":
            m += abs(float(torch.logsumexp(head_z.detach(), 0)))
        coef_mags, coefs = [w_a * m], [w_a]  # |d figure / d log p| terms: the sampled token, then H
        if loss == "score_centering":
            if mode == "selected":
                tail_p = sum(p[v] for v in range(vocab) if v not in q)
                tail_q = 1.0 - sum(q.values())
                rho = max(tail_q, EPS) / max(tail_p, EPS)
                alpha = rho * w(1.0 / rho)
                head_p = sum(p[v] for v in head)
            else:
                rho, alpha = 0.0, 0.0
                head_p = sum(math.exp(float(full[v].detach())) for v in head)
            coefs = {v: q[v] * w(p[v] / q[v]) - alpha * p[v] for v in head}
            for v in head:
                term = term - coefs[v] * logp[v]
            sums["sc_correction"] += sum(coefs[v] * float(logp[v].detach()) for v in head)
            sums["sc_residual_l1"] += sum(abs(c) for c in coefs.values())
            sums["sc_train_head_mass"] += head_p
            sums["sc_rollout_head_mass"] += sum(q.values())
            sums["sc_tail_ratio"] += rho
            q_head = sum(q.values())
            tail = m * head_p / max(1 - head_p, EPS) + q_head / max(1 - q_head, EPS) + 2 if mode == "selected" else 0.0
            c_mag = {v: q[v] * w(p[v] / q[v]) * m + alpha * p[v] * (m + tail) for v in head}
            logp_abs = {v: abs(float(logp[v].detach())) for v in head}
            mags["sc_correction"] += sum(c_mag[v] * logp_abs[v] + abs(coefs[v]) * m for v in head)
            mags["sc_residual_l1"] += sum(c_mag.values())
            mags["sc_train_head_mass"] += head_p * m
            mags["sc_rollout_head_mass"] += 2 * q_head
            mags["sc_tail_ratio"] += rho * tail
            coef_mags += list(c_mag.values())
            coefs_abs = [abs(c) for c in coefs.values()]
            mags["loss"] += abs(A) * sum(c_mag[v] * logp_abs[v] + abs(coefs[v]) * m for v in head)
        else:
            coefs_abs = []
        mags["loss"] += abs(A) * w_a * m * (1 + abs(float(logp[a].detach())))
        # A gradient row is sum_j coef_j (e_j - softmax): each coefficient's error twice, plus the
        # softmax's relative error m times the coefficients' total.
        grad_rows[i] = abs(A) * (2 * sum(coef_mags) + 2 * m * (w_a + sum(coefs_abs)))
        total = total - A * term
        sums["sc_importance_weight"] += w_a
        log_r = min(
            max(float(logp[a].detach()) - float(case["sampled_logprobs"][i]), -20.0), 20.0
        )  # clamped as miles does
        sums["train_rollout_kl"] += math.exp(log_r) - 1 - log_r
        sums["train_rollout_logprob_abs_diff"] += abs(math.log(p[a]) - math.log(q_a))
        mags["sc_importance_weight"] += w_a * m
        mags["train_rollout_kl"] += (math.exp(log_r) + 1) * m
        mags["train_rollout_logprob_abs_diff"] += m
    value = total / max(count, 1)
    (grad,) = torch.autograd.grad(value, logits) if value.requires_grad else (torch.zeros_like(logits),)
    metrics = {key: s / sum(mask) for key, s in sums.items()}
    magnitudes = {key: s / sum(mask) for key, s in mags.items() if key in metrics}
    magnitudes["loss"] = mags["loss"] / max(count, 1)
    grad_rows /= max(count, 1)
    magnitudes["grad_abs_sum"] = magnitudes["grad_norm"] = float(grad_rows.sum())  # an L1 bound bounds L2
    magnitudes["grad_rows"] = grad_rows
    if loss != "score_centering":
        metrics = {
            key: metrics[key] for key in ("sc_importance_weight", "train_rollout_kl", "train_rollout_logprob_abs_diff")
        }
    return float(value.detach()), grad, metrics, magnitudes

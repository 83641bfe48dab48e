"""Independent dense reference for docs/design.md section 6, in float64.

Written to be obviously right rather than fast: a Python loop over tokens, the full
softmax over the whole vocabulary, Python-float coefficients, the tail as an explicit sum
over the tokens outside the head (not `1 - P_H`), and the gradient from autograd through
the dense log-softmax. It shares no code with `trainer_service/loss.py`.
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
    """Returns (loss: float, grad: float64 [N, V] tensor, metrics: dict of floats)."""
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
        total = total - A * term
        sums["sc_importance_weight"] += w_a
        log_r = min(
            max(float(logp[a].detach()) - float(case["sampled_logprobs"][i]), -20.0), 20.0
        )  # clamped as miles does
        sums["train_rollout_kl"] += math.exp(log_r) - 1 - log_r
        sums["train_rollout_logprob_abs_diff"] += abs(math.log(p[a]) - math.log(q_a))
    value = total / max(count, 1)
    (grad,) = torch.autograd.grad(value, logits) if value.requires_grad else (torch.zeros_like(logits),)
    metrics = {key: s / sum(mask) for key, s in sums.items()}
    if loss != "score_centering":
        metrics = {
            key: metrics[key] for key in ("sc_importance_weight", "train_rollout_kl", "train_rollout_logprob_abs_diff")
        }
    return float(value.detach()), grad, metrics

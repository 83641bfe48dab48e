"""trainer_service.loss against the dense float64 oracle (tests/trainer_service/oracle.py).

Tolerances come from tests/rounding.py: each figure, gradient row included, may differ from the
oracle's by the rounding bound of its magnitude (the oracle computes both) in the precision the
loss computes in. With float64 logits that is ~1e-12 or less on these cases, far below any
formula error, which shows at >= 1e-4 here; with float32 logits, float32's bound.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.rounding import sum_tolerance, unit_roundoff
from tests.trainer_service.cases import fresh, make_case, reinforce_loss, score_centering_loss, tis_loss
from tests.trainer_service.oracle import chain_length, oracle
from trainer_service.loss import NonFiniteInput

MODES = ("selected", "support")
IS_MODES = ("none", "tis", "mis")
TOL64 = 1e-12  # closed-form float64 expectations of order 1 from a handful of operations: ~1e-16 each


def run(fn, case, **kw):
    case = fresh(case)
    loss, metrics = fn(**case, **kw)
    loss.backward()
    return float(loss.detach()), case["logits"].grad, metrics


def assert_matches_oracle(
    case, *, mode, is_mode, temperature=1.0, fn=score_centering_loss, loss="score_centering", **kw
):
    value, grad, metrics = run(fn, case, mode=mode, is_mode=is_mode, temperature=temperature, **kw)
    ref_value, ref_grad, ref_metrics, mags = oracle(
        case, loss=loss, mode=mode, is_mode=is_mode, temperature=temperature, **kw
    )

    def tolerance(magnitude):
        return sum_tolerance(magnitude, chain_length(case), unit_roundoff(case["logits"].dtype))

    assert abs(value - ref_value) <= tolerance(mags["loss"])
    mask = case["loss_mask"]
    row_error = (grad.double() - ref_grad).abs().max(1).values
    assert bool((row_error[mask] <= tolerance(mags["grad_rows"][mask])).all()), float(row_error[mask].max())
    assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))
    assert set(metrics) == set(ref_metrics)
    for key, ref in ref_metrics.items():
        assert abs(metrics[key] - ref) <= tolerance(mags[key]), key
    return grad, ref_grad


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("is_mode", IS_MODES)
@pytest.mark.parametrize("temperature", (1.0, 0.7))
def test_gradient_matches_dense_oracle(mode, is_mode, temperature):
    # selected: every third row samples a token outside the head; support: strict-subset supports.
    case = make_case(11, mode=mode)
    assert_matches_oracle(case, mode=mode, is_mode=is_mode, temperature=temperature)


@pytest.mark.parametrize("is_mode", IS_MODES)
def test_gradient_matches_oracle_when_every_sampled_token_is_outside_the_head(is_mode):
    case = make_case(12, mode="selected", outside_head_every=1)
    ids = case["cand_ids"].long()
    assert not (ids == case["response_ids"][:, None]).any()
    assert_matches_oracle(case, mode="selected", is_mode=is_mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("is_mode", IS_MODES)
def test_gradient_matches_oracle_with_tiny_tails(mode, is_mode):
    case = make_case(13, mode=mode, tiny_tail=True)
    q_head = case["cand_logprobs"].exp().sum(1)
    assert bool(((1 - q_head).abs() < 1e-7).all())  # head mass within 1e-7 of 1
    assert_matches_oracle(case, mode=mode, is_mode=is_mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("is_mode", IS_MODES)
def test_padded_rows_contribute_nothing(mode, is_mode):
    # Padded rows hold NaN logits/advantages/log-probs and -1 ids; the divisor is the trained count.
    case = make_case(14, mode=mode, padded_rows=(0, 5, 11))
    grad, _ = assert_matches_oracle(case, mode=mode, is_mode=is_mode)
    assert torch.isfinite(grad).all()


def test_support_mode_uses_a_strict_subset_of_the_vocabulary():
    case = make_case(15, mode="support")
    assert bool(((case["cand_ids"] >= 0).sum(1) < case["logits"].shape[1]).all())
    grad, _ = assert_matches_oracle(case, mode="support", is_mode="none")
    # Renormalised on H: no gradient reaches tokens outside the support.
    outside = torch.ones_like(grad, dtype=torch.bool)
    outside.scatter_(1, case["cand_ids"].clamp_min(0).long(), False)
    assert torch.equal(grad[outside], torch.zeros_like(grad[outside]))


def test_cases_exercise_both_branches_of_tis_and_mis():
    case = make_case(11, mode="selected")
    logp = torch.log_softmax(case["logits"].detach(), 1)
    ratio = (logp.gather(1, case["cand_ids"].long()) - case["cand_logprobs"]).exp()
    assert bool((ratio > 2.0).any()) and bool((ratio < 2.0).any())  # tis clip active and inactive
    assert bool((ratio < 0.5).any()) and bool(((ratio >= 0.5) & (ratio <= 5.0)).any())  # mis in and out


@pytest.mark.parametrize("mode", MODES)
def test_expected_update_under_q_is_zero_for_constant_reward(mode):
    # H = the whole vocabulary, f = none: sum_a q_a * grad l(a) = 0 exactly (docs/design.md section 6).
    # Summed analytically over every token a, weighted by q_a; float64 leaves ~1e-16 residue.
    vocab = 9
    case = make_case(16, mode=mode, n=1, vocab=vocab, full_vocab=True)
    case["advantages"] = torch.tensor([1.7], dtype=torch.float64)
    lq = {int(v): float(lp) for v, lp in zip(case["cand_ids"][0], case["cand_logprobs"][0])}
    expected_sc = torch.zeros(vocab, dtype=torch.float64)
    expected_pg = torch.zeros(vocab, dtype=torch.float64)
    for a in range(vocab):
        case["response_ids"] = torch.tensor([a])
        case["sampled_logprobs"] = torch.tensor([lq[a]], dtype=torch.float64)
        expected_sc += math.exp(lq[a]) * run(score_centering_loss, case, mode=mode, is_mode="none")[1][0]
        expected_pg += math.exp(lq[a]) * run(reinforce_loss, case)[1][0]
    assert float(expected_sc.abs().max()) < 1e-15
    # REINFORCE keeps the drift term A * (q - p) that centering removes.
    assert float(expected_pg.abs().max()) > 1e-2


def test_centering_vanishes_when_trainer_equals_sampler():
    # p = q on a full-vocabulary head: coefficients q_v - alpha p_v are all zero, so the
    # score-centering gradient is exactly REINFORCE's.
    case = make_case(17, n=6, vocab=12, full_vocab=True, noise=0.0)
    _, grad_sc, metrics = run(score_centering_loss, case)
    _, grad_pg, _ = run(reinforce_loss, case)
    assert metrics["sc_correction"] < 1e-14
    assert torch.allclose(grad_sc, grad_pg, rtol=0, atol=1e-15)


def test_sc_correction_is_the_signed_centering_term_and_sc_residual_l1_its_mass():
    # p = (1, 2, 3)/6 over V = 3; H = {2, 1} with q = (1/2, 1/4): Q_H = 3/4, P_H = 5/6,
    # rho = (1/4) / (1/6) = 3/2 = alpha (f = none), c_2 = 1/2 - 3/2 * 1/2 = -1/4,
    # c_1 = 1/4 - 3/2 * 1/3 = -1/4; sum_H c log p = -1/4 (log 1/2 + log 1/3) = log(6) / 4.
    case = {
        "logits": torch.log(torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.float64)).requires_grad_(),
        "response_ids": torch.tensor([0]),
        "sampled_logprobs": torch.tensor([math.log(0.25)], dtype=torch.float64),
        "cand_ids": torch.tensor([[2, 1]], dtype=torch.int32),
        "cand_logprobs": torch.log(torch.tensor([[0.5, 0.25]], dtype=torch.float64)),
        "advantages": torch.tensor([1.0], dtype=torch.float64),
        "loss_mask": torch.tensor([True]),
    }
    assert_matches_oracle(case, mode="selected", is_mode="none")
    _, _, metrics = run(score_centering_loss, case)
    assert metrics["sc_correction"] == pytest.approx(math.log(6) / 4, abs=TOL64)
    assert metrics["sc_residual_l1"] == pytest.approx(0.5, abs=TOL64)
    assert metrics["sc_tail_ratio"] == pytest.approx(1.5, abs=TOL64)


@pytest.mark.parametrize("fn", (score_centering_loss, reinforce_loss, tis_loss))
def test_one_extreme_token_leaves_train_rollout_kl_finite(fn):
    # log p_a - log q_a ~ 1e4 overflows exp; clamped to 20, that token's k3 is e^20 - 1 - 20.
    case = make_case(30, n=4, mode="selected")
    case["sampled_logprobs"][0] = -1e4
    value, grad, metrics = run(fn, case)
    assert math.isfinite(value) and bool(torch.isfinite(grad).all())
    case["loss_mask"][0] = False
    _, _, rest = run(fn, case)
    expected = (3 * rest["train_rollout_kl"] + math.exp(20) - 21) / 4
    assert metrics["train_rollout_kl"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("fn, loss, is_mode", [(reinforce_loss, "reinforce", "none"), (tis_loss, "tis", "tis")])
def test_baselines_match_dense_oracle(fn, loss, is_mode):
    case = make_case(18, mode="selected", padded_rows=(3,))
    assert_matches_oracle(case, mode="selected", is_mode=is_mode, temperature=0.9, fn=fn, loss=loss)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("is_mode", IS_MODES)
def test_float32_logits_match_oracle_within_float32_rounding(mode, is_mode):
    case = make_case(19, mode=mode, dtype=torch.float32)
    grad, _ = assert_matches_oracle(case, mode=mode, is_mode=is_mode)
    assert grad.dtype == torch.float32


def test_bfloat16_logits_get_bfloat16_gradients_computed_in_float32():
    case = make_case(20, dtype=torch.float32)
    _, grad32, _ = run(score_centering_loss, case)
    case16 = dict(case, logits=case["logits"].detach().to(torch.bfloat16).requires_grad_())
    _, grad16, _ = run(score_centering_loss, case16)
    assert grad16.dtype == torch.bfloat16
    # bf16 logits carry ~2^-8 relative rounding, so gradients agree to ~1e-2 of their scale.
    assert torch.allclose(grad16.float(), grad32, rtol=0, atol=1e-2 * float(grad32.abs().max()))


def test_token_count_is_the_divisor():
    case = make_case(21)
    local, grad_local, metrics_local = run(score_centering_loss, case)
    scaled, grad_scaled, metrics_scaled = run(score_centering_loss, case, token_count=48)
    assert scaled == pytest.approx(local * 12 / 48, rel=1e-14)
    assert torch.allclose(grad_scaled, grad_local * 12 / 48, rtol=1e-14, atol=0)
    assert metrics_scaled == metrics_local  # metrics are means over this call's trained tokens


@pytest.mark.parametrize("chunk_size", (1, 5, 64))
def test_chunk_size_does_not_change_results(chunk_size):
    case = make_case(22, mode="selected", dtype=torch.float32, padded_rows=(4,))
    value, grad, metrics = run(score_centering_loss, case, is_mode="tis", temperature=0.8)
    value_c, grad_c, metrics_c = run(score_centering_loss, case, is_mode="tis", temperature=0.8, chunk_size=chunk_size)
    assert value_c == value and metrics_c == metrics
    assert torch.equal(grad_c, grad)


def test_no_trained_tokens_gives_zero_loss_and_gradient():
    case = make_case(23, padded_rows=range(12))
    value, grad, metrics = run(score_centering_loss, case)
    assert value == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    assert set(metrics.values()) == {0.0}


@pytest.mark.parametrize(
    "field, index, value, message",
    [
        ("advantages", (3,), math.nan, "advantages[3] is nan"),
        ("sampled_logprobs", (7,), math.inf, "sampled_logprobs[7] is inf"),
        ("cand_logprobs", (2, 1), math.nan, "cand_logprobs[2, 1] is nan"),
        ("cand_logprobs", (4, 0), -math.inf, "cand_logprobs[4, 0] is -inf"),  # -inf in a non-empty slot
        ("logits", (5, 17), math.nan, "logits[5, 17] is nan"),
        ("logits", (6, 2), math.inf, "logits[6, 2] is inf"),
    ],
)
@pytest.mark.parametrize("fn", (score_centering_loss, reinforce_loss, tis_loss))
def test_non_finite_input_raises_naming_tensor_and_position(fn, field, index, value, message):
    case = fresh(make_case(24, padded_rows=(9,)))
    with torch.no_grad():
        case[field][index] = value
    with pytest.raises(NonFiniteInput, match=message.replace("[", r"\[")):
        fn(**case)


def test_non_finite_logit_at_a_candidate_raises():
    case = fresh(make_case(25))
    col = int(case["cand_ids"][2, 3])
    with torch.no_grad():
        case["logits"][2, col] = -math.inf  # logsumexp stays finite, log p at the candidate does not
    with pytest.raises(NonFiniteInput, match=rf"logits\[2, {col}\] is -inf .*every candidate"):
        score_centering_loss(**case)


def test_empty_slots_and_untrained_rows_may_hold_non_finite_values():
    case = make_case(26, mode="support", padded_rows=(0,))
    assert bool((case["cand_logprobs"][1] == -math.inf).any())  # row 1 is trained, with empty slots
    value, grad, _ = run(score_centering_loss, case, mode="support")
    assert math.isfinite(value) and bool(torch.isfinite(grad).all())


def test_support_mode_rejects_a_sampled_token_outside_the_support():
    case = make_case(27, mode="support")
    outside = next(v for v in range(40) if v not in case["cand_ids"][2].tolist())
    case["response_ids"][2] = outside
    with pytest.raises(ValueError, match=r"response_ids\[2\] = \d+ is not in the recorded support"):
        score_centering_loss(**fresh(case), mode="support")


def test_selected_mode_refuses_a_short_trained_row_even_without_the_gate():
    case = make_case(29, mode="selected")
    k = case["cand_ids"].shape[1]
    case["cand_ids"][3, k - 2 :] = -1  # the row a capped router would return, padded as a collector would
    case["cand_logprobs"][3, k - 2 :] = -math.inf
    with pytest.raises(ValueError, match=rf"trained row 3 holds {k - 2} candidates, expected min\(K, vocab\) = {k}"):
        score_centering_loss(**fresh(case), mode="selected")
    case["loss_mask"][3] = False  # untrained, the same row is only padding
    value, _, _ = run(score_centering_loss, case, mode="selected")
    assert math.isfinite(value)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"mode": "tail"}, "mode='tail'"),
        ({"is_mode": "clip"}, "is_mode\n  Input should be 'none', 'tis' or 'mis'"),
        ({"temperature": 0.0}, "--rollout-temperature"),
        ({"is_mode": "mis", "mis_low": 2.0, "mis_high": 1.0}, "--score-centering-mis-low"),
    ],
)
def test_bad_options_raise_naming_the_flag(kw, message):
    with pytest.raises(ValueError, match=message):
        score_centering_loss(**fresh(make_case(28)), **kw)

"""The LM head and the loss chunk by chunk from hidden states (trainer_service/head.py) against
the dense path: logits ``h @ W.T + b`` held whole, the loss of trainer_service/loss.py on them,
autograd through the head. In float64 both must agree to float64 rounding, loss, metrics and
the gradients of hidden states, head weight and bias alike, at every chunk size."""

from __future__ import annotations

import pytest
import torch

from tests.trainer_service.cases import LOSSES, make_case
from trainer_service.head import HeadLogits

HIDDEN = 6
TOL64 = 1e-11  # a few hundred float64 operations of order-1 values per figure


def head_case(seed, *, mode="selected", n=12, vocab=40, bias=True, padded_rows=()):
    """A loss case whose logits are ``h @ W.T + b``, and the leaves h, W, b."""
    case = make_case(seed, mode=mode, n=n, vocab=vocab, padded_rows=padded_rows)
    g = torch.Generator().manual_seed(seed + 100)
    h = torch.randn(n, HIDDEN, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, HIDDEN, generator=g, dtype=torch.float64)
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    for i in padded_rows:
        h[i] = torch.nan  # a padded row may hold anything; it must reach no figure
    del case["logits"]
    return case, (h, w, b)


def leaves(params):
    return tuple(None if p is None else p.detach().clone().requires_grad_() for p in params)


def dense(fn, case, params, **kw):
    h, w, b = leaves(params)
    logits = h @ w.T + (b if b is not None else 0.0)
    loss, metrics = fn(logits, **case, **kw)
    loss.backward()
    return float(loss.detach()), metrics, (h.grad, w.grad, None if b is None else b.grad)


def chunked(fn, case, params, chunk, **kw):
    h, w, b = leaves(params)
    loss, metrics = fn(HeadLogits(h, w, b), **case, chunk_size=chunk, **kw)
    loss.backward()
    return float(loss.detach()), metrics, (h.grad, w.grad, None if b is None else b.grad)


def assert_same(got, want, mask):
    (value, metrics, grads), (ref_value, ref_metrics, ref_grads) = got, want
    assert abs(value - ref_value) <= TOL64
    assert set(metrics) == set(ref_metrics)
    for key, ref in ref_metrics.items():
        assert abs(metrics[key] - ref) <= TOL64, key
    (gh, gw, gb), (rh, rw, rb) = grads, ref_grads
    assert float((gh[mask] - rh[mask]).abs().max()) <= TOL64
    assert torch.equal(gh[~mask], torch.zeros_like(gh[~mask]))
    assert float((gw - rw).abs().max()) <= TOL64
    assert (gb is None) == (rb is None)
    if gb is not None:
        assert float((gb - rb).abs().max()) <= TOL64


@pytest.mark.parametrize("mode", ("selected", "support"))
@pytest.mark.parametrize("is_mode", ("none", "tis", "mis"))
@pytest.mark.parametrize("chunk", (1, 5, 7, 12, 64))  # 5 and 7 do not divide the 12 rows
def test_chunked_head_loss_equals_dense_logits_loss_and_gradients(mode, is_mode, chunk):
    case, params = head_case(4, mode=mode)
    want = dense(LOSSES["score_centering"], case, params, mode=mode, is_mode=is_mode, temperature=0.7)
    got = chunked(LOSSES["score_centering"], case, params, chunk, mode=mode, is_mode=is_mode, temperature=0.7)
    assert_same(got, want, case["loss_mask"])


@pytest.mark.parametrize("loss", ("reinforce", "tis"))
@pytest.mark.parametrize("chunk", (1, 5, 64))
def test_chunked_head_baselines_equal_dense(loss, chunk):
    case, params = head_case(5, bias=False)
    want = dense(LOSSES[loss], case, params, temperature=1.0)
    got = chunked(LOSSES[loss], case, params, chunk, temperature=1.0)
    assert_same(got, want, case["loss_mask"])


@pytest.mark.parametrize("chunk", (1, 5))
def test_untrained_rows_holding_nan_reach_no_figure(chunk):
    case, params = head_case(6, padded_rows=(2, 9))
    h, w, b = params
    clean = h.clone()
    clean[[2, 9]] = 0.0
    want = dense(LOSSES["score_centering"], case, (clean, w, b))
    got = chunked(LOSSES["score_centering"], case, params, chunk)
    assert_same(got, want, case["loss_mask"])
    assert bool(torch.isfinite(got[2][1]).all()) and bool(torch.isfinite(got[2][2]).all())


def test_tied_head_weight_gets_the_sum_of_both_uses():
    # Tied embeddings: the head weight is also the embedding table the hidden states come from.
    case, (_, w, _) = head_case(7, bias=False)
    ids = torch.arange(12) % w.shape[0]

    def run(use_head):
        table = w.detach().clone().requires_grad_()
        h = torch.tanh(table[ids] * 1.3)
        if use_head:
            loss, _ = LOSSES["score_centering"](HeadLogits(h, table), **case, chunk_size=5)
        else:
            loss, _ = LOSSES["score_centering"](h @ table.T, **case)
        loss.backward()
        return float(loss.detach()), table.grad

    (value, grad), (ref_value, ref_grad) = run(True), run(False)
    assert abs(value - ref_value) <= TOL64
    assert float((grad - ref_grad).abs().max()) <= TOL64


def test_float32_hidden_states_match_float64_within_float32_rounding():
    case, params = head_case(8)
    want = dense(LOSSES["score_centering"], case, params)
    h, w, b = (p.float() for p in params)
    case32 = {k: v.float() if v.is_floating_point() else v for k, v in case.items()}
    got = chunked(LOSSES["score_centering"], case32, (h, w, b), 5)
    assert abs(got[0] - want[0]) <= 1e-5
    for g, r in zip(got[2], want[2]):
        assert float((g.double() - r).abs().max()) <= 1e-5 * max(1.0, float(r.abs().max()))


def test_mismatched_hidden_and_head_are_refused():
    with pytest.raises(ValueError, match=r"hidden \(3, 4\) and head weight \(10, 5\)"):
        HeadLogits(torch.zeros(3, 4), torch.zeros(10, 5))

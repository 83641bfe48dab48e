"""What the loss relies on in SGLang's native /generate (docs/design.md section 8), checked against an
independent float64 transformers forward of the same weights.

Tolerance: the server runs in float32. A float32 forward of this model (4 layers, logits up to
about 7) is itself up to about 2e-5 off float64 in the logits (transformers float32 against
float64, measured), and log_softmax(l / T) moves by at most 2 max|dl| / T; so 5e-5 / T. The
server was measured at most 2e-5 off at T = 0.5. Any semantic difference (another temperature,
log-probs after the filters instead of before, an off-by-one position) is above 1e-2.
"""

from __future__ import annotations

import pytest
import torch

from tests.processes import http

pytestmark = pytest.mark.integration

PROMPT = list(b"The quick brown fox")
# Support checks read the first output position of each prompt only: it depends on the prompt
# alone, so the rows compared (and how close any token lies to a filter's cut-off) are the same
# every run. Later positions follow sampled tokens, and SGLang ignores sampling_seed here.
PROMPTS = [list(b"The quick brown fox"), list(b"hello, world"), list(b"0123456789"), list(b"centerline")]
K = 128


def tolerance(temperature: float) -> float:
    return 5e-5 / temperature


def generate(url: str, body: dict):
    status, out = http("POST", url + "/generate", body)
    assert status == 200, out
    return out


def reference_logprobs(reference, prompt: list[int], output_ids: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) over the whole vocabulary at each output position."""
    logits = reference.default(prompt + output_ids)[len(prompt) - 1 : len(prompt) - 1 + len(output_ids)]
    return torch.log_softmax(logits / temperature, dim=-1)


def reference_support(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> dict[int, float]:
    """SGLang's joint filter (pytorch sampler, layers/sampler.py): the top_k most likely tokens,
    of those each whose preceding cumulative probability is at most top_p, of those each with
    at least min_p times the largest probability; {token: log-prob renormalised over them}."""
    probs = row.exp()
    order = torch.argsort(probs, descending=True).tolist()
    kept, cumulative = [], 0.0
    for rank, token in enumerate(order):
        if rank >= top_k or cumulative > top_p:
            break
        kept.append(token)
        cumulative += float(probs[token])
    kept = [t for t in kept if float(probs[t]) >= min_p * float(probs[order[0]])]
    mass = sum(float(probs[t]) for t in kept)
    return {t: float(torch.log(probs[t] / mass)) for t in kept}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_output_and_top_logprobs_are_log_softmax_of_logits_over_temperature(sglang, reference, temperature):
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "top_logprobs_num": K,
        "sampling_params": {"max_new_tokens": 6, "temperature": temperature, "ignore_eos": True},
    }
    out = generate(sglang.url, body)
    meta, ids, tol = out["meta_info"], out["output_ids"], tolerance(temperature)
    assert (len(ids), meta["completion_tokens"], meta["prompt_tokens"]) == (6, 6, len(PROMPT))
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    ref = reference_logprobs(reference, PROMPT, ids, temperature)
    assert [(token, text) for _, token, text in meta["output_token_logprobs"]] == [(t, None) for t in ids]
    for i, (logprob, token, _) in enumerate(meta["output_token_logprobs"]):
        assert abs(logprob - float(ref[i, token])) < tol
        top = meta["output_top_logprobs"][i]
        values, top_ids = [v for v, _, _ in top], [t for _, t, _ in top]
        assert len(top) == len(set(top_ids)) == K
        assert values == sorted(values, reverse=True)
        assert max(abs(v - float(ref[i, t])) for v, t in zip(values, top_ids)) < tol
        # the K most likely tokens: none left out is likelier than one returned (ties within the tolerance aside)
        left_out = torch.ones_like(ref[i], dtype=torch.bool)
        left_out[top_ids] = False
        assert float(ref[i][left_out].max()) < float(ref[i][top_ids].min()) + 2 * tol


def test_greedy_logprobs_are_log_softmax_of_the_raw_logits(sglang, reference):
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "top_logprobs_num": K,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    }
    out = generate(sglang.url, body)
    ref = reference_logprobs(reference, PROMPT, out["output_ids"], 1.0)
    assert out["output_ids"] == ref.argmax(dim=-1).tolist()
    for i, (logprob, token, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert abs(logprob - float(ref[i, token])) < tolerance(1.0)
        assert max(abs(v - float(ref[i, t])) for v, t, _ in out["meta_info"]["output_top_logprobs"][i]) < tolerance(1.0)


def test_top_k_1_is_greedy_and_its_logprobs_ignore_the_temperature(sglang, reference):
    """A batch of greedy requests (top_k 1) gets log_softmax(logits), whatever temperature it
    states (sampler.py, ``is_all_greedy``): log-probs at T only come with top_k above 1."""
    body = {
        "input_ids": PROMPT,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0.8, "top_k": 1, "ignore_eos": True},
    }
    out = generate(sglang.url, body)
    ref = reference_logprobs(reference, PROMPT, out["output_ids"], 1.0)
    at_temperature = reference_logprobs(reference, PROMPT, out["output_ids"], 0.8)
    assert out["output_ids"] == ref.argmax(dim=-1).tolist()
    for i, (logprob, token, _) in enumerate(out["meta_info"]["output_token_logprobs"]):
        assert abs(logprob - float(ref[i, token])) < tolerance(1.0)
        assert abs(logprob - float(at_temperature[i, token])) > 1e-2


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p"), [(40, 1.0, 0.0), (128, 0.7, 0.0), (64, 0.9, 0.05), (20, 0.5, 0.0), (1, 1.0, 0.0)]
)
@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_support_mode_returns_the_joint_filter_support_renormalised(sglang, reference, prompt, top_k, top_p, min_p):
    temperature = 0.8
    body = {
        "input_ids": PROMPTS[prompt],
        "return_logprob": True,
        "return_sampling_mask": True,
        "sampling_logprobs_mode": "support",
        "sampling_params": {
            "max_new_tokens": 1,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "min_p": min_p,
        },
    }
    out = generate(sglang.url, body)
    meta, (token,) = out["meta_info"], out["output_ids"]
    (mask,), (logprobs,) = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    assert meta["output_token_sampling_mask_length"] == 1
    row = reference_logprobs(reference, PROMPTS[prompt], [token], temperature)[0]
    expected = reference_support(row, top_k, top_p, min_p)
    assert len(mask) == len(logprobs) == len(set(mask)) and set(mask) == set(expected) and token in expected
    assert max(abs(lp - expected[t]) for t, lp in zip(mask, logprobs)) < tolerance(temperature)
    # the sampled token's own log-prob stays the unfiltered one (top_k 1 is greedy: temperature 1, as above)
    unfiltered = row if top_k > 1 else reference_logprobs(reference, PROMPTS[prompt], [token], 1.0)[0]
    assert abs(meta["output_token_logprobs"][0][0] - float(unfiltered[token])) < tolerance(temperature)


@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_selected_mode_returns_the_sampled_tokens_renormalised_logprob(sglang, reference, prompt):
    body = {
        "input_ids": PROMPTS[prompt],
        "return_sampling_mask": True,
        "sampling_logprobs_mode": "selected",
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0, "top_k": 30},
    }
    out = generate(sglang.url, body)
    (token,), meta = out["output_ids"], out["meta_info"]
    expected = reference_support(reference_logprobs(reference, PROMPTS[prompt], [token], 1.0)[0], 30, 1.0, 0.0)
    assert (
        set(meta["output_token_sampling_mask"][0]) == set(expected) and len(meta["output_token_sampling_mask"][0]) == 30
    )
    assert abs(meta["output_token_sampling_logprobs"][0] - expected[token]) < tolerance(1.0)


def test_sampling_mask_without_a_finite_top_k_is_400(sglang):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 2},
        "return_sampling_mask": True,
        "sampling_logprobs_mode": "support",
    }
    assert http("POST", sglang.url + "/generate", body) == (
        400,
        {
            "error": {
                "message": (
                    "return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= 4096; got "
                    "top_k=1073741824. "
                    "Lower top_k or increase --sampling-mask-max-tokens."
                )
            }
        },
    )


def test_sampling_logprobs_mode_other_than_selected_or_support_is_400(sglang):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 2, "top_k": 5},
        "return_sampling_mask": True,
        "sampling_logprobs_mode": "all",
    }
    status, out = http("POST", sglang.url + "/generate", body)
    assert status == 400 and "Input should be 'selected' or 'support'" in out["message"]


def test_prompt_logprobs_from_logprob_start_len_0(sglang, reference):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 1},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
    }
    meta = generate(sglang.url, body)["meta_info"]
    ref = torch.log_softmax(
        reference.default(PROMPT), dim=-1
    )  # prompt positions: temperature 1 (the request's default)
    assert meta["input_token_logprobs"][0] == [None, PROMPT[0], None] and meta["input_top_logprobs"][0] is None
    assert [token for _, token, _ in meta["input_token_logprobs"]] == PROMPT
    for pos in range(1, len(PROMPT)):
        assert abs(meta["input_token_logprobs"][pos][0] - float(ref[pos - 1, PROMPT[pos]])) < tolerance(1.0)
        assert [t for _, t, _ in meta["input_top_logprobs"][pos]] == torch.topk(ref[pos - 1], 3).indices.tolist()


def test_n_and_2d_batches_return_one_object_per_sequence(sglang):
    prompts = [list(b"abc"), list(b"hello there")]
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": 3, "n": 2, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": 4,
    }
    out = generate(sglang.url, body)
    assert isinstance(out, list) and sorted(o["meta_info"]["prompt_tokens"] for o in out) == [3, 3, 11, 11]
    assert len({o["meta_info"]["id"] for o in out}) == 4
    assert all(
        len(o["output_ids"]) == 3 and [len(r) for r in o["meta_info"]["output_top_logprobs"]] == [4] * 3 for o in out
    )
    assert len(generate(sglang.url, {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 3, "n": 2}})) == 2
    assert isinstance(generate(sglang.url, {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 3}}), dict)


def test_stop_token_id_finishes_with_a_stop_reason_naming_it(sglang):
    first = generate(sglang.url, {"text": "The quick", "sampling_params": {"max_new_tokens": 1, "temperature": 0}})[
        "output_ids"
    ][0]
    out = generate(
        sglang.url,
        {"text": "The quick", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "stop_token_ids": [first]}},
    )
    assert (out["output_ids"], out["text"]) == ([first], "")
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}


def test_sampling_seed_is_ignored_without_deterministic_inference(sglang):
    """sampling_seed only seeds the sampler under --enable-deterministic-inference
    (sampling_batch_info.py); on this server two equal requests sample independently (the
    chance that 8 tokens at temperature 1 over 260 agree is far below 1e-6)."""
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 123, "ignore_eos": True},
    }
    assert generate(sglang.url, body)["output_ids"] != generate(sglang.url, body)["output_ids"]

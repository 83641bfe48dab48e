"""Native /generate against an independent forward pass of the same weights."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

pytestmark = pytest.mark.integration

PROMPT = list(b"The quick brown fox")
K = 128
TOL = 1e-5


def generate(tools, engine, body):
    status, out = tools.http("POST", engine.url + "/generate", body)
    assert status == 200, out
    return out


def reference_logprobs(reference, prompt, output_ids, temperature):
    """log_softmax(logits / T) at each output position (T = 1 for greedy, as SGLang)."""
    logits = reference.default(prompt + output_ids)[len(prompt) - 1 : len(prompt) - 1 + len(output_ids)]
    return torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)


def reference_support(logprobs_row, top_k, top_p, min_p):
    """The kept set of SGLang's torch sampler, recomputed here: {token: renormalised log-prob}."""
    probs = logprobs_row.exp()
    order = sorted(range(len(probs)), key=lambda t: -float(probs[t]))
    kept, cumulative = [], 0.0
    for rank, t in enumerate(order):
        if rank >= top_k or cumulative > top_p:
            break
        kept.append(t)
        cumulative += float(probs[t])
    largest = float(probs[order[0]])
    kept = [t for t in kept if float(probs[t]) >= min_p * largest]
    mass = sum(float(probs[t]) for t in kept)
    return {t: float(torch.log(probs[t] / mass)) for t in kept}


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, 1.7])
def test_logprobs_match_log_softmax_of_logits_over_temperature(tools, engine, reference, temperature):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 6, "temperature": temperature, "sampling_seed": 7, "ignore_eos": True},
        "return_logprob": True,
        "top_logprobs_num": K,
    }
    out = generate(tools, engine, body)
    meta, ids = out["meta_info"], out["output_ids"]
    assert len(ids) == 6 and meta["completion_tokens"] == 6 and meta["prompt_tokens"] == len(PROMPT)
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    ref = reference_logprobs(reference, PROMPT, ids, temperature)
    for i, (lp, token, text) in enumerate(meta["output_token_logprobs"]):
        assert token == ids[i] and text is None
        assert abs(lp - float(ref[i, token])) < TOL
        top = meta["output_top_logprobs"][i]
        assert len(top) == K
        top_ids = [t for _, t, _ in top]
        top_lps = [v for v, _, _ in top]
        assert len(set(top_ids)) == K
        assert top_lps == sorted(top_lps, reverse=True)
        assert max(abs(v - float(ref[i, t])) for v, t in zip(top_lps, top_ids)) < TOL
        assert set(top_ids) == set(torch.topk(ref[i], K).indices.tolist())
        if temperature == 0.0:
            assert token == int(ref[i].argmax())


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [(40, 1.0, 0.0), (128, 0.7, 0.0), (64, 0.9, 0.05), (1, 1.0, 0.0)])
def test_support_mode_returns_the_filters_kept_set_renormalised(tools, engine, reference, top_k, top_p, min_p):
    temperature = 0.8
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 5, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                            "min_p": min_p, "sampling_seed": 11, "ignore_eos": True},
        "return_logprob": True,
        "return_sampling_mask": True,
        "sampling_logprobs_mode": "support",
    }  # fmt: skip
    out = generate(tools, engine, body)
    meta, ids = out["meta_info"], out["output_ids"]
    ref = reference_logprobs(reference, PROMPT, ids, temperature)
    masks, lps = meta["output_token_sampling_mask"], meta["output_token_sampling_logprobs"]
    assert len(masks) == len(lps) == len(ids) == meta["output_token_sampling_mask_length"] == 5
    for i, token in enumerate(ids):
        expected = reference_support(ref[i], top_k, top_p, min_p)
        assert set(masks[i]) == set(expected) and len(masks[i]) == len(expected)
        assert token in masks[i]
        assert abs(sum(torch.tensor(lps[i], dtype=torch.float64).exp().tolist()) - 1.0) < TOL
        assert max(abs(v - expected[t]) for t, v in zip(masks[i], lps[i])) < TOL
        assert abs(meta["output_token_logprobs"][i][0] - float(ref[i, token])) < TOL


def test_selected_mode_returns_the_sampled_tokens_renormalised_logprob(tools, engine, reference):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "top_k": 30, "sampling_seed": 5, "ignore_eos": True},
        "return_sampling_mask": True,
        "sampling_logprobs_mode": "selected",
    }
    out = generate(tools, engine, body)
    ref = reference_logprobs(reference, PROMPT, out["output_ids"], 1.0)
    for i, token in enumerate(out["output_ids"]):
        expected = reference_support(ref[i], 30, 1.0, 0.0)
        assert set(out["meta_info"]["output_token_sampling_mask"][i]) == set(expected)
        assert abs(out["meta_info"]["output_token_sampling_logprobs"][i] - expected[token]) < TOL


def test_n_and_2d_batches_return_one_object_per_sequence(tools, engine):
    prompts = [list(b"abc"), list(b"hello there")]
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": 3, "n": 2, "sampling_seed": 1, "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 4}  # fmt: skip
    out = generate(tools, engine, body)
    assert isinstance(out, list) and len(out) == 4
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [3, 3, 11, 11]
    assert len({o["meta_info"]["id"] for o in out}) == 4
    assert all(len(o["output_ids"]) == 3 and len(o["meta_info"]["output_top_logprobs"]) == 3 for o in out)
    single = generate(tools, engine, {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 3, "n": 2}})
    assert isinstance(single, list) and len(single) == 2
    one = generate(tools, engine, {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 3}})
    assert isinstance(one, dict)


def test_same_sampling_seed_gives_the_same_output(tools, engine):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "sampling_seed": 123, "ignore_eos": True},
            "return_logprob": True}  # fmt: skip
    first, second = generate(tools, engine, body), generate(tools, engine, body)
    assert first["output_ids"] == second["output_ids"]
    assert first["meta_info"]["output_token_logprobs"] == second["meta_info"]["output_token_logprobs"]


def test_concurrent_requests_match_the_same_requests_alone(tools, engine):
    bodies = [
        {"input_ids": list(f"prompt number {i}".encode()) * (1 + i % 3),
         "sampling_params": {"max_new_tokens": 6 + i, "sampling_seed": 1000 + i, "ignore_eos": True, "temperature": 0.9},
         "return_logprob": True, "top_logprobs_num": 8}
        for i in range(8)
    ]  # fmt: skip
    alone = [generate(tools, engine, b) for b in bodies]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda b: generate(tools, engine, b), bodies))
    for a, t in zip(alone, together):
        assert a["output_ids"] == t["output_ids"]
        diffs = [abs(x[0] - y[0]) for x, y in zip(a["meta_info"]["output_token_logprobs"], t["meta_info"]["output_token_logprobs"])]
        assert max(diffs) < 1e-9


def test_health_answers_while_a_long_generation_runs(tools, engine):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate, tools, engine, body)
        tools.wait_until(lambda: tools.http("GET", engine.url + "/server_info")[1]["internal_states"][0]["load"] > 0, 30, "load")
        status, _ = tools.http("GET", engine.url + "/health", timeout=2)
        assert status == 200
        assert not running.done()
        assert len(running.result()["output_ids"]) == 400


def test_unknown_sampling_param_is_rejected_with_400(tools, engine):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "bogus": 1}}
    status, out = tools.http("POST", engine.url + "/generate", body)
    assert status == 400
    assert out["error"]["message"].startswith("unknown field `bogus`, expected one of `max_new_tokens`, `stop`")


def test_router_added_top_level_fields_are_accepted(tools, engine):
    body = {
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "model": None, "background": False,
        "stream": False, "log_metrics": True, "return_hidden_states": False, "no_logs": False, "return_bytes": False,
        "return_entropy": False, "return_text_in_logprobs": False, "something_new": {"x": 1},
    }  # fmt: skip
    assert len(generate(tools, engine, body)["output_ids"]) == 2


def test_text_input_and_stop_token_ids_finish_with_a_stop_reason(tools, engine):
    greedy = generate(tools, engine, {"text": "The quick", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    first = greedy["output_ids"][0]
    body = {"text": "The quick", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "stop_token_ids": [first]}}
    out = generate(tools, engine, body)
    assert out["output_ids"] == [first]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert out["text"] == ""


def test_sampling_mask_needs_a_finite_top_k_like_sglang(tools, engine):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "return_sampling_mask": True}
    status, out = tools.http("POST", engine.url + "/generate", body)
    assert status == 400 and "return_sampling_mask requires top_k=1" in out["error"]["message"]


def test_prompt_logprobs_from_logprob_start_len(tools, engine, reference):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 3}  # fmt: skip
    meta = generate(tools, engine, body)["meta_info"]
    ref = torch.log_softmax(reference.default(PROMPT), dim=-1)
    assert meta["input_token_logprobs"][0] == [None, PROMPT[0], None]
    assert meta["input_top_logprobs"][0] is None
    for pos in range(1, len(PROMPT)):
        lp, token, _ = meta["input_token_logprobs"][pos]
        assert token == PROMPT[pos] and abs(lp - float(ref[pos - 1, token])) < TOL

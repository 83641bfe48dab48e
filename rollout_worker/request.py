"""The native /generate training request a worker sends through the proxy (docs/design.md section 7).

The proxy owns the log-prob fields and states every sampling setting the contract fixes; the
worker states its own side, the sampling it was configured with, so a request means the same
whichever proxy or server defaults it meets.
"""

from __future__ import annotations

from shared.config import Config


def sampling(cfg: Config) -> dict:
    """The sampling settings of every training request: temperature, top-p and, when set, top-k."""
    run = cfg.rollout.sampling
    out = {"temperature": run.temperature, "top_p": run.top_p}
    if run.top_k > 0:
        out["top_k"] = run.top_k
    return out


def training_body(cfg: Config, prompt_ids: list[int], n: int) -> dict:
    """The native /generate training request of a prompt's group of ``n`` samples; the proxy adds
    the log-prob fields of the contract."""
    return {
        "input_ids": prompt_ids,
        "sampling_params": {"n": n, "max_new_tokens": cfg.rollout.max_new_tokens, **sampling(cfg)},
    }


def chat_training_body(cfg: Config, prompt: str | list[dict], n: int) -> dict:
    """The same request on ``/v1/chat/completions`` (``--rollout-endpoint chat``): the prompt as one user
    message, or a chat row's messages."""
    return {
        "model": "default",
        "messages": prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}],
        "n": n,
        "max_tokens": cfg.rollout.max_new_tokens,
        **sampling(cfg),
    }


def logprob_fields(cfg: Config) -> dict:
    """What the contract asks SGLang to return: the sampled log-probs and the top-``K`` rows
    (``selected``) or the realized support (``support``). The proxy sets the same again."""
    run = cfg.rollout.sampling
    if run.mode == "selected":
        return {"return_logprob": True, "top_logprobs_num": run.k}
    return {"return_logprob": True, "return_sampling_mask": True, "sampling_logprobs_mode": "support"}


def generate_body(cfg: Config, input_ids: list[int], *, max_new_tokens: int, stop: list[str] | None = None) -> dict:
    """One native /generate of one sample continuing ``input_ids`` (a session's turn)."""
    params = {"n": 1, "max_new_tokens": max_new_tokens, **sampling(cfg)}
    if stop:
        params["stop"] = stop
    return {"input_ids": input_ids, "sampling_params": params, **logprob_fields(cfg)}

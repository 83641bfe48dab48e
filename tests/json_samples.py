"""A worker's samples from SGLang's JSON, parsed here as the proxy parses it: what tests compare the
proxy's binary answer with (the worker itself only ever reads that answer, rollout_worker/packing.py)."""

from __future__ import annotations

from rollout_worker.packing import Sample, samples_from_arrays
from router_proxy import answer, sglang_response
from shared.contract import ContractViolation


class ResponseError(ValueError):
    """A response that cannot be turned into samples; the message names the field."""


def samples_from_response(doc, *, endpoint: str, mode: str, k: int) -> list[Sample]:
    """Every sample of a native (``endpoint="generate"``) or chat response body (parsed JSON): the
    samples of the same arrays as the proxy's binary answer."""
    try:
        metas = sglang_response.response_metas(doc, endpoint)
        found = answer.from_parsed(doc, metas, endpoint, mode=mode, k=k)
    except ContractViolation as exc:
        raise ResponseError(str(exc)) from None
    return samples_from_arrays(found)

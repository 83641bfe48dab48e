"""The proxy's binary answer from SGLang's JSON: ``sglang_response``'s arrays in the batch's dtypes
(``to_wire_dtypes``) with each sample's text, finish reason and versions, as ``ResponseArrays``
(``shared/response_arrays.py``, which a worker decodes). The audit judges them in these dtypes, as
they travel: what it passed is what arrives.
"""

from __future__ import annotations

import numpy as np

from router_proxy import sglang_response, versions
from shared.contract import ContractViolation
from shared.response_arrays import ResponseArrays, cached_count

_INT32 = np.iinfo(np.int32)
# The JSON fields each array comes from, by mode: sampled ids and log-probs, candidate ids, candidate log-probs.
_FIELDS = {
    "selected": ("output_token_logprobs", "output_top_logprobs", "output_top_logprobs"),
    "support": ("output_token_logprobs", "output_token_sampling_mask", "output_token_sampling_logprobs"),
}


def from_parsed(doc, metas: list[dict], endpoint: str, *, mode: str, k: int, arrays=None) -> ResponseArrays:
    """The arrays of a parsed response (``sglang_response.parse_body``'s doc and metas); ``arrays``:
    ``to_wire_dtypes(to_arrays(metas))`` where already built. Raises ``ContractViolation`` as
    ``to_arrays``, ``to_wire_dtypes``, ``response_texts``, ``finish_reasons``, ``weight_versions`` and
    ``token_versions`` do."""
    if arrays is None:
        arrays = to_wire_dtypes(sglang_response.to_arrays(metas, mode=mode, k=k), mode=mode)
    ids, logprobs, _, cand_ids, cand_logprobs, offsets = arrays
    return ResponseArrays(
        texts=sglang_response.response_texts(doc, endpoint),
        finish_reasons=sglang_response.finish_reasons(metas),
        weight_versions=versions.weight_versions(metas),
        prompt_ids=sglang_response.prompt_token_ids(doc) if endpoint == "chat" else None,
        offsets=offsets,
        response_ids=ids,
        sampled_logprobs=logprobs,
        cand_ids=cand_ids,
        cand_logprobs=cand_logprobs,
        cached_tokens=[cached_count(meta.get("cached_tokens")) for meta in metas],
        token_versions=versions.token_versions(metas),
    )


def to_wire_dtypes(arrays: tuple, *, mode: str) -> tuple:
    """``sglang_response.to_arrays``' ``(ids, logprobs, loss_mask, cand_ids, cand_logprobs, offsets)`` with ids
    in int32 and log-probs in float32: the values as they travel, which the audit then judges.

    A value the conversion would change by more than float32 rounding raises ``malformed_response``
    naming its field, sample and row: an id outside int32 (it would wrap), a finite log-prob beyond
    float32's range (it would travel as -inf or inf; -inf is the wire format's mark of an empty
    slot). The first such token row is reported; within it ids before log-probs, the sampled token
    before its candidates.
    """
    ids, logprobs, loss_mask, cand_ids, cand_logprobs, offsets = arrays
    with np.errstate(over="ignore"):  # an overflow is found below, by value
        logprobs32, cand_logprobs32 = logprobs.astype(np.float32), cand_logprobs.astype(np.float32)
    sampled, cand_id_field, cand_lp_field = _FIELDS[mode]
    checks = [
        (ids, _outside_int32(ids), f"{sampled} id"),
        (cand_ids, _outside_int32(cand_ids), f"{cand_id_field} id"),
        (logprobs, _overflows(logprobs, logprobs32), f"{sampled} log-prob"),
        (cand_logprobs, _overflows(cand_logprobs, cand_logprobs32), f"{cand_lp_field} log-prob"),
    ]
    firsts = [
        (int(np.argmax(bad if bad.ndim == 1 else bad.any(axis=1))), n)
        for n, (_, bad, _) in enumerate(checks)
        if bad is not None
    ]
    if firsts:
        i, n = min(firsts)
        values, bad, name = checks[n]
        value = (values[i] if values.ndim == 1 else values[i][bad[i]][0]).item()
        if type(value) is int:
            why = "outside int32, the wire format's id dtype: it would wrap"
        else:
            why = f"beyond float32's range, the wire format's log-prob dtype: it would travel as {'-' * (value < 0)}inf"
        sample = int(np.searchsorted(offsets, i, side="right") - 1)
        row = i - int(offsets[sample])
        raise ContractViolation(
            "malformed_response",
            f"sample {sample} row {row}: {name} {value!r} is {why}",
            sample=sample,
            row=row,
            found=value,
        )
    return ids.astype(np.int32), logprobs32, loss_mask, cand_ids.astype(np.int32), cand_logprobs32, offsets


def _outside_int32(ids: np.ndarray) -> np.ndarray | None:
    """Where ``ids`` (int64) do not fit int32; None where all do (two reductions, no mask, in the usual case)."""
    if ids.size == 0 or (int(ids.min()) >= _INT32.min and int(ids.max()) <= _INT32.max):
        return None
    return (ids < _INT32.min) | (ids > _INT32.max)


def _overflows(wide: np.ndarray, narrow: np.ndarray) -> np.ndarray | None:
    """Where a finite float64 became infinite in float32; None where none did. (-inf stays -inf: empty slots.)"""
    inf = np.isinf(narrow)
    if not inf.any():
        return None
    inf &= np.isfinite(wide)
    return inf if inf.any() else None


def from_body(body: bytes, endpoint: str, *, mode: str, k: int) -> ResponseArrays:
    """The arrays of a response body, unchecked; raises as ``parse_body`` and ``from_parsed`` do."""
    doc, metas = sglang_response.parse_body(body, endpoint, mode=mode, k=k)
    return from_parsed(doc, metas, endpoint, mode=mode, k=k)

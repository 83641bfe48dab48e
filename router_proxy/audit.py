"""A response audited against the completeness contract.

    response bytes -> router_proxy.sglang_response.parse_body (orjson; large candidate rows scanned by
    router_proxy.candidate_scan) -> arrays -> shared.contract.check_rows [-> shared.response_arrays]

The parse is ``router_proxy/sglang_response.py``; an aborted sample is refused before anything
else. Asked with ``arrays=True`` (a worker that accepts the binary answer), a passed audit
also returns the arrays it checked, encoded as the proxy's binary answer: the worker packs
those and never parses the JSON itself. ``centerline bench proxy`` measures the audit against
``orjson.loads`` of the same body.

The audit judges the values as they travel: the arrays are converted to the wire dtypes first
(int32 ids, float32 log-probs; ``answer.to_wire_dtypes`` refuses a value that would not
survive it), and ``check_rows`` runs on those, as the worker's and the trainer's checks do. The
texts and finish reasons the binary answer carries are judged for both answers too, so the
JSON and the binary verdicts are the same (but for a weight version, see ``audit_body``).

Small responses (up to ``SMALL_ENTRIES`` candidates) are first tried by ``quick_accept``, a
pure-Python pass: numpy's fixed cost (array set-up and two dozen whole-array operations)
is many times a short response's own. It only ever *accepts*, and only what
``check_rows`` certainly accepts on the float32 values (exact types, masses and differences with
a margin for float32 rounding and summation order); anything else, defects included, goes the
numpy way, so every verdict and error message comes from ``check_rows``.
``tests/router_proxy/test_audit.py`` checks both agree.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass

import numpy as np
import orjson

from router_proxy import answer
from router_proxy.answer import to_wire_dtypes
from router_proxy.sglang_response import (
    check_not_aborted,
    check_not_clipped,
    finish_reasons,
    malformed,
    parse_body,
    response_texts,
    to_arrays,
)
from shared import response_arrays
from shared.contract import LOGPROB_TOL, MASS_TOL, check_rows

# Rules the proxy adds to shared.contract.RULES for responses that cannot even be read.
PROXY_RULES = {
    "malformed_response": "the upstream body is not the SGLang response shape (bad JSON, wrong types, missing fields)",
    "missing_token_ids": "a chat response carries no token ids (no choices[].meta_info), so it cannot be audited or "
    "trained on",
    "upstream_refused": "the upstream refused the request as it is (400, 413 or 422): the same request would be "
    "refused again",
    "upstream_status": "the upstream answered a training request with an error status",
    "sample_aborted": "the upstream aborted a sample (finish_reason abort): its output is cut off",
    "prompt_over_engine_limit": "the upstream aborted a sample whose prompt its context length or KV pool cannot "
    "hold: the same request would be aborted again",
    "length_clipped": "a sample finished 'length' below the request's max_new_tokens: the upstream lowered the "
    "budget to fit its context length or KV pool, and cut the response short",
    "upstream_too_large": "the upstream's answer exceeded --max-upstream-response-bytes and was cut off",
    "upstream_unreachable": "the upstream could not be reached, broke off its answer, or did not speak HTTP/1.1",
    "vocab_unknown": "the vocabulary size is unknown (no vocab_size from the upstream, no --vocab-size)",
    "k_above_vocab": "the proxy's K is above the model's vocabulary (which takes an SGLang server down): nothing sent",
}

# Up to this many candidate entries, quick_accept's Python loop (~0.3 us an entry) beats numpy's fixed ~60 us.
SMALL_ENTRIES = 256
# quick_accept sums probabilities in another order (and with math.exp) than numpy: it accepts
# only masses this far inside the tolerance, leaving the boundary to check_rows.
_MARGIN = 1e-9
# check_rows judges float32 values; quick_accept reads the float64 ones. _U32 is float32's unit roundoff:
# a row of L entries keeps (2L + 8) * _U32 more margin for its mass (each log-prob's rounding moves its
# probability by at most _U32 * |lp| * p, and sum(p * |lp|) <= max(ln L, 1); numpy's float32 exp is within
# 3 ulp = 6 _U32 of exact, numpy's accuracy tests; any float32 summation order of L terms within (L - 1) _U32),
# and a sampled log-prob's difference to its candidate's keeps _U32 * (|a| + |b|), both roundings.
_U32 = 2.0**-24
_TOL32 = float(np.float32(MASS_TOL))  # the tolerance as check_rows compares float32 differences to it
_FLT_MAX = float(np.finfo(np.float32).max)  # beyond it a log-prob may not survive float32: to_wire_dtypes decides


@dataclass(frozen=True)
class AuditResult:
    """A passed audit: how much was checked."""

    samples: int
    tokens: int
    reply: bytes | None = None  # with audit_body(arrays=True): the binary answer (shared/response_arrays.py)


def audit_body(
    body: bytes,
    *,
    endpoint: str,
    mode: str,
    k: int,
    vocab_size: int,
    content_type: bytes | None = None,
    arrays: bool = False,
    max_new_tokens: int | None = None,
) -> AuditResult:
    """Raise ``ContractViolation`` for the first defect of an upstream response body; else say what was checked
    and, with ``arrays``, return the response as the binary answer (``shared/response_arrays.py``;
    a weight version that is not one, or ``meta_info.weight_versions`` spans that do not cover the
    sample's tokens, raise ``malformed_response`` then: they cannot be put in it).

    ``max_new_tokens``, the request's length budget when it stated one: a length finish below it was
    cut short by the upstream (``length_clipped``).
    ``content_type``, when given, must be JSON: SGLang answers ``application/json``, and a
    client must not be handed another media type as a training response.
    The cyclic GC is paused meanwhile: a long response parses into ~N*K small lists (none
    cyclic, all freed by refcount on return), and GC passes over them cost more than the parse.
    """
    if content_type is not None and content_type.split(b";", 1)[0].strip().lower() != b"application/json":
        shown = content_type[:80].decode("latin-1") or "none"
        raise malformed(f"the upstream answered content-type {shown!r}, expected application/json")
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _audit(body, endpoint, mode, k, vocab_size, arrays, max_new_tokens)
    finally:
        if enabled:
            gc.enable()


def _audit(
    body: bytes, endpoint: str, mode: str, k: int, vocab_size: int, arrays: bool, max_new_tokens: int | None
) -> AuditResult:
    try:
        doc, metas = parse_body(body, endpoint, mode=mode, k=k)
    except orjson.JSONDecodeError as exc:
        raise malformed(f"the upstream body is not valid JSON ({exc})") from None
    check_not_aborted(metas)
    check_not_clipped(metas, max_new_tokens)
    response_texts(doc, endpoint)  # what the binary answer carries besides the arrays, judged for both answers
    finish_reasons(metas)
    tokens = quick_accept(metas, mode=mode, k=k, vocab_size=vocab_size)
    if tokens is None:
        built = checked_arrays(metas, mode=mode, k=k, vocab_size=vocab_size)
        tokens = int(built[0].shape[0])
    elif arrays:
        built = to_wire_dtypes(to_arrays(metas, mode=mode, k=k), mode=mode)
    if not arrays:
        return AuditResult(samples=len(metas), tokens=tokens)
    answered = answer.from_parsed(doc, metas, endpoint, mode=mode, k=k, arrays=built)
    try:
        reply = response_arrays.encode(answered)
    except OverflowError as exc:  # msgpack: an int beyond 64 bits
        raise malformed(f"the response cannot be put in arrays ({exc})") from None
    return AuditResult(samples=len(metas), tokens=tokens, reply=reply)


def checked_arrays(metas: list[dict], *, mode: str, k: int, vocab_size: int) -> tuple:
    """``to_arrays(metas)`` in the wire dtypes (``to_wire_dtypes``) once ``check_rows`` passed them as such;
    raises the first defect."""
    arrays = to_wire_dtypes(to_arrays(metas, mode=mode, k=k), mode=mode)
    check_rows(*arrays[:5], mode=mode, k=k, vocab_size=vocab_size, offsets=arrays[5])
    return arrays


def quick_accept(metas: list[dict], *, mode: str, k: int, vocab_size: int) -> int | None:
    """The token count if the samples certainly pass ``check_rows``; None when large, unusual or defective.

    Accepted entries are exactly ``[float logprob, int id(, text)]`` (orjson never yields a
    non-finite float), ids in ``[0, vocab)``, no duplicates, log-probs in ``[-FLT_MAX, LOGPROB_TOL]``
    (so finite in float32 too). Selected mode: each row holds ``min(K, vocab)`` candidates,
    mass <= 1 + tol, and the sampled token, when in its row, has the same log-prob within tol.
    Support mode: rows of 1..K ids with parallel log-probs, mass 1 within tol, the sampled token
    in the row (its log-prob is then the row's, see ``_support_sampled_logprobs``). Masses and
    differences keep the float32 margins above, so what passes here passes ``check_rows`` on
    the float32 values.
    A plain loop: ``set(map(type, ...))`` and friends measured slower on rows this short.
    """
    selected = mode == "selected"
    need = min(k, vocab_size)
    budget, tokens = SMALL_ENTRIES, 0
    exp, low = math.exp, -_FLT_MAX
    top = 1 + MASS_TOL - _MARGIN - (2 * need + 8) * _U32  # selected rows: all of width need
    match_tol = _TOL32 - _MARGIN
    try:
        for meta in metas:
            sampled = meta.get("output_token_logprobs")
            rows = meta.get("output_top_logprobs" if selected else "output_token_sampling_mask")
            lp_rows = rows if selected else meta.get("output_token_sampling_logprobs")
            if (
                type(sampled) is not list
                or type(rows) is not list
                or type(lp_rows) is not list
                or not len(sampled) == len(rows) == len(lp_rows)
            ):
                return None
            for (lp, token, _), row, lp_row in zip(
                sampled, rows, lp_rows
            ):  # [logprob, id, text]: 3 items, else ValueError
                if type(row) is not list or type(lp_row) is not list or len(row) != len(lp_row):
                    return None
                budget -= len(row)
                if budget < 0 or (len(row) != need if selected else not 0 < len(row) <= k):
                    return None
                if (
                    type(lp) is not float
                    or type(token) is not int
                    or not 0 <= token < vocab_size
                    or lp < low
                    or (selected and lp > LOGPROB_TOL)
                ):
                    return None
                seen, mass = {}, 0.0  # id -> log-prob; fewer entries than the row means a duplicate
                for clp, cid, _ in (
                    row if selected else zip(lp_row, row, row)
                ):  # selected: exactly 3 items, else ValueError
                    if (
                        type(clp) is not float
                        or type(cid) is not int
                        or not 0 <= cid < vocab_size
                        or not low <= clp <= LOGPROB_TOL
                    ):
                        return None
                    seen[cid] = clp
                    mass += exp(clp)
                if len(seen) != len(row):
                    return None
                if selected:
                    hit = seen.get(token)
                    if mass > top or (hit is not None and abs(hit - lp) + (abs(hit) + abs(lp)) * _U32 > match_tol):
                        return None
                elif abs(mass - 1) > MASS_TOL - _MARGIN - (2 * len(row) + 8) * _U32 or token not in seen:
                    return None  # (in the row, the sampled log-prob is the row's own: _support_sampled_logprobs)
            tokens += len(sampled)
    except (TypeError, ValueError):  # an entry that is not a [logprob, id, text] list: the numpy path names the defect
        return None
    return tokens

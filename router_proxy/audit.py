"""A response audited against the completeness contract (DESIGN sections 5 and 7).

    response bytes -> orjson -> flat Python lists -> numpy [N] / [N, K] -> shared.contract.check_rows

Every sample of a response (a native object, a native list for batches or n > 1, or the
choices of a chat completion with ``return_meta_info``) becomes one sample of the arrays.
Sampled tokens come from ``meta_info.output_token_logprobs`` ([logprob, id, text] per token);
candidates from ``output_top_logprobs`` (selected mode) or ``output_token_sampling_mask`` +
``output_token_sampling_logprobs`` (support mode). A missing candidate field becomes empty
rows, so the contract reports it as ``short_row`` / ``support_mass`` with its likely cause.

The conversion never loops over tokens in Python bytecode: each nested list is flattened
with ``itertools.chain`` (C), types are checked with ``set(map(type, ...))`` (C), and numpy
builds the arrays from flat lists. ``centerline bench proxy`` measures it against
``orjson.loads`` of the same body.

Small responses (up to ``SMALL_ENTRIES`` candidates) are first tried by ``quick_accept``, a
pure-Python pass: numpy's fixed cost (~60 us of array set-up and two dozen whole-array
operations) is ten times a short response's own. It only ever *accepts*, and only what
``check_rows`` certainly accepts (exact types, mass with a margin for summation order);
anything else, defects included, goes the numpy way, so every verdict and error message
comes from ``check_rows``. ``tests/router_proxy/test_audit.py`` checks both agree.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass
from itertools import chain

import numpy as np
import orjson

from shared.contract import LOGPROB_TOL, MASS_TOL, ContractViolation, check_rows

# Rules the proxy adds to shared.contract.RULES for responses that cannot even be read.
PROXY_RULES = {
    "malformed_response": "the upstream body is not the SGLang response shape (bad JSON, wrong types, missing fields)",
    "missing_token_ids": "a chat response carries no token ids (no choices[].meta_info), so it cannot be audited or trained on",
    "upstream_refused": "the upstream refused the request as it is (400, 413 or 422): the same request would be refused again",
    "upstream_status": "the upstream answered a training request with an error status",
    "sample_aborted": "the upstream aborted a sample (finish_reason abort): its output is cut off",
    "upstream_too_large": "the upstream's answer exceeded --max-upstream-response-bytes and was cut off",
    "upstream_unreachable": "the upstream could not be reached, broke off its answer, or did not speak HTTP/1.1",
    "vocab_unknown": "the vocabulary size is unknown (no vocab_size from the upstream, no --vocab-size)",
}

_NUMBER = {float, int}
_INT = {int}

# Up to this many candidate entries, quick_accept's Python loop (~0.3 us an entry) beats numpy's fixed ~60 us.
SMALL_ENTRIES = 256
# quick_accept sums probabilities in another order (and with math.exp) than numpy: it accepts
# only masses this far inside the tolerance, leaving the boundary to check_rows.
_MARGIN = 1e-9


@dataclass(frozen=True)
class AuditResult:
    """A passed audit: how much was checked."""

    samples: int
    tokens: int


def malformed(message: str) -> ContractViolation:
    return ContractViolation("malformed_response", message)


def audit_body(body: bytes, *, endpoint: str, mode: str, k: int, vocab_size: int, content_type: bytes | None = None) -> AuditResult:
    """Raise ``ContractViolation`` for the first defect of an upstream response body; else say what was checked.

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
        return _audit(body, endpoint, mode, k, vocab_size)
    finally:
        if enabled:
            gc.enable()


def _audit(body: bytes, endpoint: str, mode: str, k: int, vocab_size: int) -> AuditResult:
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise malformed(f"the upstream body is not valid JSON ({exc})") from None
    metas = chat_metas(doc) if endpoint == "chat" else native_metas(doc)
    check_not_aborted(metas)
    tokens = quick_accept(metas, mode=mode, k=k, vocab_size=vocab_size)
    if tokens is not None:
        return AuditResult(samples=len(metas), tokens=tokens)
    return full_audit(metas, mode=mode, k=k, vocab_size=vocab_size)


def full_audit(metas: list[dict], *, mode: str, k: int, vocab_size: int) -> AuditResult:
    """The numpy way: arrays, then ``check_rows``; raises the first defect."""
    arrays = to_arrays(metas, mode=mode, k=k)
    check_rows(*arrays[:5], mode=mode, k=k, vocab_size=vocab_size, offsets=arrays[5])
    return AuditResult(samples=len(metas), tokens=int(arrays[0].shape[0]))


def quick_accept(metas: list[dict], *, mode: str, k: int, vocab_size: int) -> int | None:
    """The token count if the samples certainly pass ``check_rows``; None when large, unusual or defective.

    Accepted entries are exactly ``[float logprob, int id(, text)]`` (orjson never yields a
    non-finite float), ids in ``[0, vocab)``, no duplicates, log-probs <= ``LOGPROB_TOL``.
    Selected mode: each row holds ``min(K, vocab)`` candidates, mass <= 1 + tol, and the
    sampled token, when in its row, has the same log-prob within tol. Support mode: rows of
    1..K ids with parallel log-probs, mass 1 within tol, the sampled token in the row (its
    log-prob is then the row's, see ``_support_sampled_logprobs``).
    A plain loop: ``set(map(type, ...))`` and friends measured slower on rows this short.
    """
    selected = mode == "selected"
    need = min(k, vocab_size)
    budget, tokens = SMALL_ENTRIES, 0
    exp, top = math.exp, 1 + MASS_TOL - _MARGIN
    try:
        for meta in metas:
            sampled = meta.get("output_token_logprobs")
            rows = meta.get("output_top_logprobs" if selected else "output_token_sampling_mask")
            lp_rows = rows if selected else meta.get("output_token_sampling_logprobs")
            if type(sampled) is not list or type(rows) is not list or type(lp_rows) is not list or not len(sampled) == len(rows) == len(lp_rows):
                return None
            for (lp, token, _), row, lp_row in zip(sampled, rows, lp_rows):  # [logprob, id, text]: 3 items, else ValueError
                if type(row) is not list or type(lp_row) is not list or len(row) != len(lp_row):
                    return None
                budget -= len(row)
                if budget < 0 or (len(row) != need if selected else not 0 < len(row) <= k):
                    return None
                if type(lp) is not float or type(token) is not int or not 0 <= token < vocab_size or (selected and lp > LOGPROB_TOL):
                    return None
                seen, mass = {}, 0.0  # id -> log-prob; fewer entries than the row means a duplicate
                for clp, cid, _ in row if selected else zip(lp_row, row, row):  # selected: exactly 3 items, else ValueError
                    if type(clp) is not float or type(cid) is not int or not 0 <= cid < vocab_size or clp > LOGPROB_TOL:
                        return None
                    seen[cid] = clp
                    mass += exp(clp)
                if len(seen) != len(row):
                    return None
                if selected:
                    hit = seen.get(token)
                    if mass > top or (hit is not None and abs(hit - lp) > MASS_TOL):
                        return None
                elif abs(mass - 1) > MASS_TOL - _MARGIN or token not in seen:
                    return None  # (in the row, the sampled log-prob is the row's own: _support_sampled_logprobs)
            tokens += len(sampled)
    except (TypeError, ValueError):  # an entry that is not a [logprob, id, text] list: the numpy path names the defect
        return None
    return tokens


def check_not_aborted(metas: list[dict]) -> None:
    """SGLang answers an aborted sample (server shutting down, requests aborted for a weight
    update) with 200 and the output so far: a cut-off sample, never to be trained as complete."""
    for i, meta in enumerate(metas):
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            raise ContractViolation("sample_aborted", f"sample {i} was aborted by the upstream ({reason.get('message')!r}), its output "
                                    "cut off; the request may be retried", sample=i)  # fmt: skip


def native_metas(doc) -> list[dict]:
    """The ``meta_info`` of each sample of a native /generate response (an object, or a list of them)."""
    items = doc if isinstance(doc, list) else [doc]
    metas = []
    for i, item in enumerate(items):
        meta = item.get("meta_info") if isinstance(item, dict) else None
        if not isinstance(meta, dict):
            raise malformed(f"sample {i} has no meta_info object")
        metas.append(meta)
    if not metas:
        raise malformed("the response holds no samples")
    return metas


def chat_metas(doc) -> list[dict]:
    """The native ``meta_info`` of each choice of a chat completion (requested with ``return_meta_info``)."""
    choices = doc.get("choices") if isinstance(doc, dict) else None
    if not isinstance(choices, list) or not choices:
        raise malformed("the chat response has no choices list")
    metas = []
    for i, choice in enumerate(choices):
        if not isinstance(choice, dict):
            raise malformed(f"choices[{i}] is not an object")
        meta = choice.get("meta_info")
        if meta is None:
            raise ContractViolation(
                "missing_token_ids",
                f"choices[{i}] has no meta_info, so the response carries no token ids (chat logprobs name tokens by text only); "
                "the router probably dropped return_meta_info. Use --rollout-endpoint generate or a router that keeps it; run `centerline probe`",
                sample=i,
            )
        if not isinstance(meta, dict):
            raise malformed(f"choices[{i}].meta_info is not an object")
        metas.append(meta)
    return metas


def to_arrays(metas: list[dict], *, mode: str, k: int):
    """``(response_ids, sampled_logprobs, loss_mask, cand_ids [N, K], cand_logprobs [N, K], offsets)`` of the samples."""
    sampled_rows = [_field(m, "output_token_logprobs", i, required=True) for i, m in enumerate(metas)]
    lengths = [len(rows) for rows in sampled_rows]
    offsets = np.zeros(len(metas) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    n = int(offsets[-1])
    logprobs, ids = _entries(list(chain.from_iterable(sampled_rows)), "output_token_logprobs")

    if mode == "selected":
        rows = _rows(metas, "output_top_logprobs", lengths)
        counts = _counts(rows, "output_top_logprobs")
        cand_lp, cand_id = _entries(list(chain.from_iterable(rows)), "output_top_logprobs")
    else:
        rows = _rows(metas, "output_token_sampling_mask", lengths)
        lp_rows = _rows(metas, "output_token_sampling_logprobs", lengths)
        counts = _counts(rows, "output_token_sampling_mask")
        if counts.tolist() != _counts(lp_rows, "output_token_sampling_logprobs").tolist():
            raise malformed("output_token_sampling_mask and output_token_sampling_logprobs differ in row lengths")
        cand_id = _column(list(chain.from_iterable(rows)), _INT, np.int64, "output_token_sampling_mask")
        cand_lp = _column(list(chain.from_iterable(lp_rows)), _NUMBER, np.float64, "output_token_sampling_logprobs")

    widest = int(counts.max()) if n else 0
    if widest > k:
        row = int(np.argmax(counts))
        raise ContractViolation("shape", f"row {row} holds {widest} candidates, more than K={k}", row=row, expected=k, found=widest)
    if n and widest == k and int(counts.min()) == k:
        cand_ids, cand_logprobs = cand_id.reshape(n, k), cand_lp.reshape(n, k)
    else:  # short rows: fill the leading slots, the rest stay empty (-1 / -inf) for check_rows to judge
        cand_ids = np.full((n, k), -1, np.int64)
        cand_logprobs = np.full((n, k), -np.inf, np.float64)
        filled = np.arange(k) < counts[:, None]
        cand_ids[filled] = cand_id
        cand_logprobs[filled] = cand_lp
    if mode == "support":
        logprobs = _support_sampled_logprobs(ids, logprobs, cand_ids, cand_logprobs)
    return ids, logprobs, np.ones(n, bool), cand_ids, cand_logprobs, offsets


def _support_sampled_logprobs(ids, logprobs, cand_ids, cand_logprobs) -> np.ndarray:
    """In support mode the sampled token's log-prob is its support (renormalised) one.

    SGLang's ``output_token_logprobs`` is log_softmax(logits / T) before the top-k/top-p
    filter (not renormalised), while the support row is the filtered, renormalised
    distribution that was actually sampled; comparing the two would fail every filtered row.
    The unfiltered value must still be a finite log-prob.
    """
    bad = ~np.isfinite(logprobs)
    if bad.any():
        i = int(np.argmax(bad))
        raise ContractViolation("non_finite", f"row {i} sampled log-prob is {logprobs[i]}; the sampler produced NaN/inf", row=i)
    match = cand_ids == ids[:, None]
    return np.where(match.any(axis=1), np.where(match, cand_logprobs, 0.0).sum(axis=1), logprobs)


def _field(meta: dict, name: str, sample: int, *, required: bool):
    value = meta.get(name)
    if value is None:
        if required:
            raise malformed(f"sample {sample}: meta_info.{name} is missing (was return_logprob dropped?)")
        return None
    if not isinstance(value, list):
        raise malformed(f"sample {sample}: meta_info.{name} is {type(value).__name__}, expected a list")
    return value


def _rows(metas: list[dict], name: str, lengths: list[int]) -> list:
    """The per-token rows of ``name`` over all samples; a missing field is empty rows (judged by the contract)."""
    out = []
    for i, (meta, n) in enumerate(zip(metas, lengths)):
        rows = _field(meta, name, i, required=False)
        if rows is None:
            rows = [[]] * n
        elif len(rows) != n:
            raise malformed(f"sample {i}: meta_info.{name} has {len(rows)} rows for {n} output tokens")
        out.append(rows)
    return list(chain.from_iterable(out))


def _counts(rows: list, name: str) -> np.ndarray:
    if None in rows:  # SGLang writes null for a position without top-logprobs: no candidates
        rows[:] = [[] if r is None else r for r in rows]
    if not set(map(type, rows)) <= {list}:
        raise malformed(f"meta_info.{name} rows must be lists")
    return np.fromiter(map(len, rows), np.int64, len(rows))


def _entries(entries: list, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Log-probs (float64) and ids (int64) of ``[logprob, id, text]`` entries."""
    if not entries:
        return np.zeros(0, np.float64), np.zeros(0, np.int64)
    try:  # entries that are not lists fail here or land non-numbers in the typed columns below
        widths = set(map(len, entries))
    except TypeError:
        raise malformed(f"meta_info.{name} entries must be [logprob, id, text] lists") from None
    if len(widths) != 1 or not {2, 3} >= widths:
        raise malformed(f"meta_info.{name} entries must be [logprob, id, text], found lengths {sorted(widths)[:4]}")
    flat = list(chain.from_iterable(entries))
    width = widths.pop()
    return _column(flat[0::width], _NUMBER, np.float64, name + " log-probs"), _column(flat[1::width], _INT, np.int64, name + " ids")


def _column(values: list, allowed: set, dtype, name: str) -> np.ndarray:
    """``values`` as a numpy array, after checking the exact Python types (no bool, str or null slips through)."""
    found = set(map(type, values))
    if not found <= allowed:
        bad = sorted(t.__name__ for t in found - allowed)
        raise malformed(f"{name} hold {', '.join(bad)} values, expected {' or '.join(sorted(t.__name__ for t in allowed))}")
    try:
        return np.array(values, dtype=dtype)
    except OverflowError:
        raise malformed(f"{name} hold a number out of range") from None

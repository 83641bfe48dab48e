"""SGLang responses parsed once, by the proxy: it audits what this returns and hands a worker
the same arrays (``shared/response_arrays.py``), so nobody parses a response twice.

    parsed JSON -> per-sample meta_info -> flat Python lists -> numpy [N] / [N, K]

Every sample of a response (a native object, a native list for batches or ``n > 1``, or the
choices of a chat completion asked with ``return_meta_info``) becomes one sample of the
arrays, ``offsets[i]:offsets[i+1]`` its tokens. Sampled tokens come from
``meta_info.output_token_logprobs`` ([logprob, id, text] per token); candidates from
``output_top_logprobs`` (selected mode) or ``output_token_sampling_mask`` +
``output_token_sampling_logprobs`` (support mode). A missing candidate field becomes empty
rows and a ``null`` row no candidates, so the contract reports it (``short_row``,
``support_mass``) with its likely cause; nothing is padded into a full row or repaired.
Besides the arrays: each sample's finish reason and text, and a chat response's prompt ids; each
sample's and each token's weight version are read by ``router_proxy/versions.py``.

The conversion never loops over tokens in Python bytecode: each nested list is flattened
with ``itertools.chain`` (C), types are checked with ``set(map(type, ...))`` (C), and numpy
builds the arrays from flat lists. Defects of shape raise ``ContractViolation``
(``malformed_response``, ``missing_token_ids``, ``sample_aborted``, ``shape``).
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import orjson

from router_proxy import candidate_scan
from shared.contract import ContractViolation

# Bodies from this size on have their candidate rows scanned (router_proxy/candidate_scan.py); below it
# numpy's fixed costs outweigh the objects orjson would build.
SCAN_MIN_BYTES = 64 << 10

_NUMBER = {float, int}
_INT = {int}


def malformed(message: str) -> ContractViolation:
    return ContractViolation("malformed_response", message)


def parse_body(body: bytes, endpoint: str, *, mode: str, k: int) -> tuple[object, list[dict]]:
    """``orjson.loads(body)`` and its samples' ``meta_info`` (``response_metas``), raising as they do.

    In selected mode a large body's ``output_top_logprobs`` are read by ``router_proxy.candidate_scan``
    and stand in the metas as ``Scanned`` arrays, which ``to_arrays`` takes as they are; the
    rest of the body is parsed by orjson. Whenever the scan cannot vouch for every sample
    (another layout, a key in a string, a duplicate key), the whole body is parsed by orjson:
    either way the arrays and every error are the same.
    """
    if mode == "selected" and len(body) >= SCAN_MIN_BYTES:
        found = candidate_scan.cut(body, k)
        if found is not None:
            parsed = _with_scanned(*found, endpoint)
            if parsed is not None:
                return parsed
    doc = orjson.loads(body)
    return doc, response_metas(doc, endpoint)


def _with_scanned(rest: bytes, scanned: list, endpoint: str):
    """The remainder's doc and metas with cut ``i`` put back at sample ``i``; None unless each sample has its own."""
    try:
        doc = orjson.loads(rest)
        metas = response_metas(doc, endpoint)
    except (orjson.JSONDecodeError, ContractViolation):
        return None
    if len(metas) != len(scanned):
        return None
    for i, meta in enumerate(metas):
        if candidate_scan.marker_index(meta.get("output_top_logprobs")) != i:
            return None
    for meta, rows in zip(metas, scanned):
        meta["output_top_logprobs"] = rows
    return doc, metas


def response_metas(doc, endpoint: str) -> list[dict]:
    """The ``meta_info`` of each sample of a parsed native (``endpoint="generate"``) or chat response."""
    return chat_metas(doc) if endpoint == "chat" else native_metas(doc)


def response_texts(doc, endpoint: str) -> list[str]:
    """Each sample's decoded text (what rewards read), in sample order; "" where absent or null.

    Native ``text``, chat ``message.content``: a string, or null or absent (chat: a message
    without content). Any other type raises ``malformed_response``: it would reach the worker as
    "" and be rewarded as an empty answer.
    """
    if endpoint == "chat":
        texts = []
        for i, choice in enumerate(doc["choices"]):
            message = choice.get("message")
            if message is not None and not isinstance(message, dict):
                raise malformed(f"choices[{i}].message is {type(message).__name__}, expected an object")
            texts.append(_text((message or {}).get("content"), f"choices[{i}].message.content"))
        return texts
    items = doc if isinstance(doc, list) else [doc]
    return [_text(item.get("text"), f"sample {i}: text") for i, item in enumerate(items)]


def prompt_token_ids(doc) -> list[int] | None:
    """The prompt ids SGLang sampled a chat response on (``choices[0].prompt_token_ids``, asked for
    by the proxy with ``return_prompt_token_ids``), None where absent or not a list of token ids."""
    choices = doc.get("choices") if isinstance(doc, dict) else None
    first = choices[0] if isinstance(choices, list) and choices else None
    ids = first.get("prompt_token_ids") if isinstance(first, dict) else None
    if not isinstance(ids, list) or not ids or not all(type(i) is int and 0 <= i < 2**31 for i in ids):
        return None
    return ids


def _text(value, name: str) -> str:
    if value is None:
        return ""
    if type(value) is not str:
        raise malformed(f"{name} is {type(value).__name__}, expected a string or null")
    return value


# SGLang's finish reasons (schedule_batch.py, FINISH_*.to_json): {"type": "stop", "matched": ...},
# {"type": "length", "length": N}, {"type": "abort", "message": ...}; null while unfinished.
FINISH_TYPES = ("stop", "length", "abort")
_FINISH_SHAPE = '{"type": ' + " | ".join(f'"{t}"' for t in FINISH_TYPES) + ", ...}"


def finish_reasons(metas: list[dict]) -> list[str | None]:
    """Each sample's ``finish_reason.type`` (``stop``, ``length``, ``abort``), None while unfinished.

    A finish reason is null or an object whose ``type`` is one of ``FINISH_TYPES``; anything
    else raises ``malformed_response``. The type is what travels (the binary answer's
    ``finish_reasons``); the object's other keys do not and are not judged.
    """
    out = []
    for i, meta in enumerate(metas):
        reason = meta.get("finish_reason")
        if reason is None:
            out.append(None)
        elif isinstance(reason, dict) and type(reason.get("type")) is str and reason["type"] in FINISH_TYPES:
            out.append(reason["type"])
        else:
            raise malformed(
                f"sample {i}: meta_info.finish_reason is {repr(reason)[:80]}, expected null or SGLang's object "
                f"{_FINISH_SHAPE}"
            )
    return out


def check_not_aborted(metas: list[dict]) -> None:
    """SGLang answers an aborted sample (server shutting down, requests aborted for a weight
    update) with 200 and the output so far: a cut-off sample, never to be trained as complete."""
    for i, meta in enumerate(metas):
        reason = meta.get("finish_reason")
        if isinstance(reason, dict) and reason.get("type") == "abort":
            message = reason.get("message")
            if isinstance(message, str) and any(m in message for m in ENGINE_LIMIT_ABORTS):
                raise ContractViolation(
                    "prompt_over_engine_limit",
                    f"sample {i} was aborted by the upstream ({message!r}): the prompt does not fit the engine's "
                    "context length or KV pool, and never will; start SGLang with a larger --context-length or KV "
                    "pool (--mem-fraction-static, --max-total-tokens), or lower --rollout-session-max-tokens",
                    sample=i,
                )
            raise ContractViolation(
                "sample_aborted",
                f"sample {i} was aborted by the upstream ({reason.get('message')!r}), its output "
                "cut off; the request may be retried",
                sample=i,
            )


# SGLang's abort messages for a prompt its server cannot hold at all (scheduler.py, managers/utils.py): the
# same request is aborted again on every attempt.
ENGINE_LIMIT_ABORTS = ("exceeds the KV memory budget", "exceeds the maximum allowed length")


def check_not_clipped(metas: list[dict], max_new_tokens: int | None) -> None:
    """A sample that finished ``length`` ended at the budget the request asked for. SGLang lowers a
    request's ``max_new_tokens`` without a word where the prompt leaves less room in its context length
    or KV pool (``--allow-auto-truncate``, ``SGLANG_MAX_NEW_TOKENS_LIMIT`` too), and its length finish
    then states the lowered budget: a response cut short by the engine, not by the run's settings."""
    if max_new_tokens is None:
        return
    for i, meta in enumerate(metas):
        reason = meta.get("finish_reason")
        if not isinstance(reason, dict) or reason.get("type") != "length":
            continue
        length = reason.get("length")
        if type(length) is int and length < max_new_tokens:
            raise ContractViolation(
                "length_clipped",
                f"sample {i} finished 'length' at {length} tokens, below the request's max_new_tokens "
                f"{max_new_tokens}: the engine lowered the budget to what its context length or KV pool leaves "
                "after the prompt; start SGLang with a larger --context-length or KV pool "
                "(--mem-fraction-static, --max-total-tokens), or lower --rollout-max-new-tokens / "
                "--rollout-session-max-tokens",
                sample=i,
                expected=max_new_tokens,
                found=length,
            )


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
                f"choices[{i}] has no meta_info, so the response carries no token ids (chat logprobs name tokens by "
                "text only); "
                "the router probably dropped return_meta_info. Use --rollout-endpoint generate or a router that keeps "
                "it; run `centerline probe`",
                sample=i,
            )
        if not isinstance(meta, dict):
            raise malformed(f"choices[{i}].meta_info is not an object")
        metas.append(meta)
    return metas


def to_arrays(metas: list[dict], *, mode: str, k: int):
    """``(response_ids, sampled_logprobs, loss_mask, cand_ids [N, K], cand_logprobs [N, K], offsets)`` of the
    samples."""
    sampled_rows = [_field(m, "output_token_logprobs", i, required=True) for i, m in enumerate(metas)]
    lengths = [len(rows) for rows in sampled_rows]
    offsets = np.zeros(len(metas) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    n = int(offsets[-1])
    logprobs, ids = _entries(list(chain.from_iterable(sampled_rows)), "output_token_logprobs")

    scanned = [m.get("output_top_logprobs") for m in metas] if mode == "selected" else []
    if scanned and all(isinstance(s, candidate_scan.Scanned) and s.ids.shape[1] == k for s in scanned):
        # rows of exactly K, read by parse_body: what the lists below would give
        for i, (rows, length) in enumerate(zip(scanned, lengths)):
            if len(rows) != length:
                raise malformed(
                    f"sample {i}: meta_info.output_top_logprobs has {len(rows)} rows for {length} output tokens"
                )
        cand_ids = np.concatenate([s.ids for s in scanned])
        cand_logprobs = np.concatenate([s.logprobs for s in scanned])
        return ids, logprobs, np.ones(n, bool), cand_ids, cand_logprobs, offsets
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
        raise ContractViolation(
            "shape", f"row {row} holds {widest} candidates, more than K={k}", row=row, expected=k, found=widest
        )
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
        raise ContractViolation(
            "non_finite", f"row {i} sampled log-prob is {logprobs[i]}; the sampler produced NaN/inf", row=i
        )
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
    return _column(flat[0::width], _NUMBER, np.float64, name + " log-probs"), _column(
        flat[1::width], _INT, np.int64, name + " ids"
    )


def _column(values: list, allowed: set, dtype, name: str) -> np.ndarray:
    """``values`` as a numpy array, after checking the exact Python types (no bool, str or null slips through)."""
    found = set(map(type, values))
    if not found <= allowed:
        bad = sorted(t.__name__ for t in found - allowed)
        raise malformed(
            f"{name} hold {', '.join(bad)} values, expected {' or '.join(sorted(t.__name__ for t in allowed))}"
        )
    try:
        return np.array(values, dtype=dtype)
    except OverflowError:
        raise malformed(f"{name} hold a number out of range") from None

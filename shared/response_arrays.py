"""An audited SGLang response as the arrays a rollout worker packs: the proxy's binary answer.

    training request with  Accept: application/x-centerline-arrays
    -> the proxy parses and audits SGLang's JSON once -> ResponseArrays -> encode (shared/msgpack_arrays.py)
    -> Content-Type: application/x-centerline-arrays -> the worker decodes: views, no parse

A client that does not name this media type in ``Accept`` gets SGLang's JSON bytes unchanged.
The message is one msgpack map in the array encoding of the wire format (``shared/msgpack_arrays.py``,
docs/design.md section 4); it holds what ``rollout_worker/packing.py`` reads and nothing else:

| field | type | meaning |
|---|---|---|
| ``v`` | int | 1 |
| ``texts`` | list[str] | each sample's decoded text ("" where absent), what rewards read |
| ``finish_reasons`` | list[str or nil] | each sample's ``finish_reason.type`` |
| ``weight_versions`` | list[int] | each sample's weight version (SGLang's ``"default"`` is 0) |
| ``cached_tokens`` | list[int or nil] or absent | each sample's prompt tokens SGLang's prefix cache served |
| ``token_versions`` | int32 [N] or absent | each token's weight version (SGLang's spans, ``token_versions``) |
| ``prompt_ids`` | int32 [P] or nil | chat: the prompt ids SGLang rendered (``choices[0].prompt_token_ids``) |
| ``offsets`` | int64 [B+1] | sample ``i`` is ``offsets[i]:offsets[i+1]`` of the per-token arrays |
| ``response_ids``, ``sampled_logprobs`` | int32 [N], float32 [N] | sampled tokens and their log-probs |
| ``cand_ids``, ``cand_logprobs`` | int32 [N, K], float32 [N, K] | candidates, ``-1`` / ``-inf`` = empty slot |

Absent ``token_versions`` (no sample had ``meta_info.weight_versions``): each sample's
``weight_versions`` entry on all of its tokens (``ResponseArrays.versions_of_tokens``).
The arrays are ``router_proxy/sglang_response.to_arrays``' in the batch's dtypes (``router_proxy/answer.py``),
so a worker packs the same batches from this as from the JSON (``tests/rollout_worker/test_packing.py``).
The proxy's audit judges them in these dtypes, as they travel: what it passed is what arrives.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from shared import msgpack_arrays

# SGLang's weight version until an update names one, and again after a restart: the server
# then serves its --model-path, the trainer's initial model, which is version 0. Where that
# is older than the trainer, the staleness rule rejects the batch; it is never trained as current.
INITIAL_VERSION = "default"

MEDIA_TYPE = "application/x-centerline-arrays"
VERSION = 1
ARRAYS = {
    "offsets": "int64",
    "response_ids": "int32",
    "sampled_logprobs": "float32",
    "cand_ids": "int32",
    "cand_logprobs": "float32",
}
# Texts are as long as the response: no string limit below the message's own size.
LIMITS = msgpack_arrays.WireLimits(max_str_len=msgpack_arrays.WireLimits().max_message_bytes)


@dataclass
class ResponseArrays:
    """B samples, N tokens in all, K candidate slots per token."""

    texts: list[str]
    finish_reasons: list[str | None]  # "stop", "length", "abort"; None while unfinished
    weight_versions: list[int]
    prompt_ids: list[int] | None  # chat: what SGLang sampled on; None for native or where absent
    offsets: np.ndarray  # int64 [B+1]
    response_ids: np.ndarray  # int32 [N]
    sampled_logprobs: np.ndarray  # float32 [N]
    cand_ids: np.ndarray  # int32 [N, K]
    cand_logprobs: np.ndarray  # float32 [N, K]
    # per sample, the prompt tokens SGLang's prefix cache served (a measurement, not audited); None: not known
    cached_tokens: list[int | None] | None = None
    # int32 [N], each token's weight version; None: each sample's weight_versions entry on all its tokens
    token_versions: np.ndarray | None = None

    def versions_of_tokens(self) -> np.ndarray:
        """``token_versions``, or where absent each sample's version repeated over its tokens."""
        if self.token_versions is not None:
            return self.token_versions
        return np.repeat(np.asarray(self.weight_versions, np.int32), np.diff(self.offsets)).astype(np.int32)

    @property
    def num_samples(self) -> int:
        return len(self.texts)


def cached_count(value) -> int | None:
    """A sample's ``cached_tokens`` as it travels: an int >= 0, else None (not known)."""
    return value if type(value) is int and value >= 0 else None


def encode(r: ResponseArrays) -> bytes:
    head = {
        "v": VERSION,
        "texts": r.texts,
        "finish_reasons": r.finish_reasons,
        "weight_versions": r.weight_versions,
        "prompt_ids": None,
    }
    if r.cached_tokens is not None:
        head["cached_tokens"] = r.cached_tokens
    arrays = {name: (getattr(r, name), dtype) for name, dtype in ARRAYS.items()}
    if r.token_versions is not None:
        arrays["token_versions"] = (r.token_versions, "int32")
    if r.prompt_ids is not None:
        del head["prompt_ids"]
        arrays["prompt_ids"] = (np.asarray(r.prompt_ids, np.int32), "int32")
    return msgpack_arrays.encode_map(head, arrays)


def decode(data: bytes) -> ResponseArrays:
    """Read an ``encode``d message; ``msgpack_arrays.WireError`` naming the field for anything else, so
    that a sample can never be read out of step with its arrays."""
    doc = msgpack_arrays.decode_map(data, limits=LIMITS)
    version = doc.get("v")
    if type(version) is not int or version != VERSION:
        raise msgpack_arrays.WireError(
            f"arrays message version {version!r} is not supported; this decoder reads {VERSION}"
        )
    values = {name: msgpack_arrays.array_value(doc, name, dtype, LIMITS) for name, dtype in ARRAYS.items()}
    texts, reasons, versions = (doc.get(name) for name in ("texts", "finish_reasons", "weight_versions"))
    if not (type(texts) is list and set(map(type, texts)) <= {str}):
        raise msgpack_arrays.WireError("arrays message: texts must be a list of strings")
    if not (type(reasons) is list and set(map(type, reasons)) <= {str, type(None)}):
        raise msgpack_arrays.WireError("arrays message: finish_reasons must be a list of strings or nil")
    if not (type(versions) is list and set(map(type, versions)) <= {int}):
        raise msgpack_arrays.WireError("arrays message: weight_versions must be a list of ints")
    offsets, ids, cand_ids = values["offsets"], values["response_ids"], values["cand_ids"]
    if offsets.ndim != 1 or not len(offsets) == len(texts) + 1 == len(reasons) + 1 == len(versions) + 1:
        raise msgpack_arrays.WireError(f"arrays message: offsets of shape {offsets.shape} for {len(texts)} samples")
    n = len(ids) if ids.ndim == 1 else -1
    if n < 0 or offsets[0] != 0 or offsets[-1] != n or (np.diff(offsets) < 0).any():
        raise msgpack_arrays.WireError(
            f"arrays message: offsets must rise from 0 to N={n}, one-dimensional response_ids"
        )
    shapes = [values[name].shape for name in ("sampled_logprobs", "cand_ids", "cand_logprobs")]
    if cand_ids.ndim != 2 or shapes != [(n,), (n, cand_ids.shape[1]), cand_ids.shape]:
        raise msgpack_arrays.WireError(
            f"arrays message: per-token arrays of shapes {shapes}, expected [N], [N, K], [N, K]"
        )
    cached = doc.get("cached_tokens")
    if cached is not None and not (
        type(cached) is list
        and len(cached) == len(texts)
        and all(c is None or cached_count(c) is not None for c in cached)
    ):
        raise msgpack_arrays.WireError(
            f"arrays message: cached_tokens must be absent or {len(texts)} counts (ints >= 0 or nil)"
        )
    token_versions = None
    if doc.get("token_versions") is not None:
        token_versions = msgpack_arrays.array_value(doc, "token_versions", "int32", LIMITS)
        if token_versions.shape != (n,):
            raise msgpack_arrays.WireError(
                f"arrays message: token_versions of shape {token_versions.shape}, expected [N]={n}"
            )
    prompt = doc.get("prompt_ids")
    return ResponseArrays(
        texts=texts,
        finish_reasons=reasons,
        weight_versions=versions,
        prompt_ids=None if prompt is None else msgpack_arrays.array_value(doc, "prompt_ids", "int32", LIMITS).tolist(),
        **values,
        cached_tokens=cached,
        token_versions=token_versions,
    )

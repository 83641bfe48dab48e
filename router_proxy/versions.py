"""The weight versions of an SGLang response (docs/design.md section 8), read by the proxy with the
rest of the response (``router_proxy/sglang_response.py``): each sample's ``weight_version`` (SGLang's
``"default"``, the initial weights, is version 0) and each token's, from ``meta_info.weight_versions``,
SGLang's spans ``{version, start, end}`` over the sample's output positions (a response that spans an
update has two or more). The spans are audited: spans that do not cover exactly the sample's tokens in
order raise ``malformed_response`` (for the binary answer, which carries them). A sample without the
field was sampled by one version.
"""

from __future__ import annotations

import numpy as np

from router_proxy.sglang_response import malformed
from shared.response_arrays import INITIAL_VERSION


def weight_versions(metas: list[dict]) -> list[int]:
    """Each sample's weight version as the trainer numbers them: SGLang writes the string the
    trainer sent (``str(v)``: ASCII digits, fewer than 20 so that 64 bits hold it) or
    ``"default"``. Anything else raises ``malformed_response``, where ``int()`` would read 1.5,
    ``true`` or ``" 3"`` as a version."""
    return [
        _version(meta.get("weight_version"), f"sample {i}: meta_info.weight_version") for i, meta in enumerate(metas)
    ]


def _version(version, name: str) -> int:
    if version == INITIAL_VERSION:
        return 0
    if type(version) is str and len(version) < 20 and version.isascii() and version.isdigit():
        return int(version)
    raise malformed(
        f"{name} is {repr(version)[:80]}, expected {INITIAL_VERSION!r} or a "
        "string of an int (up to 19 ASCII digits: the trainer names versions 0, 1, ...)"
    )


_INT32_MAX = 2**31 - 1  # token versions travel as int32 (shared/wire.py)


def token_versions(metas: list[dict]) -> np.ndarray | None:
    """Each token's weight version, int32 [N] in sample order: SGLang's ``meta_info.weight_versions``
    spans ``[{version, start, end}, ...]`` (``sglang/srt/utils/weight_versions.py``) read out over
    the sample's output positions, or the sample's ``weight_version`` on every token where the field
    is absent; None where no sample has the field (each sample is then one version). The spans must
    be a list of objects with a version (as ``weight_versions`` reads one) and int ``start`` <
    ``end``, the first starting at 0, each where the one before ended, the last ending at the
    sample's token count and naming the sample's ``weight_version``; one span
    ``{start: 0, end: 0}`` for a sample of no tokens. Anything else raises ``malformed_response``
    naming the sample and the span: a version cannot be guessed for a token."""
    if not any("weight_versions" in meta for meta in metas):
        return None
    samples = weight_versions(metas)
    parts = []
    for i, (meta, version) in enumerate(zip(metas, samples)):
        n = len(meta.get("output_token_logprobs") or ())
        spans = meta.get("weight_versions")
        parts.append(np.full(n, version, np.int64) if spans is None else _span_versions(spans, n, version, i))
    out = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    if out.size and int(out.max()) > _INT32_MAX:
        raise malformed(f"a token's weight version {int(out.max())} is beyond int32, the wire format's version dtype")
    return out.astype(np.int32)


def _span_versions(spans, n: int, version: int, i: int) -> np.ndarray:
    name = f"sample {i}: meta_info.weight_versions"
    expected = f"expected spans {{version, start, end}} covering its {n} output positions in order"
    if type(spans) is not list or not spans:
        raise malformed(f"{name} is {repr(spans)[:80]}, {expected}")
    versions, lengths, end = [], [], 0
    for j, span in enumerate(spans):
        if type(span) is not dict:
            raise malformed(f"{name}[{j}] is {repr(span)[:80]}, {expected}")
        start, stop = span.get("start"), span.get("end")
        if type(start) is not int or type(stop) is not int:
            raise malformed(f"{name}[{j}] has start {start!r} and end {stop!r}, expected ints; {expected}")
        empty_sample = n == 0 and len(spans) == 1 and start == stop == 0
        if start != end or (stop <= start and not empty_sample):
            raise malformed(f"{name}[{j}] is {start}..{stop} after a span ending at {end}; {expected}")
        versions.append(_version(span.get("version"), f"{name}[{j}].version"))
        lengths.append(stop - start)
        end = stop
    if end != n:
        raise malformed(f"{name} ends at {end}, the sample has {n} tokens; {expected}")
    if versions[-1] != version:
        raise malformed(f"{name}' last span names version {versions[-1]}, meta_info.weight_version {version}")
    return np.repeat(np.asarray(versions, np.int64), lengths)

"""Fuzz the proxy's reading of upstream answers: the HTTP/1.1 response parser (``upstream.py``)
and the audit (``audit.py``) of what it returns.

The first input byte picks the case: bit 0 the endpoint (generate, chat), bit 1 the mode
(selected, support), bit 2 whether the rest is a whole HTTP response (parsed by the proxy's
upstream connection, split in two reads at the second byte, under a 64 KiB answer limit,
then audited with its content type) or just a body for ``audit_body``. The only acceptable
failures are ``UpstreamError`` and ``ContractViolation``. Every body is audited with each
candidate-row scanner (``shared/candidate_scan.py``: C where built, numpy) and once parsed
whole by orjson: the verdicts must be the same, and the binary answer a worker asks for
(``shared/response_arrays.py``) must have the same verdict and decode to what was audited.
Seeds are valid SGLang answers (``router_proxy/bench.py``), written to ``fuzz/corpus/proxy_audit/`` when it is empty.

    .venv/bin/python -m fuzz.fuzz_proxy_audit -max_total_time=600 -rss_limit_mb=1024 -timeout=5

The end-to-end counterpart (a real proxy process in front of a hostile upstream) is
``tests/router_proxy/test_hostile_upstream.py``.
"""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path

import orjson

from fuzz.fuzz_wire import fuzz
from router_proxy.audit import audit_body
from router_proxy.bench import native_response
from router_proxy.upstream import UpstreamError, UpstreamPool, _Connection
from shared import candidate_scan, response_arrays, sglang_response
from shared.contract import ContractViolation

VOCAB = 300
K = 8  # support rows hold up to K ids, selected rows exactly K
# (SCAN_MIN_BYTES, SCANNER) of each audit: every scanner built here, then the whole-body parse last
WAYS = [(0, "c")] * (candidate_scan._rowscan is not None) + [(0, "numpy"), (1 << 62, candidate_scan.SCANNER)]
LIMIT = 64 << 10
CORPUS = Path(__file__).resolve().parent / "corpus" / "proxy_audit"
ENDPOINTS, MODES = ("generate", "chat"), ("selected", "support")
_loop = asyncio.new_event_loop()


class _Transport:
    """What ``_Connection`` calls on its transport; nothing goes anywhere."""

    def write(self, data):
        pass

    def writelines(self, data):
        pass

    def close(self):
        pass

    abort = close

    def is_closing(self):
        return False


async def _answer(raw: bytes, split: int) -> tuple[int, bytes, bytes]:
    """``raw`` as the upstream's bytes to one request, in two reads, then EOF."""
    pool = UpstreamPool("http://127.0.0.1:9", max_response_bytes=LIMIT)
    pool.loop = asyncio.get_running_loop()
    conn = _Connection(pool)
    conn.connection_made(_Transport())
    waiter = conn.send(b"POST /generate HTTP/1.1\r\n\r\n", b"{}", 60.0)
    conn.data_received(raw[:split])
    conn.data_received(raw[split:])
    conn.connection_lost(None)
    return await waiter


def TestOneInput(data: bytes) -> None:
    if len(data) < 2:
        return
    endpoint, mode = ENDPOINTS[data[0] & 1], MODES[data[0] >> 1 & 1]
    ctype = None
    body = data[1:]
    try:
        if data[0] & 4:
            status, body, ctype = _loop.run_until_complete(_answer(data[2:], data[1] * len(data) // 256))
            if status != 200:
                return
    except UpstreamError:
        return
    verdicts = []
    saved = sglang_response.SCAN_MIN_BYTES, candidate_scan.SCANNER
    try:
        for threshold, scanner in WAYS:
            sglang_response.SCAN_MIN_BYTES, candidate_scan.SCANNER = threshold, scanner
            try:
                result = audit_body(body, endpoint=endpoint, mode=mode, k=K, vocab_size=VOCAB, content_type=ctype)
                verdicts.append((result.samples, result.tokens))
            except ContractViolation as exc:
                verdicts.append(exc.to_dict())
    finally:
        sglang_response.SCAN_MIN_BYTES, candidate_scan.SCANNER = saved  # the module's own for everyone else
    for (_, scanner), verdict in zip(WAYS, verdicts[:-1]):
        if verdict != verdicts[-1]:
            raise AssertionError(f"scanned ({scanner}) {verdict} != parsed {verdicts[-1]}")
    _check_binary_answer(body, endpoint, mode, ctype, verdicts[1])


def _check_binary_answer(body: bytes, endpoint: str, mode: str, ctype, verdict) -> None:
    """The binary answer (``audit_body(arrays=True)``) has the verdict of the JSON one and decodes to
    the samples and tokens audited; it may only add ``malformed_response`` for a weight version."""
    try:
        result = audit_body(body, endpoint=endpoint, mode=mode, k=K, vocab_size=VOCAB, content_type=ctype, arrays=True)
    except ContractViolation as exc:
        if exc.to_dict() != verdict and not (type(verdict) is tuple and exc.rule == "malformed_response"):
            raise AssertionError(f"binary answer {exc.to_dict()} != JSON answer {verdict}") from None
        if type(verdict) is tuple and "weight_version" not in str(exc) and "arrays" not in str(exc):
            raise AssertionError(f"binary answer refused a response the JSON answer passed: {exc}") from None
        return
    found = response_arrays.decode(result.reply)
    if (found.num_samples, len(found.response_ids)) != verdict:
        raise AssertionError(
            f"binary answer of {found.num_samples} samples, {len(found.response_ids)} tokens != {verdict}"
        )


def valid_body(endpoint: str, mode: str, tokens: int, seed: int) -> bytes:
    doc = orjson.loads(native_response(tokens, K, VOCAB, seed=seed))
    meta = doc["meta_info"]
    if mode == "support":  # the first 4 candidates of each row, renormalised
        rows = [row[:4] for row in meta.pop("output_top_logprobs")]
        lps = [[e[0] - math.log(sum(math.exp(c[0]) for c in r)) for e in r] for r in rows]
        meta["output_token_sampling_mask"] = [[e[1] for e in r] for r in rows]
        meta["output_token_sampling_logprobs"] = lps
        meta["output_token_logprobs"] = [[lp[0], r[0][1], None] for lp, r in zip(lps, rows)]
    if endpoint == "chat":
        doc = {
            "id": "c",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "meta_info": meta}],
        }
    return orjson.dumps(doc)


def seeds() -> list[bytes]:
    out = []
    for selector in range(8):
        endpoint, mode = ENDPOINTS[selector & 1], MODES[selector >> 1 & 1]
        for tokens in (1, 3):
            body = valid_body(endpoint, mode, tokens, seed=selector)
            if selector & 4:
                chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
                out.append(
                    bytes([selector, 128])
                    + b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(body), body)
                )
                out.append(
                    bytes([selector, 40])
                    + b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
                    + chunked
                )
            else:
                out.append(bytes([selector]) + body)
    return out


if __name__ == "__main__":
    fuzz(
        sys.argv,
        TestOneInput,
        CORPUS,
        seeds(),
        (
            "router_proxy.audit",
            "router_proxy.upstream",
            "shared.contract",
            "shared.sglang_response",
            "shared.candidate_scan",
        ),
    )

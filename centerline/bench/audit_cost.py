"""The audit-cost table of ``centerline bench proxy`` (``centerline/bench/proxy.py`` says what it
measures): the CPU one native response costs across proxy and worker, before and after the proxy
scanned candidate rows and answered in binary, beside ``orjson.loads`` of it."""

from __future__ import annotations

import statistics
import time

import orjson

from centerline.synth import native_response
from router_proxy.audit import audit_body


def _cpu_ms(fn, repeats: int) -> float:
    """Median CPU time of ``fn()`` in ms (process time: a busy neighbour on the cores does not count)."""
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return statistics.median(times) * 1e3


def audit_cost(repeats: int, tokens: int = 1024, k: int = 128, vocab_size: int = 32768) -> dict:
    """One native response of ``tokens`` x ``k``: orjson.loads of it, and its CPU cost across proxy and
    worker, before and after, in ms per response.

    before: the proxy audits the body parsed whole by orjson and forwards the JSON, which the
    worker parses again (``parse_body``, its samples' metas and arrays). after: the proxy audits with
    candidate rows scanned (``router_proxy/candidate_scan.py``) and encodes the checked arrays as its
    binary answer; the worker decodes them (``shared/response_arrays.py``) and parses nothing.
    ``*_audit_ms`` is the audit alone (what the audit-to-parse ratio compares), ``*_proxy_ms`` the
    proxy's whole share."""
    from rollout_worker.packing import samples_from_arrays
    from router_proxy import answer, candidate_scan, sglang_response
    from shared import response_arrays

    body = native_response(tokens, k, vocab_size)
    reply = audit_body(body, endpoint="generate", mode="selected", k=k, vocab_size=vocab_size, arrays=True).reply

    def audit(arrays: bool):
        return lambda: audit_body(body, endpoint="generate", mode="selected", k=k, vocab_size=vocab_size, arrays=arrays)

    def json_worker():
        doc, _ = sglang_response.parse_body(body, "generate", mode="selected", k=k)
        metas = sglang_response.response_metas(doc, "generate")
        samples_from_arrays(answer.from_parsed(doc, metas, "generate", mode="selected", k=k))

    def binary_worker():
        samples_from_arrays(response_arrays.decode(reply))

    saved, sglang_response.SCAN_MIN_BYTES = sglang_response.SCAN_MIN_BYTES, 1 << 62  # before: nothing scanned
    try:
        before = {"audit": _cpu_ms(audit(False), repeats), "worker": _cpu_ms(json_worker, repeats)}
    finally:
        sglang_response.SCAN_MIN_BYTES = saved
    after = {
        "audit": _cpu_ms(audit(False), repeats),
        "proxy": _cpu_ms(audit(True), repeats),
        "worker": _cpu_ms(binary_worker, repeats),
    }
    before["proxy"] = before["audit"]
    saved, candidate_scan.SCANNER = candidate_scan.SCANNER, "numpy"  # the fallback without a C compiler
    try:
        numpy_audit_ms = _cpu_ms(audit(False), repeats)
    finally:
        candidate_scan.SCANNER = saved
    parse_ms = _cpu_ms(lambda: orjson.loads(body), repeats)
    out = {
        "tokens": tokens,
        "k": k,
        "scanner": candidate_scan.SCANNER,
        "body_bytes": len(body),
        "reply_bytes": len(reply),
        "parse_ms": round(parse_ms, 3),
        "parse_mb_per_s": round(len(body) / parse_ms / 1e3, 1),
    }
    for name, ms in (("before", before), ("after", after)):
        out[f"{name}_audit_ms"] = round(ms["audit"], 3)
        out[f"{name}_proxy_ms"] = round(ms["proxy"], 3)
        out[f"{name}_worker_ms"] = round(ms["worker"], 3)
        out[f"{name}_cpu_ms_per_response"] = round(ms["proxy"] + ms["worker"], 3)
        out[f"{name}_audit_to_parse_ratio"] = round(ms["audit"] / parse_ms, 3)
        out[f"{name}_audit_mb_per_s"] = round(len(body) / ms["audit"] / 1e3, 1)
    out["after_encode_ms"] = round(after["proxy"] - after["audit"], 3)
    out["numpy_scanner_audit_ms"] = round(numpy_audit_ms, 3)
    out["numpy_scanner_audit_to_parse_ratio"] = round(numpy_audit_ms / parse_ms, 3)
    out["cpu_after_to_before"] = round(out["after_cpu_ms_per_response"] / out["before_cpu_ms_per_response"], 3)
    return out

"""The renderers of the benches along a batch's bytes: encoded (``bench wire``), checked (``bench
contract``), published in pieces (``bench long-sample``), audited by the proxy (``bench proxy``)."""

from __future__ import annotations

from scripts.bench_docs.markdown import mb, sig, table


def wire(fig: dict) -> list[str]:
    rows = [
        [
            f"{s['tokens']:,}",
            str(s["k"]),
            mb(s["message_bytes"]),
            f"{sig(s['encode_decode_gbps'])} GB/s ({sig(s['encode_decode_ms'])} ms)",
            f"{sig(s['memcpy_gbps'])} GB/s",
            f"{sig(s['ratio_to_memcpy'])}x",
            f"{sig(s['nested_list_msgpack_gbps'])} GB/s",
        ]
        for s in sorted([fig, *fig["sizes"]], key=lambda s: s["tokens"])
    ]
    header = ["tokens", "K", "message", "encode+decode", "memcpy, fresh buffer", "ratio", "nested-list msgpack"]
    return table(header, rows)


def contract(fig: dict) -> list[str]:
    header = ["tokens", "K", "batch", "selected mode", "rows/s", "MB/s", "support mode"]
    row = [
        f"{fig['tokens']:,}",
        str(fig["k"]),
        f"{sig(fig['batch_mb'])} MiB",
        f"{sig(fig['ms_per_batch'])} ms",
        f"{fig['rows_per_s']:,.0f}",
        f"{fig['mb_per_s']:,.0f}",
        f"{sig(fig['support_ms_per_batch'])} ms",
    ]
    return table(header, [row])


def long_sample(fig: dict) -> list[str]:
    """``bench long-sample``: a sample in pieces beside one in one message, and what they were checked to be."""
    samples = fig["samples"]

    def ms(seconds: float) -> str:
        return f"{sig(seconds * 1e3)} ms"

    rows = [
        [
            f"{name}: {s['tokens']:,} tokens",
            mb(s["wire_bytes"]),
            str(s["messages"]),
            f"{ms(s['publish_s'])} ({sig(s['publish_mb_per_s'])} MB/s; encode and cut {ms(s['pack_s'])})",
            f"{ms(s['admit_s'])} ({sig(s['admit_mb_per_s'])} MB/s; check alone {ms(s['check_s'])})",
            ms(s["ack_s"]),
            f"{ms(s['loopback_s'])} (memcpy {ms(s['memcpy_s'])})",
            f"{sig(s['publish_to_loopback'])}x / {sig(s['admit_to_loopback'])}x",
        ]
        for name, s in samples.items()
    ]
    header = [
        "sample",
        "wire",
        "messages",
        "publish, every PubAck",
        "fetch and admit",
        "ack",
        "same bytes over loopback",
        "publish / admit vs loopback",
    ]
    whole = all(
        s["sha256"] == s["admitted_sha256"] and s["gate_counts"] == {"accepted": fig["repeats"]}
        for s in samples.values()
    )
    checked = (
        "each repeat was held by the gate as published (sha256) and accepted, nothing dead-lettered, nothing left "
        "unacked"
        if whole and fig["unacked"] == fig["dead_letters"] == 0
        else f"NOT held as published: gate counts {[s['gate_counts'] for s in samples.values()]}, "
        f"{fig['unacked']} unacked, {fig['dead_letters']} dead-lettered"
    )
    per_byte = fig["long_to_fits_per_byte"]
    return [
        f"K = {fig['k']}, max_payload {fig['max_payload']:,} bytes (pieces of up to {fig['piece_bytes']:,}), medians "
        f"of {fig['repeats']} repeats, the two samples in turns; {checked}.",
        "",
        *table(header, rows),
        "",
        f"Per byte, the long sample's publish takes {sig(per_byte['publish_s'])}x the fitting one's, its fetch and "
        f"admission {sig(per_byte['admit_s'])}x, its acks {sig(per_byte['ack_s'])}x.",
    ]


SCANNERS = {"c": "C"}  # candidate_scan.SCANNER's names as the README writes them


def proxy(fig: dict) -> list[str]:
    header = [
        "tokens",
        "body",
        "parse",
        f"audit, {SCANNERS.get(fig['audit'][0]['scanner'], fig['audit'][0]['scanner'])} scanner",
        "audit, numpy scanner",
        "proxy + worker before",
        "after",
    ]
    rows = [
        [
            f"{r['tokens']:,}",
            mb(r["body_bytes"]),
            f"{sig(r['parse_ms'])} ms ({sig(r['parse_mb_per_s'])} MB/s)",
            f"{sig(r['after_audit_ms'])} ms, {sig(r['after_audit_to_parse_ratio'])}x parse "
            f"({sig(r['after_audit_mb_per_s'])} MB/s)",
            f"{sig(r['numpy_scanner_audit_ms'])} ms, {sig(r['numpy_scanner_audit_to_parse_ratio'])}x",
            f"{sig(r['before_cpu_ms_per_response'])} ms",
            f"{sig(r['after_cpu_ms_per_response'])} ms ({sig(r['cpu_after_to_before'])}x; worker "
            f"{sig(r['after_worker_ms'])} ms)",
        ]
        for r in fig["audit"]
    ]
    return table(header, rows)

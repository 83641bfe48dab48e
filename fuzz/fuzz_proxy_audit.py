"""Fuzz the proxy's reading of upstream answers: the HTTP/1.1 response parser (``upstream.py``)
and the audit (``audit.py``) of what it returns.

The first input byte picks the case: bit 0 the endpoint (generate, chat), bit 1 the mode
(selected, support), bit 2 whether the rest is a whole HTTP response (parsed by the proxy's
upstream connection, split in two reads at the second byte, under a 64 KiB answer limit,
then audited with its content type) or just a body for ``audit_body``. The only acceptable
failures are ``UpstreamError`` and ``ContractViolation``. Every body is audited with each
candidate-row scanner (``router_proxy/candidate_scan.py``: C where built, numpy) and once parsed
whole by orjson: the verdicts must be the same, and the binary answer a worker asks for
(``shared/response_arrays.py``) must have the same verdict. An accepted binary answer must
decode, and equal value for value, in the wire dtypes, what the JSON says (``travelled``, read
here without ``router_proxy/sglang_response.py``): every log-prob finite and its float32 rounding,
every id exact, each text, finish reason and weight version; and its arrays must pass the
contract as the worker and the trainer will check them. The audit's promise is that what a
worker receives is what it audited.

Besides libFuzzer's byte mutations, ``mutate_structure`` edits a body's JSON as a tree: a
value's type swapped, a number pushed past float32's or int32's range, a list cut short, a key
dropped. Seeds are valid SGLang answers (``centerline/synth.py``), written to
``fuzz/corpus/proxy_audit/`` when it is empty.

    .venv/bin/python -m fuzz.fuzz_proxy_audit -max_total_time=600 -rss_limit_mb=1024 -timeout=5

The end-to-end counterpart (a real proxy process in front of a hostile upstream) is
``tests/router_proxy/test_hostile_upstream.py``; ``fuzz/sanitized.py`` runs this target against
the C scanner built with AddressSanitizer and UBSan.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import orjson

from centerline.synth import native_response
from fuzz.fuzz_wire import fuzz
from router_proxy import candidate_scan, sglang_response
from router_proxy.audit import audit_body
from router_proxy.upstream import UpstreamError, UpstreamPool, _Connection
from shared import response_arrays
from shared.contract import ContractViolation, check_rows
from shared.msgpack_arrays import WireError

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
    verdicts = _each_way(lambda: _counted(audit_body(body, **_audit_args(endpoint, mode, ctype))))
    replies = _each_way(lambda: audit_body(body, arrays=True, **_audit_args(endpoint, mode, ctype)).reply)
    for (_, scanner), verdict, reply in zip(WAYS, verdicts[:-1], replies[:-1]):
        if verdict != verdicts[-1]:
            raise AssertionError(f"scanned ({scanner}) {verdict} != parsed {verdicts[-1]}")
        if reply != replies[-1]:
            raise AssertionError(f"scanned ({scanner}) binary answer differs from the parsed one's")
    verdict, reply = verdicts[-1], replies[-1]
    if type(reply) is bytes:  # passed: the JSON answer too, and the worker gets what was audited
        if type(verdict) is not tuple:
            raise AssertionError(f"binary answer passed a response the JSON answer refused: {verdict}")
        check_travelled(body, endpoint, mode, reply)
    elif reply != verdict and not (type(verdict) is tuple and reply["rule"] == "malformed_response"):
        raise AssertionError(f"binary answer {reply} != JSON answer {verdict}")
    elif type(verdict) is tuple and "weight_version" not in reply["message"]:
        raise AssertionError(f"binary answer refused a response the JSON answer passed: {reply['message']}")


def _audit_args(endpoint: str, mode: str, ctype) -> dict:
    return {"endpoint": endpoint, "mode": mode, "k": K, "vocab_size": VOCAB, "content_type": ctype}


def _counted(result) -> tuple[int, int]:
    return result.samples, result.tokens


def _each_way(audit) -> list:
    """``audit()`` with each of ``WAYS``: what it returns, or its ``ContractViolation`` as a dict."""
    out = []
    saved = sglang_response.SCAN_MIN_BYTES, candidate_scan.SCANNER
    try:
        for threshold, scanner in WAYS:
            sglang_response.SCAN_MIN_BYTES, candidate_scan.SCANNER = threshold, scanner
            try:
                out.append(audit())
            except ContractViolation as exc:
                out.append(exc.to_dict())
    finally:
        sglang_response.SCAN_MIN_BYTES, candidate_scan.SCANNER = saved  # the module's own for everyone else
    return out


def check_travelled(body: bytes, endpoint: str, mode: str, reply: bytes) -> None:
    """Raise ``AssertionError`` unless ``reply``, the binary answer of the accepted ``body``, decodes to what
    the JSON says in the wire dtypes (``travelled``) and its arrays pass the contract."""
    try:
        found = response_arrays.decode(reply)
    except WireError as exc:
        raise AssertionError(f"the binary answer of an accepted response does not decode: {exc}") from None
    try:
        expect = travelled(body, endpoint, mode)
    except (AssertionError, TypeError, ValueError, OverflowError, KeyError, IndexError, AttributeError) as exc:
        raise AssertionError(f"an accepted response is not SGLang's shape: {exc!r}") from None
    for name in ("texts", "finish_reasons", "weight_versions", "prompt_ids"):
        if getattr(found, name) != expect[name]:
            raise AssertionError(f"binary answer {name} {getattr(found, name)!r} != the JSON's {expect[name]!r}")
    for name in response_arrays.ARRAYS:
        got, want = getattr(found, name), expect[name]
        if got.dtype != want.dtype or got.shape != want.shape:
            raise AssertionError(
                f"binary answer {name} is {got.dtype} {got.shape}, the JSON's {want.dtype} {want.shape}"
            )
        bits = f"u{got.itemsize}"  # bit for bit: -0.0 is not 0.0
        bad = np.flatnonzero(got.view(bits).reshape(-1) != want.view(bits).reshape(-1))[:4]
        if bad.size:
            raise AssertionError(
                f"binary answer {name} at flat index {bad.tolist()}: {got.reshape(-1)[bad].tolist()} != the JSON's "
                f"{want.reshape(-1)[bad].tolist()}"
            )
    try:
        check_rows(
            found.response_ids,
            found.sampled_logprobs,
            np.ones(len(found.response_ids), bool),
            found.cand_ids,
            found.cand_logprobs,
            mode=mode,
            k=K,
            vocab_size=VOCAB,
            offsets=found.offsets,
        )
    except ContractViolation as exc:
        raise AssertionError(f"the binary answer of an accepted response breaks the contract: {exc}") from None


def travelled(body: bytes, endpoint: str, mode: str) -> dict:
    """What an accepted body must reach a worker as, read from its JSON by the documented mapping
    (``shared/response_arrays.py``) and nothing of the code under test: texts ("" for null or absent),
    finish reasons' types, weight versions (``"default"`` 0, else the digits' int), chat prompt ids,
    and per token the sampled id and log-prob (support: its row's), K candidate slots (``-1`` /
    ``-inf`` past a row's end), in the wire dtypes. A JSON log-prob must survive float32."""
    doc = orjson.loads(body)
    if endpoint == "chat":
        pairs = [((c.get("message") or {}).get("content"), c["meta_info"]) for c in doc["choices"]]
        ids = doc["choices"][0].get("prompt_token_ids")
        ok = type(ids) is list and ids and all(type(i) is int and 0 <= i < 2**31 for i in ids)
        prompt = ids if ok else None
    else:
        pairs = [(item.get("text"), item["meta_info"]) for item in (doc if type(doc) is list else [doc])]
        prompt = None
    out = {"texts": [], "finish_reasons": [], "weight_versions": [], "prompt_ids": prompt, "offsets": [0]}
    tokens, logprobs, cand_ids, cand_logprobs = [], [], [], []
    for text, meta in pairs:
        assert text is None or type(text) is str, f"text {text!r}"
        reason, version = meta.get("finish_reason"), meta.get("weight_version")
        assert reason is None or reason["type"] in ("stop", "length", "abort"), f"finish_reason {reason!r}"
        assert version == "default" or (version.isascii() and version.isdigit()), f"weight_version {version!r}"
        out["texts"].append(text or "")
        out["finish_reasons"].append(reason and reason["type"])
        out["weight_versions"].append(0 if version == "default" else int(version))
        sampled = meta["output_token_logprobs"]
        if mode == "selected":
            rows = [
                [(e[1], e[0]) for e in row or []] for row in meta.get("output_top_logprobs") or [None] * len(sampled)
            ]
        else:
            masks = meta.get("output_token_sampling_mask") or [None] * len(sampled)
            lps = meta.get("output_token_sampling_logprobs") or [None] * len(sampled)
            rows = [list(zip(m or [], lp or [])) for m, lp in zip(masks, lps)]
        for (lp, token, *_), row in zip(sampled, rows):
            own = [c_lp for c, c_lp in row if c == token]
            tokens.append(token)
            logprobs.append(own[0] if mode == "support" and own else lp)
            cand_ids.append([c for c, _ in row] + [-1] * (K - len(row)))
            cand_logprobs.append([c_lp for _, c_lp in row] + [-math.inf] * (K - len(row)))
        out["offsets"].append(len(tokens))
    for name, values in (("sampled_logprobs", logprobs), ("cand_logprobs", cand_logprobs)):
        wide = np.array(values, np.float64).reshape(-1, K) if name == "cand_logprobs" else np.array(values, np.float64)
        with np.errstate(over="ignore"):
            out[name] = wide.astype(np.float32)
        lost = np.isfinite(wide) & ~np.isfinite(out[name])
        assert not lost.any(), f"{name} {wide[lost][:4].tolist()} do not survive float32"
    out["offsets"] = np.array(out["offsets"], np.int64)
    for name, values in (("response_ids", tokens), ("cand_ids", cand_ids)):
        out[name] = np.array(values, np.int64).reshape(-1, K) if name == "cand_ids" else np.array(values, np.int64)
        assert (out[name] == out[name].astype(np.int32)).all(), f"{name} do not fit int32"
        out[name] = out[name].astype(np.int32)
    return out


# Numbers at the edges of the wire dtypes: float32's largest finite value and the float64 midpoint past it
# (which rounds to inf), float64's extremes, float32's underflow, and int32's and int64's bounds.
EDGE_NUMBERS = [
    -3.4028234663852886e38,
    -3.4028235677973366e38,
    3.4028235677973366e38,
    -1e39,
    -1e300,
    -1.7976931348623157e308,
    -5e-324,
    -1e-46,
    -0.0,
    2**31 - 1,
    2**31,
    -(2**31) - 1,
    2**32,
    2**53 + 1,
    2**63,
    2**64,
    -(2**63) - 1,
]
# What a value of another type may become.
OTHER_TYPES = [None, True, False, 0, 1, -1, 1.5, -0.5, "", "stop", "default", "7", [], {}, {"type": "stop"}]


def mutate_structure(data: bytes, rng: random.Random) -> bytes | None:
    """``data`` (a body input: selector byte, then JSON) with one value of its JSON tree changed by type,
    range or length; None where the input is an HTTP response or its body is not JSON. The value is
    drawn depth first (a depth at random, then a value at that depth), so that a response's few
    fields are drawn as often as its many candidate entries."""
    if len(data) < 2 or data[0] & 4:
        return None
    try:
        doc = orjson.loads(data[1:])
    except orjson.JSONDecodeError:
        return None
    levels, todo = [], [(doc, 0)]
    while todo:  # (container, key) of every value, by depth
        node, depth = todo.pop()
        keys = list(node) if type(node) is dict else range(len(node)) if type(node) is list else []
        for key in keys:
            while len(levels) <= depth:
                levels.append([])
            levels[depth].append((node, key))
            todo.append((node[key], depth + 1))
    if not levels:
        return None
    parent, key = rng.choice(rng.choice(levels))
    value = parent[key]
    kind = rng.choice(["type", "range", "length"])
    if kind == "range" and type(value) in (int, float):
        parent[key] = rng.choice([rng.choice(EDGE_NUMBERS), value * 1e300, value + 2**32, value - 2**32, -value])
    elif kind == "length" and type(value) is list and value:
        cut = rng.randrange(len(value))
        parent[key] = rng.choice([value[:cut], value[:cut] + value[cut + 1 :], value + value[cut : cut + 1]])
    elif kind == "length" and type(value) is dict and value:
        del value[rng.choice(list(value))]
    else:
        parent[key] = rng.choice([v for v in OTHER_TYPES if type(v) is not type(value)] + [[value], {"type": value}])
    try:
        text = orjson.dumps(doc)
    except TypeError:  # an integer beyond 64 bits
        text = json.dumps(doc, separators=(",", ":")).encode()
    return data[:1] + text


def mutator(data: bytes, max_size: int, seed: int) -> bytes:
    """libFuzzer's custom mutator: a structural mutation one time in two where the input is a JSON body,
    libFuzzer's own byte mutations otherwise."""
    import atheris

    if seed % 2:
        found = mutate_structure(data, random.Random(seed))
        if found is not None and len(found) <= max_size:
            return found
    return atheris.Mutate(data, max_size)


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


def main(argv: list[str]) -> None:
    """libFuzzer on ``TestOneInput`` with ``argv``'s flags and corpus directories (``fuzz_wire.fuzz``)."""
    fuzz(
        argv,
        TestOneInput,
        CORPUS,
        seeds(),
        (
            "router_proxy.audit",
            "router_proxy.upstream",
            "shared.contract",
            "router_proxy.sglang_response",
            "router_proxy.versions",
            "shared.response_arrays",
            "router_proxy.candidate_scan",
        ),
        mutator=mutator,
    )


if __name__ == "__main__":
    main(sys.argv)

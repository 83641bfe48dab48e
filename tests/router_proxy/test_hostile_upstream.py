"""The real proxy process in front of a hostile upstream: whatever the upstream answers a
training request, enforce mode answers 502 with a JSON error naming a rule (never 500, never
the hostile body), observe mode passes what it got with a verdict header.

The upstream is a raw HTTP/1.1 server on loopback (in a thread of the test process) that
answers each request with the exact bytes registered for its ``X-Request-Id``, which the
proxy forwards: malformed, truncated, huge, wrongly typed, NaN-bearing, deeply nested,
non-UTF-8, chunked, close-delimited, mislabelled or error-status answers, drawn by hypothesis.
"""

from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import threading

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from centerline.synth import native_response
from router_proxy.audit import PROXY_RULES
from shared.contract import RULES

pytestmark = pytest.mark.integration
VOCAB, K = 300, 8
LIMIT = 1_000_000  # --max-upstream-response-bytes of the proxies under test
NO_ANSWER = b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
ids = itertools.count()


def huge() -> bytes:
    """A 50 MiB body (made when drawn, not held for the session)."""
    return b'{"meta_info": {"output_token_logprobs": "' + b"x" * (50 << 20) + b'"}}'


class HostileUpstream:
    """Answers each request with ``answers[x-request-id]`` (raw bytes: status line, headers, body), then closes."""

    def __init__(self):
        self.answers: dict[bytes, bytes] = {}
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(10), "hostile upstream did not start"
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()
        server.close()

    async def _serve(self, reader, writer) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            fields = dict(line.split(b": ", 1) for line in head.lower().split(b"\r\n")[1:] if b": " in line)
            await reader.readexactly(int(fields.get(b"content-length", b"0")))
            writer.write(self.answers.get(fields.get(b"x-request-id"), NO_ANSWER))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the proxy cut off an answer above its limit
        finally:
            writer.close()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, kinds):
    upstream = HostileUpstream()
    flags = [
        "--vocab-size",
        str(VOCAB),
        "--rollout-top-logprobs-num",
        str(K),
        "--max-upstream-response-bytes",
        str(LIMIT),
        "--upstream-timeout",
        "30",
    ]
    logs = tmp_path_factory.mktemp("hostile")
    proxies = {}
    try:
        for mode in ("enforce", "observe"):
            proxies[mode] = kinds.ProxyProcess(logs / f"{mode}.log", upstream.url, *flags, "--proxy-audit-mode", mode)
        yield upstream, proxies
    finally:
        for proxy in proxies.values():
            proxy.stop()
        upstream.stop()


# ---------------------------------------------------------------- hostile answers

JUNK = [None, True, False, "NaN", "Infinity", "-Infinity", "0.5", "", [], [1, 2], {}, {"a": 1}]
RAW_NUMBERS = [b"NaN", b"Infinity", b"-Infinity", b"nan", b"1e400", b"-1e400", b"0x10", b"+1", b"01", b".5"]
PLACEHOLDER = "\x00placeholder\x00"


def valid_doc(chat: bool, tokens: int) -> dict:
    doc = orjson.loads(native_response(tokens, K, VOCAB))
    if chat:
        return {
            "id": "c",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "meta_info": doc["meta_info"]}],
        }
    return doc


@st.composite
def hostile_body(draw, chat: bool) -> tuple[str, bytes, int]:
    """``(kind, body, budget)``: a body no audit may accept for a request of ``budget`` new tokens;
    ``kind`` "valid" is the one exception. "clipped" is a valid body whose length finish falls short of
    the budget (an engine that cut the answer at its context limit)."""
    tokens = draw(st.integers(1, 3))
    doc = valid_doc(chat, tokens)
    meta = doc["choices"][0]["meta_info"] if chat else doc["meta_info"]
    kind = draw(
        st.sampled_from(
            [
                "valid",
                "clipped",
                "entry",
                "row",
                "field",
                "meta",
                "top",
                "raw_number",
                "truncated",
                "non_utf8",
                "depth",
                "huge",
                "empty",
            ]
        )
    )
    if kind in ("valid", "clipped"):
        return kind, orjson.dumps(doc), tokens + (draw(st.integers(1, 2)) if kind == "clipped" else 0)
    return (*hostile_error(draw, kind, doc, meta, tokens), tokens)


def hostile_error(draw, kind: str, doc: dict, meta: dict, tokens: int) -> tuple[str, bytes]:
    if kind == "huge":
        return kind, huge()
    if kind == "empty":
        return kind, draw(st.sampled_from([b"", b" ", b"null", b"[]", b"{}", b'"text"', b"123", b"true"]))
    if kind == "depth":
        depth = draw(st.sampled_from([600, 1100, 100_000]))
        bomb = "[" * depth + "]" * depth
        return kind, orjson.dumps(doc).replace(
            b'"output_token_logprobs":', b'"output_token_logprobs":' + bomb.encode() + b',"x":', 1
        )
    if kind == "truncated":
        body = orjson.dumps(doc)
        return kind, body[: draw(st.integers(0, len(body) - 1))]
    if kind == "non_utf8":
        body = orjson.dumps(doc)
        at = body.index(b'"id"') + 1
        return kind, body[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80"])) + body[at:]
    if kind == "raw_number":  # NaN and friends written into the JSON text, where a log-prob goes
        i = draw(st.integers(0, tokens - 1))
        (
            meta["output_token_logprobs"][i]
            if draw(st.booleans())
            else meta["output_top_logprobs"][i][draw(st.integers(0, K - 1))]
        )[0] = PLACEHOLDER
        return kind, orjson.dumps(doc).replace(orjson.dumps(PLACEHOLDER), draw(st.sampled_from(RAW_NUMBERS)), 1)
    junk = draw(st.sampled_from(JUNK))
    if kind == "entry":  # a wrong type in the log-prob or id slot of one entry
        i, slot = draw(st.integers(0, tokens - 1)), draw(st.integers(0, 1))
        entry = (
            meta["output_token_logprobs"][i]
            if draw(st.booleans())
            else meta["output_top_logprobs"][i][draw(st.integers(0, K - 1))]
        )
        entry[slot] = junk
    elif kind == "row":  # null is SGLang's empty row: a short one
        meta["output_top_logprobs"][draw(st.integers(0, tokens - 1))] = junk
    elif kind == "field":
        meta[draw(st.sampled_from(["output_token_logprobs", "output_top_logprobs"]))] = junk
    elif kind == "meta":
        (doc["choices"][0] if "choices" in doc else doc)["meta_info"] = junk
    else:  # "top": the whole document
        doc = draw(st.sampled_from([junk, {"choices": junk}, {"meta_info": junk}]))
    return kind, orjson.dumps(doc)


class Answer(dict):
    """A drawn answer: ``path``, ``raw`` (the bytes sent), ``status``, ``body``, ``ctype``, ``framing``, ``kind``,
    ``budget`` (the new tokens the request asks for).
    Its repr is short: a failing example must not print a 50 MiB body."""

    def __repr__(self) -> str:
        shown = {
            k: (v[:200] + b"...(%d bytes)" % len(v) if isinstance(v, bytes) and len(v) > 200 else v)
            for k, v in self.items()
        }
        return f"Answer({shown})"


@st.composite
def hostile_answer(draw) -> Answer:
    chat = draw(st.booleans())
    kind, body, budget = draw(hostile_body(chat))
    status = draw(st.sampled_from([200] * 6 + [404, 429, 500, 503]))
    ctype = draw(
        st.sampled_from(
            [b"application/json"] * 6
            + [b"application/json; charset=utf-8", b"text/html", b"text/plain", b"", b"application/jsonx"]
        )
    )
    framing = draw(st.sampled_from(["length", "length", "chunked", "close", "truncated", "trailing"]))
    head = b"HTTP/1.1 %d Whatever\r\n" % status + (b"content-type: %s\r\n" % ctype if ctype else b"")
    if framing in ("length", "trailing"):
        raw = (
            head
            + b"content-length: %d\r\n\r\n" % len(body)
            + body
            + (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}" if framing == "trailing" else b"")
        )
    elif framing == "chunked":
        size = draw(st.integers(1, 64)) if len(body) < 50_000 else 1 << 16  # framing keeps a depth bomb under LIMIT
        chunks = b"".join(
            b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size]) for i in range(0, len(body), size)
        )
        raw = head + b"transfer-encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
    elif framing == "close":
        raw = head + b"connection: close\r\n\r\n" + body
    else:
        raw = head + b"content-length: %d\r\n\r\n" % (len(body) + 10) + body
    path = "/v1/chat/completions" if chat else "/generate"
    return Answer(path=path, raw=raw, status=status, body=body, ctype=ctype, framing=framing, kind=kind, budget=budget)


def post(
    url: str, path: str, rid: str, body: dict | None = None, headers: dict | None = None, raw: bytes | None = None
):
    """``(status, body bytes, headers)`` of one POST."""
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    try:
        data = (
            raw
            if raw is not None
            else json.dumps(body or {"text": "a", "sampling_params": {"max_new_tokens": 3}}).encode()
        )
        conn.request(
            "POST",
            path,
            body=data,
            headers={"Content-Type": "application/json", "X-Request-Id": rid, **(headers or {})},
        )
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


KNOWN_RULES = set(RULES) | set(PROXY_RULES)


def is_json(ctype: bytes) -> bool:
    return ctype.split(b";")[0] == b"application/json"


def passes(answer: dict) -> bool:
    """The one kind of answer a proxy may pass in enforce mode."""
    return (
        answer["kind"] == "valid"
        and answer["status"] == 200
        and answer["framing"] != "truncated"
        and is_json(answer["ctype"])
    )


def ask(stack, mode: str, path: str, raw: bytes, budget: int = 3):
    upstream, proxies = stack
    rid = f"fuzz-{next(ids)}"
    upstream.answers[rid.encode()] = raw
    request = (
        {"messages": [{"role": "user", "content": "a"}], "max_tokens": budget}
        if path.startswith("/v1")
        else {"text": "a", "sampling_params": {"max_new_tokens": budget}}
    )
    try:
        return post(proxies[mode].url, path, rid, request)
    finally:
        del upstream.answers[rid.encode()]


FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def expected_rule(answer: dict) -> str | None:
    """The rule an answer must be refused with, where the answer alone decides it."""
    if answer["kind"] == "huge":
        return "upstream_too_large"
    if answer["framing"] == "truncated":
        return "upstream_unreachable"
    if answer["status"] != 200:
        return "upstream_status"
    if not is_json(answer["ctype"]):
        return "malformed_response"
    return "length_clipped" if answer["kind"] == "clipped" else None


@settings(FUZZ, max_examples=300)
@given(answer=hostile_answer())
def test_enforce_mode_answers_every_hostile_upstream_answer_with_502_and_a_rule(stack, answer):
    status, body, headers = ask(stack, "enforce", answer["path"], answer["raw"], answer["budget"])
    if passes(answer):
        assert (status, headers["x-centerline-audit"]) == (200, "ok") and body == answer["body"]
        return
    assert (status, headers["content-type"]) == (502, "application/json"), (
        status,
        body[:200],
    )  # never the hostile body
    error = json.loads(body)["error"]
    assert error["rule"] in KNOWN_RULES and error["message"], error
    assert error["rule"] == (expected_rule(answer) or error["rule"]), (error, answer["kind"], answer["framing"])
    if error["rule"] == "upstream_too_large":
        assert error["expected"] == LIMIT
    if error["rule"] == "upstream_status":
        assert error["found"] == answer["status"]


@settings(FUZZ, max_examples=150)
@given(answer=hostile_answer())
def test_observe_mode_passes_what_the_upstream_answered_with_a_verdict(stack, answer):
    status, body, headers = ask(stack, "observe", answer["path"], answer["raw"], answer["budget"])
    verdict = headers["x-centerline-audit"]
    rule = expected_rule(answer)
    if rule in ("upstream_too_large", "upstream_unreachable"):  # no whole answer to pass on
        assert (status, json.loads(body)["error"]["rule"]) == (502, rule)
        assert verdict.startswith(f"fail; rule={rule}")
        return
    assert status == answer["status"] and body == answer["body"]
    if passes(answer):
        assert verdict == "ok"
    else:
        found = verdict.split("; ")[1].removeprefix("rule=")
        assert found in KNOWN_RULES and (rule is None or found == rule), verdict


def test_a_50_mib_answer_is_cut_off_at_the_limit_and_named(stack):
    sent = huge()
    status, body, _ = ask(
        stack,
        "enforce",
        "/generate",
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(sent) + sent,
    )
    error = json.loads(body)["error"]
    assert (status, error["rule"], error["expected"]) == (502, "upstream_too_large", LIMIT)
    assert f"exceeds {LIMIT} bytes (--max-upstream-response-bytes)" in error["message"]

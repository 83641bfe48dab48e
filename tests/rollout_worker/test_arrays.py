"""The proxy's binary answer (shared/response_arrays.py): a worker packs the same batches from it
as from SGLang's JSON, for doubles here and for real SGLang responses through a real proxy."""

from __future__ import annotations

import math
import urllib.error
import urllib.request

import numpy as np
import orjson
import pytest

from rollout_worker.packing import samples_from_arrays
from router_proxy import answer
from router_proxy.audit import audit_body
from shared import response_arrays
from shared.msgpack_arrays import WireError, encode_map
from shared.sampling import Sampling
from shared.wire import ARRAY_FIELDS, Batch
from tests.json_samples import samples_from_response
from tests.rollout_worker.test_packing import SELECTED, TASK, VOCAB, K, native, pack, pack_responses

ARRAYS_ACCEPT = {"Accept": response_arrays.MEDIA_TYPE}


def assert_same_batches(a: Batch, b: Batch) -> None:
    names = ("batch_id", "producer", "task_id", "attempt", "parts", "weight_version", "mode", "k")
    for name in (*names, "temperature", "top_p", "top_k"):
        assert getattr(a, name) == getattr(b, name), name
    assert (a.sample_ids, a.group_ids) == (b.sample_ids, b.group_ids)
    for name in ARRAY_FIELDS:  # bit for bit, dtype and shape included (NaN/-inf compare equal)
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name


def binary_samples(body: bytes, *, endpoint: str = "generate", mode: str = "selected", k: int = K):
    """What the worker gets through the proxy: the audit's binary answer, decoded."""
    result = audit_body(body, endpoint=endpoint, mode=mode, k=k, vocab_size=VOCAB, arrays=True)
    return samples_from_arrays(response_arrays.decode(result.reply))


def json_samples(body: bytes, *, endpoint: str = "generate", mode: str = "selected", k: int = K):
    """What the worker packed before the binary answer: SGLang's JSON, parsed."""
    return samples_from_response(orjson.loads(body), endpoint=endpoint, mode=mode, k=k)


SUPPORT = [
    native([(-0.9, 65)], support=[[(math.log(0.6), 65), (math.log(0.4), 66)]], text="A"),
    native([(-1.2, 66)], support=[[(math.log(0.6), 65), (math.log(0.4), 66)]], text="B", finish="length"),
]
MIXED = [SELECTED[0], native([(-1.5, 66)], tops=[[(-0.5, 65), (-1.5, 66), (-2.5, 67)]], version="default")]


@pytest.mark.parametrize(
    "doc, mode", [(SELECTED, "selected"), (SUPPORT, "support"), (MIXED, "selected"), (SELECTED[0], "selected")]
)
def test_the_binary_answer_packs_the_same_batches_as_the_json(doc, mode):
    body = orjson.dumps(doc)
    samples, json_way = binary_samples(body, mode=mode), json_samples(body, mode=mode)
    assert [(s.text, s.finish_reason) for s in samples] == [(s.text, s.finish_reason) for s in json_way]
    rewards = (1.0, 0.0)[: len(samples)]
    assert_same_batches(pack(samples, rewards=rewards, mode=mode), pack(json_way, rewards=rewards, mode=mode))


def test_a_chat_answer_carries_the_prompt_ids_sglang_rendered():
    choices = [
        {"index": i, "message": {"content": s["text"]}, "meta_info": s["meta_info"], "prompt_token_ids": [1, 2, 3]}
        for i, s in enumerate(SELECTED)
    ]
    body = orjson.dumps({"choices": choices})
    result = audit_body(body, endpoint="chat", mode="selected", k=K, vocab_size=VOCAB, arrays=True)
    found = response_arrays.decode(result.reply)
    assert found.prompt_ids == [1, 2, 3] and found.texts == ["A", "B"]
    assert_same_batches(pack(samples_from_arrays(found)), pack(json_samples(body, endpoint="chat")))


def test_a_large_scanned_response_packs_the_same_batches_either_way():
    from centerline.synth import native_response

    body = native_response(512, 128, VOCAB)  # above SCAN_MIN_BYTES: candidate rows scanned, not parsed
    found = binary_samples(body, k=128)
    assert_same_batches(pack_k(found, 128), pack_k(json_samples(body, k=128), 128))


def pack_k(samples, k: int) -> Batch:
    rewards = np.arange(len(samples), dtype=np.float64)
    return pack_responses(
        TASK,
        [1, 2],
        samples,
        rewards,
        rewards - rewards.mean(),
        producer="w0",
        sampling=Sampling(k=k, temperature=1.0, top_p=1.0, top_k=-1, mode="selected"),
    )


def test_a_message_that_disagrees_with_itself_is_refused_naming_the_field():
    good = answer.from_body(orjson.dumps(SELECTED), "generate", mode="selected", k=K)
    head = {"v": 1, "texts": good.texts, "finish_reasons": good.finish_reasons, "weight_versions": good.weight_versions}
    arrays = {name: (getattr(good, name), dtype) for name, dtype in response_arrays.ARRAYS.items()}
    assert response_arrays.decode(encode_map({**head, "prompt_ids": None}, arrays)).texts == ["A", "B"]
    cases = [
        ({**head, "texts": ["A"]}, arrays, "offsets of shape"),
        ({**head, "weight_versions": ["3", "3"]}, arrays, "weight_versions"),
        ({**head, "v": 2}, arrays, "version 2"),
        (head, {**arrays, "offsets": (np.array([0, 3, 2]), "int64")}, "offsets must rise"),
        (head, {**arrays, "cand_ids": (good.cand_ids[:, :2], "int32")}, "per-token arrays"),
        (head, {**arrays, "response_ids": (good.response_ids, "int64")}, "dtype 'int64'"),
    ]
    for h, a, message in cases:
        with pytest.raises(WireError, match=message):
            response_arrays.decode(encode_map(h, a))


def test_the_binary_answer_carries_each_samples_cached_prompt_tokens():
    """SGLang's ``meta_info.cached_tokens`` per sample (what a session measures its prefix cache by);
    a value that is no count travels as nil; a message without the field decodes to None."""
    doc = [{**SELECTED[0], "meta_info": {**SELECTED[0]["meta_info"], "cached_tokens": 7}}, SELECTED[1]]
    doc[1] = {**doc[1], "meta_info": {**doc[1]["meta_info"], "cached_tokens": "7"}}
    result = audit_body(orjson.dumps(doc), endpoint="generate", mode="selected", k=K, vocab_size=VOCAB, arrays=True)
    assert response_arrays.decode(result.reply).cached_tokens == [7, None]
    good = answer.from_body(orjson.dumps(SELECTED), "generate", mode="selected", k=K)
    head = {"v": 1, "texts": good.texts, "finish_reasons": good.finish_reasons, "weight_versions": good.weight_versions}
    arrays = {name: (getattr(good, name), dtype) for name, dtype in response_arrays.ARRAYS.items()}
    assert response_arrays.decode(encode_map(head, arrays)).cached_tokens is None
    for bad in ([3], [3, -1], [3, 1.5], "3"):
        with pytest.raises(WireError, match="cached_tokens must be absent or 2 counts"):
            response_arrays.decode(encode_map({**head, "cached_tokens": bad}, arrays))


# ---------------------------------------------------------------------------- real SGLang through a real proxy


class ReplayingRelay:
    """An upstream in front of real SGLang that answers a training request body it has seen
    before with SGLang's recorded answer to it: one real response, served to both clients."""

    def __init__(self, target: str):
        import http.server
        import threading

        recorded: dict[bytes, tuple[int, str, bytes]] = {}

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the proxy's pool expects

            def do_GET(self):
                self.answer(*forward("GET", self.path, None))

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                key = self.path.encode() + b" " + body
                if key not in recorded:
                    recorded[key] = forward("POST", self.path, body)
                self.answer(*recorded[key])

            def answer(self, status: int, ctype: str, body: bytes):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        def forward(method: str, path: str, body: bytes | None) -> tuple[int, str, bytes]:
            req = urllib.request.Request(target + path, data=body, method=method)
            req.add_header("Content-Type", "application/json")
            try:
                with urllib.request.urlopen(req, timeout=300) as resp:
                    return resp.status, resp.headers.get("Content-Type", "application/json"), resp.read()
            except urllib.error.HTTPError as exc:
                return exc.code, exc.headers.get("Content-Type", "application/json"), exc.read()

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def proxies(tmp_path_factory, sglang_server, model_dir):
    """Proxies at K=128, native /generate and chat, in front of a replaying relay to the shared SGLang server."""
    from tests.router_proxy.conftest import ProxyProcess

    root = tmp_path_factory.mktemp("arrays")
    relay = ReplayingRelay(sglang_server.serve(model_dir).url)
    started = {}
    try:
        for endpoint in ("generate", "chat"):
            started[endpoint] = proxy = ProxyProcess(
                root / f"{endpoint}.log",
                relay.url,
                "--rollout-top-logprobs-num",
                "128",
                "--rollout-endpoint",
                endpoint,
            )
            status, body = proxy.wait_probed()
            assert status == 200, body
        yield {endpoint: proxy.url for endpoint, proxy in started.items()}
    finally:
        for proxy in started.values():
            proxy.stop()
        relay.stop()


def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, str, bytes]:
    req = urllib.request.Request(
        url, data=orjson.dumps(body), method="POST", headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return resp.status, resp.headers.get("Content-Type"), resp.read()


REQUESTS = {
    "generate": (
        "/generate",
        {"input_ids": [104, 105, 106], "sampling_params": {"max_new_tokens": 24, "n": 2}},
    ),
    "chat": (
        "/v1/chat/completions",
        {
            "model": "default",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 24,
            "n": 2,
        },
    ),
}


@pytest.mark.integration
@pytest.mark.usefixtures("sglang")
@pytest.mark.parametrize("endpoint", ["generate", "chat"])
def test_real_sglang_responses_pack_the_same_batches_from_the_binary_answer_as_from_the_json(proxies, endpoint):
    path, request = REQUESTS[endpoint]
    url = proxies[endpoint] + path
    status, ctype, plain = post(url, request)
    assert (status, ctype) == (200, "application/json")
    status, ctype, binary = post(url, request, ARRAYS_ACCEPT)
    assert (status, ctype) == (200, response_arrays.MEDIA_TYPE)
    found = response_arrays.decode(binary)
    json_way = samples_from_response(orjson.loads(plain), endpoint=endpoint, mode="selected", k=128)
    assert found.num_samples == len(json_way) == 2 and found.cand_ids.shape[1] == 128
    if endpoint == "chat":
        assert found.prompt_ids == orjson.loads(plain)["choices"][0]["prompt_token_ids"]
    else:
        assert found.cached_tokens == [o["meta_info"]["cached_tokens"] for o in orjson.loads(plain)]
    # the relay served SGLang's one answer to both: the same response in two forms
    assert_same_batches(pack_k(samples_from_arrays(found), 128), pack_k(json_way, 128))
    assert [s.text for s in samples_from_arrays(found)] == [s.text for s in json_way]

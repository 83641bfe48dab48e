"""The engines' admin key. `centerline sglang` passes CENTERLINE_ENGINE_ADMIN_API_KEY to SGLang
as --admin-api-key; SGLang then answers its admin endpoints 401 without ``Authorization:
Bearer <key>`` and serves everything else without it; the trainer's weight publisher is the
client that holds the key. Needs a server unlike the shared one, which has no key: the
session's second server (tests/conftest.py: keyed_sglang)."""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from shared import admin_key
from tests.processes import ADMIN_KEY, Process, free_port, http, wait_until
from trainer_service.weights import WeightPublisher

pytestmark = pytest.mark.integration
KEY = ADMIN_KEY


@pytest.fixture
def keyed(keyed_sglang):
    return keyed_sglang


def call(method: str, url: str, body: bytes | None = None, authorization: str | None = None) -> tuple[int, bytes]:
    headers = {
        "Content-Type": "application/json",
        **({"Authorization": authorization} if authorization is not None else {}),
    }
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize(
    "authorization", [None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x", f"Bearer  {KEY}", "Bearer "]
)
@pytest.mark.parametrize(
    "method, path", [("POST", "/update_weights_from_disk"), ("GET", "/flush_cache"), ("POST", "/flush_cache")]
)
def test_admin_endpoint_without_the_key_is_401_unauthorized(keyed, other_model_dir, method, path, authorization):
    body = (
        json.dumps({"model_path": str(other_model_dir), "weight_version": "9"}).encode()
        if path.startswith("/update")
        else None
    )
    before = keyed.weight_version()
    assert call(method, keyed.url + path, body, authorization) == (401, b'{"error":"Unauthorized"}')
    assert keyed.weight_version() == before != "9"


@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_admin_endpoint_with_the_key_is_served(keyed, scheme):
    status, text = call("POST", keyed.url + "/flush_cache", authorization=f"{scheme} {KEY}")
    assert status == 200 and text.startswith(b"Cache flushed.")


def test_weight_update_with_the_key_switches_the_version(keyed, model_dir):
    body = json.dumps({"model_path": str(model_dir), "weight_version": "keyed"}).encode()
    status, reply = call("POST", keyed.url + "/update_weights_from_disk", body, f"Bearer {KEY}")
    assert (status, keyed.weight_version()) == (200, "keyed"), reply


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/health"),
        ("GET", "/model_info"),
        ("GET", "/get_model_info"),
        ("GET", "/server_info"),
        ("GET", "/v1/models"),
    ],
)
def test_other_endpoints_need_no_key(keyed, method, path):
    assert call(method, keyed.url + path)[0] == 200


def test_generation_needs_no_key(keyed):
    status, out = http("POST", keyed.url + "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and len(out["output_ids"]) == 1


def test_server_info_shows_the_admin_key_to_anyone(keyed):
    """SGLang 0.5.23 reports its arguments, the key among them, on the unauthenticated /server_info
    and /get_server_info (its ``launch_command`` is the arguments merged from the --config file):
    whoever reaches a server's HTTP port can read the key, so nothing in front of a server may pass
    those paths through, and only the trainer and the router reach one (docs/design.md section 11)."""
    for path in ("/server_info", "/get_server_info"):
        status, info = http("GET", keyed.url + path)
        assert (status, info["admin_api_key"]) == (200, KEY)
        words = info["launch_command"].split()
        assert words[words.index("--admin-api-key") + 1] == KEY


def group_members(pgid: int) -> list[int]:
    """The processes of the process group ``pgid`` (field 5 of /proc/PID/stat, after the name)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # gone since the listing
            continue
        if int(fields[2]) == pgid:
            members.append(int(stat.parent.name))
    return members


def test_the_key_is_on_no_command_line_of_the_server(keyed):
    """`centerline sglang` hands SGLang the key in a --config file, not as a flag: no process of
    the server (SGLang, its scheduler and detokenizer, the watchdog) shows it in /proc/PID/cmdline,
    which every user of the machine may read, nor does the server's environment hold it; the file
    is removed once the server answers."""
    members = group_members(keyed.proc.pid)
    assert keyed.proc.pid in members and len(members) >= 3, members
    cmdlines = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in members}
    assert not [pid for pid, argv in cmdlines.items() if any(KEY.encode() in arg for arg in argv)], cmdlines
    assert KEY.encode() not in Path(f"/proc/{keyed.proc.pid}/environ").read_bytes()
    server = [arg.decode() for arg in cmdlines[keyed.proc.pid]]
    config = Path(server[server.index("--config") + 1])
    assert config.name == "sglang-admin.yaml"
    wait_until(lambda: not config.parent.exists(), 30, "the key's --config file removed", keyed.proc)


@pytest.fixture(scope="module")
def keyed_proxy(keyed_sglang, tmp_path_factory):
    """`centerline proxy` in front of the keyed server: what a worker reaches."""
    port = free_port()
    argv = [sys.executable, "-m", "centerline", "proxy", "--upstream", keyed_sglang.url, "--port", str(port)]
    argv += ["--rollout-top-logprobs-num", "8", "--vocab-size", "260"]
    proxy = Process(argv, tmp_path_factory.mktemp("proxy") / "proxy.log")
    try:
        wait_until(lambda: http("GET", f"http://127.0.0.1:{port}/ready", timeout=2)[0] == 200, 120, "proxy", proxy.proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proxy.stop()


@pytest.mark.parametrize("path", ["/server_info", "/get_server_info"])
def test_the_proxy_never_passes_the_admin_key_on(keyed_proxy, path):
    """Whoever reaches the proxy is a rollout client, not the trainer: the proxy answers 403 and no
    answer of it may carry the engines' key (docs/design.md section 7: admin powers are never reachable through it)."""
    status, body = call("GET", keyed_proxy + path)
    assert KEY.encode() not in body, (status, body[:300])
    message = f"{path} is an engine admin endpoint and is not reachable through the proxy; call each engine directly"
    assert (status, json.loads(body)) == (403, {"error": {"rule": "admin_forbidden", "message": message}})


def test_no_answer_of_the_proxy_carries_the_key(keyed_proxy):
    """Every route the proxy serves a worker, the ones it forwards and its own, and a sampling
    request: each answers, and none with the engines' key."""
    gets = ["/health", "/health_generate", "/v1/models", "/model_info", "/get_model_info", "/ready", "/liveness"]
    gets += ["/capabilities", "/metrics"]
    answers = {path: call("GET", keyed_proxy + path) for path in gets}
    body = {"text": "a", "sampling_params": {"max_new_tokens": 1}, "return_logprob": True, "top_logprobs_num": 8}
    answers["/generate"] = call("POST", keyed_proxy + "/generate", json.dumps(body).encode())
    assert {path: status for path, (status, _) in answers.items()} == dict.fromkeys(answers, 200)
    assert [path for path, (_, text) in answers.items() if KEY.encode() in text] == []


def test_weight_publisher_with_the_key_updates_the_server(keyed, other_model_dir):
    async def update():
        publisher = WeightPublisher(None, [keyed.url], admin_api_key=KEY)
        try:
            return await publisher.update(keyed.url, 1, other_model_dir)
        finally:
            await publisher.close()

    assert asyncio.run(update()) is True
    assert keyed.weight_version() == "1"


@pytest.mark.parametrize(
    "key, problem", [("wrong", "is not the engine's --admin-api-key"), (None, "is unset, and the engine requires one")]
)
def test_weight_publisher_refused_by_the_server_names_the_server_and_the_setting(
    keyed, other_model_dir, monkeypatch, key, problem
):
    monkeypatch.delenv(admin_key.KEY_ENV, raising=False)
    monkeypatch.delenv(admin_key.KEY_FILE_ENV, raising=False)

    async def update():
        publisher = WeightPublisher(None, [keyed.url], admin_api_key=key)
        try:
            return await publisher.update(keyed.url, 5, other_model_dir)
        finally:
            await publisher.close()

    before = keyed.weight_version()
    with pytest.raises(admin_key.AdminKeyError) as info:
        asyncio.run(update())
    assert str(info.value) == (
        f"engine {keyed.url} refused /pause_generation with HTTP 401: the trainer's admin key "
        f"(CENTERLINE_ENGINE_ADMIN_API_KEY or CENTERLINE_ENGINE_ADMIN_API_KEY_FILE) {problem}"
    )
    assert keyed.weight_version() == before != "5"
    assert http("GET", keyed.url + "/ready")[0] == 200  # refused, the pause never happened


def test_the_key_comes_from_the_environment_or_a_file(tmp_path):
    (tmp_path / "key").write_text("from-file\n")
    assert admin_key.key_from_env({}) is None
    assert admin_key.key_from_env({admin_key.KEY_ENV: ""}) is None
    assert admin_key.key_from_env({admin_key.KEY_ENV: "from-env"}) == "from-env"
    assert admin_key.key_from_env({admin_key.KEY_FILE_ENV: str(tmp_path / "key")}) == "from-file"
    with pytest.raises(
        admin_key.AdminKeyError,
        match="both CENTERLINE_ENGINE_ADMIN_API_KEY and CENTERLINE_ENGINE_ADMIN_API_KEY_FILE are set",
    ):
        admin_key.key_from_env({admin_key.KEY_ENV: "a", admin_key.KEY_FILE_ENV: str(tmp_path / "key")})
    with pytest.raises(
        admin_key.AdminKeyError,
        match=r"CENTERLINE_ENGINE_ADMIN_API_KEY_FILE=.*/missing: cannot read the key file "
        r"\(No such file or directory\)",
    ):
        admin_key.key_from_env({admin_key.KEY_FILE_ENV: str(tmp_path / "missing")})

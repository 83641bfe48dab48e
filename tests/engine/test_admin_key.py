"""--admin-api-key: the engine's admin endpoints answer as SGLang's do (401 without the key),
everything else stays open, and the trainer's weight publisher is the client that holds it."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from shared import admin_key
from trainer_service.weights import WeightPublisher

pytestmark = pytest.mark.integration
KEY = "k3y-under-test"


@pytest.fixture(scope="module")
def keyed(start_engine, model_dir):
    return start_engine(model_dir, "--admin-api-key", KEY)


def version(engine) -> str:
    return json.loads(call("GET", engine.url + "/model_info")[1])["weight_version"]


def call(method: str, url: str, body: dict | None = None, authorization: str | None = None):
    headers = {"Content-Type": "application/json", **({"Authorization": authorization} if authorization is not None else {})}
    req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", KEY, f"Bearer {KEY}x", "Bearer "])
@pytest.mark.parametrize("method, path", [("POST", "/update_weights_from_disk"), ("GET", "/flush_cache"), ("POST", "/flush_cache")])
def test_admin_endpoint_without_the_key_is_401_unauthorized(keyed, model_dir, method, path, authorization):
    body = {"model_path": str(model_dir), "weight_version": "9"} if path.startswith("/update") else None
    before = version(keyed)
    assert call(method, keyed.url + path, body, authorization) == (401, b'{"error":"Unauthorized"}')
    assert version(keyed) == before != "9"


def test_admin_endpoint_with_the_key_is_served(keyed):
    status, text = call("POST", keyed.url + "/flush_cache", authorization=f"bearer {KEY}")  # the scheme in any case, as SGLang
    assert status == 200 and text.startswith(b"Cache flushed.")


@pytest.mark.parametrize("method, path", [("GET", "/health"), ("GET", "/model_info"), ("GET", "/get_server_info"), ("GET", "/v1/models")])
def test_other_endpoints_need_no_key(keyed, method, path):
    assert call(method, keyed.url + path)[0] == 200


def test_generation_needs_no_key(keyed):
    status, out = call("POST", keyed.url + "/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1}})
    assert status == 200 and len(json.loads(out)["output_ids"]) == 1


def test_weight_publisher_with_the_key_updates_the_engine(keyed, other_model_dir):
    async def update():
        publisher = WeightPublisher(None, [keyed.url], admin_api_key=KEY)
        try:
            return await publisher.update(keyed.url, 1, other_model_dir)
        finally:
            await publisher.close()

    assert asyncio.run(update()) is True
    assert version(keyed) == "1"


@pytest.mark.parametrize("key, problem", [("wrong", "is not the engine's --admin-api-key"), (None, "is unset, and the engine requires one")])
def test_weight_publisher_refused_by_the_engine_names_the_engine_and_the_setting(keyed, other_model_dir, monkeypatch, key, problem):
    monkeypatch.delenv(admin_key.KEY_ENV, raising=False)
    monkeypatch.delenv(admin_key.KEY_FILE_ENV, raising=False)

    async def update():
        publisher = WeightPublisher(None, [keyed.url], admin_api_key=key)
        try:
            return await publisher.update(keyed.url, 5, other_model_dir)
        finally:
            await publisher.close()

    before = version(keyed)
    with pytest.raises(admin_key.AdminKeyError) as info:
        asyncio.run(update())
    assert str(info.value) == (f"engine {keyed.url} refused the weight update with HTTP 401: the trainer's admin key "
                               f"(CENTERLINE_ENGINE_ADMIN_API_KEY or CENTERLINE_ENGINE_ADMIN_API_KEY_FILE) {problem}")  # fmt: skip
    assert version(keyed) == before != "5"


def test_the_key_comes_from_the_environment_or_a_file(tmp_path):
    (tmp_path / "key").write_text("from-file\n")
    assert admin_key.key_from_env({}) is None
    assert admin_key.key_from_env({admin_key.KEY_ENV: ""}) is None
    assert admin_key.key_from_env({admin_key.KEY_ENV: "from-env"}) == "from-env"
    assert admin_key.key_from_env({admin_key.KEY_FILE_ENV: str(tmp_path / "key")}) == "from-file"
    with pytest.raises(admin_key.AdminKeyError, match="both CENTERLINE_ENGINE_ADMIN_API_KEY and CENTERLINE_ENGINE_ADMIN_API_KEY_FILE are set"):
        admin_key.key_from_env({admin_key.KEY_ENV: "a", admin_key.KEY_FILE_ENV: str(tmp_path / "key")})
    with pytest.raises(admin_key.AdminKeyError, match=r"CENTERLINE_ENGINE_ADMIN_API_KEY_FILE=.*/missing: cannot read the admin key file"):
        admin_key.key_from_env({admin_key.KEY_FILE_ENV: str(tmp_path / "missing")})


def test_bearer_check_refuses_malformed_and_non_ascii_headers():
    assert admin_key.authorized(f"Bearer {KEY}", KEY) and admin_key.authorized(f"BEARER {KEY}", KEY)
    for header in (None, "", "Bearer", f"Bearer  {KEY}", f"Bearer {KEY} ", "Bearer k\u00e9y", "Bearer \udcff"):
        assert not admin_key.authorized(header, KEY), header

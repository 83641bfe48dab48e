"""Shared fixtures for the embedded engine: a model made by `centerline init-model` and a
real engine subprocess on a free loopback port, ready once GET /health answers 200.

Reuse pattern (router_proxy tests): `start_engine(model_dir)` returns an `EngineProcess`
with `.url`; the session stops it. Test modules get the helpers through the `tools`
fixture rather than importing this file.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body=None, timeout: float = 60.0) -> tuple[int, object]:
    """One HTTP request with a JSON body; returns (status, parsed JSON or text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode()


def wait_until(check, deadline_s: float, what: str, proc: subprocess.Popen | None = None):
    """Poll `check()` until it returns a truthy value or the deadline passes."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        try:
            value = check()
            if value:
                return value
        except OSError:
            pass
        time.sleep(0.1)  # polling interval, not synchronisation
    raise TimeoutError(f"{what} not ready after {deadline_s}s")


class EngineProcess:
    def __init__(self, model_dir: Path, log_path: Path, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "centerline", "engine", "--model", str(model_dir), "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: http("GET", self.url + "/health", timeout=2)[0] == 200, 90, "engine", self.proc)
        except Exception:
            self.stop()
            raise RuntimeError(f"engine failed to start:\n{log_path.read_text()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def init_model(out: Path, seed: int) -> Path:
    cmd = [sys.executable, "-m", "centerline", "init-model", "--out", str(out), "--seed", str(seed)]
    subprocess.run(cmd, cwd=REPO, env=ENV, check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("model") / "seed0", seed=0)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("model") / "seed1", seed=1)


@pytest.fixture(scope="session")
def start_engine(tmp_path_factory):
    started: list[EngineProcess] = []

    def start(model: Path, *extra: str) -> EngineProcess:
        engine = EngineProcess(model, tmp_path_factory.mktemp("engine") / "engine.log", *extra)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


@pytest.fixture(scope="session")
def engine(start_engine, model_dir) -> EngineProcess:
    """The shared engine: serves `model_dir` at weight version "0"; tests must not update it."""
    return start_engine(model_dir)


@pytest.fixture(scope="session")
def reference(model_dir):
    """An independent float64 transformers forward over the same weights: ids -> logits [L, V]."""
    import torch
    from transformers import AutoModelForCausalLM

    def load(path: Path):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()

        def logits(ids: list[int]) -> torch.Tensor:
            with torch.inference_mode():
                return model(torch.tensor([ids])).logits[0]

        return logits

    load.default = load(model_dir)
    return load


@pytest.fixture(scope="session")
def api_types():
    """SGLang 0.5.23's generated JSON contract types, loaded by file path (never `import sglang`)."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang==0.5.23 (installed --no-deps) is required"
    path = Path(list(spec.submodule_search_locations)[0]) / "api" / "v1" / "api_types.py"
    module_spec = importlib.util.spec_from_file_location("sglang_api_types_standalone", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # msgspec resolves the annotations through sys.modules
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tools():
    return SimpleNamespace(http=http, free_port=free_port, wait_until=wait_until, init_model=init_model, env=ENV, repo=REPO)

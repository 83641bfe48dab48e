"""Processes for the proxy tests: the upstream double (a deliberately broken upstream), the
proxy, and the session's real SGLang server behind the real router (tests/conftest.py).

Every server is a real process on a free loopback port, ready when polled endpoints answer
(never a fixed sleep); all are stopped at the end of their fixture's scope.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.processes import REPO, Process, free_port, http, wait_until


class Double(Process):
    def __init__(self, log_path: Path, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(
            [sys.executable, str(REPO / "tests/router_proxy/upstream_double.py"), "--port", str(self.port), *flags],
            log_path,
        )
        wait_until(lambda: http("GET", self.url + "/health", timeout=2)[0] == 200, 30, "upstream double", self.proc)

    def next(self, body: str, status: int = 200) -> None:
        assert http("POST", self.url + "/_next", {"body": body, "status": status})[0] == 200

    def last(self):
        return http("GET", self.url + "/_last")[1]

    def last_headers(self) -> dict:
        return http("GET", self.url + "/_last_headers")[1]


class ProxyProcess(Process):
    def __init__(self, log_path: Path, upstream: str, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "centerline", "proxy", "--upstream", upstream, "--port", str(self.port), *flags]
        super().__init__(cmd, log_path)
        try:
            wait_until(lambda: http("GET", self.url + "/liveness", timeout=2)[0] == 200, 60, "proxy", self.proc)
        except Exception:  # noqa: BLE001 (whatever went wrong, the log says more than the exception)
            self.stop()
            raise RuntimeError(f"proxy failed to start:\n{self.log()}") from None

    def wait_probed(self, deadline: float = 60.0) -> tuple[int, dict]:
        """/ready once the first capability probe has finished (ready or not, with its cause)."""

        def probed():
            status, body = http("GET", self.url + "/ready", timeout=5)
            return (status, body) if body.get("cause") != "capability probe not finished" else None

        return wait_until(probed, deadline, "first capability probe", self.proc)


@pytest.fixture
def start(tmp_path):
    """``start(Kind, *args)``: a process of that kind, stopped after the test."""
    started: list[Process] = []

    def run(kind, *args):
        proc = kind(tmp_path / f"{kind.__name__.lower()}{len(started)}.log", *args)
        started.append(proc)
        return proc

    yield run
    for proc in reversed(started):
        proc.stop()


@pytest.fixture
def sglang_stack(sglang, sglang_router, model_dir):
    """The session's real SGLang server (serving ``model_dir`` at "default") and sglang-router
    0.3.2 in front of it, with the model's vocabulary size: SGLang's /model_info has none."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    return SimpleNamespace(server=sglang.url, router=sglang_router.url, vocab=vocab)


@pytest.fixture(scope="session")
def kinds():
    """The process kinds and helpers, for test modules (conftest is not importable in importlib mode)."""
    return SimpleNamespace(Double=Double, ProxyProcess=ProxyProcess, http=http, wait_until=wait_until)

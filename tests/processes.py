"""Real processes for integration tests: free loopback ports, JSON over HTTP, polling with a
deadline (never a fixed sleep), and child processes stopped with SIGTERM then SIGKILL."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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


class Process:
    """A child process with its log, stopped with SIGTERM (SIGKILL after 15 s)."""

    def __init__(self, cmd: list[str], log_path: Path):
        self.log_path = log_path
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class EngineProcess(Process):
    """`centerline engine` on a free port, ready once GET /health answers 200."""

    def __init__(self, model_dir: Path, log_path: Path, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__([sys.executable, "-m", "centerline", "engine", "--model", str(model_dir), "--port", str(self.port), *extra], log_path)
        try:
            wait_until(lambda: http("GET", self.url + "/health", timeout=2)[0] == 200, 90, "engine", self.proc)
        except Exception:
            self.stop()
            raise RuntimeError(f"engine failed to start:\n{log_path.read_text()}") from None


def init_model(out: Path, seed: int) -> Path:
    cmd = [sys.executable, "-m", "centerline", "init-model", "--out", str(out), "--seed", str(seed)]
    subprocess.run(cmd, cwd=REPO, env=ENV, check=True, capture_output=True)
    return out


async def stored_messages(nats_url: str, stream: str) -> list:
    """Every message ``stream`` holds, in sequence order, read with the message-get API (no
    consumer, so nothing is delivered or acked): nats-py ``RawStreamMsg``s (``seq``,
    ``subject``, ``headers``, ``data``)."""
    from shared.nats import connect

    nc = await connect(nats_url)
    js = nc.jetstream()
    try:
        state = (await js.stream_info(stream)).state
        return [await js.get_msg(stream, seq) for seq in range(state.first_seq, state.last_seq + 1)] if state.messages else []
    finally:
        await nc.close()

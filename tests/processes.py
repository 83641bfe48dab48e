"""Real processes for integration tests: free loopback ports, JSON over HTTP, polling with a
deadline (never a fixed sleep), and child processes stopped with SIGTERM then SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson

from centerline.ports import free_port

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(REPO)}
ADMIN_KEY = "k3y-under-test"  # the admin key of the session's second SGLang server (tests/conftest.py)


def fresh_peak_rss(argv: list[str]) -> list[str]:
    """``argv`` started through a shell's background child. Linux carries a process's peak RSS across
    exec, so a command started straight from a test worker (a gigabyte once models are loaded)
    would report the worker's peak as its own: libFuzzer's ``-rss_limit_mb`` then fails at once.
    The shell's child is forked from the small shell, and counts from nothing."""
    return ["sh", "-c", '"$@" & wait $!', "sh", *argv]


def http(method: str, url: str, body=None, timeout: float = 60.0, headers: dict | None = None) -> tuple[int, object]:
    """One HTTP request with a JSON body; returns (status, parsed JSON or text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
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
    """Poll `check()` until it returns a truthy value or the deadline passes; raise as soon as
    ``proc`` has exited with `check()` still false (a process may finish what was awaited and exit
    between two polls)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        exited = proc is not None and proc.poll() is not None
        try:
            value = check()
            if value:
                return value
        except OSError:
            pass
        if exited:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        time.sleep(0.1)  # polling interval, not synchronisation
    raise TimeoutError(f"{what} not ready after {deadline_s}s")


def metrics_lines(run_dir: Path) -> list[dict]:
    """The trainer's ``metrics.jsonl`` in ``run_dir``, one record per step so far ([] before the first).
    A last line without its newline is one being written (a reader can see part of an append): left out."""
    path = run_dir / "metrics.jsonl"
    data = path.read_bytes() if path.exists() else b""
    return [orjson.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]


class Process:
    """A child process with its log, stopped with SIGTERM (SIGKILL after 15 s)."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict | None = None):
        """``env`` adds to the tests' environment (a key, say)."""
        self.log_path = log_path
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env={**ENV, **(env or {})}, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT
        )

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


class SGLangProcess(Process):
    """A real SGLang server, started by `centerline sglang` (the CPU recipe) on a free port and
    ready once GET /health answers 200. ``extra`` goes to SGLang itself (after ``--``);
    ``env`` adds to the environment (an admin key, say)."""

    def __init__(self, model_dir: Path, log_path: Path, *extra: str, env: dict | None = None, port: int | None = None):
        self.model_dir, self.extra, self.env = model_dir, extra, env or {}
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.start()

    def start(self) -> None:
        """Start (again, after `stop`) on the same port with the same flags."""
        cmd = [sys.executable, "-m", "centerline", "sglang", "--model", str(self.model_dir), "--port", str(self.port)]
        self.proc = subprocess.Popen(
            cmd + (["--", *self.extra] if self.extra else []),
            cwd=REPO,
            env={**ENV, **self.env},
            stdout=open(self.log_path, "ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_until(lambda: http("GET", self.url + "/health", timeout=2)[0] == 200, 180, "SGLang", self.proc)
        except Exception:  # noqa: BLE001 (whatever went wrong, the log says more than the exception)
            self.stop()
            raise RuntimeError(f"SGLang failed to start:\n{self.log()[-6000:]}") from None

    def stop(self) -> None:
        """SIGTERM to the server's process group, as `centerline up` stops it: the scheduler
        exits and the server follows within a second (alone, it drains and checks every 5 s;
        docs/sglang.md); SIGKILL to the whole group after 15 s, and to anything of it left behind."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # Children that outlived the parent. Its pid, reaped, may since be another process's (pids
        # wrap at 32768 here, and tests run side by side): then no old member holds the group any
        # more, and the number is left alone.
        if Path(f"/proc/{self.proc.pid}").exists():
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def weight_version(self) -> str:
        return http("GET", self.url + "/model_info", timeout=30)[1]["weight_version"]

    def serve(self, model_dir: Path) -> SGLangProcess:
        """Alive (started again if it died) and serving ``model_dir`` at weight version "default":
        what the ``sglang`` fixture hands over, for fixtures of a wider scope than a test."""
        if self.proc.poll() is not None or http("GET", self.url + "/health", timeout=5)[0] != 200:
            self.stop()
            self.start()
        if self.weight_version() != "default":
            body = {"model_path": str(model_dir), "weight_version": "default"}
            status, reply = http("POST", self.url + "/update_weights_from_disk", body)
            assert status == 200 and reply["success"], reply
        return self


class Router(Process):
    """The real SGLang router (`smg launch`, sglang-router wheel) in front of ``workers``, as
    ``centerline up`` starts it (``router_argv``: session affinity); ready once it has routed a
    request to a worker."""

    def __init__(self, log_path: Path, workers: list[str], *extra: str, api_key: str | None = None):
        """``api_key``: the router's ``--api-key``, which its readiness request then carries."""
        from centerline.sglang import router_argv

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        key_flags = ["--api-key", api_key] if api_key else []
        super().__init__(router_argv(workers, "127.0.0.1", self.port, free_port()) + key_flags + list(extra), log_path)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

        def routes():
            body = {"text": "a", "sampling_params": {"max_new_tokens": 1}}
            return http("POST", self.url + "/generate", body, timeout=5, headers=headers)[0] == 200

        try:
            wait_until(routes, 120, "sglang-router", self.proc)
        except Exception:  # noqa: BLE001 (whatever went wrong, the log says more than the exception)
            self.stop()
            raise RuntimeError(f"router failed to start:\n{self.log()[-6000:]}") from None


def init_model(out: Path, seed: int) -> Path:
    cmd = [sys.executable, "-m", "centerline", "init-model", "--out", str(out), "--seed", str(seed)]
    subprocess.run(cmd, cwd=REPO, env=ENV, check=True, capture_output=True)
    return out


async def stored_messages(nats_url: str, stream: str) -> list:
    """Every message ``stream`` holds, in sequence order, read with the message-get API (no
    consumer, so nothing is delivered or acked): nats-py ``RawStreamMsg``s (``seq``,
    ``subject``, ``headers``, ``data``)."""
    from shared.nats_client import connect

    nc = await connect(nats_url)
    js = nc.jetstream()
    try:
        state = (await js.stream_info(stream)).state
        return (
            [await js.get_msg(stream, seq) for seq in range(state.first_seq, state.last_seq + 1)]
            if state.messages
            else []
        )
    finally:
        await nc.close()

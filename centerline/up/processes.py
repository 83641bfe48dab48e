"""The processes of a run on one machine: each started in its own session with its log, its
environment stripped of what is not its own, restarted or ended when it dies.

``Supervisor`` starts and stops them (``centerline up``, the benches that start SGLang servers);
``wait_http`` waits for a server to answer; ``service_env`` is a service's environment (its own
NATS credentials only, no ``CENTERLINE_*`` settings variables: the run spec resolved them);
``sglang_argv`` is the command line of one ``centerline sglang`` server;
``restart_dead_nats_nodes`` starts again the NATS nodes that died.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from centerline import nats_users, sglang
from centerline.nats_server import EmbeddedNats, NatsCluster
from centerline.up import run_spec
from shared import admin_key

PYTHON = sys.executable


def service_env(base: Mapping[str, str], nats_user: str | None, passwords: Mapping[str, str]) -> dict[str, str]:
    """A service's environment: ``base`` without any NATS credential, plus ``nats_user``'s own
    (none for a service that does not use NATS), so no process holds another's password; and
    without ``CENTERLINE_*`` settings variables, which would beat the run spec's file (the spec
    composed them already: a user's variable reaches every service through it)."""
    settings = run_spec.setting_variables()
    env = {k: v for k, v in base.items() if not nats_users.is_secret_variable(k) and k not in settings}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if nats_user is not None:
        env |= nats_users.client_env(nats_user, passwords[nats_user])
    return env


class Supervisor:
    """Child processes started in their own sessions (so Ctrl-C reaches the launcher only).

    A process started with ``restart=True`` (the SGLang servers) that dies is started again,
    same command, port and key, up to ``MAX_RESTARTS`` times, as a supervisor would: the server
    comes back with its initial weights and the trainer sends it the latest version
    (trainer_service/weights.py ``watch``). Any other process that dies ends the run.
    """

    MAX_RESTARTS = 5

    def __init__(self, log_dir: Path, nats_passwords: Mapping[str, str]):
        self.log_dir = log_dir
        self.nats_passwords = nats_passwords
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.restartable: dict[str, tuple[list[str], dict[str, str]]] = {}
        self.restarts: dict[str, int] = {}

    def start(
        self,
        name: str,
        argv: list[str],
        nats_user: str | None = None,
        engine_key: str | None = None,
        restart: bool = False,
    ) -> subprocess.Popen:
        """``engine_key``: the engine's admin key, for the engine and the trainer; no other process gets one."""
        env = {
            k: v
            for k, v in service_env(os.environ, nats_user, self.nats_passwords).items()
            if k not in sglang.ADMIN_KEY_VARIABLES
        }
        if engine_key is not None:
            env[admin_key.KEY_ENV] = engine_key
        if restart:
            self.restartable[name] = (argv, env)
        return self._spawn(name, argv, env, "wb")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], mode: str) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", mode) as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        names_ = [n for n, _ in self.procs]
        if name in names_:  # a restart keeps its place in the stopping order
            self.procs[names_.index(name)] = (name, proc)
        else:
            self.procs.append((name, proc))
        return proc

    def check(self) -> list[str]:
        """Start again a restartable process that died; raise if any other service died on its own
        (the trainer's exit is handled by the caller). Returns the names restarted."""
        restarted = []
        for name, proc in list(self.procs):
            if name == "trainer" or proc.poll() is None:
                continue
            where = self.log_dir / (name + ".log")
            if name not in self.restartable or self.restarts.get(name, 0) >= self.MAX_RESTARTS:
                raise RuntimeError(f"{name} exited with status {proc.returncode}; see {where}")
            self.restarts[name] = self.restarts.get(name, 0) + 1
            self._spawn(name, *self.restartable[name], "ab")
            restarted.append(f"{name} (exit status {proc.returncode}, restart {self.restarts[name]})")
        return restarted

    def stop(self, timeout: float = 30.0) -> None:
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _name, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_http(url: str, what: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Poll ``url`` until it answers 200, the process dies, or the deadline passes."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} while starting; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError as exc:  # refused while starting, 503 while not ready
            last = str(exc)
        time.sleep(0.2)  # polling interval, not synchronisation: the loop waits for a 200
    raise RuntimeError(f"{what} not ready at {url} after {timeout:.0f}s ({last}); see {log}")


def sglang_argv(model: str, url: str, sglang_flags: list[str], own: list[str] | None = None) -> list[str]:
    """``centerline sglang`` serving ``model`` on ``url``'s port, its ``own`` flags (``--device``),
    SGLang's own flags after ``--`` (no settings file)."""
    return [
        PYTHON,
        "-m",
        "centerline",
        "sglang",
        "--model",
        model,
        "--port",
        url.rsplit(":", 1)[1],
        *(own or []),
        "--",
        *sglang_flags,
    ]


def restart_dead_nats_nodes(nats: EmbeddedNats | NatsCluster) -> list[str]:
    """Start again each NATS node that died (same store, same ports), as a supervisor would."""
    restarted = []
    for node in getattr(nats, "nodes", [nats]):
        if node.proc is not None and node.proc.poll() is not None:
            node.start()
            restarted.append(node.server_name or node.url)
    return restarted

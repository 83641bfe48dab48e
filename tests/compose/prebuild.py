"""The compose tier's slow part, begun in the background when the session starts.

On a machine that has never built the centerline image, ``deploy/docker/prepare.sh`` (Docker
from Debian's packages, a debootstrap base image) and the image build (torch and SGLang from
PyPI) take minutes, mostly downloads and unpacking. A session that collects the compose tests
starts both at once, out of the way of the tests that run meanwhile, and runs the compose tests
last: ``prepare.sh`` under ``nice -n 19``, the build through the classic builder with
``--cpu-shares 2`` (the build containers get almost no CPU while a test wants it). The build is
``docker-compose``'s own (``deploy/Dockerfile``, the repository root as context, the build
arguments compose passes, the tag ``centerline:dev``), so the README's ``docker-compose up -d
--build`` that ``tests/compose`` runs afterwards finds every layer cached. What it prints goes to
``LOG``; if it fails, the README's commands do the work again and fail where it failed.

Under pytest-xdist (``make test``) the controller starts it and a worker runs the compose tests:
the background work writes its exit status to ``STATUS`` when it ends, and its pid is in ``PID``,
so a process that did not start it waits for the one or the end of the other. (Not a lock held by
the work: ``prepare.sh`` may start a Docker daemon, which would inherit it and hold it for good.)
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOG = ROOT / "runs" / "compose-prebuild.log"
PID = ROOT / "runs" / "compose-prebuild.pid"  # the background work's, while this session runs
STATUS = ROOT / "runs" / "compose-prebuild.status"  # its exit status, once it has ended
# The build docker-compose.yml describes, its ${...} defaults as compose resolves them from `.env`.
BUILD = (
    "set -a; [ -f .env ] && . ./.env; set +a; "
    "DOCKER_BUILDKIT=0 docker build --cpu-shares 2 -f deploy/Dockerfile -t centerline:dev "
    '--build-arg BASE="${CENTERLINE_BASE_IMAGE:-python:3.11-slim}" '
    '--build-arg TORCH_INDEX_URL="${CENTERLINE_TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}" .'
)

_proc: subprocess.Popen | None = None
had_daemon: bool | None = None  # whether a Docker daemon answered before start(); None: not started


def daemon_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


def start() -> None:
    """Begin ``prepare.sh`` and the image build (once per session)."""
    global _proc, had_daemon
    if _proc is not None:
        return
    had_daemon = daemon_answers()
    LOG.parent.mkdir(exist_ok=True)
    STATUS.unlink(missing_ok=True)
    script = (
        f"(set -e; deploy/docker/prepare.sh; {BUILD}); code=$?; echo $code > {shlex.quote(str(STATUS))}; exit $code"
    )
    with open(LOG, "wb") as out:
        _proc = subprocess.Popen(
            ["nice", "-n", "19", "bash", "-c", script],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=os.environ.copy(),
        )
    PID.write_text(f"{_proc.pid}\n")


def running() -> bool:
    """Whether background work begun by this or another process of the session still runs."""
    if _proc is not None:
        return _proc.poll() is None
    if STATUS.exists() or not PID.exists():
        return False
    try:  # the pid, and the work's own command line (not a later process given the same pid)
        cmdline = Path(f"/proc/{int(PID.read_text())}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False
    return b"deploy/docker/prepare.sh" in cmdline


def wait(timeout: float = 1800) -> str:
    """Wait for the background work (if any was begun); one line saying how it ended."""
    started = time.monotonic()
    if _proc is not None:
        try:
            _proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(_proc.pid, 9)
            _proc.wait()
            STATUS.write_text(f"{_proc.returncode} (killed after {timeout:.0f}s)\n")
    else:  # begun by the xdist controller, or not at all
        while running() and time.monotonic() - started < timeout:
            time.sleep(0.5)  # polling interval, not synchronisation: STATUS or the pid's end is the event
        if running():
            return f"compose-prebuild: still running after {timeout:.0f}s (log: {LOG}); the README's commands go on"
    waited = time.monotonic() - started
    if not STATUS.exists():
        return "compose-prebuild: not started in this session"
    code = STATUS.read_text().strip()
    tail = "" if code == "0" else "; its log ends:\n" + LOG.read_text(errors="replace")[-2000:]
    return f"compose-prebuild: exited {code}, waited {waited:.0f}s for it (log: {LOG}){tail}"


def stop() -> None:
    """At the session's end: end the background work if it still runs, and stop a Docker daemon
    that was not running before it (``prepare.sh`` starts one where none answers)."""
    if _proc is None:
        return
    if _proc.poll() is None:
        os.killpg(_proc.pid, 9)
        _proc.wait()
    PID.unlink(missing_ok=True)
    pid = Path("/var/run/docker.pid")
    if not had_daemon and pid.exists():
        subprocess.run(["kill", pid.read_text().strip()], check=False)


def wait_for_tool(name: str, timeout: float = 900) -> str | None:
    """``name``'s path once it is on PATH, or None once the background work has ended without it
    (``prepare.sh`` installs docker-compose first, before the base image and the build)."""
    end = time.monotonic() + timeout
    while (path := shutil.which(name)) is None and running():
        if time.monotonic() > end:
            break
        time.sleep(0.5)  # polling interval, not synchronisation
    return path or shutil.which(name)

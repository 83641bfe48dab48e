"""The real SGLang server behind the router killed mid-run (its whole process group, SIGKILL, as
a crashed machine): `centerline up` starts it again and it serves its initial weights. No step
can finish meanwhile, so no regular weight update comes: the trainer's watch finds the server
behind and sends it the latest version, and the run goes on, with nothing sampled by old weights
trained as current. The test stops the run with SIGTERM once the server caught up and a few more
steps are done. (One engine: each start of one costs ~20 s of both cores here; the trainer's
watch treats every engine alike, and tests/trainer_service/test_weight_sync.py checks that it
leaves a current one alone.)

The README's times are measured here from the server's return (the first answer of its
/model_info, polled every 0.1 s): within ``CATCH_UP_S`` it serves the trainer's latest version (its own
/model_info says so), and within ``ROUTED_S`` a request sent to the router is served by it.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import http, metrics_lines, wait_until

ROOT = Path(__file__).resolve().parents[1]
MAX_STALENESS = 2  # the default (shared/settings.py)
# The trainer's watch asks every 5 s (trainer_service/weights.py), then loads the toy model's
# weights (well under a second); the router retries an engine's open circuit after 5 s
# (centerline/sglang.py: ROUTER_CIRCUIT_RETRY_S).
WATCH_S, LOAD_S = 5.0, 1.0
CATCH_UP_S = WATCH_S + LOAD_S
ROUTED_S = 5.0
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]


def process_group_serving(port: int) -> int:
    """The process group of the `centerline sglang` started for ``port`` (a session leader)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        pid = int(entry.name)
        serves = b"--port" in argv and str(port).encode() in argv and any(b"sglang" in a for a in argv)
        if serves and os.getpgid(pid) == pid:
            return pid
    raise AssertionError(f"no SGLang server process found for port {port}")


def weight_version(url: str) -> str | None:
    """The weight version ``url``/model_info reports now (the trainer's watch asks the same), None
    while it does not answer."""
    try:
        status, info = http("GET", url + "/model_info", timeout=2)
    except OSError:
        return None
    return info["weight_version"] if status == 200 else None


def served_by_router(router: str) -> bool:
    """Whether one request of one token sent to the router now comes back served."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    try:
        status, out = http("POST", router + "/generate", body, timeout=5)
    except OSError:
        return False
    return status == 200 and len(out["output_ids"]) == 1


def times_after_return(url: str, router: str, deadline_s: float, proc) -> dict[str, float]:
    """Seconds from the restarted server's return (the first answer of its /model_info) until it
    serves a trainer's weight version (``weights``) and until the router has it serve a request
    (``routed``), each polled every 0.1 s."""
    wait_until(lambda: weight_version(url) is None, 60, "the killed server gone", proc)
    wait_until(lambda: weight_version(url) is not None, deadline_s, "the server back", proc)
    back = time.monotonic()
    seen: dict[str, float] = {}
    while len(seen) < 2 and time.monotonic() < back + 60:
        if "weights" not in seen and weight_version(url) not in (None, "default"):
            seen["weights"] = time.monotonic() - back
        if "routed" not in seen and served_by_router(router):
            seen["routed"] = time.monotonic() - back
        time.sleep(0.1)  # polling interval, not synchronisation
    assert len(seen) == 2, f"after 60 s only {seen} (weights: the trainer's catch-up; routed: the router)"
    return seen


def test_a_killed_sglang_server_comes_back_and_is_brought_to_the_current_weights(tmp_path, toy_models):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "centerline", "up", "--engines", "1", "--task", "copy", "--steps", "1000"]
    argv += ["--workers", "2", "--trainer-ranks", "1", "--prompts-per-step", "3", "--rollout-n", "2"]
    argv += ["--heldout-prompts", "8", "--heldout-every", "100000", "--model-dir", str(toy_models)]
    argv += ["--run-dir", str(run_dir)]
    out = open(tmp_path / "up.log", "w")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        up_log = lambda: (tmp_path / "up.log").read_text()  # noqa: E731
        found = wait_until(
            lambda: re.search(r"SGLang (\S+) behind the router (\S+),", up_log()), 600, "SGLang up", proc
        )
        url, router = found.groups()
        wait_until(lambda: len(metrics_lines(run_dir)) >= 3, 600, "3 steps", proc)
        os.killpg(process_group_serving(int(url.rsplit(":", 1)[1])), signal.SIGKILL)
        killed_at = len(metrics_lines(run_dir))
        after_return = times_after_return(url, router, 600, proc)

        trainer_log = run_dir / "logs" / "trainer.log"

        def caught_up() -> list[int] | None:
            text = trainer_log.read_text()
            found = re.search(rf"engine {re.escape(url)} serves weights version 0, the trainer's is (\d+)", text)
            return [int(found.group(1))] if found else None

        versions = wait_until(caught_up, 600, "the restarted server caught up", proc)
        wait_until(lambda: len(metrics_lines(run_dir)) >= killed_at + 3, 600, "3 more steps", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.close()

    assert "sglang-0 (exit status -9, restart 1) died: started again" in up_log()
    records = metrics_lines(run_dir)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))  # the run never stopped
    # No step needed them while they were down: up to max_inflight_steps (2, the default) steps
    # may have had every batch sampled before the kill, the one training and the next.
    assert all(killed_at <= v <= killed_at + 2 for v in versions), (versions, killed_at)
    print(f"\n[engine restart] seconds after the server's return: {after_return}")
    assert after_return["weights"] <= CATCH_UP_S, after_return
    assert after_return["routed"] <= ROUTED_S, after_return
    # nothing trained was sampled more than max_staleness versions behind the weights it met
    assert all(r["staleness_max"] <= MAX_STALENESS for r in records)
    assert all(r["samples"] > 0 for r in records)

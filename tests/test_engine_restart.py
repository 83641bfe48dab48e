"""The real SGLang server behind the router killed mid-run (its whole process group, SIGKILL, as
a crashed machine): `centerline up` starts it again and it serves its initial weights. No step
can finish meanwhile, so no regular weight update comes: the trainer's watch finds the server
behind and sends it the latest version, and the run goes on, with nothing sampled by old weights
trained as current. The test stops the run with SIGTERM once the server caught up and a few more
steps are done. (One engine: each start of one costs ~20 s of both cores here; the trainer's
watch treats every engine alike, and tests/trainer_service/test_weight_sync.py checks that it
leaves a current one alone.)
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.processes import metrics_lines, wait_until

ROOT = Path(__file__).resolve().parents[1]
MAX_STALENESS = 2  # the default (shared/config.py)
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


def test_a_killed_sglang_server_comes_back_and_is_brought_to_the_current_weights(tmp_path, toy_models):
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "centerline", "up", "--engines", "1", "--task", "copy", "--steps", "1000"]
    argv += ["--workers", "2", "--trainer-ranks", "1", "--prompts-per-step", "3", "--rollout-n", "2"]
    argv += ["--eval-prompts", "8", "--eval-every", "100000", "--model-dir", str(toy_models)]
    argv += ["--run-dir", str(run_dir)]
    out = open(tmp_path / "up.log", "w")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        up_log = lambda: (tmp_path / "up.log").read_text()  # noqa: E731
        urls = wait_until(lambda: re.search(r"SGLang (\S+) behind the router", up_log()), 600, "SGLang up", proc)
        wait_until(lambda: len(metrics_lines(run_dir)) >= 3, 600, "3 steps", proc)
        for url in urls.groups():
            os.killpg(process_group_serving(int(url.rsplit(":", 1)[1])), signal.SIGKILL)
        killed_at = len(metrics_lines(run_dir))

        trainer_log = run_dir / "logs" / "trainer.log"

        def caught_up() -> list[int] | None:
            text = trainer_log.read_text()
            found = [
                re.search(rf"engine {re.escape(url)} serves weights version 0, the trainer's is (\d+)", text)
                for url in urls.groups()
            ]
            return [int(m.group(1)) for m in found] if all(found) else None

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
    # nothing trained was sampled more than max_staleness versions behind the weights it met
    assert all(r["staleness_max"] <= MAX_STALENESS for r in records)
    assert all(r["samples"] > 0 for r in records)

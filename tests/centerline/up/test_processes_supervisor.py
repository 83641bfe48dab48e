"""`centerline up`'s process supervisor: an SGLang server that dies is started again (same command,
log appended), up to a limit; any other service that dies ends the run naming it."""

import sys

import pytest

from centerline.up.processes import Supervisor

EXIT_3 = [sys.executable, "-c", "import sys; print('ran'); sys.exit(3)"]


def wait_all(supervisor: Supervisor) -> None:
    for _name, proc in supervisor.procs:
        proc.wait(timeout=30)


def test_a_restartable_process_is_started_again_until_the_limit(tmp_path):
    supervisor = Supervisor(tmp_path, {})
    first = supervisor.start("sglang-0", EXIT_3, restart=True)
    for attempt in range(1, Supervisor.MAX_RESTARTS + 1):
        wait_all(supervisor)
        assert supervisor.check() == [f"sglang-0 (exit status 3, restart {attempt})"]
        assert [name for name, _ in supervisor.procs] == ["sglang-0"] and supervisor.procs[0][1] is not first
    wait_all(supervisor)
    with pytest.raises(RuntimeError, match=r"^sglang-0 exited with status 3; see .*sglang-0\.log$"):
        supervisor.check()
    assert (tmp_path / "sglang-0.log").read_text() == "ran\n" * (Supervisor.MAX_RESTARTS + 1)  # appended, not replaced


def test_another_service_that_dies_ends_the_run_and_a_restart_keeps_the_stopping_order(tmp_path):
    supervisor = Supervisor(tmp_path, {})
    supervisor.start("sglang-0", EXIT_3, restart=True)
    supervisor.start("proxy", [sys.executable, "-c", "pass"])
    wait_all(supervisor)
    with pytest.raises(RuntimeError, match=r"^proxy exited with status 0"):
        supervisor.check()
    assert [name for name, _ in supervisor.procs] == ["sglang-0", "proxy"]  # the engine restarted in its place

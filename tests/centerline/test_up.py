"""`centerline up` end to end: every service as a real process, a few steps, then the report."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from tests.processes import wait_until
from tests.trainer_service.service_stack import descendants

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.mark.integration
@pytest.mark.slow
def test_up_runs_steps_and_writes_the_report(up_run):
    run_dir = up_run.run_dir
    steps = [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["gate_accepted"] == 3 and s["gate_rejected"] == {} and s["samples"] == 6 for s in steps)
    # The trainer's held-out evaluation (docs/design.md section 9): before training, every --heldout-every 2
    # steps and after the last, one sample of each of the 8 held-out rows, sampled by the workers
    evals = [orjson.loads(line) for line in (run_dir / "heldout_metrics.jsonl").read_bytes().splitlines()]
    assert [e["step"] for e in evals] == [0, 2, 3]
    assert all(e["heldout_rows"] == 8 and e["heldout_accuracy"] in {i / 8 for i in range(9)} for e in evals)
    assert [e["version"] for e in evals] == [0, 2, 3] and all(e["heldout_version_min"] >= e["version"] for e in evals)
    heldout = (run_dir / "heldout.jsonl").read_bytes().splitlines()
    assert len(heldout) == 8 and {orjson.loads(row)["reward"] for row in heldout} == {"exact"}
    assert not any("/heldout/" in batch for s in steps for batch in s["batch_ids"])  # never trained
    # Non-TTY progress: one JSON line per step and per evaluation on stdout.
    printed = [orjson.loads(line) for line in up_run.stdout.splitlines() if line.startswith("{")]
    assert [r["step"] for r in printed if "loss" in r] == [1, 2, 3]
    assert sorted(r["step"] for r in printed if "heldout_accuracy" in r) == [0, 2, 3]

    page = (run_dir / "report.html").read_text()
    plots = {"reward", "accuracy", "sc_correction", "head_mass", "tail_ratio", "kl", "staleness", "gate"}
    assert {p.stem for p in (run_dir / "plots").glob("*.png")} == plots
    assert all((run_dir / "plots" / f"{name}.png").read_bytes().startswith(PNG_MAGIC) for name in plots)
    assert page.count("data:image/png;base64,") == len(plots)
    assert "batches accepted / rejected</td><td>9 / 0" in page
    assert "rollout_top_logprobs_num = 128" in page  # the resolved configuration


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def _processes_mentioning(*paths: str) -> list[str]:
    """Command lines of live processes that mention any of ``paths`` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = _cmdline(int(entry.name))
            except OSError:
                continue  # exited while we looked
            if any(p in cmdline for p in paths):
                found.append(f"{entry.name}: {cmdline}")
    return found


def _in_sessions(sessions: set[int]) -> list[str]:
    """Command lines of live processes in any of ``sessions`` (a zombie has exited: not live)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state not in "ZX" and os.getsid(int(entry.name)) in sessions:
                    found.append(f"{entry.name} ({state}): {_cmdline(int(entry.name))}")
            except OSError:  # ProcessLookupError included
                continue  # exited while we looked
    return found


def _service(argv: list[str]) -> str | None:
    """Which service a command line runs: a ``centerline`` subcommand, an SGLang server
    (``centerline sglang`` execs ``sglang.launch_server``) or the SGLang router (``smg``, which
    renames itself ``sglang::router``); None for anything else (SGLang's scheduler, nats-server)."""
    if "centerline" in argv:
        return argv[argv.index("centerline") + 1]
    if "sglang.launch_server" in argv:
        return "sglang"
    return "router" if argv and (argv[0] == "sglang::router" or Path(argv[0]).name == "smg") else None


def _nats_users(pids: list[int]) -> dict[str, set]:
    """``{service: {CENTERLINE_NATS_USER of each of its processes}}`` of ``pids``; also checks no
    process holds a NATS secret but its own password."""
    users: dict[str, set] = {}
    for pid in pids:
        try:
            cmdline, raw = _cmdline(pid), Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue  # exited while we looked
        service = _service(cmdline.split())
        if service is None:
            continue
        env = dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
        assert {k for k in env if "NATS" in k} <= {"CENTERLINE_NATS_USER", "CENTERLINE_NATS_PASSWORD"}, cmdline
        users.setdefault(service, set()).add(env.get("CENTERLINE_NATS_USER"))
    return users


@pytest.mark.integration
@pytest.mark.slow
def test_ctrl_c_stops_every_process(up_run, tmp_path):
    run_dir = tmp_path / "interrupted"
    argv = [
        sys.executable,
        "-m",
        "centerline",
        "up",
        "--engines",
        "2",  # `make run`'s topology: two SGLang servers behind the router
        "--task",
        "copy",
        "--steps",
        "100000",  # far more than the test lets it run: steps against SGLang take ~0.15 s here
        "--workers",
        "2",
        "--trainer-ranks",
        "2",
        "--prompts-per-step",
        "2",
        "--rollout-n",
        "2",
        "--heldout-prompts",
        "4",
        "--heldout-every",
        "100",
        "--model-dir",
        str(up_run.model_dir.parent),
        "--run-dir",
        str(run_dir),
    ]
    launcher = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and metrics.read_bytes().count(b"\n") >= 1, 300, "first step", launcher)
        # Each service logs in to NATS as its own user (the launcher creates the streams as admin);
        # SGLang and its router get none. The services are the launcher's descendants, each in a
        # session of its own that its children share (SGLang's scheduler names no path of the run).
        services = descendants(launcher.pid)
        assert sum("sglang.launch_server" in _cmdline(pid) for pid in services) == 2  # one per engine
        users = _nats_users([launcher.pid, *services])
        assert users == {
            "up": {None},
            "sglang": {None},
            "router": {None},
            "proxy": {"proxy"},
            "worker": {"worker"},
            "trainer": {"trainer"},
        }
        sessions = {os.getsid(pid) for pid in services} - {os.getsid(0)}
        launcher.send_signal(signal.SIGINT)  # what Ctrl-C sends the foreground process
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:  # the test failed first: SIGTERM makes the launcher stop every service
            launcher.terminate()
            try:
                launcher.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                launcher.kill()
    assert launcher.returncode == 130, err[-2000:]
    assert "interrupted; stopping every service" in err
    assert _processes_mentioning(str(run_dir), str(up_run.model_dir)) == []
    assert _in_sessions(sessions) == []

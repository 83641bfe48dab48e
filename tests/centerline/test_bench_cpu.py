"""`centerline/bench/cpu.py`: the CPU seconds of a phase, by whom, read from a real child process that
burns a known amount of CPU between the two looks."""

import subprocess
import sys

from centerline.bench.cpu import CpuClock, cpu_bound_ratio, engines_ms_per_token, tree_cpu

BURN = 0.3  # CPU seconds the child spends between the looks
CHILD = f"""
import sys, time
print("ready", flush=True)
sys.stdin.readline()
start = time.process_time()
while time.process_time() - start < {BURN}:
    pass
print("done", flush=True)
sys.stdin.readline()
"""


def test_a_phase_counts_the_cpu_a_server_spent_in_it_and_not_before():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"  # its start-up, before the clock
        clock = CpuClock({"server": child.pid, "engine-0": child.pid})
        clock.start()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "done\n"
        cpu = clock.stop()
    finally:
        child.kill()
        child.wait()
    assert BURN - 0.02 <= cpu["servers"]["server"] < BURN + 0.1  # /proc counts whole 10 ms ticks
    assert cpu["servers"]["engine-0"] == cpu["servers"]["server"]
    assert 0 <= cpu["bench_process"] < 0.1
    assert cpu["machine"] >= BURN - 0.02  # the machine's clock ticks at 10 ms
    others = cpu["machine"] - cpu["bench_process"] - 2 * cpu["servers"]["server"]  # of rounded figures
    assert abs(cpu["others"] - others) <= 0.003
    assert cpu["wall"] > 0 and cpu["machine_busy_share"] > 0
    assert engines_ms_per_token(cpu, 100) == round(10 * cpu["servers"]["engine-0"], 3)


def test_a_server_that_is_gone_counts_as_unknown():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert tree_cpu(child.pid) is None
    clock = CpuClock({"engine-0": child.pid})
    clock.start()
    cpu = clock.stop()
    assert cpu["servers"] == {"engine-0": None} and cpu["others"] is None
    assert engines_ms_per_token(cpu, 100) is None
    assert engines_ms_per_token({"servers": {"router": 1.0}}, 100) is None  # no engine started here


def test_the_cpu_bound_ratio_compares_cpu_per_token_with_the_engines_at_the_single_requests_rate():
    """Single requests: engines 9 s, bench 0.1 s, router and proxy 0.4 s for 2,000 tokens (4.75 ms a
    token); sessions: engines 7 s (their own rate is not used), bench 0.8 s, router and proxy 0.4 s
    for 2,000 tokens (4.5 + 0.6 = 5.1 ms); what others took is in neither."""
    single = {"bench_process": 0.1, "servers": {"engine-0": 5.0, "engine-1": 4.0, "router": 0.1, "proxy": 0.3}}
    sessions = {"bench_process": 0.8, "servers": {"engine-0": 3.0, "engine-1": 4.0, "router": 0.1, "proxy": 0.3}}
    assert cpu_bound_ratio(sessions, 2000, single, 2000) == round(4.75 / 5.1, 4)
    assert cpu_bound_ratio(single, 2000, single, 2000) == 1.0
    unknown = {"bench_process": 0.1, "servers": {"router": 0.1, "proxy": 0.3}}
    assert cpu_bound_ratio(sessions, 2000, unknown, 2000) is None

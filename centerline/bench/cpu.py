"""CPU seconds a phase of ``centerline bench sessions`` spends, by whom (``centerline/bench/sessions.py``
says what each figure is): the bench's own process (which runs the sessions as a worker does, or
sends the single requests), each server process the bench started with its children (the engines,
the router, the proxy), and the whole machine, read before and after the phase. On a machine whose
engines compute on the same cores as the worker, every CPU second of the worker's Python is one the
engines do not get."""

from __future__ import annotations

import time

import psutil


def tree_cpu(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` and its living children; None once it is gone."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:  # a child that ended between the listing and the look
            continue
        total += times.user + times.system
    return total


def machine_busy() -> float:
    """CPU seconds the whole machine's processes and kernel ran, since boot: user (a guest's included),
    nice, system and interrupts; not idle, waits on disk or time a hypervisor took (steal)."""
    times = psutil.cpu_times()
    return sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))


class CpuClock:
    """The CPU seconds of a phase: ``start()`` before it, ``stop()`` after it. ``servers``: name ->
    pid of each process tree the bench started (an engine, the router, the proxy)."""

    def __init__(self, servers: dict[str, int]):
        self.servers = servers
        self._before: dict = {}

    def start(self) -> None:
        self._before = self._look()

    def stop(self) -> dict:
        """The phase's CPU seconds: ``bench_process`` (this process), ``servers`` (each started one, None
        where it was not started here), ``others`` (the machine's busy time less those two: processes
        the bench did not start, the kernel's own work; None where a server is unknown), ``machine``
        (all cores, busy) and ``wall`` (seconds); and ``machine_busy_share``, the machine's busy time
        over its cores' time (1.0: every core busy)."""
        after = self._look()
        before = self._before
        servers = {
            name: None
            if before["servers"][name] is None or value is None
            else round(value - before["servers"][name], 3)
            for name, value in after["servers"].items()
        }
        wall = after["wall"] - before["wall"]
        machine = after["machine"] - before["machine"]
        process = after["process"] - before["process"]
        known = None if None in servers.values() else process + sum(servers.values())
        return {
            "bench_process": round(process, 3),
            "servers": servers,
            "others": None if known is None else round(machine - known, 3),
            "machine": round(machine, 3),
            "wall": round(wall, 3),
            "machine_busy_share": round(machine / (wall * psutil.cpu_count()), 4) if wall > 0 else None,
        }

    def _look(self) -> dict:
        return {
            "process": time.process_time(),
            "servers": {name: tree_cpu(pid) for name, pid in self.servers.items()},
            "machine": machine_busy(),
            "wall": time.monotonic(),
        }


def engines_ms_per_token(cpu_s: dict, tokens: int) -> float | None:
    """CPU milliseconds the engines (the ``engine-*`` servers) spent per sampled token over a phase;
    None where the bench started none (``--engine-urls``) or none was sampled."""
    engines = [v for name, v in cpu_s["servers"].items() if name.startswith("engine-")]
    if not engines or None in engines or not tokens:
        return None
    return round(1000 * sum(engines) / tokens, 3)


def cpu_bound_ratio(phase: dict, tokens: int, single: dict, single_tokens: int) -> float | None:
    """The tokens/s ratio of a phase to the single requests' that the CPU allows on a machine the
    bench's processes have to themselves, every core busy: each phase's CPU seconds per sampled token
    (the engines' at the single requests' rate, plus the bench process's, the router's and the
    proxy's own) compared, so what other processes took in either phase counts in neither. None where
    the engines' CPU is unknown (``--engine-urls``)."""
    engines = engines_ms_per_token(single, single_tokens)
    if engines is None or not tokens:
        return None

    def rest_ms(cpu: dict, n: int) -> float:
        servers = sum(v for name, v in cpu["servers"].items() if not name.startswith("engine-"))
        return 1000 * (cpu["bench_process"] + servers) / n

    return round((engines + rest_ms(single, single_tokens)) / (engines + rest_ms(phase, tokens)), 4)

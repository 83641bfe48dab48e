"""SGLang's duty cycle, as ``centerline bench pipeline`` measures it (``centerline/bench/pipeline.py``
says what the bench measures): the share of a window in which the SGLang scheduler had work.

It comes from the scheduler's Prometheus counter ``sglang:scheduler_idle_seconds_total`` ("wall
time while the scheduler has no runnable or queued work",
``srt/managers/scheduler_components/metrics_reporter.py``). The scheduler
timestamps each switch exactly (monotonic ns: idle from the moment ``on_idle`` finds no running
batch and an empty waiting queue, busy from the receipt of a request or the launch of a batch)
but adds the accumulated idle time to the counter only when at least 1 s has passed since its last
addition, at its next busy/idle event (a forward pass, or the 1 s poll of ``--sleep-on-idle``):
the counter is exact at those flush moments and up to about 2 s behind in between. So the bench
scrapes ``/metrics`` every ``--poll`` s (``Scraper``), recognises a flush by a change of
``sglang:scheduler_process_cpu_seconds_total`` (added at every flush), and measures between the
first flush after the window starts and the last before it ends, dating each flush at the middle
of the two scrapes that bracket it (``duty_cycle``). ``duty_cycle = 1 - idle / window``; the
window's ends are known to half a poll interval each, so ``duty_cycle_error_bound = (half gap +
half gap) / window``. A control request (a weight update the trainer sends) is work by this
definition; the router's health checks (``/health``, no generation by default) are not. A scrape
costs the server's HTTP process some milliseconds, so the default ``--poll`` of 0.25 s takes a few
percent of one core. It is the scheduler's view: a request still in SGLang's tokenizer or
detokenizer process (before the scheduler has it, after its last token) leaves the scheduler idle
unless another is running. SGLang alone (``sglang_alone.py``) reports its own duty cycle the same
way, what the pipeline's could be at this concurrency: short of 1 by the round trips between an
answer and the next request, which are long beside a small model's forward passes (top-K
log-probs are formatted in Python).
"""

from __future__ import annotations

import threading
import time
import urllib.request

IDLE = "sglang:scheduler_idle_seconds_total"
CPU = "sglang:scheduler_process_cpu_seconds_total"  # grows at every flush of IDLE


def counters(text: str) -> dict[str, float]:
    """``IDLE`` and ``CPU`` from a Prometheus text page, summed over label sets (one per scheduler)."""
    totals = {IDLE: 0.0, CPU: 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


class Scraper:
    """Scrapes ``url``/metrics every ``interval`` s on a thread: ``samples`` is ``[(t, idle_s, cpu_s)]``,
    ``t`` the monotonic time the answer arrived."""

    def __init__(self, url: str, interval: float):
        self.url, self.interval = url.rstrip("/") + "/metrics", interval
        self.samples: list[tuple[float, float, float]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Scraper:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as resp:
                    page = counters(resp.read().decode())
                self.samples.append((time.monotonic(), page[IDLE], page[CPU]))
            except OSError:
                pass  # a missed scrape only widens the bracket around a flush
            self.stopping.wait(self.interval)


def duty_cycle(samples: list[tuple[float, float, float]], start: float, end: float) -> dict:
    """Share of ``[start, end]`` the scheduler was busy, from scrapes ``(t, idle_s, cpu_s)`` (module
    docstring). Measured between the first flush after ``start`` and the last before ``end``."""
    flushes = [
        (t0, t1, idle)
        for (t0, _, c0), (t1, idle, c1) in zip(samples, samples[1:])
        if c1 != c0 and t0 >= start and t1 <= end
    ]
    if len(flushes) < 2:
        raise RuntimeError(
            f"SGLang flushed its idle counter {len(flushes)} times in the {end - start:.1f} s window, "
            "too few to measure (it flushes about once a second); raise --steps or --alone-seconds"
        )
    (a0, a1, idle_a), (b0, b1, idle_b) = flushes[0], flushes[-1]
    window = (b0 + b1) / 2 - (a0 + a1) / 2
    return {
        "duty_cycle": round(min(1.0, max(0.0, 1 - (idle_b - idle_a) / window)), 4),
        "duty_cycle_window_s": round(window, 3),
        "duty_cycle_error_bound": round(((a1 - a0) / 2 + (b1 - b0) / 2) / window, 4),
    }

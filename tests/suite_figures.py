"""What a test session took, written by the session itself: ``runs/test-suite.json``.

The pytest process that reports (the only one, or pytest-xdist's controller) counts the outcomes
and times the session from its start to its end, and sums each test file's durations (set-up, call
and tear-down, whichever worker ran it). The file is stamped like a bench's figures (``command``,
``commit``, ``machine``, ``digest``: ``centerline/runs/run_figures.py``), so that docs/testing.md
quotes a copy of it (``docs/runs/test-suite.json``) and ``scripts/gen_bench_docs.py --check``
fails on a figure edited by hand.
"""

from __future__ import annotations

import json
import shlex
import time
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "runs" / "test-suite.json"
# Every file's and the slowest tests' seconds, and each xdist worker's busy seconds: where a
# session's wall time goes (docs/testing.md), too long to quote.
DURATIONS = OUT.with_name("test-durations.json")
SLOWEST_FILES = 12
SLOWEST_TESTS = 60


class SuiteFigures:
    def __init__(self, config):
        self.config = config
        self.started = time.monotonic()
        self.outcomes: Counter[str] = Counter()
        self.file_seconds: Counter[str] = Counter()
        self.test_seconds: Counter[str] = Counter()
        self.worker_seconds: Counter[str] = Counter()

    def pytest_runtest_logreport(self, report):
        self.file_seconds[report.nodeid.split("::", 1)[0]] += report.duration
        self.test_seconds[report.nodeid] += report.duration
        node = getattr(report, "node", None)
        self.worker_seconds[getattr(getattr(node, "gateway", None), "id", "main")] += report.duration
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            self.outcomes[report.outcome] += 1
        elif report.when == "teardown" and report.outcome == "failed":
            self.outcomes["error"] += 1

    def pytest_sessionfinish(self, session, exitstatus):
        from centerline.runs.run_figures import stamped

        figures = {
            "wall_s": round(time.monotonic() - self.started, 1),
            "exit_status": int(exitstatus),
            "collected": session.testscollected,
            "passed": self.outcomes["passed"],
            "failed": self.outcomes["failed"],
            "skipped": self.outcomes["skipped"],
            "errors": self.outcomes["error"],
            "workers": int(getattr(self.config.option, "numprocesses", 0) or 0),
            "markers": self.config.option.markexpr or "",
            "slowest_files_s": {
                path: round(seconds, 1) for path, seconds in self.file_seconds.most_common(SLOWEST_FILES)
            },
            "test_seconds_total": round(sum(self.file_seconds.values()), 1),
        }
        command = shlex.join(["pytest", *self.config.invocation_params.args])
        OUT.parent.mkdir(exist_ok=True)
        OUT.write_text(json.dumps(stamped(figures, command), indent=2) + "\n")
        durations = {
            "wall_s": figures["wall_s"],
            "worker_busy_s": {worker: round(s, 1) for worker, s in sorted(self.worker_seconds.items())},
            "files_s": {path: round(s, 1) for path, s in self.file_seconds.most_common()},
            "slowest_tests_s": {test: round(s, 1) for test, s in self.test_seconds.most_common(SLOWEST_TESTS)},
        }
        DURATIONS.write_text(json.dumps(stamped(durations, command), indent=2) + "\n")

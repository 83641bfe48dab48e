"""One log format for every service: one JSON object per line on stderr.

    {"ts": 1733000000.123, "level": "info", "service": "trainer", "logger": "centerline.trainer",
     "msg": "...", ...fields}

A call adds structured fields with ``log.info("task done", extra={"fields": {"task_id": ...}})``;
an exception adds ``exc`` (its traceback). Step records are not log lines: the trainer writes
them to stdout and ``metrics.jsonl`` (``trainer_service/metrics.py``).
"""

from __future__ import annotations

import json
import logging
import sys


class JsonFormatter(logging.Formatter):
    """A record as one JSON line; ``service`` names the process that wrote it."""

    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(getattr(record, "fields", {}))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def setup(service: str, level: int = logging.INFO) -> None:
    """Send every logger's records at ``level`` and above to stderr as JSON lines (replaces
    any handler set up before, so a library's own set-up does not add a second format)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    logging.basicConfig(level=level, handlers=[handler], force=True)

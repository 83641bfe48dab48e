"""shared/logs.py: every service logs one JSON object per line, in one format."""

from __future__ import annotations

import json
import logging

import pytest

from shared import logs


@pytest.fixture(autouse=True)
def root_logger():
    """logs.setup replaces the root logger's handlers: give the other tests theirs back."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_a_record_is_one_json_line_with_service_level_logger_message_and_fields(capsys):
    logs.setup("worker")
    logging.getLogger("centerline.worker").warning("task done", extra={"fields": {"task_id": "r/0/1"}})
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    doc = json.loads(lines[0])
    assert isinstance(doc.pop("ts"), float)
    assert doc == {
        "level": "warning",
        "service": "worker",
        "logger": "centerline.worker",
        "msg": "task done",
        "task_id": "r/0/1",
    }


def test_an_exception_travels_in_the_same_line(capsys):
    logs.setup("trainer")
    try:
        raise ValueError("bad batch")
    except ValueError:
        logging.getLogger("centerline.trainer").exception("step failed")
    (line,) = capsys.readouterr().err.splitlines()
    doc = json.loads(line)
    assert doc["msg"] == "step failed" and doc["service"] == "trainer"
    assert doc["exc"].endswith("ValueError: bad batch")

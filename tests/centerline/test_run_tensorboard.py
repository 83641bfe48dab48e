"""A `centerline up` run shows up in TensorBoard: `tensorboard --logdir runs/` reads the run
directory's event files, one scalar series per step metric of metrics.jsonl."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_every_step_of_an_up_run_is_in_its_tensorboard_events(up_run):
    steps = [json.loads(line) for line in (up_run.run_dir / "metrics.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(up_run.run_dir))
    events.Reload()
    for name in ("loss", "reward_mean", "sc_correction", "staleness_max", "gate_accepted"):
        series = [(e.step, e.value) for e in events.Scalars(name)]
        assert series == [(s["step"], float(np.float32(s[name]))) for s in steps], name  # stored as float32
    assert [s["step"] for s in steps] == list(range(1, up_run.steps + 1))

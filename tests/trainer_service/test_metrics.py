"""The trainer's step metrics where users look: TensorBoard event files in the run directory
(read back with TensorBoard's own reader) and Weights & Biases offline."""

from __future__ import annotations

import sys

import numpy as np
import orjson
import pytest
from prometheus_client import generate_latest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from shared.config import ConfigError
from shared.settings import TrainerSettings
from trainer_service.metrics import Metrics, complete_lines, scalars


def record(step: int, loss: float) -> dict:
    return {
        "step": step,
        "version": step,
        "loss": loss,
        "trained_tokens": 40 * step,
        "gate_rejected": {"short_row": step - 1},
        "recovered": False,
        "batch_ids": ["a", "b"],
    }


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_step_record_becomes_scalars_by_name_with_tables_as_name_slash_key():
    assert scalars(record(2, 0.5)) == {
        "step": 2.0,
        "version": 2.0,
        "loss": 0.5,
        "trained_tokens": 80.0,
        "gate_rejected/short_row": 1.0,
    }


def test_every_step_is_a_tensorboard_scalar_in_the_run_directory(tmp_path):
    metrics = Metrics(TrainerSettings(run_dir=tmp_path))
    for step, loss in ((1, -0.25), (2, 0.125), (3, 1.0 / 3)):
        metrics.step(record(step, loss))
    metrics.close()
    found = tensorboard_scalars(tmp_path)
    assert set(found) == {"step", "version", "loss", "trained_tokens", "gate_rejected/short_row"}
    assert found["loss"] == [(1, -0.25), (2, 0.125), (3, float(np.float32(1.0 / 3)))]  # stored as float32
    assert found["gate_rejected/short_row"] == [(1, 0.0), (2, 1.0), (3, 2.0)]


def test_a_resumed_trainer_replaces_the_events_of_the_steps_it_trains_again(tmp_path):
    first = Metrics(TrainerSettings(run_dir=tmp_path))
    for step in (1, 2, 3):
        first.step(record(step, float(step)))
    first.close()  # as if it died after step 3's line; the checkpoint it resumes from is step 1
    again = Metrics(TrainerSettings(run_dir=tmp_path))
    for step in (2, 3):
        again.step(record(step, 10.0 * step))
    again.close()
    assert tensorboard_scalars(tmp_path)["loss"] == [(1, 1.0), (2, 20.0), (3, 30.0)]


def test_a_heldout_record_goes_to_heldout_metrics_jsonl_tensorboard_and_gauges_by_its_heldout_names(tmp_path):
    metrics = Metrics(TrainerSettings(run_dir=tmp_path))
    line = {
        "step": 4,
        "heldout_accuracy": 0.5,
        "heldout_rows": 2,
        "version": 4,
        "heldout_version_min": 4,
        "heldout_version_max": 5,
        "heldout_s": 1.25,
    }
    metrics.heldout(line)
    metrics.close()
    assert sorted(p.name for p in tmp_path.glob("*.jsonl")) == ["heldout_metrics.jsonl"]
    assert [orjson.loads(x) for x in (tmp_path / "heldout_metrics.jsonl").read_bytes().splitlines()] == [line]
    assert tensorboard_scalars(tmp_path) == {
        "heldout_accuracy": [(4, 0.5)],
        "heldout_rows": [(4, 2.0)],
        "heldout_version_min": [(4, 4.0)],
        "heldout_version_max": [(4, 5.0)],
        "heldout_s": [(4, 1.25)],
    }
    exposition = generate_latest(metrics.registry).decode().splitlines()
    assert {x.split()[0]: float(x.split()[1]) for x in exposition if x.startswith("centerline_trainer_heldout")} == {
        "centerline_trainer_heldout_step": 4.0,
        "centerline_trainer_heldout_accuracy": 0.5,
        "centerline_trainer_heldout_reward": 0.0,  # never set: this run's figure is the accuracy
        "centerline_trainer_heldout_rows": 2.0,
        "centerline_trainer_heldout_version_min": 4.0,
        "centerline_trainer_heldout_version_max": 5.0,
    }


def test_tensorboard_off_writes_no_event_file(tmp_path):
    metrics = Metrics(TrainerSettings(run_dir=tmp_path, tensorboard=False))
    metrics.step(record(1, 0.5))
    metrics.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]


def test_wandb_offline_logs_every_step_under_the_run_directory(tmp_path):
    run_dir = tmp_path / "run-7"
    run_dir.mkdir()
    metrics = Metrics(TrainerSettings(run_dir=run_dir, wandb="offline", wandb_project="tests"))
    for step in (1, 2):
        metrics.step(record(step, 0.5 * step))
    metrics.close()
    (offline,) = (run_dir / "wandb").glob("offline-run-*-run-7")
    (data,) = offline.glob("run-run-7.wandb")
    body = data.read_bytes()
    assert b"gate_rejected/short_row" in body and b"trained_tokens" in body


def test_wandb_without_the_package_stops_start_up_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets where it is not installed
    with pytest.raises(ConfigError, match=r"--wandb online needs the wandb package.*centerline\[wandb\]"):
        Metrics(TrainerSettings(run_dir=tmp_path, wandb="online"))


@pytest.mark.parametrize(
    ("data", "lines", "end"),
    [
        (b"", [], 0),
        (b'{"step": 1}', [], 0),  # the first line, being written
        (b'{"step": 1}\n{"st', [b'{"step": 1}'], 12),
        (b'{"step": 1}\n{"step": 2}\n', [b'{"step": 1}', b'{"step": 2}'], 24),
    ],
)
def test_complete_lines_of_a_growing_file_leave_out_the_line_being_written(data, lines, end):
    assert complete_lines(data) == (lines, end)


def test_recover_drops_a_line_a_crash_cut_short_and_keeps_the_complete_ones(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"step": 2, "lo')
    (tmp_path / "heldout_metrics.jsonl").write_bytes(b'{"step": 0}\n{"step": 2, "he')
    (tmp_path / "eval.jsonl").write_bytes(b'{"step": 0}\n{"st')  # an earlier release's held-out record
    metrics = Metrics(TrainerSettings(run_dir=tmp_path, tensorboard=False))
    metrics.recover({"step": 1})
    metrics.close()
    assert (tmp_path / "metrics.jsonl").read_bytes() == b'{"step": 1}\n'
    assert (tmp_path / "heldout_metrics.jsonl").read_bytes() == b'{"step": 0}\n'
    assert (tmp_path / "eval.jsonl").read_bytes() == b'{"step": 0}\n'


def test_the_runs_whole_configuration_is_wandbs_config_and_tensorboards_hparams(tmp_path):
    from tensorboard.plugins.hparams import plugin_data_pb2

    run_dir = tmp_path / "run-8"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text(
        'learning_rate = 0.0003\nnats_url = "nats://u:secret@127.0.0.1:4222"\nengine_urls = ["http://a:1"]\n'
        '[up]\nreward = ["exact=1.0", "m:f=0.5"]\nmodel = "/m"\n[trainer]\nsteps = 300\n'
    )
    metrics = Metrics(TrainerSettings(run_dir=run_dir, wandb="offline", wandb_project="tests"))
    assert metrics.config == {
        "engine_urls": '["http://a:1"]',
        "learning_rate": 0.0003,
        "nats_url": "nats://u:***@127.0.0.1:4222",
        "trainer.steps": 300,
        "up.model": "/m",
        "up.reward": '["exact=1.0","m:f=0.5"]',
    }
    metrics.step(record(1, 0.5))
    metrics.close()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    found = {}
    for data in events.PluginTagToContent("hparams").values():
        parsed = plugin_data_pb2.HParamsPluginData.FromString(data)
        if parsed.HasField("session_start_info"):
            found = {k: getattr(v, v.WhichOneof("kind")) for k, v in parsed.session_start_info.hparams.items()}
    assert found == {**metrics.config, "trainer.steps": 300.0, "learning_rate": 0.0003}
    (offline,) = (run_dir / "wandb").glob("offline-run-*-run-8")
    body = (offline / "run-run-8.wandb").read_bytes()
    assert b"up.reward" in body and b"trainer.steps" in body and b"secret" not in body

"""`centerline record` / `centerline replay` against a real run: the session's 3-step
`centerline up` (tests/conftest.py), whose ROLLOUTS stream is recorded afterwards from its
persisted JetStream store.

The replay starts from the run's checkpoint step-000002 (the trainer keeps the last two)
under torchrun with 2 ranks, as the run's trainer had, and must reproduce step 3 bit for
bit: every metric, and the checkpoint after it (model bytes, optimizer tensors).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import orjson
import pytest
import torch

from centerline.nats_server import EmbeddedNats
from centerline.runs.record import MAGIC, Message, RecordFileError, read_record, record_stream
from shared import names
from shared.nats_client import connect
from shared.streams import ensure_streams
from tests.processes import stored_messages

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
# Fields that depend on the batches and the model only (not on timings).
REPRODUCED = (
    "step",
    "version",
    "loss",
    "grad_norm",
    "trained_tokens",
    "samples",
    "reward_mean",
    "sc_correction",
    "sc_residual_l1",
    "sc_train_head_mass",
    "sc_rollout_head_mass",
    "sc_tail_ratio",
    "sc_importance_weight",
    "train_rollout_kl",
    "train_rollout_logprob_abs_diff",
    "staleness_mean",
    "staleness_max",
    "gate_accepted",
    "batch_ids",
)


def centerline(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "centerline", *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout
    )


def lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


async def stream_messages(url: str, stream: str = names.ROLLOUTS_STREAM) -> list[tuple[str, dict, bytes]]:
    return [(m.subject, dict(m.headers or {}), m.data) for m in await stored_messages(url, stream)]


@pytest.fixture(scope="module")
def run(up_run, tmp_path_factory):
    """The session's finished 3-step run, its NATS store served again, and a recording of all of ROLLOUTS."""
    tmp = tmp_path_factory.mktemp("record-replay")
    run_dir = up_run.run_dir
    nats = EmbeddedNats(run_dir / "nats").start()  # the persisted JetStream store, on a new port
    try:
        record = centerline(
            "record", "--stream", "ROLLOUTS", "--from-seq", "1", "--out", str(tmp / "seg.clrec"), "--nats-url", nats.url
        )
        assert record.returncode == 0, record.stderr
        yield tmp, run_dir, nats
    finally:
        nats.stop()


def test_record_holds_every_stream_message_unchanged(run):
    tmp, run_dir, nats = run
    header, messages = read_record(tmp / "seg.clrec")
    stored = asyncio.run(stream_messages(nats.url))
    assert [(m.subject, m.headers, m.data) for m in messages] == stored
    assert [m.seq for m in messages] == list(range(1, len(stored) + 1))
    assert header["source"]["stream"] == "ROLLOUTS"
    trained = {b for step in lines(run_dir / "metrics.jsonl") for b in step["batch_ids"]}
    assert trained <= {m.headers[names.MSG_ID_HEADER] for m in messages}


def test_replay_train_reproduces_the_step_bit_for_bit(run):
    tmp, run_dir, _ = run
    out = tmp / "replayed"
    # The trainer wrote every setting; replay --train takes them from there, no flag repeated.
    written = tomllib.loads((run_dir / "config.toml").read_text())
    assert {"strategy", "max_grad_norm", "threads", "weight_sync_interval"} <= set(written["trainer"])
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "centerline",
        "replay",
        str(tmp / "seg.clrec"),
        "--train",
        "--checkpoint",
        str(run_dir / "checkpoints" / "step-000002"),
        "--run-dir",
        str(out),  # the steps' grouping and settings: the checkpoint's run's metrics.jsonl and config.toml
    ]
    replay = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert replay.returncode == 0, replay.stderr[-3000:]

    original = {r["step"]: r for r in lines(run_dir / "metrics.jsonl")}
    replayed = lines(out / "metrics.jsonl")
    assert [r["step"] for r in replayed] == [3]
    for r in replayed:
        for key in REPRODUCED:
            assert r[key] == original[r["step"]][key], key  # floats equal, not close
    # The state after the step, too: model bytes and every optimizer tensor.
    mine, theirs = out / "checkpoints" / "step-000003", run_dir / "checkpoints" / "step-000003"
    assert (mine / "model" / "model.safetensors").read_bytes() == (theirs / "model" / "model.safetensors").read_bytes()
    a, b = (read_training_state(p, tmp / f"dcp-{i}") for i, p in enumerate((mine, theirs)))
    assert a.keys() == b.keys()
    tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
    assert any(k.startswith("optim.state.") for k in tensors)
    assert all(torch.equal(a[k], b[k]) for k in tensors)
    assert {k: v for k, v in a.items() if k not in tensors} == {k: v for k, v in b.items() if k not in tensors}
    assert orjson.loads((mine / "state.json").read_bytes()) == orjson.loads((theirs / "state.json").read_bytes())


def test_replay_train_restores_every_trainer_setting_of_the_run(run, tmp_path):
    tmp, run_dir, _ = run
    # The run's config.toml with two trainer settings a replay used to drop: it kept 2 checkpoints
    # and wrote TensorBoard events whatever the run said.
    written = tomllib.loads((run_dir / "config.toml").read_text())
    assert (written["trainer"]["keep_checkpoints"], written["trainer"]["tensorboard"]) == (2, True)
    config = tmp_path / "config.toml"
    config.write_text(
        (run_dir / "config.toml")
        .read_text()
        .replace("keep_checkpoints = 2", "keep_checkpoints = 1")
        .replace("tensorboard = true", "tensorboard = false")
    )
    out = tmp_path / "replayed"
    replay = centerline(
        "replay",
        str(tmp / "seg.clrec"),
        "--train",
        "--checkpoint",
        str(run_dir / "checkpoints" / "step-000002"),
        "--run-dir",
        str(out),
        "--config",
        str(config),
        "--batches-per-step",
        "1",  # step 3's batches one per step: a step and a checkpoint each
        "--max-staleness",
        "10",  # the later ones meet weights more than 2 versions newer than theirs
    )
    assert replay.returncode == 0, replay.stderr[-3000:]
    steps = [r["step"] for r in lines(out / "metrics.jsonl")]
    assert len(steps) >= 2 and steps == list(range(3, 3 + len(steps)))
    assert [p.name for p in (out / "checkpoints").iterdir()] == [f"step-{steps[-1]:06d}"]  # only the newest kept
    assert list(out.glob("events.out.tfevents.*")) == []


def test_replay_to_a_fresh_server_delivers_the_same_messages(run, tmp_path):
    tmp, _, _ = run
    with EmbeddedNats(tmp_path / "fresh") as fresh:
        first = centerline("replay", str(tmp / "seg.clrec"), "--to", fresh.url)
        assert first.returncode == 0, first.stderr
        again = centerline("replay", str(tmp / "seg.clrec"), "--to", fresh.url)  # Nats-Msg-Id dedup applies
        delivered = asyncio.run(stream_messages(fresh.url))
    _, messages = read_record(tmp / "seg.clrec")
    assert delivered == [(m.subject, m.headers, m.data) for m in messages]
    assert orjson.loads(first.stdout) == {
        "published": len(messages),
        "stored": len(messages),
        "duplicates": 0,
        "to": fresh.url,
    }
    assert orjson.loads(again.stdout)["duplicates"] == len(messages)


def test_jsonl_dump_has_one_line_per_message_with_the_batch_summary(run):
    tmp, _, _ = run
    dump = centerline("replay", str(tmp / "seg.clrec"), "--jsonl")
    assert dump.returncode == 0, dump.stderr
    _, messages = read_record(tmp / "seg.clrec")
    rows = [orjson.loads(line) for line in dump.stdout.splitlines()]
    assert [(r["subject"], r["seq"], r["headers"]) for r in rows] == [(m.subject, m.seq, m.headers) for m in messages]
    heldout = [r for r in rows if "/heldout/" in r["batch"]["task_id"]]  # the trainer's rounds: one sample a row
    assert 0 < len(heldout) < len(rows)
    for r in rows:
        batch = r["batch"]
        assert batch["batch_id"] == r["headers"][names.MSG_ID_HEADER]
        assert batch["producer"] in {"worker-0", "worker-1"} and batch["mode"] == "selected" and batch["k"] == 128
        assert batch["samples"] == (1 if r in heldout else 2)  # held-out rows one each, training groups rollout_n
        assert batch["tokens"] > 0 and 0.0 <= batch["reward_mean"] <= 1.0
        assert batch["task_id"] == batch["batch_id"] and (batch["attempt"], batch["parts"]) == (1, 1)
        # weights are updated in flight (the default, docs/design.md section 8): a response may span
        # updates, its first tokens sampled by an older version (one, almost always, for 8 tokens)
        assert 0 <= batch["weight_version"] - batch["oldest_trained_version"] <= 2
        assert set(batch) == {
            "batch_id",
            "producer",
            "task_id",
            "attempt",
            "parts",
            "weight_version",
            "oldest_trained_version",
            "mode",
            "k",
            "samples",
            "tokens",
            "reward_mean",
            "prompt_tokens",
            "sampled_tokens",
            "injected_tokens",
            "turns",
            "finish_reasons",
        }
        samples = batch["samples"]
        assert batch["turns"] == [1] * samples and batch["injected_tokens"] == 0  # plain responses
        assert batch["sampled_tokens"] == batch["tokens"] and len(batch["finish_reasons"]) == samples


def test_live_recording_stops_after_count_messages(tmp_path):
    with EmbeddedNats(tmp_path / "nats") as server:
        cmd = [
            sys.executable,
            "-m",
            "centerline",
            "record",
            "--subject",
            names.ROLLOUTS_SUBJECT,
            "--count",
            "2",
            "--out",
            str(tmp_path / "live.clrec"),
            "--nats-url",
            server.url,
        ]
        rec = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stderr=subprocess.PIPE, text=True)
        assert "recording" in rec.stderr.readline()  # subscribed: what is published now is recorded

        async def publish():
            nc = await connect(server.url)
            js = nc.jetstream()
            await ensure_streams(js)
            for i in range(3):
                await js.publish(names.ROLLOUTS_SUBJECT, b"m%d" % i, headers={names.MSG_ID_HEADER: f"id-{i}"})
            await nc.close()

        asyncio.run(publish())
        assert rec.wait(60) == 0
    _, messages = read_record(tmp_path / "live.clrec")
    assert [(m.subject, m.seq, m.headers, m.data) for m in messages] == [
        (names.ROLLOUTS_SUBJECT, 0, {names.MSG_ID_HEADER: "id-0"}, b"m0"),
        (names.ROLLOUTS_SUBJECT, 0, {names.MSG_ID_HEADER: "id-1"}, b"m1"),
    ]


def test_a_stream_recording_past_the_last_sequence_stops_there_and_says_so(tmp_path, capsys):
    async def publish_then_record(url: str) -> tuple[dict, list[Message]]:
        nc = await connect(url)
        js = nc.jetstream()
        await ensure_streams(js)
        for i in range(3):
            await js.publish(names.ROLLOUTS_SUBJECT, b"m%d" % i, headers={names.MSG_ID_HEADER: f"id-{i}"})
        await nc.close()
        recorded = []
        return await record_stream(url, names.ROLLOUTS_STREAM, 1, 1000, recorded.append), recorded

    with EmbeddedNats(tmp_path / "nats") as server:
        done, recorded = asyncio.run(publish_then_record(server.url))
    # Sequences 4..1000 were never asked for: none is counted missing.
    assert done == {"stream": "ROLLOUTS", "from_seq": 1, "to_seq": 3, "stream_last_seq": 3, "missing": 0}
    assert [(m.seq, m.data) for m in recorded] == [(1, b"m0"), (2, b"m1"), (3, b"m2")]
    assert capsys.readouterr().err == (
        "centerline record: --to-seq 1000 is past the last sequence of stream 'ROLLOUTS', 3: recording up to 3\n"
    )


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"NOPE!\x01", "offset 0: expected the magic b'CLREC'"),
        (MAGIC + b"\x07", "offset 5: expected format version 1, found 7"),
        (MAGIC + b"\x01", "offset 6: expected the file header frame, found end of file"),
        (MAGIC + b"\x01\x00\x00", "offset 6: expected a 4-byte frame length, 2 bytes left"),
        (MAGIC + b"\x01\x00\x00\x00\x09\x80", "offset 6: frame length says 9 bytes, 1 left"),
        (MAGIC + b"\x01\x00\x00\x00\x01\x80\x00\x00\x00\x01\x07", "offset 15: expected a msgpack map, found int"),
        (
            MAGIC + b"\x01\x00\x00\x00\x01\x80\x00\x00\x00\x01\x80",
            "offset 15: message field 'subject' is missing, expected str",
        ),
    ],
)
def test_malformed_record_file_names_the_offset_and_what_was_expected(tmp_path, content, expected):
    path = tmp_path / "bad.clrec"
    path.write_bytes(content)
    with pytest.raises(RecordFileError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        read_record(path)
    replay = centerline("replay", str(path), "--jsonl")
    assert replay.returncode == 2 and expected in replay.stderr


def test_replay_train_takes_every_setting_from_the_runs_config_toml(tmp_path):
    from centerline.runs import replay

    (tmp_path / "checkpoints" / "step-000002").mkdir(parents=True)
    (tmp_path / "config.toml").write_text(
        'loss = "tis"\nlearning_rate = 0.001\n\n[trainer]\nmodel = "m"\nstrategy = "fsdp2"\nmax_grad_norm = 0.5\n'
        "threads = 3\nweight_sync_interval = 2\n"
    )
    argv = ["seg.clrec", "--train", "--checkpoint", str(tmp_path / "checkpoints" / "step-000002")]
    cfg, trainer = replay.run_settings(replay.parse(argv)[0])
    assert (cfg.loss.name, cfg.training.learning_rate) == ("tis", 0.001)
    assert (trainer.strategy, trainer.max_grad_norm, trainer.threads, trainer.weight_sync_interval) == (
        "fsdp2",
        0.5,
        3,
        2,
    )
    _, trainer = replay.run_settings(replay.parse([*argv, "--threads", "1"])[0])
    assert trainer.threads == 1  # a flag still wins


def test_a_replay_runs_the_trainer_settings_of_the_run_but_its_model_run_directory_and_metrics_port(tmp_path):
    from centerline.runs import replay
    from shared.settings import ReplaySettings, TrainerSettings

    run = TrainerSettings(
        model="m",
        dataset="d",
        run_dir="r",
        strategy="fsdp2",
        micro_batch_tokens=64,
        keep_checkpoints=5,
        tensorboard=False,
        wandb="offline",
        wandb_project="p",
        metrics_port=9100,
    )
    checkpoint = tmp_path / "checkpoints" / "step-000002"
    got = replay.replayed(run, ReplaySettings(checkpoint=checkpoint), tmp_path / "out")
    assert got.model_dump() == {
        **run.model_dump(),
        "model": checkpoint / "model",
        "run_dir": tmp_path / "out",
        "metrics_port": None,
    }


def test_replay_train_groups_steps_as_the_checkpoints_run_did_unless_told_otherwise(tmp_path):
    from centerline.runs import replay

    (tmp_path / "metrics.jsonl").write_text("")
    checkpoint = str(tmp_path / "checkpoints" / "step-000002")
    assert replay.parse(["seg.clrec", "--train", "--checkpoint", checkpoint])[1].steps_from == (
        tmp_path / "metrics.jsonl"
    )
    given = replay.parse(["seg.clrec", "--train", "--checkpoint", checkpoint, "--batches-per-step", "4"])[1]
    assert (given.steps_from, given.batches_per_step) == (None, 4)
    (tmp_path / "metrics.jsonl").unlink()
    assert replay.parse(["seg.clrec", "--train", "--checkpoint", checkpoint])[1].steps_from is None


def read_training_state(path, tmp) -> dict:
    """A checkpoint's sharded model and optimizer state (``state/``) as one flat dict of CPU values."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tmp.mkdir(parents=True, exist_ok=True)
    dcp_to_torch_save(path / "state", tmp / "state.pt")
    state = torch.load(tmp / "state.pt", weights_only=False)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = value

    walk("", state)
    return flat


def test_a_recorded_part_in_pieces_is_joined_for_replay_where_its_last_piece_was():
    from centerline.runs.record import joined
    from shared.pieces import cut

    part, other, broken = os.urandom(2500), os.urandom(900), os.urandom(1500)

    def pieces(data: bytes, batch_id: str, first: int) -> list[Message]:
        return [
            Message("rollouts.batches", first + i, 1.0, h, d) for i, (_, d, h) in enumerate(cut(data, batch_id, 1000))
        ]

    a = pieces(part, "t/1/a", 1)
    bad = pieces(broken, "t/1/c", 10)
    bad[1] = Message(bad[1].subject, bad[1].seq, 1.0, bad[1].headers, b"x" + bad[1].data[1:])
    lone = pieces(os.urandom(2500), "t/1/d", 20)[:2]  # its last piece never stored
    plain = Message("rollouts.batches", 5, 1.0, {"Nats-Msg-Id": "t/1/b"}, other)
    out = joined([a[0], a[1], plain, a[2], *bad, *lone])
    assert out[:2] == [plain, Message("rollouts.batches", 1, 1.0, {"Nats-Msg-Id": "t/1/a"}, part)]
    assert out[2:] == [*bad, *lone]  # no whole: left for the gate's rules to refuse


def test_a_stream_read_back_with_jsonl_summarizes_a_part_in_pieces_once_as_its_batch(tmp_path, capsys):
    from dataclasses import replace

    from centerline.runs.record import JoinedSummaries
    from centerline.synth import make_batch
    from rollout_worker.publish import publish_batch

    long = make_batch(samples=1, tokens_per_sample=1200, k=8, batch_id="r1/0/0")  # ~93 KB: two pieces
    long = replace(long, task_id="r1/0/0")
    short = replace(make_batch(samples=1, k=8, batch_id="r1/0/1"), task_id="r1/0/1")

    async def publish_then_read(url: str) -> None:
        nc = await connect(url)
        js = nc.jetstream()
        await ensure_streams(js)
        for batch in (long, short):
            await publish_batch(js, batch, max_payload=nc.max_payload)
        await nc.close()
        summaries = JoinedSummaries()
        await record_stream(url, names.ROLLOUTS_STREAM, None, None, summaries)
        summaries.close()

    with EmbeddedNats(tmp_path / "nats", max_payload=64 << 10) as server:
        asyncio.run(publish_then_read(server.url))
    lines = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(s["seq"], s["headers"], s["batch"]["batch_id"], s["batch"]["tokens"]) for s in lines] == [
        (1, {"Nats-Msg-Id": "r1/0/0/0-1"}, "r1/0/0/0-1", 1200),  # one sample alone: a part of its own
        (3, {"Nats-Msg-Id": "r1/0/1"}, "r1/0/1", 8),
    ]

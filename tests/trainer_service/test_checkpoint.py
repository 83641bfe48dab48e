"""Atomic checkpoints: complete ones only, the last two kept, model and optimizer restored; on two
gloo ranks each writes and reads its own shards."""

from __future__ import annotations

import os
import subprocess

import orjson
import pytest
import torch
from safetensors.torch import load_file

from centerline.ports import free_port
from tests.trainer_service.conftest import global_batch
from tests.trainer_service.test_distributed import REPO, TORCHRUN
from trainer_service import checkpoint
from trainer_service.model import load_model
from trainer_service.step import make_optimizer, train_step


def test_partial_directories_are_ignored_and_the_last_two_kept(tmp_path, tiny_model_dir):
    model = load_model(tiny_model_dir)
    optimizer = make_optimizer(model, lr=1e-3)
    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        checkpoint.save(root, model, optimizer, {"step": step, "ledger": {f"b{step}": [step, step - 1]}})
    (root / ".tmp-step-000004").mkdir()
    (root / ".tmp-step-000004" / "state.json").write_bytes(b"{")  # a crash mid-write
    assert [p.name for p in checkpoint.complete(root)] == ["step-000002", "step-000003"]
    assert checkpoint.load_state(checkpoint.latest(root))["ledger"] == {"b3": [3, 2]}
    checkpoint.remove_partial(root)
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000003"]


def test_resumed_optimizer_continues_like_the_uninterrupted_one(tmp_path, tiny_model_dir):
    batch = global_batch()
    model = load_model(tiny_model_dir)
    optimizer = make_optimizer(model, lr=1e-3)
    train_step(model, optimizer, batch)
    path = checkpoint.save(tmp_path, model, optimizer, {"step": 1})
    assert orjson.loads((path / "state.json").read_bytes()) == {"step": 1}
    train_step(model, optimizer, batch)

    resumed = load_model(str(path / "model"))
    resumed_opt = make_optimizer(resumed, lr=1e-3)
    checkpoint.load_training_state(path, resumed, resumed_opt)
    train_step(resumed, resumed_opt, batch)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.integration
@pytest.mark.parametrize("strategy", ("fsdp2", "ddp"))
def test_two_gloo_ranks_write_and_read_their_own_shards_and_resume_bit_for_bit(setup, strategy):
    tmp, model_dir, batch_file, _before = setup
    out = tmp / f"sharded-{strategy}"
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    cmd += ["-m", "tests.trainer_service.sharded_checkpoint", "--model", model_dir, "--batch", str(batch_file)]
    cmd += ["--out", str(out), "--strategy", strategy]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    state = out / "checkpoints" / "step-000001" / "state"
    # one file of shards per rank and the metadata; no full optimizer state written by rank 0
    assert sorted(p.name for p in state.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (state.parent / "optimizer.pt").exists()
    if strategy == "fsdp2":  # each rank holds half of every sharded tensor: both files carry data
        sizes = [(state / f"__{r}_0.distcp").stat().st_size for r in (0, 1)]
        assert min(sizes) > 0.3 * max(sizes), sizes
    straight, resumed = (load_file(out / name / "model.safetensors") for name in ("straight", "resumed"))
    assert straight.keys() == resumed.keys()
    assert [k for k in straight if not torch.equal(straight[k], resumed[k])] == []

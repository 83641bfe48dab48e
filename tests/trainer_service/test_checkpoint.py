"""Atomic checkpoints on one process: complete ones only, the last two kept, optimizer restored."""

from __future__ import annotations

import orjson
import torch

from tests.trainer_service.conftest import global_batch
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
    checkpoint.load_optimizer(path, resumed, resumed_opt)
    train_step(resumed, resumed_opt, batch)
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name

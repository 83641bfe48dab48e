"""Each rank binds its own device and every collective of a step carries tensors its process
group serves, on the rank's device (docs/design.md section 6, "Devices"): two real gloo ranks
that believe they have a GPU each (``tests.trainer_service.probe``), for DDP and FSDP2."""

from __future__ import annotations

import json

import pytest
import torch

from tests.trainer_service.probe import served
from tests.trainer_service.test_distributed import run_steps


@pytest.mark.integration
@pytest.mark.parametrize("strategy", ("ddp", "fsdp2"))
def test_each_rank_binds_its_local_device_and_every_collective_is_on_a_device_its_group_serves(setup, strategy):
    tmp, model_dir, batch_file, _before = setup
    probe = tmp / f"probe-{strategy}"
    run_steps(tmp, model_dir, [batch_file, batch_file], 2, "--strategy", strategy, "--scatter", "--probe", str(probe))
    ranks = [json.loads((probe / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["set_device"] == [rank["local_rank"]] == [rank["rank"]]  # bound once, before the group
        assert rank["backend"] == "cpu:gloo,cuda:nccl"
        ops = {c["op"] for c in rank["collectives"]}
        assert {"all_reduce", "scatter_object_list"} <= ops, ops
        wrong = [
            c for c in rank["collectives"] if any(d.split(":")[0] not in served(rank["backend"]) for d in c["devices"])
        ]
        assert wrong == []
        # tensors on the model's device; objects through gloo in CPU memory, never staged on a GPU
        assert {d for c in rank["collectives"] for d in c["devices"]} == {rank["param_device"]} == {"cpu"}


def test_a_local_rank_past_the_gpus_the_machine_shows_is_refused_by_name(monkeypatch):
    from trainer_service import distributed

    bound = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    distributed.bind_device()
    assert bound == [1] and distributed.backend() == "cpu:gloo,cuda:nccl"
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=2 but this machine shows 2 GPU\(s\).*--nproc-per-node"):
        distributed.bind_device()
    assert bound == [1]

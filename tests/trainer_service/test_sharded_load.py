"""FSDP2 on two gloo ranks loads the model without any rank but 0 reading the weights or holding
them whole: each rank's shards are its slices of the model loaded whole in one process, buffers
included, the tied embedding stays tied, and a step trains exactly as on the model loaded whole
on every rank; a rank 0 that cannot read the weights ends the launch. Runs
`python -m tests.trainer_service.sharded_load` (and `one_step`) under torchrun for real."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from centerline.ports import free_port
from tests.trainer_service.conftest import VOCAB
from tests.trainer_service.test_distributed import REPO, TORCHRUN
from trainer_service.model import load_model


@pytest.fixture(scope="module")
def big_tied_model(tmp_path_factory):
    """A tied Llama of about 120 MB in float32 whose largest tensor is 4 MB (the memory a rank
    holds whole stands out from its half and from one tensor in flight), with generation
    settings of its own; and a directory with its config.json alone."""
    path = tmp_path_factory.mktemp("big-tied")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=2048,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.update(do_sample=True, temperature=0.6, top_p=0.9)
    model.save_pretrained(path)
    config_only = tmp_path_factory.mktemp("config-only")
    shutil.copy(path / "config.json", config_only / "config.json")
    return path, config_only


def launch(module: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([*cmd, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def run(setup, big_tied_model, tmp_path_factory):
    """The harness's output directory after one launch on two ranks."""
    tmp, _tiny, batch_file, _before = setup
    model_dir, config_only = big_tied_model
    out = tmp_path_factory.mktemp("sharded-load")
    args = ["--model", str(model_dir), "--config-only", str(config_only), "--batch", str(batch_file), "--out", str(out)]
    proc = launch("tests.trainer_service.sharded_load", *args)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out, model_dir


def ranks(out):
    return [torch.load(out / f"rank-{r}.pt") for r in (0, 1)]


@pytest.mark.integration
def test_each_ranks_shards_are_its_slices_of_the_whole_model_and_the_buffers_its_buffers(run):
    out, model_dir = run
    whole = load_model(str(model_dir))
    full = whole.state_dict()
    for rank, got in enumerate(ranks(out)):
        assert got["tied"] is True
        assert "lm_head.weight" not in got["shards"]  # one parameter, named once
        assert got["shards"].keys() == {n for n, _ in whole.named_parameters()}
        for name, shard in got["shards"].items():
            rows = -(-full[name].shape[0] // 2)  # FSDP2 shards dim 0 in chunks of ceil(rows / ranks)
            assert shard.dtype == torch.float32
            assert torch.equal(shard, full[name][rank * rows : (rank + 1) * rows]), (rank, name)
        buffers = dict(whole.named_buffers())
        assert (
            got["buffers"].keys()
            == buffers.keys()
            == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
        )
        assert [n for n in buffers if not torch.equal(got["buffers"][n], buffers[n])] == []


@pytest.mark.integration
def test_rank_1_builds_from_the_config_alone_and_never_holds_the_model_whole(run):
    # Rank 1 was given a directory with config.json and no weights: it cannot have read them.
    # Its peak resident memory grew by less than the model during the load (its half, one tensor
    # of 4 MB in flight, and what sharding allocates); rank 0's, which read the model, by all of it.
    out, model_dir = run
    model_bytes = (model_dir / "model.safetensors").stat().st_size
    rank0, rank1 = ranks(out)
    assert rank1["rss_grown"] < model_bytes, (rank1["rss_grown"], model_bytes)
    assert rank0["rss_grown"] >= model_bytes, (rank0["rss_grown"], model_bytes)


@pytest.mark.integration
def test_a_step_after_the_sharded_load_trains_exactly_like_one_after_a_whole_load(run):
    out, _ = run
    assert [got["checkpointing"] for got in ranks(out)] == [True, True]  # prepared before sharding, as the trainer does
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["sharded"] == metrics["whole"]  # bit for bit, float32
    assert metrics["sharded"]["trained_tokens"] == 25
    sharded, whole = (load_file(out / name / "model.safetensors") for name in ("sharded", "whole"))
    assert sharded.keys() == whole.keys()
    assert [k for k in sharded if not torch.equal(sharded[k], whole[k])] == []
    for name in ("config.json", "generation_config.json"):
        assert (out / "sharded" / name).read_text() == (out / "whole" / name).read_text(), name


@pytest.mark.integration
def test_a_rank_0_that_cannot_read_the_weights_ends_the_launch_with_its_error(setup, big_tied_model, tmp_path):
    # Rank 1 builds from the config and waits for rank 0's tensors; rank 0's error ends both.
    _tmp, _tiny, batch_file, _before = setup
    _model_dir, config_only = big_tied_model
    args = ["--model", str(config_only), "--batch", str(batch_file), "--out", str(tmp_path / "out")]
    proc = launch("tests.trainer_service.one_step", *args, "--strategy", "fsdp2")
    assert proc.returncode != 0
    assert "[rank0]: OSError: Error no file named model.safetensors" in proc.stderr, proc.stderr[-4000:]

"""`centerline bench weights`: the versions it publishes and the limit it measures them against."""

import json

import torch
from safetensors.torch import load_file, save_file

from centerline.bench.weights import loopback_gbps, memcpy_gbps, write_versions


def test_two_versions_the_models_tensors_and_the_same_times_1001(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (model / "tokenizer.json").write_text("{}")
    tensors = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b.bias": torch.ones(4)}
    save_file(tensors, str(model / "model.safetensors"))
    versions = write_versions(model, tmp_path / "out")
    assert versions == [tmp_path / "out" / "v0", tmp_path / "out" / "v1"]
    for v, scale in zip(versions, (1.0, 1.001)):
        # every file of the model but its safetensors, copied; the tensors in one file, as the trainer writes them
        assert sorted(p.name for p in v.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
        assert (v / "config.json").read_text() == (model / "config.json").read_text()
        loaded = load_file(str(v / "model.safetensors"))
        assert sorted(loaded) == sorted(tensors)
        for name, t in tensors.items():
            assert torch.equal(loaded[name], t * scale)


def test_the_limits_rates_are_measured_over_the_bytes_asked():
    # one byte short of two writes: the last, partial write is sent and received too
    assert loopback_gbps((8 << 20) - 1) > 0
    assert memcpy_gbps(1 << 20, repeats=2) > 0

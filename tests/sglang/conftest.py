"""Fixtures for the facts this project relies on in real SGLang 0.5.23 and sglang-router 0.3.2.

The server and router are the session's shared ones (``sglang``, ``sglang_router`` in
tests/conftest.py); here are only what the checks compare them with: a second model, an
independent float64 forward of the same weights, and SGLang's own JSON contract types.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory, make_model) -> Path:
    """Seed 1: same architecture and tokenizer as ``model_dir``, other weights."""
    return make_model(tmp_path_factory.mktemp("model") / "seed1", seed=1)


@pytest.fixture(scope="session")
def reference(model_dir):
    """An independent float64 transformers forward over a model directory's weights:
    ``reference(path)(ids) -> logits [L, V]``; ``reference.default`` is ``model_dir``'s."""
    import torch
    from transformers import AutoModelForCausalLM

    def load(path: Path):
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64).eval()

        def logits(ids: list[int]) -> torch.Tensor:
            with torch.inference_mode():
                return model(torch.tensor([ids])).logits[0]

        return logits

    load.default = load(model_dir)
    return load


@pytest.fixture(scope="session")
def api_types():
    """SGLang 0.5.23's generated JSON contract types (``sglang/api/v1/api_types.py``), loaded
    by file path: it needs only msgspec, while ``import sglang`` pulls its whole server stack."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang==0.5.23 is required"
    path = Path(list(spec.submodule_search_locations)[0]) / "api" / "v1" / "api_types.py"
    module_spec = importlib.util.spec_from_file_location("sglang_api_types_standalone", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # msgspec resolves the annotations through sys.modules
    module_spec.loader.exec_module(module)
    return module

"""Shared fixtures for the embedded engine: a model made by `centerline init-model` and a
real engine subprocess on a free loopback port, ready once GET /health answers 200.

`start_engine(model_dir)` returns an `EngineProcess` with `.url`; the session stops it. The
process helpers live in `tests/processes.py`, shared with the other test packages.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.processes import ENV, REPO, EngineProcess, free_port, http, init_model, wait_until  # noqa: F401


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("model") / "seed0", seed=0)


@pytest.fixture(scope="session")
def other_model_dir(tmp_path_factory) -> Path:
    return init_model(tmp_path_factory.mktemp("model") / "seed1", seed=1)


@pytest.fixture(scope="session")
def start_engine(tmp_path_factory):
    started: list[EngineProcess] = []

    def start(model: Path, *extra: str) -> EngineProcess:
        engine = EngineProcess(model, tmp_path_factory.mktemp("engine") / "engine.log", *extra)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        engine.stop()


@pytest.fixture(scope="session")
def engine(start_engine, model_dir) -> EngineProcess:
    """The shared engine: serves `model_dir` at weight version "0"; tests must not update it."""
    return start_engine(model_dir)


@pytest.fixture(scope="session")
def reference(model_dir):
    """An independent float64 transformers forward over the same weights: ids -> logits [L, V]."""
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
    """SGLang 0.5.23's generated JSON contract types, loaded by file path (never `import sglang`)."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations, "sglang==0.5.23 (installed --no-deps) is required"
    path = Path(list(spec.submodule_search_locations)[0]) / "api" / "v1" / "api_types.py"
    module_spec = importlib.util.spec_from_file_location("sglang_api_types_standalone", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_spec.name] = module  # msgspec resolves the annotations through sys.modules
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tools():
    return SimpleNamespace(http=http, free_port=free_port, wait_until=wait_until, init_model=init_model, env=ENV, repo=REPO)

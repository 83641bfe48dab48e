"""The real-model tier: SmolLM2-135M-Instruct (``centerline make-model smollm2``), served by real SGLang
behind the real router, once per session.

The model is made once per machine and cached outside the repository, in
``$CENTERLINE_MODELS_CACHE/smollm2-135m-instruct`` (default ``~/.cache/centerline/models``): the
GGUF's sha256 is checked against the pin when it is made, the safetensors' sha256 against the
record written beside them every time the cache is used. Sized for the suite's time budget: on 2
CPU cores SGLang samples about 50 tokens/s on it at K = 128 and 8 concurrent requests (15 alone),
so requests here ask for at most 16 new tokens.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

import pytest

from centerline.make_model import make

VOCAB = 49152
IM_END = 2  # <|im_end|>: the end of an assistant turn, the model's eos


def models_cache() -> Path:
    return Path(os.environ.get("CENTERLINE_MODELS_CACHE", "~/.cache/centerline/models")).expanduser()


@pytest.fixture(scope="session")
def real_model() -> Path:
    """The model directory, made on first use (a lock keeps concurrent sessions from making it twice)."""
    out = models_cache() / "smollm2-135m-instruct"
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".smollm2-135m-instruct.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        make("smollm2", out)
    return out


@pytest.fixture(scope="session")
def real_sglang(real_model, tmp_path_factory):
    """One real SGLang server on the CPU serving the real model, for the whole session."""
    from tests.processes import SGLangProcess

    server = SGLangProcess(real_model, tmp_path_factory.mktemp("real-sglang") / "sglang.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def real_router(real_sglang, tmp_path_factory):
    """The real SGLang router (smg 0.3.2) in front of ``real_sglang``, default settings."""
    from tests.processes import Router

    router = Router(tmp_path_factory.mktemp("real-router") / "router.log", [real_sglang.url])
    yield router
    router.stop()

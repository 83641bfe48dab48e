"""`centerline sglang`: start a real SGLang server with this project's recipe, CPU or GPU.

It execs ``python -m sglang.launch_server`` (the sglang version pinned in pyproject.toml);
nothing of SGLang is re-implemented here.

Always set: ``SGLANG_RETURN_ORIGINAL_LOGPROB=0`` (log-probs are ``log_softmax(logits / T)``
over the whole vocabulary, before top-k/top-p/min-p, which the loss assumes), and the
engines' admin key, read from ``CENTERLINE_ENGINE_ADMIN_API_KEY`` or the file
``CENTERLINE_ENGINE_ADMIN_API_KEY_FILE`` (``shared/admin_key.py``), as ``--admin-api-key``.
SGLang takes keys as flags only, so the key shows in the server's command line, never in this one's.

The CPU recipe (``--device cpu``, docs/sglang.md): ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's CPU
switch), ``OMP_NUM_THREADS`` 1 unless set, ``--max-total-tokens 2048
--sleep-on-idle``, and the import-only ``sgl_kernel`` stand-in (``centerline/sgl_kernel_stub``)
on ``PYTHONPATH``: the package index has no CPU build of ``sgl_kernel``. On ``--device cuda``
none of that applies. The dtype is the trainer's, float32, on both (SGLang's ``auto`` would
serve a float32 model in float16, and the sampler's log-probs would then differ from the
trainer's by the rounding); ``--dtype`` changes it.

Flags after ``--`` go to SGLang unchanged (they win over the recipe's):

    centerline sglang --model models/default --port 30000
    centerline sglang --model /ckpt/base --device cuda --port 30000 -- --tp-size 2
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from shared import admin_key

STUB_DIR = Path(__file__).resolve().parent / "sgl_kernel_stub"
# Measured on 2 cores (docs/sglang.md): without these, a 15 GB KV cache is allocated in 33 s,
# the idle scheduler busy-polls most of a core, and fp16 log-probs are off by about 1e-3.
CPU_FLAGS = ("--max-total-tokens", "2048", "--sleep-on-idle")


def server_argv(
    model: Path | str, host: str, port: int, device: str, extra: list[str] = (), dtype: str = "float32"
) -> list[str]:
    """The ``sglang.launch_server`` command line, without any key. ``extra`` comes last, so an
    SGLang flag given there replaces the recipe's."""
    argv = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--host",
        host,
        "--port",
        str(port),
        "--device",
        device,
    ]
    argv += ["--dtype", dtype]
    if device == "cpu":
        argv += CPU_FLAGS
    return argv + list(extra)


def server_env(base: Mapping[str, str], device: str) -> dict[str, str]:
    """The server's environment: ``base`` without the project's secrets (the admin key goes on
    the command line SGLang reads), plus the recipe's variables."""
    env = {k: v for k, v in base.items() if k not in admin_key.VARIABLES}
    env |= {"SGLANG_RETURN_ORIGINAL_LOGPROB": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUB_DIR), env.get("PYTHONPATH", "")) if p)
    return env


def router_argv(worker_urls: list[str], host: str, port: int, metrics_port: int) -> list[str]:
    """The real SGLang router (``smg``, from the sglang-router wheel) in front of ``worker_urls``,
    with its own settings otherwise; Prometheus on ``metrics_port`` (its default 29000 would
    collide between routers on one machine)."""
    smg = Path(sys.executable).parent / "smg"
    return [
        str(smg) if smg.exists() else "smg",
        "launch",
        "--worker-urls",
        *worker_urls,
        "--host",
        host,
        "--port",
        str(port),
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
    ]


def main(argv: list[str]) -> int:
    ours, _, extra = (
        (argv[: argv.index("--")], None, argv[argv.index("--") + 1 :]) if "--" in argv else (argv, None, [])
    )
    parser = argparse.ArgumentParser(
        prog="centerline sglang",
        description=__doc__.split("\n")[0],
        epilog="flags after -- are passed to sglang.launch_server",
    )
    parser.add_argument("--model", required=True, type=Path, help="HF model directory (weight version 0)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=30000, help="port to listen on")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu: the CPU recipe above")
    parser.add_argument(
        "--dtype", default="float32", help="SGLang --dtype: the trainer's float32 unless you choose otherwise"
    )
    args = parser.parse_args(ours)
    try:
        key = admin_key.key_from_env()
    except admin_key.AdminKeyError as exc:
        parser.error(str(exc))
    if not (args.model / "config.json").is_file():
        parser.error(
            f"--model {args.model}: no config.json there; make one with `centerline init-model --out {args.model}`"
        )
    command = server_argv(args.model, args.host, args.port, args.device, extra, args.dtype)
    if key:
        command.append(f"--admin-api-key={key}")  # one argument: a key may begin with "-"
    sys.stdout.flush()
    os.execve(command[0], command, server_env(os.environ, args.device))
    return 0  # not reached

"""`centerline sglang`: start a real SGLang server with this project's recipe, CPU or GPU.

It execs ``python -m sglang.launch_server`` (the sglang version pinned in pyproject.toml);
nothing of SGLang is re-implemented here.

Always set: ``SGLANG_RETURN_ORIGINAL_LOGPROB=0`` (log-probs are ``log_softmax(logits / T)``
over the whole vocabulary, before top-k/top-p/min-p, which the loss assumes), and the
engines' admin key, read from ``CENTERLINE_ENGINE_ADMIN_API_KEY`` or the file
``CENTERLINE_ENGINE_ADMIN_API_KEY_FILE`` (``shared/admin_key.py``), given to SGLang in a private
``--config`` file, removed once the server answers (``centerline/engine_key.py``): never on a
command line, and never in the server's environment. The flags after ``--`` may hold neither
``--config`` (SGLang takes one, this one) nor ``--admin-api-key``.

The CPU recipe (``--device cpu``, docs/sglang.md): ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's CPU
switch), ``OMP_NUM_THREADS`` 1 unless set, ``--max-total-tokens 2048
--sleep-on-idle``, and the import-only ``sgl_kernel`` stand-in (``centerline/sgl_kernel_stub``)
on ``PYTHONPATH``: the package index has no CPU build of ``sgl_kernel``. On ``--device cuda``
none of that applies. The dtype is the trainer's, float32, on both (SGLang's ``auto`` would
serve a float32 model in float16, and the sampler's log-probs would then differ from the
trainer's by the rounding); ``--dtype`` changes it.

The watchdog: before the exec, a small process is forked that (after removing the key's file)
asks the server's ``/ready``
every second (SGLang answers 503 while generation is paused) and, once the server has been
ready, sends ``/continue_generation`` (with the admin key) to a server that has stayed paused
``--continue-after`` seconds (default 10; 0: no watchdog). The trainer pauses an engine only
for the length of a weight update (trainer_service/weights.py); a trainer killed between the
pause and the continue would otherwise leave the engine paused until the next trainer's
update. A continue that comes during a slow load is harmless: SGLang's scheduler handles it
after the load (docs/design.md section 8). The watchdog ends when the server does.

Flags after ``--`` go to SGLang unchanged (they win over the recipe's):

    centerline sglang --model models/default --port 30000
    centerline sglang --model /ckpt/base --device cuda --port 30000 -- --tp-size 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from centerline import engine_key
from shared import admin_key

# The engines' admin key's variables: only the engine and the trainer may hold them.
ADMIN_KEY_VARIABLES = (admin_key.KEY_ENV, admin_key.KEY_FILE_ENV)
STUB_DIR = Path(__file__).resolve().parent / "sgl_kernel_stub"
# Each is needed on the CPU: without them the KV cache is sized for a GPU, the idle scheduler
# busy-polls, and fp16 log-probs are off (docs/sglang.md, The CPU recipe).
CPU_FLAGS = ("--max-total-tokens", "2048", "--sleep-on-idle")
CRASH_DIAGNOSTICS = ("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH")
CONTINUE_AFTER = 10.0  # seconds: weight loads of the toy model take ~0.02 s, of a 7B model from page cache a few


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
    """The server's environment: ``base`` without the project's secrets (the admin key goes in
    the ``--config`` file SGLang reads), plus the recipe's variables."""
    env = {k: v for k, v in base.items() if k not in ADMIN_KEY_VARIABLES}
    env |= {"SGLANG_RETURN_ORIGINAL_LOGPROB": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env.setdefault("OMP_NUM_THREADS", "1")
        # A server stopped with its process group (as `centerline up` stops it) sees its scheduler
        # die and sleeps 5 s for crash diagnostics, a py-spy dump and a CUDA core dump, neither of
        # which exists here (docs/sglang.md, The CPU recipe).
        for diagnostics in CRASH_DIAGNOSTICS:
            env.setdefault(diagnostics, "0")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(STUB_DIR), env.get("PYTHONPATH", "")) if p)
    return env


# Session affinity (docs/design.md section 12): smg's ``manual`` policy sends every request carrying
# ``X-SMG-Routing-Key`` to the engine it first chose for that key (another only when that one is
# unhealthy), so a session's turns find their history in one engine's prefix cache; a request
# without the header (a single-turn task: one request of n samples) goes to a healthy engine at
# random, so those still spread over the engines.
ROUTER_POLICY = "manual"
# Where ``manual`` puts a new key: ``min_group``, the engine with the fewest keys that have a request
# in flight, so the sessions that run at once are spread evenly. smg's default, ``random``, placed 16
# sessions 12/4 over 2 engines, one engine doing most of the work for the sessions' whole length.
ROUTER_ASSIGNMENT_MODE = "min_group"
# An engine that stops answering (a crash, a restart) opens smg's circuit for it after 10 failed
# requests; smg lets a request through again only after --cb-timeout-duration-secs, 60 s by
# default, so an engine back after 15 s sat unused for 45 s more. Five seconds bounds that wait
# at one failed request per engine every 5 s while it is down (docs/sglang.md).
ROUTER_CIRCUIT_RETRY_S = 5


def router_main(argv: list[str]) -> int:
    """`centerline router FLAGS`: the real SGLang router, as ``smg launch FLAGS`` starts it (the
    sglang-router wheel's own flags, parser and Rust router), without what ``smg launch`` imports on
    the way: its module of the Python debugging balancer, which imports SGLang and costs every start
    of the router most of its start-up time (docs/sglang.md, Starting the router)."""
    import setproctitle
    from sglang_router.router import Router
    from sglang_router.router_args import RouterArgs

    parser = argparse.ArgumentParser(prog="centerline router", description=router_main.__doc__)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    args = RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)
    if args.mini_lb:
        parser.error("--mini-lb: the Python debugging balancer is not started here; use `smg launch --mini-lb`")
    setproctitle.setproctitle("sglang::router")
    args._validate_router_args()  # what `smg launch` checks before it starts the router
    Router.from_args(args).start()
    return 0


# How the router is started: `centerline router`, after the interpreter (``router_argv``).
ROUTER_PROGRAM = ("-m", "centerline", "router")


def router_argv(
    worker_urls: list[str],
    host: str,
    port: int,
    metrics_port: int,
    policy: str = ROUTER_POLICY,
    assignment_mode: str = ROUTER_ASSIGNMENT_MODE,
) -> list[str]:
    """The real SGLang router (smg's, from the sglang-router wheel, by ``centerline router``) in front
    of ``worker_urls``, routing by ``policy`` (session affinity unless told otherwise; under
    ``manual``, new keys placed by ``assignment_mode``), retrying an engine's open circuit after
    ``ROUTER_CIRCUIT_RETRY_S``, with its own settings otherwise; Prometheus on ``metrics_port`` (its
    default 29000 would collide between routers on one machine)."""
    placement = ["--assignment-mode", assignment_mode] if policy == "manual" else []
    return [
        sys.executable,
        *ROUTER_PROGRAM,
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        *placement,
        "--cb-timeout-duration-secs",
        str(ROUTER_CIRCUIT_RETRY_S),
        "--host",
        host,
        "--port",
        str(port),
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
    ]


def ready_status(url: str) -> int | None:
    """The status of GET ``url``/ready (200 ready, 503 paused or not up), None when it does not answer."""
    try:
        with urllib.request.urlopen(url + "/ready", timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


def continue_generation(url: str, key: str | None) -> int | None:
    """POST ``url``/continue_generation with the admin key; its status, None when it does not answer."""
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    request = urllib.request.Request(url + "/continue_generation", data=b"{}", headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return None


def watchdog(url: str, key: str | None, continue_after: float, server_pid: int, clock=time.monotonic) -> None:
    """Continue the server at ``url`` whenever it has been paused ``continue_after`` seconds; return
    when the process ``server_pid`` is gone (this process, forked from it, is then someone else's)."""
    ready_once, paused_since = False, None
    while os.getppid() == server_pid:
        status, now = ready_status(url), clock()
        if status == 200:
            ready_once, paused_since = True, None
        elif status == 503 and ready_once:
            paused_since = now if paused_since is None else paused_since
            if now - paused_since >= continue_after:
                answer = continue_generation(url, key)
                print(
                    f"centerline sglang watchdog: {url} paused {now - paused_since:.1f} s without a continue "
                    f"(its trainer died between pause and continue?): sent /continue_generation, HTTP {answer}",
                    file=sys.stderr,
                    flush=True,
                )
                paused_since = None
        else:
            paused_since = None  # not answering: starting, stopping or gone
        time.sleep(1.0)  # polling interval of the server's own report


def start_watchdog(host: str, port: int, key: str | None, continue_after: float, config: Path | None) -> None:
    """Fork the helper of the server this process is about to become (its pid stays the same):
    it removes the key's ``config`` once the server has read it, then is its watchdog (none when
    ``continue_after`` is 0)."""
    server_pid = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    if os.fork() == 0:
        try:
            address = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
            address = f"[{address}]" if ":" in address else address
            if config is not None:
                engine_key.forget_once_read(f"http://{address}:{port}", config, server_pid)
            if continue_after:
                watchdog(f"http://{address}:{port}", key, continue_after, server_pid)
        finally:
            os._exit(0)


def flags_left_to_us(extra: list[str]) -> str | None:
    """Why the SGLang flags ``extra`` cannot be passed on, or None: ``--config`` (SGLang reads one
    file, the key's) and ``--admin-api-key`` (a key on a command line) are this command's."""
    for flag in ("--config", "--admin-api-key"):
        if any(arg == flag or arg.startswith(flag + "=") for arg in extra):
            return (
                f"{flag} after --: the admin key reaches SGLang in the --config file this command writes; "
                f"set {admin_key.KEY_ENV} or {admin_key.KEY_FILE_ENV} and pass SGLang's other flags after -- "
                "one by one"
            )
    return None


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
    parser.add_argument(
        "--continue-after",
        type=float,
        default=CONTINUE_AFTER,
        help="continue the server when it has been paused this many seconds without a continue (a trainer died "
        "between pause and continue); 0: no watchdog",
    )
    args = parser.parse_args(ours)
    if args.continue_after < 0:
        parser.error(f"--continue-after {args.continue_after}: must be >= 0 (0 turns the watchdog off)")
    if (problem := flags_left_to_us(extra)) is not None:
        parser.error(problem)
    if not (args.model / "config.json").is_file():
        parser.error(
            f"--model {args.model}: no config.json there; make one with `centerline init-model --out {args.model}`"
        )
    try:  # the key's file last: nothing may fail between its writing and the exec
        key = admin_key.key_from_env()
        config = engine_key.private_config(key) if key else None
    except admin_key.AdminKeyError as exc:
        parser.error(str(exc))
    command = server_argv(args.model, args.host, args.port, args.device, extra, args.dtype)
    if config is not None:
        command += ["--config", str(config)]
    if config is not None or args.continue_after:
        start_watchdog(args.host, args.port, key, args.continue_after, config)
    sys.stdout.flush()
    os.execve(command[0], command, server_env(os.environ, args.device))
    return 0  # not reached

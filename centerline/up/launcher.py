"""`centerline up`: the whole system on one machine, on a verifiable toy task or on your own.

Starts, each as its own process with its log in ``RUN_DIR/logs/``: the embedded NATS
server, ``--engines`` real SGLang servers on the CPU (``centerline sglang``; model made by
``init-model --sft``, cached in ``--model-dir``), the real SGLang router in front of them,
the proxy in front of the router, ``--workers`` rollout workers and a
``--trainer-ranks``-rank trainer under torchrun that loads every new weight version into
each SGLang server directly. Every service reads one run spec (``centerline/up/run_spec.py``),
``RUN_DIR/config.toml``, written once with every table before the first service starts; each is
started with ``--config RUN_DIR/config.toml`` and its identity only (a worker's ``--worker-id``)
in an environment without ``CENTERLINE_*`` settings variables, which the spec resolved already,
so what ran is what the file and the report show. As it starts ``up`` fills in the trainer's
``model``, ``dataset``, ``run_dir`` and ``heldout_dataset``, the workers' ``chat_template``, the
proxy's ``upstream`` and ``port`` (``run_spec.with_launch_settings``); ``--steps``,
``--prompts-per-step``, ``--train-seconds``, ``--heldout-every`` and ``--weight-update`` are the
trainer's settings, which ``up`` takes as flags too.
Held-out accuracy (exact match of one sample per prompt at the rollout temperature,
``--heldout-prompts`` prompts) is the
trainer's own (docs/design.md section 9): ``up`` writes the held-out rows to ``RUN_DIR/heldout.jsonl``,
the trainer's ``heldout_dataset``, and the trainer has the workers sample them before training,
every ``--heldout-every`` steps and after the last, into ``RUN_DIR/heldout_metrics.jsonl``, which
``up`` shows as it appears. At the end ``RUN_DIR/report.html`` and ``RUN_DIR/plots/*.png`` are written.

Your own task (``centerline/up/prepare.py``, ``centerline/up/user_task.py``): ``--model DIR`` replaces the toy model,
``--dataset FILE`` the toy task (its rows without ``"split": "eval"`` become the trainer's
``RUN_DIR/train.jsonl``), ``--reward`` names the reward, and the held-out figure is then the mean
reward of one sample per held-out row (``--heldout-dataset``, else the rows marked eval, else none:
``RUN_DIR/heldout.json`` and the report say which). ``--chat-template`` (auto: on for a
``--model`` whose tokenizer has one) has the workers render each prompt, held-out ones too, as one
user message; the model's eos ends a response. Same topology, credentials and keys as the toy run.

Multi-turn sessions (``--environment``, docs/design.md section 12): ``module:function`` (importable
from the directory ``up`` runs in, checked before anything starts) or the built-in ``chain``
(``--task chain``, which names it by itself) makes every toy task, or every ``--dataset`` row that
names no environment of its own, ``n`` sessions of it. The held-out figure is then the mean
reward of one session per held-out row, which a worker plays as it plays a training task.

NATS runs with centerline/nats_users.py's users, passwords made for this run: the launcher
creates the streams as ``admin``, and each service gets only its own user and password, in its
environment (``centerline/up/processes.py``), never in ``config.toml``. Likewise the engines' admin key
(``shared/admin_key.py``): a new one per run, in the environment of the SGLang servers and
the trainer only.

Progress: a live status line on a terminal, one JSON line per step otherwise. Ctrl-C or
SIGTERM stops every process, trainer first (it commits or abandons its step), NATS last.

    centerline up                       # defaults: 2 workers, 2 trainer ranks, task upper, 300 steps
    centerline up --steps 5 --workers 1 --heldout-prompts 16
    centerline up --model models/smollm2 --dataset data.jsonl --reward rewards:score --steps 3

Defaults are chosen so that the default run learns on 2 CPU cores in under 10 minutes:
task ``upper`` (its errors are per-character mappings shared across prompts), exact reward,
learning rate 3e-4, 16 prompts x 8 samples per step (fewer samples per step left the
reward flat at 1e-4 and collapsed it at 1e-3: too much gradient noise for AdamW), 8 new
tokens, 300 steps. What such a run reaches is in its ``RUN_DIR/figures.json``
(``centerline/runs/run_figures.py``; ``make run``'s is ``docs/runs/make-run.json``, quoted in
``docs/results.md``).
``run_spec.UP_DEFAULTS`` holds the settings this job changes (shared ones, the trainer's steps and
prompts per step; ``SESSION_DEFAULTS`` over them for a run of sessions). The pipeline is asynchronous, as
everywhere by default (``max_inflight_steps`` 2: SGLang samples the next step while the trainer
trains); ``--max-inflight-steps 1`` runs on-policy. ``--train-seconds T`` ends training after
``T`` seconds instead of ``--steps``, then the trainer evaluates as after the last step: runs compared at
equal wall time (``centerline bench pipeline`` does).

Left out on purpose: restarts of crashed services but the SGLang servers and NATS nodes (use compose
or Kubernetes for that).
"""

from __future__ import annotations

import asyncio
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import orjson

from centerline import nats_users, sglang
from centerline.engine_key import new_key
from centerline.nats_server import EmbeddedNats, NatsCluster, provision
from centerline.ports import free_port
from centerline.up import engine_context, run_spec
from centerline.up.console import Progress, log
from centerline.up.prepare import prepare
from centerline.up.processes import PYTHON, Supervisor, restart_dead_nats_nodes, sglang_argv, wait_http
from centerline.up.run_spec import RunSpec
from centerline.up.user_task import UserTaskError
from shared import heldout_record
from shared.streams import StreamLimits


def engine_argv(spec: RunSpec, url: str) -> list[str]:
    """An SGLang server of the run: its model, its port, its device (``up.engine_device``, named
    when not the CPU), the context and KV pool a session of the whole budget needs
    (``engine_context``), then ``up.sglang_args``."""
    device = ["--device", spec.up.engine_device] if spec.up.engine_device != "cpu" else []
    return sglang_argv(str(spec.trainer.model), url, session_flags(spec, spec.trainer.model), device)


def session_flags(spec: RunSpec, model: Path) -> list[str]:
    """SGLang's flags for ``model``: ``engine_context``'s, then ``up.sglang_args``; raises
    ``UserTaskError`` where the engine could not take a session of the whole token budget."""
    extra = shlex.split(spec.up.sglang_args)
    flags = engine_context.engine_flags(
        model, spec.up.model is None, spec.cfg.rollout.session_max_tokens, extra, spec.up.engine_device
    )
    return flags + extra


def service_argv(spec: RunSpec, config_file: Path) -> dict[str, list[str]]:
    """Each centerline service's command line, by its log name: ``--config config_file`` and the
    process's identity only (a worker's id; the trainer's ranks are torchrun's)."""
    config = ["--config", str(config_file)]
    argv = {"proxy": [PYTHON, "-m", "centerline", "proxy", *config]}
    for i in range(spec.up.workers):
        argv[f"worker-{i}"] = [PYTHON, "-m", "centerline", "worker", *config, "--worker-id", f"worker-{i}"]
    ranks = spec.up.trainer_ranks
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)] if ranks > 1 else []
    argv["trainer"] = [PYTHON, *torchrun, "-m", "centerline", "trainer", *config]
    return argv


def stream_replicas(setting: int, nodes: int) -> int:
    """The streams' copies for a run on ``nodes`` NATS servers: ``nats_stream_replicas`` when set
    above its default 1, else min(3, nodes) on a cluster; refused when the cluster is too small."""
    replicas = setting if setting > 1 or nodes == 1 else min(3, nodes)
    if replicas > nodes:
        raise RuntimeError(
            f"nats_stream_replicas={replicas} but --nats-nodes {nodes}: a stream has at most one copy per "
            f"node; lower nats_stream_replicas to {nodes} or start more nodes"
        )
    return replicas


class Stopped(Exception):
    """A signal asked the run to stop before its last step."""


def main(argv: list[str]) -> int:
    spec = run_spec.parse(argv)
    stopping: list[str] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))
    # Ctrl-C stops the run even where SIGINT came ignored from the parent (a shell's background
    # job, a CI runner): Python then leaves it ignored instead of raising KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        launch(spec, stopping)
    except (KeyboardInterrupt, Stopped):
        print("\ncenterline up: interrupted; stopping every service", file=sys.stderr)
        return 130
    except (RuntimeError, UserTaskError) as exc:
        print(f"\ncenterline up: {exc}", file=sys.stderr)
        return 1
    return 0


def launch(spec: RunSpec, stopping: list[str] | None = None) -> Path:
    """One whole run of the spec of ``run_spec.parse``; returns its run directory once the report is
    written. Every process it started is stopped on the way out, whatever happened.
    Raises ``RuntimeError`` when a service fails, ``Stopped`` when ``stopping`` gets an entry."""
    run_dir = spec.up.run_dir or Path("runs") / datetime.now().strftime("%Y-%m-%d-%H%M%S")
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    passwords = nats_users.new_passwords()
    supervisor = Supervisor(run_dir / "logs", passwords)
    if spec.up.nats_nodes > 1:
        nats = NatsCluster(run_dir / "nats", spec.up.nats_nodes, passwords=passwords)
    else:
        nats = EmbeddedNats(run_dir / "nats", passwords=passwords)
    try:
        run(spec.derive(up={"run_dir": run_dir}), supervisor, nats, [] if stopping is None else stopping)
    finally:
        supervisor.stop()
        nats.stop()
    return run_dir


def run(spec: RunSpec, supervisor: Supervisor, nats: EmbeddedNats | NatsCluster, stopping: list) -> None:
    """One run, each job in turn: prepare what it trains, start NATS and its streams, choose the
    addresses and write ``config.toml``, start the engines, router and proxy, then the workers and
    the trainer, watch the run (``watch_run``) to its last step and last held-out evaluation, write the report.
    ``launch`` stops every process afterwards, whatever happened."""
    up, run_dir = spec.up, spec.up.run_dir
    if spec.trainer.weight_transport == "distributed":  # torch only then: up starts faster without it
        import torch

        engine_context.check_weight_transport("distributed", up.engine_device, torch.cuda.is_available())
    task = prepare(up, spec.cfg, run_dir, log)
    session_flags(spec, task.model)  # a session budget the engines cannot take stops the run here
    replicas = start_nats(nats, spec.cfg.services.nats_stream_replicas, up.nats_nodes)
    addresses = Addresses.pick(up.engines)
    spec = run_spec.with_launch_settings(
        spec,
        task,
        nats_url=nats.url,
        replicas=replicas,
        engine_urls=addresses.engines,
        router_url=addresses.router,
        proxy_url=addresses.proxy,
    )
    config_file = run_dir / "config.toml"
    spec.write(config_file)  # once, every table: no service writes it again
    argv = service_argv(spec, config_file)

    engine_key = new_key()  # weight updates and cache flushes: the trainer's alone
    start_serving(spec, supervisor, addresses, argv["proxy"], engine_key)
    log(
        f"SGLang {' '.join(addresses.engines)} behind the router {addresses.router}, proxy {addresses.proxy} "
        f"(ready: the upstream returns complete candidate sets), NATS {nats.url}"
    )

    progress = Progress()
    for i in range(up.workers):
        supervisor.start(f"worker-{i}", argv[f"worker-{i}"], nats_user="worker")
    trainer = supervisor.start("trainer", argv["trainer"], nats_user="trainer", engine_key=engine_key)
    watch_run(trainer, spec, supervisor, nats, progress, stopping)

    if progress.tty:
        print()
    if trainer.returncode != 0:
        raise RuntimeError(f"trainer exited with status {trainer.returncode}; see {run_dir / 'logs' / 'trainer.log'}")
    from centerline.runs.report import write_report
    from centerline.runs.run_figures import write_run_figures

    log(f"report: {write_report(run_dir)}; figures: {write_run_figures(run_dir)}")


def start_nats(nats: EmbeddedNats | NatsCluster, replicas_setting: int, nodes: int) -> int:
    """Start the NATS server (or cluster) and create the streams, with the copies
    ``stream_replicas`` gives; returns that number."""
    replicas = stream_replicas(replicas_setting, nodes)
    nats.start()
    # workers and the proxy may not create streams
    asyncio.run(provision(nats.url, StreamLimits(replicas=replicas), **nats.credentials("admin")))
    return replicas


@dataclass(frozen=True)
class Addresses:
    """Where a run's servers listen, on this machine: chosen before any starts, written into config.toml."""

    engines: list[str]
    router: str
    proxy: str

    @classmethod
    def pick(cls, engines: int) -> Addresses:
        """Free ports for ``engines`` SGLang servers, the router and the proxy."""
        engine_urls = [f"http://127.0.0.1:{free_port()}" for _ in range(engines)]
        return cls(engine_urls, f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}")


def start_serving(
    spec: RunSpec, supervisor: Supervisor, addresses: Addresses, proxy_argv: list[str], engine_key: str
) -> None:
    """Start the SGLang servers, then the router in front of them, then the proxy in front of the
    router, each once the one before answers; the proxy is ready once its probe of the upstream passed."""
    logs, timeout = spec.up.run_dir / "logs", spec.up.startup_timeout
    engines = [
        supervisor.start(f"sglang-{i}", engine_argv(spec, url), engine_key=engine_key, restart=True)
        for i, url in enumerate(addresses.engines)
    ]
    for i, (url, proc) in enumerate(zip(addresses.engines, engines)):
        wait_http(f"{url}/health", f"SGLang server {i}", proc, logs / f"sglang-{i}.log", timeout)
    router_port = int(addresses.router.rsplit(":", 1)[1])
    router = supervisor.start("router", sglang.router_argv(addresses.engines, "127.0.0.1", router_port, free_port()))
    wait_http(f"{addresses.router}/readiness", "SGLang router", router, logs / "router.log", timeout)
    proxy = supervisor.start("proxy", proxy_argv, nats_user="proxy")
    wait_http(f"{addresses.proxy}/ready", "proxy", proxy, logs / "proxy.log", timeout)


def watch_run(
    trainer: subprocess.Popen,
    spec: RunSpec,
    supervisor: Supervisor,
    nats: EmbeddedNats | NatsCluster,
    progress: Progress,
    stopping: list,
) -> None:
    """Until the trainer exits: restart what died, show each step and each held-out evaluation the
    trainer writes (``metrics.jsonl``, ``heldout_metrics.jsonl``). Raises ``Stopped`` once ``stopping`` gets an
    entry (a signal)."""
    from trainer_service.metrics import complete_lines  # here: it imports torch, which the launcher needs nowhere else

    files = [spec.up.run_dir / "metrics.jsonl", spec.up.run_dir / heldout_record.FILE]
    seen = [0, 0]  # complete lines shown of each
    while True:
        if stopping:
            log(f"{stopping[0]}: stopping every service")
            raise Stopped(stopping[0])
        for restarted in supervisor.check():
            log(f"{restarted} died: started again; the trainer sends it the latest weights")
        for name in restart_dead_nats_nodes(nats):
            log(f"NATS node {name} died: started again on its store; clients reconnect")
        finished = trainer.poll() is not None  # before the read: its last lines are in the files then
        for i, path in enumerate(files):
            lines, _ = complete_lines(path.read_bytes() if path.exists() else b"")
            for line in lines[seen[i] :]:
                progress.show(orjson.loads(line), spec.trainer.steps)
            seen[i] = len(lines)
        if finished:
            return
        time.sleep(0.5)  # polling interval of the progress display

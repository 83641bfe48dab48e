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
so what ran is what the file and the report show. From its own settings ``up`` gives the trainer
its ``model``, ``dataset``, ``run_dir``, ``steps``, ``prompts_per_step`` and ``train_seconds``, the
workers their ``chat_template``, the proxy its ``upstream`` and ``port`` (``with_launch_settings``).
Held-out accuracy (exact match of one sample per prompt at the rollout temperature,
``--eval-prompts`` prompts) is the
trainer's own (docs/design.md section 9): ``up`` writes the held-out rows to ``RUN_DIR/heldout.jsonl``,
the trainer's ``heldout_dataset``, and the trainer has the workers sample them before training,
every ``--eval-every`` steps and after the last, into ``RUN_DIR/eval.jsonl``, which ``up`` shows as
it appears. At the end ``RUN_DIR/report.html`` and ``RUN_DIR/plots/*.png`` are written.

Your own task (``prepare``, ``centerline/up/user_task.py``): ``--model DIR`` replaces the toy model,
``--dataset FILE`` the toy task (its rows without ``"split": "eval"`` become the trainer's
``RUN_DIR/train.jsonl``), ``--reward`` names the reward, and the held-out figure is then the mean
reward of one sample per held-out row (``--eval-dataset``, else the rows marked eval, else none:
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
environment (``service_env``), never in ``config.toml``. Likewise the engines' admin key
(``shared/admin_key.py``): a new one per run, in the environment of the SGLang servers and
the trainer only.

Progress: a live status line on a terminal, one JSON line per step otherwise. Ctrl-C or
SIGTERM stops every process, trainer first (it commits or abandons its step), NATS last.

    centerline up                       # defaults: 2 workers, 2 trainer ranks, task upper, 300 steps
    centerline up --steps 5 --workers 1 --eval-prompts 16
    centerline up --model models/smollm2 --dataset data.jsonl --reward rewards:score --steps 3

Defaults are chosen so that the default run learns on 2 CPU cores in under 10 minutes:
task ``upper`` (its errors are per-character mappings shared across prompts), exact reward,
learning rate 3e-4, 16 prompts x 8 samples per step (fewer samples per step left the
reward flat at 1e-4 and collapsed it at 1e-3: too much gradient noise for AdamW), 8 new
tokens, 300 steps. What such a run reaches is in its ``RUN_DIR/figures.json``
(``centerline/run_figures.py``; ``make run``'s is ``docs/runs/make-run.json``, quoted in
``docs/results.md``).
``UP_DEFAULTS`` holds the shared settings this job changes (``SESSION_DEFAULTS`` over them for a
run of sessions). The pipeline is asynchronous, as
everywhere by default (``max_inflight_steps`` 2: SGLang samples the next step while the trainer
trains); ``--max-inflight-steps 1`` runs on-policy. ``--train-seconds T`` ends training after
``T`` seconds instead of ``--steps``, then the trainer evaluates as after the last step: runs compared at
equal wall time (``centerline bench pipeline`` does).

Left out on purpose: restarts of crashed services (use compose or Kubernetes for that).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import orjson

from centerline import nats_users, sglang
from centerline.dataset import CHAT_TASKS, TASK_DEFAULTS, examples
from centerline.nats_server import EmbeddedNats, NatsCluster, provision
from centerline.ports import free_port
from centerline.up import run_spec
from centerline.up.run_spec import RunSpec
from centerline.up.user_task import (
    Row,
    UserTask,
    UserTaskError,
    chat_template_on,
    check_environment,
    check_reward,
    load_task,
    write_trainer_dataset,
)
from shared import admin_key
from shared import config as shared_config
from shared.settings import ProxySettings, TrainerSettings, UpSettings, WorkerSettings
from shared.streams import StreamLimits

PYTHON = sys.executable
# Shared settings whose default differs for this job (chosen so that the default run learns;
# the docstring above says why each).
UP_DEFAULTS = {"learning_rate": 3e-4, "rollout_n": 8, "rollout_max_new_tokens": 8}
# ... and for a run of sessions (``--environment``, or a multi-turn toy task): a session's replies
# share one advantage, so 3e-4 moved the policy too far on chain (docs/results.md, "Sessions: the chain runs").
SESSION_DEFAULTS = {"learning_rate": 1e-4}


def service_env(base: Mapping[str, str], nats_user: str | None, passwords: Mapping[str, str]) -> dict[str, str]:
    """A service's environment: ``base`` without any NATS credential, plus ``nats_user``'s own
    (none for a service that does not use NATS), so no process holds another's password; and
    without ``CENTERLINE_*`` settings variables, which would beat the run spec's file (the spec
    composed them already: a user's variable reaches every service through it)."""
    settings = run_spec.setting_variables()
    env = {k: v for k, v in base.items() if not nats_users.is_secret_variable(k) and k not in settings}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if nats_user is not None:
        env |= nats_users.client_env(nats_user, passwords[nats_user])
    return env


class Supervisor:
    """Child processes started in their own sessions (so Ctrl-C reaches the launcher only).

    A process started with ``restart=True`` (the SGLang servers) that dies is started again,
    same command, port and key, up to ``MAX_RESTARTS`` times, as a supervisor would: the server
    comes back with its initial weights and the trainer sends it the latest version
    (trainer_service/weights.py ``watch``). Any other process that dies ends the run.
    """

    MAX_RESTARTS = 5

    def __init__(self, log_dir: Path, nats_passwords: Mapping[str, str]):
        self.log_dir = log_dir
        self.nats_passwords = nats_passwords
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.restartable: dict[str, tuple[list[str], dict[str, str]]] = {}
        self.restarts: dict[str, int] = {}

    def start(
        self,
        name: str,
        argv: list[str],
        nats_user: str | None = None,
        engine_key: str | None = None,
        restart: bool = False,
    ) -> subprocess.Popen:
        """``engine_key``: the engine's admin key, for the engine and the trainer; no other process gets one."""
        env = {
            k: v
            for k, v in service_env(os.environ, nats_user, self.nats_passwords).items()
            if k not in sglang.ADMIN_KEY_VARIABLES
        }
        if engine_key is not None:
            env[admin_key.KEY_ENV] = engine_key
        if restart:
            self.restartable[name] = (argv, env)
        return self._spawn(name, argv, env, "wb")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], mode: str) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", mode) as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        names_ = [n for n, _ in self.procs]
        if name in names_:  # a restart keeps its place in the stopping order
            self.procs[names_.index(name)] = (name, proc)
        else:
            self.procs.append((name, proc))
        return proc

    def check(self) -> list[str]:
        """Start again a restartable process that died; raise if any other service died on its own
        (the trainer's exit is handled by the caller). Returns the names restarted."""
        restarted = []
        for name, proc in list(self.procs):
            if name == "trainer" or proc.poll() is None:
                continue
            where = self.log_dir / (name + ".log")
            if name not in self.restartable or self.restarts.get(name, 0) >= self.MAX_RESTARTS:
                raise RuntimeError(f"{name} exited with status {proc.returncode}; see {where}")
            self.restarts[name] = self.restarts.get(name, 0) + 1
            self._spawn(name, *self.restartable[name], "ab")
            restarted.append(f"{name} (exit status {proc.returncode}, restart {self.restarts[name]})")
        return restarted

    def stop(self, timeout: float = 30.0) -> None:
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _name, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def wait_http(url: str, what: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Poll ``url`` until it answers 200, the process dies, or the deadline passes."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} while starting; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError as exc:  # refused while starting, 503 while not ready
            last = str(exc)
        time.sleep(0.2)  # polling interval, not synchronisation: the loop waits for a 200
    raise RuntimeError(f"{what} not ready at {url} after {timeout:.0f}s ({last}); see {log}")


class Progress:
    """A live line on a terminal, one JSON line per record otherwise."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout  # looked up now, so contextlib.redirect_stdout applies
        self.tty = self.stream.isatty()

    def show(self, record: dict, steps: int) -> None:
        if not self.tty:
            self.stream.write(orjson.dumps(record).decode() + "\n")
        elif "eval_accuracy" in record and "loss" not in record:
            self.stream.write(f"\r\x1b[K  held-out accuracy at step {record['step']}: {record['eval_accuracy']:.3f}\n")
        elif "eval_reward" in record and "loss" not in record:
            self.stream.write(f"\r\x1b[K  held-out mean reward at step {record['step']}: {record['eval_reward']:.3f}\n")
        else:
            done = record.get("step", 0)
            bar = "#" * int(30 * done / max(steps, 1))
            rejected = sum((record.get("gate_rejected") or {}).values())
            self.stream.write(
                f"\r\x1b[K[{bar:<30}] step {done}/{steps}  reward {record.get('reward_mean', 0):.3f}  "
                f"sc_corr {record.get('sc_correction', 0):.4f}  sc_l1 {record.get('sc_residual_l1', 0):.4f}  "
                f"head P/Q {record.get('sc_train_head_mass', 0):.3f}/"
                f"{record.get('sc_rollout_head_mass', 0):.3f}  kl {record.get('train_rollout_kl', 0):.2e}  "
                f"stale {record.get('staleness_mean', 0):.1f}  gate +{record.get('gate_accepted', 0)}/-{rejected}"
            )
        self.stream.flush()


def parse(argv: list[str]) -> RunSpec:
    """The run spec of these flags: ``UpSettings``, the shared settings, whose job defaults
    (``UP_DEFAULTS``) sit just above the shared ones (TOML, environment and flags still override
    them), and the services' tables (``run_spec.compose``). A bad setting exits 2 naming it."""
    parser = argparse.ArgumentParser(prog="centerline up", description=__doc__.split("\n")[0])
    shared_config.add_arguments(parser, UpSettings)
    shared_config.add_arguments(
        parser,
        TrainerSettings,
        only=run_spec.UP_TRAINER_FLAGS,
        shared=False,
        title="the trainer's settings up takes as flags (the others: --config FILE's [trainer] table)",
    )
    args = parser.parse_args(argv)
    try:
        spec = run_spec.compose(args, defaults=UP_DEFAULTS)
        if trains_sessions(spec.up):
            toy = TASK_DEFAULTS.get(spec.up.task, {}) if spec.up.dataset is None else {}
            spec = run_spec.compose(args, defaults=UP_DEFAULTS | SESSION_DEFAULTS | toy)
        return spec
    except shared_config.ConfigError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")


def trains_sessions(up: UpSettings) -> bool:
    """Whether every task of the run is a session: ``--environment``, or a multi-turn toy task
    (a dataset's rows may name environments of their own; those runs keep ``UP_DEFAULTS``)."""
    return bool(up.environment) or (up.dataset is None and up.task in CHAT_TASKS)


def with_launch_settings(
    spec: RunSpec,
    task: Prepared,
    *,
    nats_url: str,
    replicas: int,
    engine_urls: list[str],
    router_url: str,
    proxy_url: str,
) -> RunSpec:
    """``spec`` with what the launcher chose as it started: the addresses, the streams' copies,
    the model and dataset ``prepare`` made, and the trainer's settings that are ``up``'s own."""
    up = spec.up
    return spec.derive(
        cfg={
            "nats_url": nats_url,
            "nats_stream_replicas": replicas,
            "proxy_url": proxy_url,
            "engine_urls": engine_urls,
        },
        trainer={
            "model": task.model,
            "dataset": task.dataset,
            "run_dir": up.run_dir,
            "steps": up.steps,
            "prompts_per_step": up.prompts_per_step,
            "train_seconds": up.train_seconds,
            "heldout_dataset": task.heldout,
            "eval_every": up.eval_every,
        },
        worker={"chat_template": task.chat_template},
        proxy={"upstream": router_url, "port": int(proxy_url.rsplit(":", 1)[1])},
    )


# The settings ``with_launch_settings`` fills in: where a run ran, not what it is
# (``centerline experiment`` compares the rest).
LAUNCH_SETTINGS = {
    "": ("nats_url", "nats_stream_replicas", "proxy_url", "engine_urls"),
    TrainerSettings.name: (
        "model",
        "dataset",
        "run_dir",
        "steps",
        "prompts_per_step",
        "train_seconds",
        "heldout_dataset",
        "eval_every",
    ),
    WorkerSettings.name: ("chat_template",),
    ProxySettings.name: ("upstream", "port"),
}


def without_launch_settings(tables: dict) -> dict:
    """A run's ``config.toml``, as read, without what ``with_launch_settings`` fills in: what the run is."""
    out = {}
    for name, value in tables.items():
        if isinstance(value, dict):
            out[name] = {k: v for k, v in value.items() if k not in LAUNCH_SETTINGS.get(name, ())}
        elif name not in LAUNCH_SETTINGS[""]:
            out[name] = value
    return out


def engine_argv(spec: RunSpec, url: str) -> list[str]:
    """An SGLang server of the run: its model, its port, then ``up.sglang_args``."""
    return sglang_argv(str(spec.trainer.model), url, shlex.split(spec.up.sglang_args))


def sglang_argv(model: str, url: str, sglang_flags: list[str]) -> list[str]:
    """``centerline sglang`` serving ``model`` on ``url``'s port, SGLang's own flags after ``--``
    (no settings file)."""
    return [
        PYTHON,
        "-m",
        "centerline",
        "sglang",
        "--model",
        model,
        "--port",
        url.rsplit(":", 1)[1],
        "--",
        *sglang_flags,
    ]


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


def restart_dead_nats_nodes(nats: EmbeddedNats | NatsCluster) -> list[str]:
    """Start again each NATS node that died (same store, same ports), as a supervisor would."""
    restarted = []
    for node in getattr(nats, "nodes", [nats]):
        if node.proc is not None and node.proc.poll() is not None:
            node.start()
            restarted.append(node.server_name or node.url)
    return restarted


class Stopped(Exception):
    """A signal asked the run to stop before its last step."""


def main(argv: list[str]) -> int:
    spec = parse(argv)
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
    """One whole run of the spec of ``parse``; returns its run directory once the report is
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


@dataclass(frozen=True)
class Prepared:
    """What a run trains and evaluates: the model, the trainer's dataset, its held-out rows."""

    model: Path
    dataset: Path
    chat_template: bool  # the workers render each prompt, held-out ones too, with the model's chat template
    heldout: Path | None  # the trainer's heldout_dataset: the held-out rows; None: a user task without any
    user: UserTask | None = None  # None: the toy task
    environment: str = ""  # the toy task's or --environment: its tasks (a user's rows naming none) are sessions


def prepare(up: UpSettings, cfg, run_dir: Path, log) -> Prepared:
    """The model (``--model``, else the toy model made and cached by init-model --sft), the trainer's
    dataset in ``run_dir/train.jsonl`` (``--dataset``'s training rows, else the toy task's) and its
    held-out rows in ``run_dir/heldout.jsonl`` (a user task's, with ``run_dir/heldout.json`` saying
    where they came from, for the report; the toy task's ``--eval-prompts``, scored by exact match
    whatever ``--reward`` trains: its held-out accuracy); a bad row, reward or model fails here,
    before any service starts."""
    check_reward(up.reward)  # as the workers will load it
    environment = up.environment or ("" if up.dataset is not None else CHAT_TASKS.get(up.task, ""))
    if environment:
        check_environment(environment)
    owner = next((t for t, e in CHAT_TASKS.items() if e == environment), None)  # a built-in's own toy task
    if owner is not None and up.dataset is None and up.task != owner:
        raise UserTaskError(
            f"--environment {environment}: the built-in environment plays the toy task {owner}, not --task "
            f"{up.task}; add --task {owner}"
        )
    user = None
    if up.dataset is not None:
        user = load_task(up.dataset, up.eval_dataset)
        log(f"dataset {up.dataset}: {len(user.train)} training rows; held-out rows: {user.heldout_source}")
        for number, row in enumerate([*user.train, *user.heldout], 1):
            if row.environment:
                check_environment(row.environment, f"{up.dataset} (row {number}'s environment)")
    if up.model is not None:
        model = up.model
        if not (model / "config.json").is_file():
            raise UserTaskError(
                f"--model {model}: no config.json there; give an HF model directory (`centerline make-model smollm2 "
                f"--out {model}` makes one)"
            )
        log(f"run directory {run_dir}; model {model}")
    else:
        model = up.model_dir / f"sft-{up.task}-seed{cfg.seed}"
        log(f"run directory {run_dir}; model {model} (made once, then cached)")
        subprocess.run(
            [
                PYTHON,
                "-m",
                "centerline",
                "init-model",
                "--sft",
                "--task",
                up.task,
                "--seed",
                str(cfg.seed),
                "--sft-steps",
                str(up.sft_steps),
                "--out",
                str(model),
            ],
            check=True,
        )
    chat = chat_template_on(up.chat_template, model, toy=up.model is None)
    dataset, heldout = run_dir / "train.jsonl", run_dir / "heldout.jsonl"
    if user is not None:
        write_trainer_dataset(user.train, up.reward, dataset, environment)
        (run_dir / "heldout.json").write_bytes(
            orjson.dumps({"rows": len(user.heldout), "source": user.heldout_source, "reward": up.reward})
        )
        if not user.heldout:
            return Prepared(model, dataset, chat, None, user, environment)
        write_trainer_dataset(user.heldout, up.reward, heldout, environment)
        return Prepared(model, dataset, chat, heldout, user, environment)
    subprocess.run(
        [
            PYTHON,
            "-m",
            "centerline",
            "dataset",
            "--task",
            up.task,
            "--n",
            str(up.dataset_size),
            "--seed",
            str(cfg.seed),
            "--reward",
            up.reward,
            "--environment",
            environment,
            "--out",
            str(dataset),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    rows = [Row(prompt, answer) for prompt, answer in examples(up.task, up.eval_prompts, cfg.seed, "heldout")]
    # a session's reward is its environment's; a single-turn toy task's held-out figure is exact match
    write_trainer_dataset(rows, up.reward if environment else "exact", heldout, environment)
    return Prepared(model, dataset, chat, heldout, environment=environment)


def log(message: str) -> None:
    """One line of ``centerline up``'s own on stderr."""
    print(f"centerline up: {message}", file=sys.stderr, flush=True)


def run(spec: RunSpec, supervisor: Supervisor, nats: EmbeddedNats | NatsCluster, stopping: list) -> None:
    """One run, each job in turn: prepare what it trains, start NATS and its streams, choose the
    addresses and write ``config.toml``, start the engines, router and proxy, then the workers and
    the trainer, follow the trainer to its last step and last held-out evaluation, write the report.
    ``launch`` stops every process afterwards, whatever happened."""
    up, run_dir = spec.up, spec.up.run_dir
    task = prepare(up, spec.cfg, run_dir, log)
    replicas = start_nats(nats, spec.cfg.nats_stream_replicas, up.nats_nodes)
    addresses = Addresses.pick(up.engines)
    spec = with_launch_settings(
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

    engine_key = sglang.new_admin_key()  # weight updates and cache flushes: the trainer's alone
    start_serving(spec, supervisor, addresses, argv["proxy"], engine_key)
    log(
        f"SGLang {' '.join(addresses.engines)} behind the router {addresses.router}, proxy {addresses.proxy} "
        f"(ready: the upstream returns complete candidate sets), NATS {nats.url}"
    )

    progress = Progress()
    for i in range(up.workers):
        supervisor.start(f"worker-{i}", argv[f"worker-{i}"], nats_user="worker")
    trainer = supervisor.start("trainer", argv["trainer"], nats_user="trainer", engine_key=engine_key)
    follow(trainer, up, supervisor, nats, progress, stopping)

    if progress.tty:
        print()
    if trainer.returncode != 0:
        raise RuntimeError(f"trainer exited with status {trainer.returncode}; see {run_dir / 'logs' / 'trainer.log'}")
    from centerline.report import write_report
    from centerline.run_figures import write_run_figures

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


def follow(
    trainer: subprocess.Popen,
    up: UpSettings,
    supervisor: Supervisor,
    nats: EmbeddedNats | NatsCluster,
    progress: Progress,
    stopping: list,
) -> None:
    """Until the trainer exits: restart what died, show each step and each held-out evaluation the
    trainer writes (``metrics.jsonl``, ``eval.jsonl``). Raises ``Stopped`` once ``stopping`` gets an
    entry (a signal)."""
    from trainer_service.metrics import complete_lines  # here: it imports torch, which the launcher needs nowhere else

    files = [up.run_dir / "metrics.jsonl", up.run_dir / "eval.jsonl"]
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
                progress.show(orjson.loads(line), up.steps)
            seen[i] = len(lines)
        if finished:
            return
        time.sleep(0.5)  # polling interval of the progress display

"""Each command's own settings, beside the shared ones of ``shared/config.py``: one class per command.

A field of ``TrainerSettings`` (table ``trainer``) such as ``max_grad_norm`` is the flag
``--max-grad-norm`` of ``centerline trainer``, the key ``max_grad_norm`` of the TOML file's
``[trainer]`` table and the variable ``CENTERLINE_TRAINER_MAX_GRAD_NORM``; sources and
precedence are the shared ones (flags, environment, file, defaults). A setting the command
cannot start without is listed in ``required`` (default None, so a file or the environment
may give it). Simple bounds are field constraints; a rule across fields is the model's
validator; a rule across a section and the shared settings is its ``check_with(cfg)``; each
rule is one ``refuse_if``, whose refusal reads ``--<flag> <value>: <fix>``. ``docs/config.md``
lists every field per command (``scripts/gen_config_docs.py``).

Not settings: what a one-shot command is asked to do this time (``centerline replay``'s record
file and its mode ``--to``/``--jsonl``/``--train``), and secrets (docs/config.md).
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from shared.rewards import REWARDS
from shared.toy_tasks import ENVIRONMENTS

# Proxy limits, defaults of the proxy's flags and of the classes in router_proxy that enforce them.
MAX_REQUEST_BODY_BYTES = 32 << 20  # a training request is prompts and settings: 32 MiB is ~4M tokens as input_ids
MAX_UPSTREAM_RESPONSE_BYTES = 256 << 20  # K=128 rows of 30-byte entries: ~4 KB a token, so ~65k tokens per answer
MAX_TOP_LOGPROBS_NUM = 1024  # K a request may ask for; the contract's default is 128
MICRO_BATCH_TOKENS = 4096  # the toy default run's whole shard in one forward; a real model's activations bound
LOSS_CHUNK_TOKENS = 1024  # rows per LM-head chunk: [1024, 151936] float32 logits are 0.6 GB


REFUSED = "setting_refused"  # the error type of ``refuse_if``, which shared.config.invalid_setting words


def refuse_if(failed: bool, name: str, value: object, fix: str) -> None:
    """Refuse ``value`` of field ``name`` when ``failed`` (in a validator, or ``Section.check_with``);
    ``shared.config`` words the error as ``--<flag> <value>: <fix>``."""
    if failed:
        raise PydanticCustomError(REFUSED, fix.replace("{", "{{").replace("}", "}}"), {"setting": name, "value": value})


class Settings(BaseSettings):
    """Settings read by ``shared.config`` from the flags, the environment and the file, which
    pydantic-settings merges (docs/config.md). Built in code, a model takes its keywords and defaults
    only: no variable, ``.env`` file or secrets directory is read behind the caller's back."""

    # case_sensitive: a key of the file or a keyword names its field exactly (variables: shared.config)
    model_config = SettingsConfigDict(extra="forbid", frozen=True, case_sensitive=True)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource, **others
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


class Section(Settings):
    """The settings of one command: flags of ``command``, TOML table ``[name]``, ``CENTERLINE_<NAME>_<KEY>``."""

    name: ClassVar[str]
    command: ClassVar[str]
    required: ClassVar[tuple[str, ...]] = ()
    # old name -> field, for one release: the old flag, TOML key and variable still set the field,
    # with a deprecation note (the held-out settings were once eval_*: docs/config.md)
    renamed: ClassVar[dict[str, str]] = {}

    def check_with(self, cfg) -> None:
        """The rules across this section and the shared ``cfg``, each a ``refuse_if``."""


ENVIRONMENT_DEADLINE_MAX = 1800.0  # seconds: the default environment deadline's bound (30 minutes)


def _check_max_deliver(value: int) -> int:
    refuse_if(value != -1 and value < 1, "max_deliver", value, "must be at least 1, or -1 for no limit")
    return value


class TrainerSettings(Section):
    """``centerline trainer``: the training loop of trainer_service/service.py."""

    name: ClassVar[str] = "trainer"
    command: ClassVar[str] = "centerline trainer"
    required: ClassVar[tuple[str, ...]] = ("model", "dataset", "run_dir")
    renamed: ClassVar[dict[str, str]] = {"eval_every": "heldout_every", "eval_timeout": "heldout_timeout"}

    model: Path | None = Field(None, description="Initial HF model directory (weight version 0). Required.")
    dataset: Path | None = Field(None, description="JSONL of {prompt, answer, reward, ...}. Required.")
    run_dir: Path | None = Field(
        None, description="Checkpoints, weight versions, metrics.jsonl and the run's config.toml. Required."
    )
    steps: int = Field(100, ge=0, description="Train until this many steps are done.")
    train_seconds: float | None = Field(
        None,
        gt=0,
        description="Also stop, after the step in progress, once this many seconds have passed since training "
        "began; unset: no time limit.",
    )
    prompts_per_step: int = Field(8, ge=1, description="Prompt groups per step.")
    heldout_dataset: Path | None = Field(
        None,
        description="JSONL of held-out rows, the format of --dataset: one sample of each, drawn as training samples "
        "are, before training, every --heldout-every steps and after the last; scored, never trained, written to "
        "eval.jsonl as that step's held-out figure (docs/design.md section 9). Unset: no held-out evaluation.",
    )
    heldout_every: int = Field(25, ge=1, description="Evaluate the held-out rows every this many steps.")
    heldout_timeout: float = Field(
        900.0,
        gt=0,
        description="Seconds an evaluation may take from its scheduling to its last row's result; past it the "
        "step's held-out figure is logged as incomplete and not recorded.",
    )
    weight_sync_interval: int = Field(1, ge=1, description="Publish weights every this many steps.")
    weight_update: Literal["retract", "in_place", "drain"] = Field(
        "retract",
        description="How an engine takes a new weight version (docs/design.md section 8). retract: pause with "
        "the requests sent back to the queue, load, flush the prefix cache, recompute them under the new weights "
        "(every token is sampled by the version its label names); drain: load without pausing, so SGLang first "
        "finishes every request in flight, then flushes; in_place: pause with the requests kept in their batch, "
        "load, continue them on the KV cache built so far (no flush: tokens labelled with a new version may rest "
        "on KV of older ones, token_kv_unverified_share counts them).",
    )
    weight_transport: Literal["disk", "distributed"] = Field(
        "disk",
        description="How a weight version reaches the engines (docs/design.md section 8, transports; disk is the "
        "default by `centerline bench weights`). distributed: "
        "rank 0 broadcasts it to each engine through SGLang's distributed update (gloo on the CPU, NCCL on CUDA), "
        "no file read by the engine; an engine it fails to reach loads the version from disk instead. disk: every "
        "engine loads the version's directory (the engines must mount the run directory).",
    )
    weight_master_address: str = Field(
        "127.0.0.1",
        description="The address engines reach the trainer's rank 0 at for --weight-transport distributed (the "
        "trainer's host name in compose or Kubernetes).",
    )
    weight_bucket_mb: int = Field(
        256, ge=1, description="Most bytes (MiB) of weights in one broadcast of --weight-transport distributed."
    )
    weight_proof_interval: float = Field(
        60.0,
        ge=0,
        description="Seconds between proofs of every engine's weights besides the one after each update "
        "(/weights_checker checksums held against the version's; docs/design.md section 8, proof); 0: after "
        "updates only.",
    )
    ack_wait: float = Field(30.0, gt=0, description="Seconds before an unacked batch is redelivered.")
    step_timeout: float = Field(300.0, description="Close a step short after this many seconds.")
    strategy: Literal["ddp", "fsdp2"] = Field("ddp", description="How ranks share the model: DDP or FSDP2.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm; 0 disables clipping.")
    metrics_port: int | None = Field(None, description="Serve Prometheus /metrics on this port (rank 0); unset: off.")
    tensorboard: bool = Field(
        True,
        description="Write each step's metrics as TensorBoard scalars into the run directory "
        "(`tensorboard --logdir runs/` shows every run by its id).",
    )
    wandb: Literal["off", "offline", "online"] = Field(
        "off",
        description="Log each step's metrics to Weights & Biases (the `wandb` extra: pip install 'centerline[wandb]'); "
        "offline writes the run under the run directory without network, for `wandb sync` later.",
    )
    wandb_project: str = Field("centerline", description="W&B project of --wandb offline/online runs.")
    threads: int = Field(1, ge=1, description="Torch intra-op threads per rank.")
    micro_batch_tokens: int = Field(
        MICRO_BATCH_TOKENS,
        ge=1,
        description="Tokens per forward pass: a rank runs its samples through the model in runs of consecutive "
        "samples this large, one sample at least, and accumulates their gradients into the step's. Packed "
        "(--pack-samples) a run's size is its tokens; padded, samples x (longest prompt + longest response). "
        "Lower it when activations do not fit; the step is the same to float32 rounding.",
    )
    pack_samples: bool = Field(
        True,
        description="Put a micro-batch's samples end to end in one row without padding, positions counting from "
        "0 in each; the model's attention masks each sample off the others (docs/design.md section 6, Memory). "
        "Off: one padded row per sample.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Training dtype. bfloat16: the model's forward and backward run under bfloat16 autocast, while "
        "weights, gradients and optimizer state stay float32 (master weights), and the LM head and loss compute "
        "in float32.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Keep only each decoder layer's input through the forward pass and recompute the layer in the "
        "backward pass: activations shrink to one layer's, for about a third more compute.",
    )
    loss_chunk_tokens: int = Field(
        LOSS_CHUNK_TOKENS,
        ge=1,
        description="Tokens per chunk of the LM head and loss, computed from the final hidden states a chunk at "
        "a time: one [chunk, vocab] float32 buffer is all the logits ever held (docs/design.md section 6, Memory).",
    )
    max_deliver: int = Field(
        20,
        description="Deliveries of a batch (each crash of the trainer holding it is one) before JetStream gives up "
        "on it and reports it in the ADVISORIES stream; -1: no limit.",
    )
    keep_checkpoints: int = Field(2, ge=0, description="Complete checkpoints kept, newest first (0 keeps all).")
    checkpoint_every: int = Field(
        1,
        ge=1,
        description="Save the checkpoint (sharded: each rank writes its own part) every this many steps and after "
        "the last. A step between two checkpoints writes its trained batches to the run directory's journal before "
        "they are acked, and a restart trains those steps again from them (docs/design.md section 10).",
    )
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="The learning rate after the warmup: constant at --learning-rate, or cosine from it down to "
        "--lr-min-ratio of it at step --steps (docs/design.md section 6).",
    )
    lr_warmup_steps: int = Field(
        0, ge=0, description="Steps whose learning rate rises linearly to --learning-rate (step s of 1..N: s/N of it)."
    )
    lr_min_ratio: float = Field(
        0.0, ge=0, le=1, description="The cosine schedule's last learning rate, a share of --learning-rate."
    )
    max_republishes: int = Field(
        3,
        ge=0,
        le=9,
        description="Times one task is published again after its batch arrived stale (docs/design.md section 10); "
        "a stale batch of a task published again this many times is dead-lettered as republish_cap.",
    )

    rollouts_max_bytes: int | None = Field(
        None,
        gt=0,
        description="Byte cap of the ROLLOUTS stream (docs/design.md section 3): full, it refuses new batches (a "
        "worker naks its task, named store_full) and never drops an untrained one; after each step the trainer "
        "purges the oldest batches it trained to keep the steps in flight room. Unset: --store-retention-steps steps "
        "of samples at their largest (--rollout-session-max-tokens tokens of 13 + 8K bytes each). At least "
        "--max-inflight-steps + 1 such steps, checked at start-up; reserved in the NATS server's max_file_store.",
    )
    dlq_max_bytes: int | None = Field(
        None,
        gt=0,
        description="Byte cap of the DLQ stream (full, its oldest letters go); unset: a quarter of ROLLOUTS's, one "
        "step's at least.",
    )
    store_retention_steps: int = Field(
        20,
        ge=1,
        description="Steps of batches at their largest that ROLLOUTS holds, when --rollouts-max-bytes is unset: "
        "the steps in flight, the rest trained batches kept for replay; with the sample size it sets the store the "
        "run needs (it must fit JetStream's max_file_store).",
    )

    _max_deliver = field_validator("max_deliver")(_check_max_deliver)

    def store_caps(self, cfg) -> tuple[int, int]:
        """``(rollouts_max_bytes, dlq_max_bytes)`` of this run (``shared.streams.store_caps``)."""
        from shared.streams import store_caps

        return store_caps(
            cfg, self.prompts_per_step, self.store_retention_steps, self.rollouts_max_bytes, self.dlq_max_bytes
        )

    def check_with(self, cfg) -> None:
        from shared.streams import sample_max_bytes

        needed = (cfg.max_inflight_steps + 1) * self.prompts_per_step * cfg.rollout_n * sample_max_bytes(cfg)
        refuse_if(
            self.rollouts_max_bytes is not None and self.rollouts_max_bytes < needed,
            "rollouts_max_bytes",
            self.rollouts_max_bytes,
            f"must hold the steps in flight, --max-inflight-steps + 1 = {cfg.max_inflight_steps + 1} steps of "
            f"{self.prompts_per_step} x {cfg.rollout_n} samples of up to {sample_max_bytes(cfg)} bytes: at least "
            f"{needed}; raise it, or lower --rollout-session-max-tokens or K",
        )


class WorkerSettings(Section):
    """``centerline worker``: a rollout worker (rollout_worker/main.py)."""

    name: ClassVar[str] = "worker"
    command: ClassVar[str] = "centerline worker"

    tokenizer: str | None = Field(None, description="HF tokenizer directory; unset: the upstream's tokenizer_path.")
    vocab_size: int | None = Field(
        None, gt=0, description="Vocabulary size for the contract check; unset: from the model."
    )
    worker_id: str | None = Field(None, description="Producer id written into batches; unset: host-pid.")
    ack_wait: float = Field(30.0, gt=0, description="Seconds before an unacked task is redelivered.")
    concurrency: int = Field(
        8,
        ge=1,
        description="Tasks in flight (the engine batches their requests); enough to keep it busy while the "
        "trainer trains.",
    )
    nak_delay: float = Field(
        2.0, ge=0, description="Seconds before a NAKed task is redelivered (doubling per delivery, up to 60)."
    )
    max_deliver: int = Field(
        10,
        description="Deliveries of a task before JetStream gives up on it and reports it in the ADVISORIES stream; "
        "-1: no limit.",
    )
    chat_template: bool = Field(
        False,
        description="On native /generate, render each prompt with the tokenizer's chat template as one user message "
        "with the generation prompt (the chat endpoint always has SGLang render it); off: the prompt's own tokens.",
    )
    shutdown_grace: float = Field(30.0, ge=0, description="SIGTERM: seconds to finish the tasks in flight.")
    request_timeout: float = Field(600.0, gt=0, description="Seconds per proxy request (a session's turn too).")
    environment_timeout: float | None = Field(
        None,
        gt=0,
        description="Seconds a task's environment may take for its n sessions together; past it they are "
        "cancelled, nothing is published and the task is dead-lettered. Unset: request_timeout x "
        "ceil(rollout_session_max_tokens / rollout_max_new_tokens), a session of its whole token budget in "
        "turns of the longest reply, each taking the turn timeout, and 30 minutes at most.",
    )
    session_transport: Literal["in-process", "loopback"] = Field(
        "in-process",
        description="How an environment's OpenAI client reaches its session: in-process, a transport that hands "
        "each request to the session in the worker (no socket); loopback, an HTTP endpoint on 127.0.0.1 per task, "
        "for an environment that gives its client's base_url to an agent out of process (a CLI agent).",
    )
    reward_threads: int = Field(
        8,
        ge=1,
        description="Threads that run plain (not async) reward functions off the event loop: at most this many "
        "calls at once across the worker's tasks (rollout_worker/rewards.py).",
    )
    reward_timeout: float = Field(
        60.0,
        gt=0,
        description="Seconds one reward call (async or plain) may take on one response; past it the task is "
        "dead-lettered, naming the reward.",
    )
    metrics_port: int | None = Field(None, description="Serve Prometheus /metrics on this port; unset: off.")
    metrics_host: str = Field("0.0.0.0", description="Address of the /metrics server.")

    _max_deliver = field_validator("max_deliver")(_check_max_deliver)

    def environment_deadline(self, cfg) -> float:
        """``environment_timeout``, or where unset its default from the turn timeout and the session
        token budget of the shared ``cfg`` (docs/design.md section 12)."""
        if self.environment_timeout is not None:
            return self.environment_timeout
        turns = math.ceil(cfg.rollout_session_max_tokens / cfg.rollout_max_new_tokens)
        return min(self.request_timeout * turns, ENVIRONMENT_DEADLINE_MAX)


class ProxySettings(Section):
    """``centerline proxy``: the contract-enforcing proxy (router_proxy/server.py)."""

    name: ClassVar[str] = "proxy"
    command: ClassVar[str] = "centerline proxy"
    required: ClassVar[tuple[str, ...]] = ("upstream",)

    upstream: str | None = Field(None, description="SGLang router or server URL. Required.")
    host: str = Field("127.0.0.1", description="Address to serve on.")
    port: int = Field(30010, description="Port to serve on.")
    vocab_size: int | None = Field(
        None, gt=0, description="Used when the upstream's /model_info reports no vocabulary size."
    )
    upstream_timeout: float = Field(1800.0, gt=0, description="Seconds per upstream request.")
    max_request_body_bytes: int = Field(
        MAX_REQUEST_BODY_BYTES, gt=0, description="Larger request bodies are refused with 413."
    )
    max_upstream_response_bytes: int = Field(
        MAX_UPSTREAM_RESPONSE_BYTES,
        gt=0,
        description="Larger upstream answers are cut off and become 502 upstream_too_large (a worker dead-letters "
        "the task, never retries it). Checked at start-up against --rollout-n x --rollout-max-new-tokens tokens of "
        "K + 1 entries of ~30 bytes.",
    )
    max_top_logprobs_num: int = Field(
        MAX_TOP_LOGPROBS_NUM,
        gt=0,
        description="Largest K (top_logprobs_num, top_logprobs) a request may ask for; above it: 400.",
    )

    def check_with(self, cfg) -> None:
        k = cfg.rollout_top_logprobs_num
        # one request's n answers of the longest reply, each token's K + 1 entries of ~30 JSON bytes
        answer = cfg.rollout_n * cfg.rollout_max_new_tokens * 30 * (k + 1)
        refuse_if(
            answer > self.max_upstream_response_bytes,
            "max_upstream_response_bytes",
            self.max_upstream_response_bytes,
            f"an answer of --rollout-n {cfg.rollout_n} x --rollout-max-new-tokens {cfg.rollout_max_new_tokens} "
            f"tokens at K={k} is about {answer} bytes and would be cut off every time; raise it, or lower them",
        )
        refuse_if(
            k > self.max_top_logprobs_num,
            "rollout_top_logprobs_num",
            k,
            f"above --max-top-logprobs-num {self.max_top_logprobs_num}; raise the limit or lower K",
        )


warnings.filterwarnings("ignore", 'Field name "json" in "ProbeSettings" shadows', UserWarning)  # the flag --json


class ProbeSettings(Section):
    """``centerline probe``: one check of an upstream against a contract (router_proxy/probe.py)."""

    name: ClassVar[str] = "probe"
    command: ClassVar[str] = "centerline probe"
    required: ClassVar[tuple[str, ...]] = ("upstream",)

    upstream: str | None = Field(None, description="SGLang router or server URL. Required.")
    k: int = Field(128, gt=0, description="Candidates per token (--rollout-top-logprobs-num).")
    endpoint: Literal["generate", "chat"] = Field("generate", description="SGLang endpoint to probe.")
    mode: Literal["selected", "support"] = Field("selected", description="Logprobs mode (--rollout-logprobs-mode).")
    temperature: float = Field(1.0, description="Sampling temperature of the canary request.")
    top_p: float = Field(1.0, description="Top-p filter of the canary request.")
    top_k: int | None = Field(None, description="Top-k filter; unset: K in support mode, -1 (off) otherwise.")
    vocab_size: int | None = Field(None, gt=0, description="Used when the upstream does not report it.")
    timeout: float = Field(60.0, gt=0, description="Seconds for the canary request.")
    json: bool = Field(False, description="Print the report as one JSON object.")


def _reward_component(spec: str) -> bool:
    """Whether ``spec`` is a reward component: a built-in or module:function, optionally ``=weight``."""
    ref, sep, weight = spec.rpartition("=") if "=" in spec else (spec, "", "1")
    try:
        finite = math.isfinite(float(weight))
    except ValueError:
        return False
    module, colon, function = ref.partition(":")
    return finite and (ref in REWARDS or bool(colon and module and function))


class UpSettings(Section):
    """``centerline up``: the whole system on one machine (centerline/up/launcher.py). What is ``up``'s own:
    the processes it starts, the task it prepares; the trainer's steps and held-out schedule are the
    trainer's settings, which ``up`` takes as flags too (below)."""

    name: ClassVar[str] = "up"
    command: ClassVar[str] = "centerline up"
    renamed: ClassVar[dict[str, str]] = {"eval_dataset": "heldout_dataset", "eval_prompts": "heldout_prompts"}

    model: Path | None = Field(
        None,
        description="Your own causal LM, an HF directory that SGLang and transformers load (`centerline make-model "
        "smollm2 --out DIR` makes one); unset: the toy model, made for --task by init-model --sft.",
    )
    dataset: Path | None = Field(
        None,
        description="Your own dataset: a JSONL file, a parquet/arrow/CSV/JSON file or a datasets save_to_disk "
        'directory (read with the datasets library), rows {"prompt" or "messages", "answer", optional "meta": {...}, '
        'optional "split": "train" | "eval"} (centerline/up/user_task.py); or reasoning-gym:NAME, a task of that '
        "library generated (--dataset-size, --heldout-prompts, --seed) and scored by its own score_answer "
        "(centerline/up/task_library.py); unset: the toy task --task.",
    )
    heldout_dataset: Path | None = Field(
        None,
        description="Held-out rows (same format, every row used) for --dataset; unset: the rows --dataset marks "
        '"split": "eval", else none. The held-out figure is the mean reward of one sample per row.',
    )
    dataset_prompt_key: str = Field(
        "prompt", min_length=1, description="The column of --dataset (and --heldout-dataset) holding the prompt text."
    )
    dataset_answer_key: str = Field(
        "answer", min_length=1, description="The column holding the answer, task.answer of the reward function."
    )
    dataset_messages_key: str = Field(
        "messages",
        min_length=1,
        description="The column holding a chat prompt (a list of {role, content}, the last the user's), rendered by "
        "the model's chat template; a row has this or the prompt column.",
    )
    chat_template: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Apply the model's chat template to each prompt as one user message with the generation "
        "prompt. auto: on for a --model whose tokenizer has one, off for the toy model.",
    )
    task: str = Field(
        "upper",
        description="Toy task (centerline/toy/dataset.py: upper, copy, reverse, add; chain, multi-turn, runs as "
        "sessions of the environment chain), when --dataset is unset.",
    )
    sft_steps: int = Field(
        0, ge=0, description="Warm-start steps of the model (0 = the task's default in centerline/toy/sft.py)."
    )
    reward: list[str] = Field(
        ["exact"],
        description="Training reward: a built-in (exact, prefix) or module:function, importable from the directory "
        "up runs in, called as reward(response_text, task) -> float (or async def); several weighted components: "
        "--reward m:f=1.0 --reward m:g=0.5 (in the TOML file a list, or a table [up.reward] of function = weight), "
        "the reward their weighted sum, each logged per step as reward/<function>. The toy task's held-out accuracy "
        "is always exact match.",
    )
    environment: str = Field(
        "",
        description="Make every task a multi-turn session run by this environment: a built-in (chain) or "
        "module:function, importable from the directory up runs in, `async def environment(client, task) -> float` "
        "(client: an openai.AsyncOpenAI on the task's session). With --dataset, the default of rows that name none "
        "(a row's own environment key wins); unset: the toy task's own (chain for --task chain), else none.",
    )
    workers: int = Field(2, ge=1, description="Rollout worker processes.")
    engines: int = Field(1, ge=1, description="SGLang servers behind the router.")
    nats_nodes: int = Field(
        1,
        ge=1,
        description="NATS servers: 1, or a JetStream cluster of this many nodes on loopback, whose streams get "
        "min(3, nodes) replicas unless nats_stream_replicas says otherwise.",
    )
    trainer_ranks: int = Field(2, ge=1, description="Torchrun processes of the trainer.")
    dataset_size: int = Field(
        2000,
        ge=1,
        description="Training prompts of the toy task, or of a task library's (--dataset reasoning-gym:NAME).",
    )
    heldout_prompts: int = Field(
        200, ge=1, description="Held-out prompts per evaluation, of the toy task or a task library's task."
    )
    model_dir: Path = Field(Path("models"), description="Cache of init-model outputs.")
    run_dir: Path | None = Field(None, description="Run directory; unset: runs/<date-time>.")
    startup_timeout: float = Field(300.0, gt=0, description="Seconds for each service to become ready.")
    sglang_args: str = Field(
        "", description="Extra flags for every SGLang server, one string: --sglang-args=--enable-metrics."
    )
    engine_device: Literal["cpu", "cuda"] = Field(
        "cpu",
        description="Where the SGLang servers run: cpu (the CPU recipe of centerline/sglang.py) or cuda (the GPU; "
        "give them a share of its memory with --sglang-args=--mem-fraction-static=X when the trainer shares it).",
    )

    @field_validator("reward", mode="before")
    @classmethod
    def _reward_forms(cls, value):
        """One name (a TOML string, an old run's config), or a TOML table of ``function = weight``."""
        if isinstance(value, str):
            return [value]
        if isinstance(value, dict):
            return [f"{ref}={weight}" for ref, weight in value.items()]
        return value

    @model_validator(mode="after")
    def _runnable(self) -> UpSettings:
        env_module, env_sep, env_function = self.environment.partition(":")
        bad_reward = next((r for r in self.reward if not _reward_component(r)), None)
        refuse_if(
            bad_reward is not None or not self.reward,
            "reward",
            bad_reward if self.reward else "(none)",
            f"a built-in ({', '.join(sorted(REWARDS))}) or module:function, with =weight where several are given "
            "(--reward m:f=1.0 --reward m:g=0.5)",
        )
        refuse_if(
            bool(self.environment)
            and self.environment not in ENVIRONMENTS
            and not (env_sep and env_module and env_function),
            "environment",
            self.environment,
            f"a built-in ({', '.join(sorted(ENVIRONMENTS))}) or module:function, e.g. mymodule:play "
            "for `async def play(client, task)` in mymodule.py",
        )
        refuse_if(
            self.heldout_dataset is not None and self.dataset is None,
            "heldout_dataset",
            self.heldout_dataset,
            "held-out rows of your own dataset need --dataset too",
        )
        return self


class ReplaySettings(Section):
    """``centerline replay``: a record file back into NATS or into the trainer's steps (centerline/runs/replay.py).
    With ``--train`` it also restores every setting of the run's ``[trainer]`` table (but its model, run
    directory and metrics port)."""

    name: ClassVar[str] = "replay"
    command: ClassVar[str] = "centerline replay"

    subject: str | None = Field(None, description="--to: publish here instead of each message's recorded subject.")
    checkpoint: Path | None = Field(None, description="--train: checkpoint directory to start from (step-NNNNNN).")
    run_dir: Path | None = Field(None, description="--train: output directory; unset: FILE with suffix .replay.")
    steps_from: Path | None = Field(
        None,
        description="--train: the original metrics.jsonl; batches are grouped into steps as it lists them. "
        "Unset: the one in the checkpoint's run directory, unless --batches-per-step is given.",
    )
    batches_per_step: int = Field(1, ge=1, description="--train without --steps-from: accepted batches per step.")
    steps: int | None = Field(None, ge=0, description="--train: replay at most this many steps; unset: all.")

    @model_validator(mode="after")
    def _one_grouping(self) -> ReplaySettings:
        refuse_if(
            self.steps_from is not None and self.batches_per_step != 1,
            "batches_per_step",
            self.batches_per_step,
            "--steps-from groups the batches as the original run did; drop --batches-per-step",
        )
        return self


SECTIONS: dict[str, type[Section]] = {
    cls.name: cls for cls in (TrainerSettings, WorkerSettings, ProxySettings, ProbeSettings, UpSettings, ReplaySettings)
}

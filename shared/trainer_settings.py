"""``centerline trainer``'s settings (table ``[trainer]``, ``CENTERLINE_TRAINER_*``): the training loop."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from shared.settings_base import LAUNCHED, UP_FLAG, CommandSettings, check_max_deliver, refuse_if

MICRO_BATCH_TOKENS = 4096  # the toy default run's whole shard in one forward; a real model's activations bound
LOSS_CHUNK_TOKENS = 1024  # rows per LM-head chunk: [1024, 151936] float32 logits are 0.6 GB


class TrainerSettings(CommandSettings):
    """``centerline trainer``: the training loop of trainer_service/service.py."""

    name: ClassVar[str] = "trainer"
    command: ClassVar[str] = "centerline trainer"
    required: ClassVar[tuple[str, ...]] = ("model", "dataset", "run_dir")
    renamed: ClassVar[dict[str, str]] = {"eval_every": "heldout_every", "eval_timeout": "heldout_timeout"}

    model: Path | None = Field(
        None, description="Initial HF model directory (weight version 0). Required.", json_schema_extra=LAUNCHED
    )
    dataset: Path | None = Field(
        None, description="JSONL of {prompt, answer, reward, ...}. Required.", json_schema_extra=LAUNCHED
    )
    run_dir: Path | None = Field(
        None,
        description="Checkpoints, weight versions, metrics.jsonl and the run's config.toml. Required.",
        json_schema_extra=LAUNCHED,
    )
    steps: int = Field(100, ge=0, description="Train until this many steps are done.", json_schema_extra=UP_FLAG)
    train_seconds: float | None = Field(
        None,
        gt=0,
        description="Also stop, after the step in progress, once this many seconds have passed since training "
        "began; unset: no time limit.",
        json_schema_extra=UP_FLAG,
    )
    prompts_per_step: int = Field(8, ge=1, description="Prompt groups per step.", json_schema_extra=UP_FLAG)
    heldout_dataset: Path | None = Field(
        None,
        description="JSONL of held-out rows, the format of --dataset: one sample of each, drawn as training samples "
        "are, before training, every --heldout-every steps and after the last; scored, never trained, written to "
        "heldout_metrics.jsonl as that step's held-out figure (docs/design.md section 9). Unset: no held-out "
        "evaluation.",
        json_schema_extra=LAUNCHED,
    )
    heldout_every: int = Field(
        25, ge=1, description="Evaluate the held-out rows every this many steps.", json_schema_extra=UP_FLAG
    )
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
        json_schema_extra=UP_FLAG,
    )
    weight_transport: Literal["disk", "distributed"] = Field(
        "disk",
        description="How a weight version reaches the engines (docs/design.md section 8, transports; disk is the "
        "default by `centerline bench weights`). distributed: "
        "rank 0 broadcasts it to each engine through SGLang's distributed update (gloo on the CPU, NCCL on CUDA), "
        "no file read by the engine; an engine it fails to reach loads the version from disk instead. disk: every "
        "engine loads the version's directory (the engines must mount the run directory).",
        json_schema_extra=UP_FLAG,
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

    _max_deliver = field_validator("max_deliver")(check_max_deliver)

    def store_caps(self, cfg) -> tuple[int, int]:
        """``(rollouts_max_bytes, dlq_max_bytes)`` of this run (``shared.streams.store_caps``)."""
        from shared.streams import store_caps

        return store_caps(
            cfg.rollout, self.prompts_per_step, self.store_retention_steps, self.rollouts_max_bytes, self.dlq_max_bytes
        )

    def check_with(self, cfg) -> None:
        from shared.streams import sample_max_bytes

        inflight, n, most = cfg.training.max_inflight_steps, cfg.rollout.n, sample_max_bytes(cfg.rollout)
        needed = (inflight + 1) * self.prompts_per_step * n * most
        refuse_if(
            self.rollouts_max_bytes is not None and self.rollouts_max_bytes < needed,
            "rollouts_max_bytes",
            self.rollouts_max_bytes,
            f"must hold the steps in flight, --max-inflight-steps + 1 = {inflight + 1} steps of "
            f"{self.prompts_per_step} x {n} samples of up to {most} bytes: at least "
            f"{needed}; raise it, or lower --rollout-session-max-tokens or K",
        )

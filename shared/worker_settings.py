"""``centerline worker``'s settings (table ``[worker]``, ``CENTERLINE_WORKER_*``): a rollout worker."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

from pydantic import Field, field_validator

from shared.settings_base import LAUNCHED, CommandSettings, check_max_deliver

ENVIRONMENT_DEADLINE_MAX = 1800.0  # seconds: the default environment deadline's bound (30 minutes)


class WorkerSettings(CommandSettings):
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
        json_schema_extra=LAUNCHED,
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

    _max_deliver = field_validator("max_deliver")(check_max_deliver)

    def environment_deadline(self, cfg) -> float:
        """``environment_timeout``, or where unset its default from the turn timeout and the session
        token budget of the shared ``cfg`` (docs/design.md section 12)."""
        if self.environment_timeout is not None:
            return self.environment_timeout
        turns = math.ceil(cfg.rollout.session_max_tokens / cfg.rollout.max_new_tokens)
        return min(self.request_timeout * turns, ENVIRONMENT_DEADLINE_MAX)

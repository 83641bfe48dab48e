"""Every setting, typed: the shared ``Config`` here, read by every service, and each command's
``CommandSettings`` (one module per role), registered by table in ``SECTIONS``.

``Config`` is four groups, each taken whole by the code that uses it: ``rollout`` (the sampling
contract: ``cfg.rollout.top_logprobs_num``, ``cfg.rollout.sampling``), ``loss`` (the policy loss
and its options: the trainer's step takes ``cfg.loss``), ``training`` (staleness, steps in flight,
learning rate, seed) and ``services`` (where NATS, the proxy and the engines are). A setting's
public name is flat, as users write it: field ``top_logprobs_num`` of ``rollout`` (alias
``rollout_top_logprobs_num``) is the flag ``--rollout-top-logprobs-num``, the TOML key
``rollout_top_logprobs_num`` at the top of the file and the variable
``CENTERLINE_ROLLOUT_TOP_LOGPROBS_NUM``; ``Config`` takes and dumps its settings by these names.

A field of ``TrainerSettings`` (table ``trainer``) such as ``max_grad_norm`` is the flag
``--max-grad-norm`` of ``centerline trainer``, the key ``max_grad_norm`` of the TOML file's
``[trainer]`` table and the variable ``CENTERLINE_TRAINER_MAX_GRAD_NORM``. A setting a command
cannot start without is listed in its ``required`` (default None, so a file or the environment may
give it). Rules: ``shared/settings_base.py``; sources, precedence and flags: ``shared/config.py``;
``docs/config.md`` lists every field (``scripts/gen_config_docs.py``).

Not settings: what a one-shot command is asked to do this time (``centerline replay``'s record
file and its mode ``--to``/``--jsonl``/``--train``), and secrets (docs/config.md).
"""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import Field, model_serializer, model_validator
from pydantic.fields import FieldInfo

from shared.proxy_settings import (
    MAX_REQUEST_BODY_BYTES,
    MAX_TOP_LOGPROBS_NUM,
    MAX_UPSTREAM_RESPONSE_BYTES,
    ProbeSettings,
    ProxySettings,
)
from shared.sampling import Sampling
from shared.settings_base import LAUNCHED, CommandSettings, Settings, SettingsGroup, refuse_if
from shared.streams import sample_max_bytes
from shared.trainer_settings import LOSS_CHUNK_TOKENS, MICRO_BATCH_TOKENS, TrainerSettings
from shared.up_settings import ReplaySettings, UpSettings
from shared.worker_settings import WorkerSettings

# The interface: every settings model and its constants, the role modules' imported from here.
__all__ = [
    "IMPORTANCE_WEIGHTS",
    "LOSS_CHUNK_TOKENS",
    "LOSS_NAMES",
    "MAX_REQUEST_BODY_BYTES",
    "MAX_SAMPLE_BYTES",
    "MAX_TOP_LOGPROBS_NUM",
    "MAX_UPSTREAM_RESPONSE_BYTES",
    "MICRO_BATCH_TOKENS",
    "SECTIONS",
    "CommandSettings",
    "Config",
    "ImportanceWeight",
    "LossName",
    "LossSettings",
    "ProbeSettings",
    "ProxySettings",
    "ReplaySettings",
    "RolloutSettings",
    "ServiceSettings",
    "TrainerSettings",
    "TrainingSettings",
    "UpSettings",
    "WorkerSettings",
]

# The largest part of a batch the trainer puts together from pieces and holds: a sample of 250k tokens at K=128.
MAX_SAMPLE_BYTES = 256 << 20
# The policy losses and score centering's importance weights, named here once: the flags' choices
# (LossSettings below), the loss table LOSSES (trainer_service/loss.py), the experiment's grid
# (centerline/experiments/staleness.py).
LossName = Literal["score_centering", "reinforce", "tis"]
ImportanceWeight = Literal["none", "tis", "mis"]
LOSS_NAMES: tuple[LossName, ...] = typing.get_args(LossName)
IMPORTANCE_WEIGHTS: tuple[ImportanceWeight, ...] = typing.get_args(ImportanceWeight)


class RolloutSettings(SettingsGroup):
    """What every training request samples with and every sample records: the sampling contract
    (docs/design.md sections 4, 5 and 7), read by the worker, the proxy and the trainer's gate."""

    top_logprobs_num: int = Field(
        128,
        alias="rollout_top_logprobs_num",
        description="K: candidates recorded per generated token (top-K head, or the largest support allowed "
        "in support mode).",
    )
    temperature: float = Field(
        1.0,
        alias="rollout_temperature",
        description="Sampling temperature; the trainer divides its logits by the same value. Must be > 0.",
    )
    top_p: float = Field(
        1.0,
        alias="rollout_top_p",
        description="Nucleus filter. Below 1 is filtered sampling and needs --rollout-logprobs-mode support.",
    )
    top_k: int = Field(
        -1,
        alias="rollout_top_k",
        description="Top-k filter, -1 = off. Filtered sampling needs --rollout-logprobs-mode support and top_k <= K.",
    )
    min_p: float = Field(
        0.0,
        alias="rollout_min_p",
        description="Min-p filter. Only 0 is supported: the support it keeps is not recorded by SGLang.",
    )
    logprobs_mode: Literal["selected", "support"] = Field(
        "selected",
        alias="rollout_logprobs_mode",
        description="selected: unfiltered sampling, record the top-K head and model the tail; "
        "support: filtered sampling, record the full realized support.",
    )
    endpoint: Literal["generate", "chat"] = Field(
        "generate",
        alias="rollout_endpoint",
        description="SGLang endpoint for training requests: native /generate or /v1/chat/completions.",
    )
    max_new_tokens: int = Field(
        16,
        gt=0,
        alias="rollout_max_new_tokens",
        description="Longest response, in tokens; in a multi-turn session, the longest turn.",
    )
    session_max_tokens: int = Field(
        1024,
        alias="rollout_session_max_tokens",
        description="A multi-turn session's token budget: its first prompt and every token after it. A turn that "
        "could pass it is not run; the session ends after its last complete turn.",
    )
    max_sample_bytes: int = Field(
        MAX_SAMPLE_BYTES,
        description="Largest encoded part of a batch (one sample at least) carried to the trainer: above "
        "max_payload it travels in pieces, above this it is dead-lettered as sample_too_large. It must hold "
        "--rollout-session-max-tokens tokens of 13 + 8K bytes each, checked at start-up.",
    )
    n: int = Field(4, gt=0, alias="rollout_n", description="Samples per prompt group (GRPO group size).")
    tool_call_parser: str = Field(
        "auto",
        alias="rollout_tool_call_parser",
        description="SGLang's tool-call parser (sglang.srt.function_call: hermes, qwen25, llama3, mistral, "
        "pythonic, deepseekv3, kimi_k2, glm45, gpt-oss, ...) that turns a session reply's sampled call markup "
        "into message.tool_calls. auto: SGLang's detection from the chat template, else hermes for a template "
        "that writes `<tool_call>`; none, or auto finding none: a request with tools is refused naming this flag.",
    )
    reasoning_parser: str = Field(
        "none",
        alias="rollout_reasoning_parser",
        description="SGLang's reasoning parser (qwen3, deepseek-r1, gpt-oss, ...) that moves a session reply's "
        "think block into reasoning_content; auto: SGLang's detection from the chat template; none: it stays "
        "in content.",
    )
    chat_template: str | None = Field(
        None,
        alias="rollout_chat_template",
        description="A Jinja chat template file that sessions render with in place of the tokenizer's own "
        "(deploy/chat_templates/smollm2-tools.jinja renders tools for SmolLM2). Unset: the tokenizer's.",
    )

    @property
    def sampling(self) -> Sampling:
        """The sampling contract these settings state (shared/sampling.py), one object for every user."""
        return Sampling(
            k=self.top_logprobs_num,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            mode=self.logprobs_mode,
        )

    @property
    def filtered(self) -> bool:
        """Whether sampling filters the distribution (top-p or top-k)."""
        return self.top_p < 1.0 or self.top_k > 0

    @model_validator(mode="after")
    def _honoured(self) -> RolloutSettings:
        """The settings the method cannot honour, in order; each refusal names the flag and the fix."""
        k = self.top_logprobs_num
        refuse_if(k <= 0, "rollout_top_logprobs_num", k, "K must be positive; 128 is typical")
        refuse_if(
            self.temperature <= 0,
            "rollout_temperature",
            self.temperature,
            "greedy decoding has no sampling distribution to centre; use a temperature > 0",
        )
        refuse_if(not 0 < self.top_p <= 1, "rollout_top_p", self.top_p, "top-p must lie in (0, 1]")
        refuse_if(
            self.top_k == 0 or self.top_k < -1,
            "rollout_top_k",
            self.top_k,
            "use -1 for no top-k filter or a positive k",
        )
        refuse_if(self.min_p != 0, "rollout_min_p", self.min_p, "min-p is not supported; set it to 0")
        refuse_if(
            self.filtered and self.logprobs_mode != "support",
            "rollout_logprobs_mode",
            self.logprobs_mode,
            "filtered sampling (top-p < 1 or top-k set) needs --rollout-logprobs-mode support: a top-K head of the "
            "unfiltered distribution does not describe what was sampled",
        )
        refuse_if(
            self.logprobs_mode == "support" and not 0 < self.top_k <= k,
            "rollout_top_k",
            self.top_k,
            f"support mode records the whole support in K={k} slots, so it needs 0 < --rollout-top-k <= K",
        )
        refuse_if(
            self.session_max_tokens <= self.max_new_tokens,
            "rollout_session_max_tokens",
            self.session_max_tokens,
            "a session's budget must leave room for a prompt and a turn: above --rollout-max-new-tokens",
        )
        most = sample_max_bytes(self)
        refuse_if(
            self.max_sample_bytes < most,
            "max_sample_bytes",
            self.max_sample_bytes,
            f"a sample of --rollout-session-max-tokens {self.session_max_tokens} tokens at K={k} is up to "
            f"{most} bytes and could never be trained; raise it, or lower the budget or K",
        )
        return self


class LossSettings(SettingsGroup):
    """The policy loss and its options (docs/design.md section 6), which the trainer's step takes
    whole (trainer_service/loss.py; the rows bring the candidate mode and the temperature), and the
    worker's normalisation of the advantages the loss weighs."""

    name: LossName = Field(
        "score_centering",
        alias="loss",
        description="Policy loss: score centering, or a baseline (plain REINFORCE, REINFORCE with TIS).",
    )
    is_mode: ImportanceWeight = Field(
        "none",
        alias="score_centering_is",
        description="Importance weight f on p/q: none, truncated (tis) or masked (mis).",
    )
    tis_clip: float = Field(
        2.0,
        gt=0,
        alias="score_centering_tis_clip",
        description="Clip c of the truncated importance weight min(r, c).",
    )
    mis_low: float = Field(
        0.5, alias="score_centering_mis_low", description="Lower bound of the masked importance weight."
    )
    mis_high: float = Field(
        5.0, alias="score_centering_mis_high", description="Upper bound of the masked importance weight."
    )
    advantage_std_norm: bool = Field(
        False, description="Divide GRPO group advantages by the group's standard deviation."
    )

    @model_validator(mode="after")
    def _honoured(self) -> LossSettings:
        refuse_if(
            not 0 <= self.mis_low < self.mis_high,
            "score_centering_mis_low",
            self.mis_low,
            "needs 0 <= --score-centering-mis-low < --score-centering-mis-high",
        )
        return self


class TrainingSettings(SettingsGroup):
    """How the run trains: how stale a batch may be, how far sampling runs ahead of training, the
    learning rate and the seed (the trainer's, and ``centerline up``'s data and model)."""

    max_staleness: int = Field(2, ge=0, description="Oldest accepted batch, in weight versions behind the trainer.")
    max_inflight_steps: int = Field(
        2,
        ge=1,
        description="Steps of prompt tasks published ahead of training; bounds staleness. 2: the engines sample "
        "the next step while the trainer trains (batches at most one version stale); 1: on-policy, one at a time.",
    )
    learning_rate: float = Field(1e-4, description="Optimizer learning rate (AdamW).")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")


class ServiceSettings(SettingsGroup):
    """Where the services are and how they meet: NATS, the proxy, the engines."""

    nats_url: str = Field(
        "nats://127.0.0.1:4222",
        description="NATS server URL; a cluster's nodes comma-separated (nats://a:4222,nats://b:4222).",
        json_schema_extra=LAUNCHED,
    )
    nats_stream_replicas: int = Field(
        1,
        ge=1,
        description="Copies of each JetStream stream, set by the trainer (and `centerline up`), which create "
        "the streams: at most the cluster's JetStream nodes, 1 for a single server; 3 on a cluster of 3 "
        "outlives the loss of a node.",
        json_schema_extra=LAUNCHED,
    )
    proxy_url: str = Field(
        "http://127.0.0.1:30010",
        description="Router proxy URL the workers send training requests to.",
        json_schema_extra=LAUNCHED,
    )
    proxy_audit_mode: Literal["enforce", "observe"] = Field(
        "enforce",
        description="enforce: an incomplete response becomes HTTP 502; observe: it passes with a verdict header.",
    )
    engine_urls: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:30000"],
        description="Engine URLs the trainer sends weight updates to directly (never a router).",
        json_schema_extra=LAUNCHED,
    )


class Config(Settings):
    """Every shared setting, in four groups. Defaults run the embedded toy job. Built and dumped by
    the settings' public names (``Config(rollout_n=8)``, ``model_dump()``: the TOML file's keys)."""

    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    loss: LossSettings = Field(default_factory=LossSettings)
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    services: ServiceSettings = Field(default_factory=ServiceSettings)

    @classmethod
    def public_fields(cls) -> dict[str, FieldInfo]:
        return {name: info for group in _groups(cls) for name, info in group.public_fields().items()}

    @model_validator(mode="before")
    @classmethod
    def _grouped(cls, data):
        """The settings given by their public names (as the flags, the variables and the file give
        them), each moved into its group; ``loss`` is both a setting and a group's name."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for field, group in zip(cls.model_fields, _groups(cls), strict=True):
            given = {name: data.pop(name) for name in group.public_fields() if name in data}
            # a group's name that is no setting ("loss" is one, popped above) would be dropped
            refuse_if(field in data, field, data.get(field), "not a setting; see docs/config.md for the settings")
            if given:
                data[field] = given
        return data

    def __getattr__(self, item: str) -> Any:
        """A setting read by its flat public name is named where it lives (``cfg.rollout.n``)."""
        try:
            return super().__getattr__(item)
        except AttributeError:
            for field, group in zip(type(self).model_fields, _groups(type(self)), strict=True):
                for attribute, info in group.model_fields.items():
                    if item in (attribute, info.alias):
                        raise AttributeError(
                            f"Config has no attribute {item!r}: the setting lives in a group, read it as "
                            f"cfg.{field}.{attribute}"
                        ) from None
            raise

    @model_serializer(mode="wrap")
    def _public(self, dump) -> dict:
        """Every setting by its public name, in order: the TOML file's keys (``shared.config.to_toml``)."""
        return {name: value for group in dump(self).values() for name, value in group.items()}


def _groups(config: type[Config]) -> list[type[SettingsGroup]]:
    return [info.annotation for info in config.model_fields.values()]


SECTIONS: dict[str, type[CommandSettings]] = {
    cls.name: cls for cls in (TrainerSettings, WorkerSettings, ProxySettings, ProbeSettings, UpSettings, ReplaySettings)
}

"""Typed configuration shared by every service, one documented field per setting.

Sources, highest precedence first (docs/design.md section 2): command-line flags, ``CENTERLINE_*``
environment variables, a TOML file (``--config FILE``), then the defaults below: the environment
beats a file, as in Docker and twelve-factor apps, so a deployment overrides one value of a mounted
file with a variable. pydantic-settings merges them (``_build``); this module says where each is.
Field ``rollout_top_logprobs_num`` is the flag ``--rollout-top-logprobs-num``, the TOML key
``rollout_top_logprobs_num`` and the variable ``CENTERLINE_ROLLOUT_TOP_LOGPROBS_NUM``.

Services add their own flags (``--port``, ``--upstream``...) to their parser and call
``add_arguments`` / ``resolve`` for the shared ones. The reference in ``docs/config.md`` is
generated from this file by ``scripts/gen_config_docs.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
import types
import typing
import warnings
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import EnvSettingsSource, InitSettingsSource

from shared.sampling import Sampling
from shared.settings import REFUSED, SECTIONS, Section, Settings, refuse_if
from shared.streams import sample_max_bytes

ENV_PREFIX = "CENTERLINE_"
# The largest part of a batch the trainer puts together from pieces and holds: a sample of 250k tokens at K=128.
MAX_SAMPLE_BYTES = 256 << 20
S = TypeVar("S", bound=Section)
M = TypeVar("M", bound=Settings)
# The policy losses and score centering's importance weights, named here once: the flags' choices,
# Config's fields below, LossSettings and the loss table LOSSES (trainer_service/loss.py), the
# experiment's grid (centerline/experiments/staleness.py).
LossName = Literal["score_centering", "reinforce", "tis"]
ImportanceWeight = Literal["none", "tis", "mis"]
LOSS_NAMES: tuple[LossName, ...] = typing.get_args(LossName)
IMPORTANCE_WEIGHTS: tuple[ImportanceWeight, ...] = typing.get_args(ImportanceWeight)
# The importance-weight options' defaults, here once: Config's fields below, and the keyword
# defaults of LossSettings (trainer_service/loss.py).
TIS_CLIP, MIS_LOW, MIS_HIGH = 2.0, 0.5, 5.0


class ConfigError(ValueError):
    """A setting that cannot be honoured. The message names the flag, the value and the fix."""


class Config(Settings):
    """Every shared setting. Defaults run the embedded toy job."""

    # Rollout: what the sampler must record (the candidate contract).
    rollout_top_logprobs_num: int = Field(
        128,
        description="K: candidates recorded per generated token (top-K head, or the largest support allowed "
        "in support mode).",
    )
    rollout_temperature: float = Field(
        1.0, description="Sampling temperature; the trainer divides its logits by the same value. Must be > 0."
    )
    rollout_top_p: float = Field(
        1.0, description="Nucleus filter. Below 1 is filtered sampling and needs --rollout-logprobs-mode support."
    )
    rollout_top_k: int = Field(
        -1,
        description="Top-k filter, -1 = off. Filtered sampling needs --rollout-logprobs-mode support and top_k <= K.",
    )
    rollout_min_p: float = Field(
        0.0, description="Min-p filter. Only 0 is supported: the support it keeps is not recorded by SGLang."
    )
    rollout_logprobs_mode: Literal["selected", "support"] = Field(
        "selected",
        description="selected: unfiltered sampling, record the top-K head and model the tail; "
        "support: filtered sampling, record the full realized support.",
    )
    rollout_endpoint: Literal["generate", "chat"] = Field(
        "generate", description="SGLang endpoint for training requests: native /generate or /v1/chat/completions."
    )
    rollout_max_new_tokens: int = Field(
        16, gt=0, description="Longest response, in tokens; in a multi-turn session, the longest turn."
    )
    rollout_session_max_tokens: int = Field(
        1024,
        description="A multi-turn session's token budget: its first prompt and every token after it. A turn that "
        "could pass it is not run; the session ends after its last complete turn.",
    )
    max_sample_bytes: int = Field(
        MAX_SAMPLE_BYTES,
        description="Largest encoded part of a batch (one sample at least) carried to the trainer: above "
        "max_payload it travels in pieces, above this it is dead-lettered as sample_too_large. It must hold "
        "--rollout-session-max-tokens tokens of 13 + 8K bytes each, checked at start-up.",
    )
    rollout_n: int = Field(4, gt=0, description="Samples per prompt group (GRPO group size).")
    rollout_tool_call_parser: str = Field(
        "auto",
        description="SGLang's tool-call parser (sglang.srt.function_call: hermes, qwen25, llama3, mistral, "
        "pythonic, deepseekv3, kimi_k2, glm45, gpt-oss, ...) that turns a session reply's sampled call markup "
        "into message.tool_calls. auto: SGLang's detection from the chat template, else hermes for a template "
        "that writes `<tool_call>`; none, or auto finding none: a request with tools is refused naming this flag.",
    )
    rollout_reasoning_parser: str = Field(
        "none",
        description="SGLang's reasoning parser (qwen3, deepseek-r1, gpt-oss, ...) that moves a session reply's "
        "think block into reasoning_content; auto: SGLang's detection from the chat template; none: it stays "
        "in content.",
    )
    rollout_chat_template: str | None = Field(
        None,
        description="A Jinja chat template file that sessions render with in place of the tokenizer's own "
        "(deploy/chat_templates/smollm2-tools.jinja renders tools for SmolLM2). Unset: the tokenizer's.",
    )

    # Loss (docs/design.md section 6).
    loss: LossName = Field(
        "score_centering",
        description="Policy loss: score centering, or a baseline (plain REINFORCE, REINFORCE with TIS).",
    )
    score_centering_is: ImportanceWeight = Field(
        "none", description="Importance weight f on p/q: none, truncated (tis) or masked (mis)."
    )
    score_centering_tis_clip: float = Field(
        TIS_CLIP, gt=0, description="Clip c of the truncated importance weight min(r, c)."
    )
    score_centering_mis_low: float = Field(MIS_LOW, description="Lower bound of the masked importance weight.")
    score_centering_mis_high: float = Field(MIS_HIGH, description="Upper bound of the masked importance weight.")
    advantage_std_norm: bool = Field(
        False, description="Divide GRPO group advantages by the group's standard deviation."
    )

    # Trainer.
    max_staleness: int = Field(2, ge=0, description="Oldest accepted batch, in weight versions behind the trainer.")
    max_inflight_steps: int = Field(
        2,
        ge=1,
        description="Steps of prompt tasks published ahead of training; bounds staleness. 2: the engines sample "
        "the next step while the trainer trains (batches at most one version stale); 1: on-policy, one at a time.",
    )
    learning_rate: float = Field(1e-4, description="Optimizer learning rate (AdamW).")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")

    # Services.
    nats_url: str = Field(
        "nats://127.0.0.1:4222",
        description="NATS server URL; a cluster's nodes comma-separated (nats://a:4222,nats://b:4222).",
    )
    nats_stream_replicas: int = Field(
        1,
        ge=1,
        description="Copies of each JetStream stream, set by the trainer (and `centerline up`), which create "
        "the streams: at most the cluster's JetStream nodes, 1 for a single server; 3 on a cluster of 3 "
        "outlives the loss of a node.",
    )
    proxy_url: str = Field(
        "http://127.0.0.1:30010", description="Router proxy URL the workers send training requests to."
    )
    proxy_audit_mode: Literal["enforce", "observe"] = Field(
        "enforce",
        description="enforce: an incomplete response becomes HTTP 502; observe: it passes with a verdict header.",
    )
    engine_urls: list[str] = Field(
        default_factory=lambda: ["http://127.0.0.1:30000"],
        description="Engine URLs the trainer sends weight updates to directly (never a router).",
    )

    @property
    def sampling(self) -> Sampling:
        """The sampling contract these settings state (shared/sampling.py), one object for every user."""
        return Sampling(
            k=self.rollout_top_logprobs_num,
            temperature=self.rollout_temperature,
            top_p=self.rollout_top_p,
            top_k=self.rollout_top_k,
            mode=self.rollout_logprobs_mode,
        )

    @property
    def filtered(self) -> bool:
        """Whether sampling filters the distribution (top-p or top-k)."""
        return self.rollout_top_p < 1.0 or self.rollout_top_k > 0

    @model_validator(mode="after")
    def _honoured(self) -> Config:
        """The settings the method cannot honour, in order; each refusal names the flag and the fix."""
        k = self.rollout_top_logprobs_num
        refuse_if(k <= 0, "rollout_top_logprobs_num", k, "K must be positive; 128 is typical")
        refuse_if(
            self.rollout_temperature <= 0,
            "rollout_temperature",
            self.rollout_temperature,
            "greedy decoding has no sampling distribution to centre; use a temperature > 0",
        )
        refuse_if(not 0 < self.rollout_top_p <= 1, "rollout_top_p", self.rollout_top_p, "top-p must lie in (0, 1]")
        refuse_if(
            self.rollout_top_k == 0 or self.rollout_top_k < -1,
            "rollout_top_k",
            self.rollout_top_k,
            "use -1 for no top-k filter or a positive k",
        )
        refuse_if(self.rollout_min_p != 0, "rollout_min_p", self.rollout_min_p, "min-p is not supported; set it to 0")
        refuse_if(
            self.filtered and self.rollout_logprobs_mode != "support",
            "rollout_logprobs_mode",
            self.rollout_logprobs_mode,
            "filtered sampling (top-p < 1 or top-k set) needs --rollout-logprobs-mode support: a top-K head of the "
            "unfiltered distribution does not describe what was sampled",
        )
        refuse_if(
            self.rollout_logprobs_mode == "support" and not 0 < self.rollout_top_k <= k,
            "rollout_top_k",
            self.rollout_top_k,
            f"support mode records the whole support in K={k} slots, so it needs 0 < --rollout-top-k <= K",
        )
        refuse_if(
            self.rollout_session_max_tokens <= self.rollout_max_new_tokens,
            "rollout_session_max_tokens",
            self.rollout_session_max_tokens,
            "a session's budget must leave room for a prompt and a turn: above --rollout-max-new-tokens",
        )
        refuse_if(
            not 0 <= self.score_centering_mis_low < self.score_centering_mis_high,
            "score_centering_mis_low",
            self.score_centering_mis_low,
            "needs 0 <= --score-centering-mis-low < --score-centering-mis-high",
        )
        most = sample_max_bytes(self)
        refuse_if(
            self.max_sample_bytes < most,
            "max_sample_bytes",
            self.max_sample_bytes,
            f"a sample of --rollout-session-max-tokens {self.rollout_session_max_tokens} tokens at K={k} is up to "
            f"{most} bytes and could never be trained; raise it, or lower the budget or K",
        )
        return self


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str, section: type[Section] | None = None) -> str:
    """``CENTERLINE_<KEY>`` for a shared field, ``CENTERLINE_<TABLE>_<KEY>`` for a command's."""
    return ENV_PREFIX + (f"{section.name}_" if section else "").upper() + name.upper()


def key_name(name: str, section: type[Section] | None = None) -> str:
    """The TOML key as a person writes it: ``loss``, ``trainer.max_grad_norm``."""
    return f"{section.name}.{name}" if section else name


def add_arguments(
    parser: argparse.ArgumentParser,
    section: type[Section] | None = None,
    *,
    only: tuple[str, ...] | None = None,
    shared: bool = True,
    title: str | None = None,
) -> None:
    """Add ``--config FILE``, one flag per field of ``section`` (those in ``only``, when given) and,
    with ``shared``, one per shared field. Unset flags stay absent from the namespace."""
    if not any("--config" in action.option_strings for action in parser._actions):
        parser.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help="TOML file of settings")
    if section is not None:
        group = parser.add_argument_group(title or f"{section.command} settings (see docs/config.md)")
        for name, info in section.model_fields.items():
            if only is None or name in only:
                group.add_argument(flag(name), **_flag_kwargs(name, info, metavar=False))
        for old, name in section.renamed.items():
            if only is None or name in only:
                kwargs = _flag_kwargs(name, section.model_fields[name], metavar=False)
                kwargs.update(action=_OldFlag, help=f"the old name of {flag(name)}, read for one release")
                group.add_argument(flag(old), **kwargs)
    if shared:
        group = parser.add_argument_group("centerline configuration (see docs/config.md)")
        for name, info in Config.model_fields.items():
            group.add_argument(flag(name), **_flag_kwargs(name, info, metavar=True))


class _OldFlag(argparse.Action):
    """The old flag of a renamed setting (``Section.renamed``): sets the setting, with a note."""

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stderr.write(f"{parser.prog}: warning: {option_string} is deprecated; use {flag(self.dest)}\n")
        setattr(namespace, self.dest, values)


def deprecated(old: str, new: str) -> None:
    """The note for a setting read by its old name, as a ``FutureWarning`` (shown to users by default)."""
    warnings.warn(f"{old} is deprecated; use {new} (docs/config.md)", FutureWarning, stacklevel=3)


def _flag_kwargs(name: str, info, metavar: bool) -> dict:
    kind = _base_type(info.annotation)
    kwargs: dict = {"dest": name, "default": argparse.SUPPRESS, "help": info.description}
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif kind is list:
        kwargs["nargs"] = "+"
        kwargs["action"] = "extend"  # a repeated flag adds its values: --reward a=1 --reward b=0.5
    elif _choices(info.annotation):
        kwargs["choices"] = _choices(info.annotation)
    else:
        kwargs["type"] = kind
    if metavar and kind is not bool and "choices" not in kwargs:
        kwargs["metavar"] = {int: "N", float: "X", list: "URL"}.get(kind, "VALUE")
    return kwargs


def resolve(
    args: argparse.Namespace | None = None,
    env: typing.Mapping[str, str] | None = None,
    defaults: typing.Mapping[str, object] | None = None,
) -> Config:
    """The shared settings: a job's ``defaults``, TOML file, environment and flags merged (in rising
    precedence), then validated by the model."""
    return _build(Config, args, env, defaults=defaults)


def resolve_section(
    section: type[S],
    args: argparse.Namespace | None = None,
    env: typing.Mapping[str, str] | None = None,
    cfg: Config | None = None,
    *,
    only: tuple[str, ...] | None = None,
    defaults: typing.Mapping[str, object] | None = None,
) -> S:
    """A command's settings, merged as ``resolve`` merges the shared ones, then checked: required
    fields, the model's bounds and validators, ``section.check_with(cfg)``. ``only``: the fields this
    command has flags for (the others come from the file, the environment or their defaults and
    need not be set)."""
    settings = _build(section, args, env, only, defaults)
    for name in section.required:
        if (only is None or name in only) and getattr(settings, name) is None:
            raise ConfigError(
                f"{flag(name)} is required: pass it, or set {key_name(name, section)} in the TOML file or "
                f"{env_name(name, section)}"
            )
    return check_section(settings, cfg or Config())


def check_section(settings: S, cfg: Config) -> S:
    """``settings`` once ``settings.check_with(cfg)``, the rules across it and the shared settings,
    pass; the first refusal raised as ``ConfigError``."""
    try:
        settings.check_with(cfg)
    except PydanticCustomError as exc:
        raise _refused(exc.context, exc.message()) from None
    return settings


def _build(model: type[M], args, env, only: tuple[str, ...] | None = None, defaults=None) -> M:
    """``model`` from its sources, the first winning: flags, environment, file, a job's ``defaults``,
    the fields' defaults; pydantic-settings merges them and the model validates the result once. They
    are this call's (``env``, the file of ``--config``), so they are handed to the model rather than
    fixed by ``Settings.settings_customise_sources``, a classmethod."""
    section = None if model is Config else model
    given = vars(args) if args is not None else {}
    read = load_toml(given["config"]) if "config" in given else {}
    table = read.get(section.name, {}) if section else {k: v for k, v in read.items() if k not in SECTIONS}
    flags = {k: v for k, v in given.items() if k in model.model_fields and (only is None or k in only)}
    sources = (
        InitSettingsSource(model, flags),
        _Environment(model, os.environ if env is None else env, env_name("", section)),
        InitSettingsSource(model, table),
        InitSettingsSource(model, dict(defaults or {})),
    )
    try:
        return model(_build_sources=(sources, flags))
    except ValidationError as exc:
        raise invalid_setting(exc, section) from None


class _Environment(EnvSettingsSource):
    """``env``'s variables as ``env_name`` spells them, in capitals exactly (the names the launcher
    strips from a service's environment); a list comma-separated."""

    def __init__(self, model: type[Settings], env: typing.Mapping[str, str], prefix: str):
        self.given = env
        self.renamed = {
            prefix + old.upper(): prefix + new.upper() for old, new in getattr(model, "renamed", {}).items()
        }
        super().__init__(model, case_sensitive=False, env_prefix=prefix)

    def _load_env_vars(self) -> dict[str, str]:
        given = {name: value for name, value in self.given.items() if name.isupper()}
        for old, new in self.renamed.items():
            if old in given:
                deprecated(old, new)
                given.setdefault(new, given[old])  # the new name wins where both are set
        return {name.lower(): value for name, value in given.items()}

    def decode_complex_value(self, field_name: str, field, value: str) -> list[str]:
        return value.split(",")  # engine_urls: a list is the only setting that is not one value


def invalid_setting(exc: ValidationError, section: type[Section] | None = None) -> ConfigError:
    """A model's refusal of a value, in the words of a flag: the flag, the value, the fix."""
    err = exc.errors()[0]
    if err["type"] == REFUSED:  # a validator's rule: the value as the rule saw it
        return _refused(err["ctx"], err["msg"])
    name = str(err["loc"][0]) if err["loc"] else "?"
    return ConfigError(
        f"{flag(name)} {err.get('input')!r}: {_fix(err)} (also settable as {env_name(name, section)} or "
        f"{key_name(name, section)} in the TOML file)"
    )


def _refused(context: dict, fix: str) -> ConfigError:
    """A ``refuse_if`` refusal in the words of a flag: ``--<flag> <value>: <fix>``."""
    return ConfigError(f"{flag(context['setting'])} {context['value']}: {fix}")


def _fix(err: dict) -> str:
    """Pydantic's message for a bound, in the words of the checks: ``must be >= 1``."""
    ctx = err.get("ctx") or {}
    for key, words in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if key in ctx and err["type"].startswith(("greater", "less")):
            return f"must be {words} {ctx[key]}"
    return err["msg"]


def load_toml(path: str) -> dict:
    """The file as TOML: shared keys at the top, a command's own in its table (``[trainer]``...).
    An unknown key or table is refused; values are checked when a command resolves them."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
    unknown = sorted(set(data) - set(Config.model_fields) - set(SECTIONS))
    for table, cls in SECTIONS.items():
        if table in data:
            if not isinstance(data[table], dict):
                raise ConfigError(f"--config {path}: {table} must be a table ([{table}])")
            for old, new in cls.renamed.items():
                if old in data[table]:
                    if new in data[table]:
                        raise ConfigError(f"--config {path}: {table}.{old} is the old name of {table}.{new}; keep one")
                    deprecated(f"{table}.{old} in {path}", f"{table}.{new}")
                    data[table][new] = data[table].pop(old)
            unknown += sorted(f"{table}.{k}" for k in set(data[table]) - set(cls.model_fields))
    if unknown:
        raise ConfigError(f"--config {path}: unknown key(s) {unknown}; see docs/config.md for the settings")
    return data


def to_toml(cfg: Config, *sections: Section, tables: typing.Mapping[str, dict] | None = None) -> str:
    """The resolved configuration as TOML: shared keys, then a table per command's settings (unset
    ones left out, shared ones too), then ``tables`` (other commands' tables, as read from a file) unchanged."""
    lines = [f"{name} = {_toml_value(value)}" for name, value in cfg.model_dump().items() if value is not None]
    blocks = [(s.name, s.model_dump()) for s in sections]
    blocks += [
        (name, dict(values)) for name, values in (tables or {}).items() if name not in {s.name for s in sections}
    ]
    for name, values in blocks:
        lines += ["", f"[{name}]"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items() if value is not None]
    return "\n".join(lines) + "\n"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | Path):
        return json.dumps(str(value))  # a JSON string is a TOML basic string
    if isinstance(value, list):
        return f"[{', '.join(_toml_value(v) for v in value)}]"
    return repr(value)


def _base_type(annotation) -> type:
    """The flag's type: ``str`` for a Literal, ``list`` for a list, X for ``X | None``."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return str
    if origin is list:
        return list
    if origin in (typing.Union, types.UnionType):
        (kind,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _base_type(kind)
    return annotation


def _choices(annotation) -> tuple | None:
    return typing.get_args(annotation) if typing.get_origin(annotation) is Literal else None


def parse_args(
    parser: argparse.ArgumentParser,
    argv: list[str],
    env: typing.Mapping[str, str] | None = None,
    section: type[S] | None = None,
):
    """``(args, config)`` for a service's parser (which called ``add_arguments``), or
    ``(args, config, settings)`` with the command's ``section``. A setting that cannot be
    honoured exits with status 2 and ``<prog>: <error>``, like argparse's own errors."""
    args = parser.parse_args(argv)
    try:
        cfg = resolve(args, env)
        if section is None:
            return args, cfg
        return args, cfg, resolve_section(section, args, env, cfg)
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")


def main(argv: list[str]) -> int:
    """`centerline config [flags]`: print the resolved configuration, or the error. Each command's
    table holds what the file, the environment and the defaults give it (its flags are its own)."""
    parser = argparse.ArgumentParser(prog="centerline config", description=main.__doc__)
    add_arguments(parser)
    args, cfg = parse_args(parser, argv)
    try:
        sections = [_build(cls, args, None, ()) for cls in SECTIONS.values()]
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")
    sys.stdout.write(to_toml(cfg, *sections))
    return 0

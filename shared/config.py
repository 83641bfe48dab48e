"""Typed configuration shared by every service, one documented field per setting.

Sources, highest precedence first (docs/design.md section 2): command-line flags, a TOML file
(``--config FILE``), ``CENTERLINE_*`` environment variables, then the defaults below.
Field ``rollout_top_logprobs_num`` is the flag ``--rollout-top-logprobs-num``, the TOML key
``rollout_top_logprobs_num`` and the variable ``CENTERLINE_ROLLOUT_TOP_LOGPROBS_NUM``.

Services add their own flags (``--port``, ``--upstream``...) to their parser and call
``add_arguments`` / ``resolve`` for the shared ones. The reference in ``docs/config.md`` is
generated from this file by ``scripts/gen_config_docs.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
import typing
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

ENV_PREFIX = "CENTERLINE_"


class ConfigError(ValueError):
    """A setting that cannot be honoured. The message names the flag, the value and the fix."""


class Config(BaseModel):
    """Every shared setting. Defaults run the embedded toy job."""

    model_config = ConfigDict(extra="forbid", frozen=True)

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
    rollout_max_new_tokens: int = Field(16, description="Longest response, in tokens.")
    rollout_n: int = Field(4, description="Samples per prompt group (GRPO group size).")

    # Loss (docs/design.md section 6).
    loss: Literal["score_centering", "reinforce", "tis"] = Field(
        "score_centering",
        description="Policy loss: score centering, or a baseline (plain REINFORCE, REINFORCE with TIS).",
    )
    score_centering_is: Literal["none", "tis", "mis"] = Field(
        "none", description="Importance weight f on p/q: none, truncated (tis) or masked (mis)."
    )
    score_centering_tis_clip: float = Field(2.0, description="Clip c of the truncated importance weight min(r, c).")
    score_centering_mis_low: float = Field(0.5, description="Lower bound of the masked importance weight.")
    score_centering_mis_high: float = Field(5.0, description="Upper bound of the masked importance weight.")
    advantage_std_norm: bool = Field(
        False, description="Divide GRPO group advantages by the group's standard deviation."
    )

    # Trainer.
    max_staleness: int = Field(2, description="Oldest accepted batch, in weight versions behind the trainer.")
    max_inflight_steps: int = Field(
        1, description="Steps of prompt tasks published ahead of training; bounds staleness."
    )
    learning_rate: float = Field(1e-4, description="Optimizer learning rate (AdamW).")
    seed: int = Field(0, description="Seed for data order, sampling and initialisation.")

    # Services.
    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server URL.")
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
    def filtered(self) -> bool:
        """Whether sampling filters the distribution (top-p or top-k)."""
        return self.rollout_top_p < 1.0 or self.rollout_top_k > 0


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate(cfg: Config) -> Config:
    """Reject settings the method cannot honour; each error names the flag and the fix."""
    k = cfg.rollout_top_logprobs_num
    checks = [
        (k <= 0, "rollout_top_logprobs_num", k, "K must be positive; 128 is typical"),
        (
            cfg.rollout_temperature <= 0,
            "rollout_temperature",
            cfg.rollout_temperature,
            "greedy decoding has no sampling distribution to centre; use a temperature > 0",
        ),
        (not 0 < cfg.rollout_top_p <= 1, "rollout_top_p", cfg.rollout_top_p, "top-p must lie in (0, 1]"),
        (
            cfg.rollout_top_k == 0 or cfg.rollout_top_k < -1,
            "rollout_top_k",
            cfg.rollout_top_k,
            "use -1 for no top-k filter or a positive k",
        ),
        (cfg.rollout_min_p != 0, "rollout_min_p", cfg.rollout_min_p, "min-p is not supported; set it to 0"),
        (
            cfg.filtered and cfg.rollout_logprobs_mode != "support",
            "rollout_logprobs_mode",
            cfg.rollout_logprobs_mode,
            "filtered sampling (top-p < 1 or top-k set) needs --rollout-logprobs-mode support: a top-K head of the "
            "unfiltered distribution does not describe what was sampled",
        ),
        (
            cfg.rollout_logprobs_mode == "support" and not 0 < cfg.rollout_top_k <= k,
            "rollout_top_k",
            cfg.rollout_top_k,
            f"support mode records the whole support in K={k} slots, so it needs 0 < --rollout-top-k <= K",
        ),
        (cfg.rollout_max_new_tokens <= 0, "rollout_max_new_tokens", cfg.rollout_max_new_tokens, "must be positive"),
        (cfg.rollout_n <= 0, "rollout_n", cfg.rollout_n, "must be positive"),
        (
            cfg.score_centering_tis_clip <= 0,
            "score_centering_tis_clip",
            cfg.score_centering_tis_clip,
            "must be positive",
        ),
        (
            not 0 <= cfg.score_centering_mis_low < cfg.score_centering_mis_high,
            "score_centering_mis_low",
            cfg.score_centering_mis_low,
            "needs 0 <= --score-centering-mis-low < --score-centering-mis-high",
        ),
        (cfg.max_staleness < 0, "max_staleness", cfg.max_staleness, "must be >= 0"),
        (cfg.max_inflight_steps < 1, "max_inflight_steps", cfg.max_inflight_steps, "must be >= 1"),
    ]
    for failed, name, value, fix in checks:
        if failed:
            raise ConfigError(f"{flag(name)} {value}: {fix}")
    return cfg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config FILE`` and one flag per field. Unset flags stay absent from the namespace."""
    group = parser.add_argument_group("centerline configuration (see docs/config.md)")
    group.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help="TOML file of settings")
    for name, info in Config.model_fields.items():
        kind = _base_type(info.annotation)
        kwargs: dict = {"dest": name, "default": argparse.SUPPRESS, "help": info.description}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind is list:
            kwargs["nargs"] = "+"
        elif typing.get_origin(info.annotation) is Literal:
            kwargs["choices"] = typing.get_args(info.annotation)
        else:
            kwargs["type"] = kind
        if kind is not bool and "choices" not in kwargs:
            kwargs["metavar"] = {int: "N", float: "X", list: "URL"}.get(kind, "VALUE")
        group.add_argument(flag(name), **kwargs)


def resolve(args: argparse.Namespace | None = None, env: typing.Mapping[str, str] | None = None) -> Config:
    """Merge environment, TOML file and flags (in rising precedence), then validate."""
    env = os.environ if env is None else env
    values: dict = {}
    for name, info in Config.model_fields.items():
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = raw.split(",") if _base_type(info.annotation) is list else raw
    args_dict = vars(args) if args is not None else {}
    if "config" in args_dict:
        values.update(load_toml(args_dict["config"]))
    values.update({name: value for name, value in args_dict.items() if name in Config.model_fields})
    try:
        cfg = Config(**values)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else "?"
        raise ConfigError(
            f"{flag(name)} {err.get('input')!r}: {err['msg']} (also settable as {ENV_PREFIX}{name.upper()} or in the "
            "TOML file)"
        ) from None
    return validate(cfg)


def load_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not valid TOML ({exc})") from None
    unknown = sorted(set(data) - set(Config.model_fields))
    if unknown:
        raise ConfigError(f"--config {path}: unknown key(s) {unknown}; see docs/config.md for the settings")
    return data


def to_toml(cfg: Config) -> str:
    """The resolved configuration as TOML (written beside each run)."""
    lines = []
    for name, value in cfg.model_dump().items():
        if isinstance(value, str):
            lines.append(f'{name} = "{value}"')
        elif isinstance(value, bool):
            lines.append(f"{name} = {'true' if value else 'false'}")
        elif isinstance(value, list):
            lines.append(f"{name} = [{', '.join(repr(v).replace(chr(39), chr(34)) for v in value)}]")
        else:
            lines.append(f"{name} = {value!r}")
    return "\n".join(lines) + "\n"


def _base_type(annotation) -> type:
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return str
    if origin is list:
        return list
    return annotation


def parse_args(parser: argparse.ArgumentParser, argv: list[str], env: typing.Mapping[str, str] | None = None):
    """``(args, config)`` for a service's parser (which called ``add_arguments``). A setting that
    cannot be honoured exits with status 2 and ``<prog>: <error>``, like argparse's own errors."""
    args = parser.parse_args(argv)
    try:
        return args, resolve(args, env)
    except ConfigError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")


def main(argv: list[str]) -> int:
    """`centerline config [flags]`: print the resolved configuration, or the error."""
    parser = argparse.ArgumentParser(prog="centerline config", description=main.__doc__)
    add_arguments(parser)
    _, cfg = parse_args(parser, argv)
    sys.stdout.write(to_toml(cfg))
    return 0

"""How settings are read: flags, ``CENTERLINE_*`` variables and a TOML file, merged into the models
of ``shared/settings.py``; and written back as TOML.

Sources, highest precedence first (docs/design.md section 2): command-line flags, ``CENTERLINE_*``
environment variables, a TOML file (``--config FILE``), then the defaults: the environment
beats a file, as in Docker and twelve-factor apps, so a deployment overrides one value of a mounted
file with a variable. pydantic-settings merges them (``_build``); this module says where each is.
Setting ``rollout_top_logprobs_num`` (``cfg.rollout.top_logprobs_num``) is the flag
``--rollout-top-logprobs-num``, the TOML key ``rollout_top_logprobs_num`` and the variable
``CENTERLINE_ROLLOUT_TOP_LOGPROBS_NUM``: every source speaks the settings' public names
(``Settings.public_fields``), which ``Config`` groups.

Services add their own flags (``--port``, ``--upstream``...) to their parser and call
``add_arguments`` / ``resolve`` for the shared ones. ``add_arguments`` makes each flag from its
field (type, choices, description) rather than through pydantic-settings' ``CliSettingsSource``,
which would spell a grouped setting ``--rollout.rollout-top-logprobs-num``, a list as a repeated
flag, and change every flag's metavar and help (it appends the default), and has no subset of a
command's flags (``only``) nor an old name that warns. ``Config`` and the loss names are imported
from here with the functions that read them. The reference in ``docs/config.md`` is generated
from the models by ``scripts/gen_config_docs.py``.
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

from pydantic import ValidationError
from pydantic_core import PydanticCustomError
from pydantic_settings import InitSettingsSource, PydanticBaseSettingsSource

from shared.settings import (
    IMPORTANCE_WEIGHTS,
    LOSS_NAMES,
    MAX_SAMPLE_BYTES,
    SECTIONS,
    Config,
    ImportanceWeight,
    LossName,
)
from shared.settings_base import REFUSED, CommandSettings, Settings

# The interface: how settings are read, and Config with the loss names (shared/settings.py) beside it.
__all__ = [
    "ENV_PREFIX",
    "IMPORTANCE_WEIGHTS",
    "LOSS_NAMES",
    "MAX_SAMPLE_BYTES",
    "Config",
    "ConfigError",
    "ImportanceWeight",
    "LossName",
    "add_arguments",
    "check_section",
    "deprecated",
    "env_name",
    "flag",
    "invalid_setting",
    "key_name",
    "load_toml",
    "main",
    "parse_args",
    "resolve",
    "resolve_section",
    "to_toml",
]

ENV_PREFIX = "CENTERLINE_"
S = TypeVar("S", bound=CommandSettings)
M = TypeVar("M", bound=Settings)


class ConfigError(ValueError):
    """A setting that cannot be honoured. The message names the flag, the value and the fix."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str, section: type[CommandSettings] | None = None) -> str:
    """``CENTERLINE_<KEY>`` for a shared field, ``CENTERLINE_<TABLE>_<KEY>`` for a command's."""
    return ENV_PREFIX + (f"{section.name}_" if section else "").upper() + name.upper()


def key_name(name: str, section: type[CommandSettings] | None = None) -> str:
    """The TOML key as a person writes it: ``loss``, ``trainer.max_grad_norm``."""
    return f"{section.name}.{name}" if section else name


def add_arguments(
    parser: argparse.ArgumentParser,
    section: type[CommandSettings] | None = None,
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
        for name, info in section.public_fields().items():
            if only is None or name in only:
                group.add_argument(flag(name), **_flag_kwargs(name, info, metavar=False))
        for old, name in section.renamed.items():
            if only is None or name in only:
                kwargs = _flag_kwargs(name, section.public_fields()[name], metavar=False)
                kwargs.update(action=_OldFlag, help=f"the old name of {flag(name)}, read for one release")
                group.add_argument(flag(old), **kwargs)
    if shared:
        group = parser.add_argument_group("centerline configuration (see docs/config.md)")
        for name, info in Config.public_fields().items():
            group.add_argument(flag(name), **_flag_kwargs(name, info, metavar=True))


class _OldFlag(argparse.Action):
    """The old flag of a renamed setting (``CommandSettings.renamed``): sets the setting, with a note."""

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
    flags = {k: v for k, v in given.items() if k in model.public_fields() and (only is None or k in only)}
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


class _Environment(PydanticBaseSettingsSource):
    """``env``'s variables as ``env_name`` spells them, in capitals exactly (the names the launcher
    strips from a service's environment), by each setting's public name; a list comma-separated.
    The values stay text, which the model validates as it would a file's."""

    def __init__(self, model: type[Settings], env: typing.Mapping[str, str], prefix: str):
        super().__init__(model)
        given = dict(env)
        for old, new in getattr(model, "renamed", {}).items():
            if prefix + old.upper() in given:
                deprecated(prefix + old.upper(), prefix + new.upper())
                given.setdefault(
                    prefix + new.upper(), given[prefix + old.upper()]
                )  # the new name wins where both are set
        self.values = {}
        for name, info in model.public_fields().items():
            if (value := given.get(prefix + name.upper())) is not None:
                # engine_urls, reward: a list is the only setting that is not one value
                self.values[name] = value.split(",") if _base_type(info.annotation) is list else value

    def get_field_value(self, field, field_name: str) -> tuple[object, str, bool]:
        return None, field_name, False  # __call__ reads every setting at once

    def __call__(self) -> dict[str, object]:
        return self.values


def invalid_setting(exc: ValidationError, section: type[CommandSettings] | None = None) -> ConfigError:
    """A model's refusal of a value, in the words of a flag: the flag, the value, the fix."""
    err = exc.errors()[0]
    if err["type"] == REFUSED:  # a validator's rule: the value as the rule saw it
        return _refused(err["ctx"], err["msg"])
    name = _setting_of(err["loc"], section)
    return ConfigError(
        f"{flag(name)} {err.get('input')!r}: {_fix(err)} (also settable as {env_name(name, section)} or "
        f"{key_name(name, section)} in the TOML file)"
    )


def _setting_of(loc: tuple, section: type[CommandSettings] | None) -> str:
    """The public name of the setting at ``loc``: ``("services", "engine_urls", 0)`` is ``engine_urls``
    of ``Config``'s group ``services``; a command's ``("reward", 0)`` is ``reward``."""
    if section is None and len(loc) > 1 and loc[0] in Config.model_fields:
        return str(loc[1])
    return str(loc[0]) if loc else "?"


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
    unknown = sorted(set(data) - set(Config.public_fields()) - set(SECTIONS))
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
            unknown += sorted(f"{table}.{k}" for k in set(data[table]) - set(cls.public_fields()))
    if unknown:
        raise ConfigError(f"--config {path}: unknown key(s) {unknown}; see docs/config.md for the settings")
    return data


def to_toml(cfg: Config, *sections: CommandSettings, tables: typing.Mapping[str, dict] | None = None) -> str:
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

"""The run spec: every setting of one `centerline up` run, composed once and written once.

``compose`` resolves the shared configuration and the table of every command the run starts
(``up``, ``trainer``, ``worker``, ``proxy``) from one source, flags > ``CENTERLINE_*`` environment >
TOML file > defaults (``up``'s flags are its own and the shared ones; the services' tables come
from the file and the environment). The launcher then fills in its launch settings (ports, NATS, the model and
dataset it prepared: ``centerline.up.launcher.with_launch_settings``) and writes it to ``RUN_DIR/config.toml`` with
every table; each service starts with ``--config RUN_DIR/config.toml`` and its identity only.

``derive`` makes a variant, every changed value checked as a flag would be: how
``centerline experiment`` and ``centerline bench pipeline`` run a grid of settings.
"""

from __future__ import annotations

import argparse
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from pydantic import BaseModel, ValidationError

from shared.config import (
    Config,
    check_section,
    env_name,
    invalid_setting,
    load_toml,
    resolve,
    resolve_section,
    to_toml,
    validate,
)
from shared.settings import SECTIONS, ProxySettings, Section, TrainerSettings, UpSettings, WorkerSettings

M = typing.TypeVar("M", bound=BaseModel)


def setting_variables() -> frozenset[str]:
    """Every ``CENTERLINE_*`` variable that sets a setting, shared or a command's (not the
    credentials' and keys' variables, which are no settings)."""
    names = {env_name(name) for name in Config.model_fields}
    names |= {env_name(name, cls) for cls in SECTIONS.values() for name in cls.model_fields}
    return frozenset(names)


@dataclass(frozen=True)
class RunSpec:
    """The shared settings and each started command's section, by its table name."""

    cfg: Config
    up: UpSettings
    trainer: TrainerSettings
    worker: WorkerSettings
    proxy: ProxySettings
    # other commands' tables of the file up read (probe, replay), written back as they were
    tables: typing.Mapping[str, dict] = field(default_factory=dict)

    @property
    def sections(self) -> tuple[Section, ...]:
        return tuple(getattr(self, f.name) for f in fields(self) if f.name in SECTIONS)

    def derive(self, **updates: dict) -> RunSpec:
        """A variant: ``cfg={...}`` and ``<table>={...}`` (``up``, ``trainer``...) name the fields
        they change. Each model is built again from its values, so a bad value raises
        ``ConfigError`` naming it, as a flag would."""
        unknown = set(updates) - {"cfg", *(s.name for s in self.sections)}
        if unknown:
            raise TypeError(f"RunSpec.derive: no section {sorted(unknown)}")
        cfg = validate(_rebuilt(self.cfg, updates.get("cfg", {})))
        sections = {s.name: check_section(_rebuilt(s, updates.get(s.name, {}), type(s)), cfg) for s in self.sections}
        return RunSpec(cfg=cfg, tables=self.tables, **sections)

    def to_toml(self) -> str:
        return to_toml(self.cfg, *self.sections, tables=self.tables)

    def write(self, path: Path) -> None:
        """``path`` atomically: services may be reading it."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_toml())
        os.replace(tmp, path)


def _rebuilt(model: M, update: typing.Mapping[str, object], section: type[Section] | None = None) -> M:
    try:
        return type(model)(**{**model.model_dump(), **update})
    except ValidationError as exc:
        raise invalid_setting(exc, section) from None


# The trainer settings `centerline up` takes as flags too (the rest: its [trainer] table).
UP_TRAINER_FLAGS = ("weight_update",)


def compose(
    args: argparse.Namespace,
    env: typing.Mapping[str, str] | None = None,
    defaults: typing.Mapping[str, object] | None = None,
) -> RunSpec:
    """The spec of `centerline up`'s flags ``args`` (``--config FILE`` among them) and ``env``
    (``os.environ`` when None). ``defaults``: shared settings' defaults of this job, which every
    source overrides (the file too). The services' tables take no flags here but ``UP_TRAINER_FLAGS``:
    `up`'s flags are its own (``--steps`` is ``up.steps``, which the launcher gives the trainer)."""
    env = os.environ if env is None else env
    read = load_toml(args.config) if "config" in vars(args) else {}
    cfg = resolve(args, env)
    unset = {
        k: v for k, v in (defaults or {}).items() if k not in vars(args) and env_name(k) not in env and k not in read
    }
    cfg = validate(_rebuilt(cfg, unset))
    spec = {UpSettings.name: resolve_section(UpSettings, args, env, cfg)}
    for section in (TrainerSettings, WorkerSettings, ProxySettings):
        flags = UP_TRAINER_FLAGS if section is TrainerSettings else ()
        spec[section.name] = resolve_section(section, args, env, cfg, only=flags)
    tables = {name: values for name, values in read.items() if name in SECTIONS and name not in spec}
    return RunSpec(cfg=cfg, tables=tables, **spec)


def load(path: Path) -> RunSpec:
    """The spec a run's ``config.toml`` holds, as its services read it (the file alone)."""
    return compose(argparse.Namespace(config=str(path)), env={})

"""The run spec: every setting of one `centerline up` run, composed once and written once;
the settings object that ``up``, ``centerline experiment`` and ``centerline bench pipeline`` take.

``parse`` reads `centerline up`'s flags: ``UpSettings`` (what is ``up``'s own: how many engines,
workers, NATS nodes and trainer ranks, the task, the model cache...), the shared settings and the
trainer's ``UP_TRAINER_FLAGS`` (``--steps``, ``--train-seconds``, ``--prompts-per-step``,
``--heldout-every``, ``--weight-update``, ``--weight-transport``: the fields marked ``UP_FLAG``),
which are the trainer's settings (table ``[trainer]``, variables ``CENTERLINE_TRAINER_*``). ``compose`` resolves the
shared configuration and the table of every command the run starts (``up``, ``trainer``,
``worker``, ``proxy``) from one source, flags > ``CENTERLINE_*`` environment > TOML file > a
job's defaults (``UP_DEFAULTS``: ``up`` trains 300 steps of 16 prompts where the trainer alone
defaults to 100 of 8) > the settings' own defaults; each model is built once from them and its
validators see the merged values. The launcher then fills in its launch settings (ports, NATS,
the model and dataset it prepared: ``with_launch_settings``, the fields marked ``LAUNCHED``) and writes the spec to
``RUN_DIR/config.toml`` with every table; each service starts with ``--config
RUN_DIR/config.toml`` and its identity only.

``derive`` makes a variant, every changed value checked as a flag would be: how
``centerline experiment`` and ``centerline bench pipeline`` run a grid of settings, each run a
``centerline up --config FILE`` of its variant.
"""

from __future__ import annotations

import argparse
import os
import tomllib
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path

from pydantic import BaseModel, ValidationError

from centerline.toy.dataset import CHAT_TASKS, TASK_DEFAULTS
from shared import config as shared_config
from shared.config import (
    Config,
    ConfigError,
    check_section,
    env_name,
    flag,
    invalid_setting,
    key_name,
    load_toml,
    resolve,
    resolve_section,
    to_toml,
)
from shared.settings import SECTIONS, CommandSettings, ProxySettings, TrainerSettings, UpSettings, WorkerSettings
from shared.settings_base import LAUNCHED, UP_FLAG

if typing.TYPE_CHECKING:
    from centerline.up.prepare import Prepared

M = typing.TypeVar("M", bound=BaseModel)


def setting_variables() -> frozenset[str]:
    """Every ``CENTERLINE_*`` variable that sets a setting, shared or a command's (not the
    credentials' and keys' variables, which are no settings)."""
    names = {env_name(name) for name in Config.public_fields()}
    names |= {env_name(name, cls) for cls in SECTIONS.values() for name in (*cls.public_fields(), *cls.renamed)}
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
    def sections(self) -> tuple[CommandSettings, ...]:
        return tuple(getattr(self, f.name) for f in fields(self) if f.name in SECTIONS)

    def derive(self, **updates: dict) -> RunSpec:
        """A variant: ``cfg={...}`` and ``<table>={...}`` (``up``, ``trainer``...) name the fields
        they change. Each model is built again from its values, so a bad value raises
        ``ConfigError`` naming it, as a flag would."""
        unknown = set(updates) - {"cfg", *(s.name for s in self.sections)}
        if unknown:
            raise TypeError(f"RunSpec.derive: no section {sorted(unknown)}")
        cfg = _rebuilt(self.cfg, updates.get("cfg", {}))
        sections = {s.name: check_section(_rebuilt(s, updates.get(s.name, {}), type(s)), cfg) for s in self.sections}
        return RunSpec(cfg=cfg, tables=self.tables, **sections)

    def to_toml(self) -> str:
        return to_toml(self.cfg, *self.sections, tables=self.tables)

    def write(self, path: Path) -> None:
        """``path`` atomically: services may be reading it."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(self.to_toml())
        os.replace(tmp, path)


def _rebuilt(model: M, update: typing.Mapping[str, object], section: type[CommandSettings] | None = None) -> M:
    try:
        return type(model)(**{**model.model_dump(), **update})
    except ValidationError as exc:
        raise invalid_setting(exc, section) from None


def marked(model: type[BaseModel], mark: dict[str, str]) -> tuple[str, ...]:
    """The fields of ``model`` whose ``json_schema_extra`` carries ``mark`` (``UP_FLAG``, ``LAUNCHED``:
    shared/settings_base.py), in the model's order."""
    return tuple(
        name
        for name, info in model.public_fields().items()
        if isinstance(info.json_schema_extra, dict) and mark.items() <= info.json_schema_extra.items()
    )


# The trainer settings `centerline up` takes as flags too (the rest: its [trainer] table), marked UP_FLAG.
UP_TRAINER_FLAGS = marked(TrainerSettings, UP_FLAG)
# Settings whose default differs for this job, by table ("cfg": the shared ones), chosen so that the
# default run learns on 2 CPU cores (centerline/up/launcher.py says why each).
UP_DEFAULTS = {
    "cfg": {"learning_rate": 3e-4, "rollout_n": 8, "rollout_max_new_tokens": 8},
    TrainerSettings.name: {"steps": 300, "prompts_per_step": 16},
}
# ... and for a run of sessions (``--environment``, or a multi-turn toy task): a session's replies
# share one advantage, so 3e-4 moved the policy too far on chain (docs/results.md, "Sessions: the chain runs").
SESSION_DEFAULTS = {"cfg": {"learning_rate": 1e-4}}
# Settings `up` once held itself and that are the trainer's, named in their new place when given in
# the old one (docs/config.md, `centerline up`)
MOVED_TO_TRAINER = ("steps", "prompts_per_step", "train_seconds", "eval_every")


def parse(
    argv: list[str],
    defaults: typing.Mapping[str, typing.Mapping[str, object]] | None = None,
    prog: str = "centerline up",
) -> RunSpec:
    """The run spec of `centerline up`'s flags ``argv``: ``UpSettings``, the shared settings and the
    trainer's ``UP_TRAINER_FLAGS``, over ``UP_DEFAULTS`` (``SESSION_DEFAULTS`` and the toy task's
    ``TASK_DEFAULTS`` too for a run of sessions), over which ``defaults`` (a job that runs ``up``:
    the bench, the experiment) sit. A bad setting exits 2 naming it."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="`centerline up`: the whole system on one machine, on a verifiable toy task or on your own.",
    )
    shared_config.add_arguments(parser, UpSettings)
    shared_config.add_arguments(
        parser,
        TrainerSettings,
        only=UP_TRAINER_FLAGS,
        shared=False,
        title="the trainer's settings up takes as flags, up's defaults "
        + ", ".join(f"{name} {value}" for name, value in UP_DEFAULTS[TrainerSettings.name].items())
        + " (the others: --config FILE's [trainer] table)",
    )
    args = parser.parse_args(argv)
    try:
        job = merged(UP_DEFAULTS, defaults or {})
        spec = compose(args, defaults=job)
        if trains_sessions(spec.up):
            toy = TASK_DEFAULTS.get(spec.up.task, {}) if spec.up.dataset is None else {}
            spec = compose(args, defaults=merged(UP_DEFAULTS, SESSION_DEFAULTS, {"cfg": toy}, defaults or {}))
        return spec
    except shared_config.ConfigError as exc:
        parser.exit(2, f"{parser.prog}: {exc}\n")


def merged(*defaults: typing.Mapping[str, typing.Mapping[str, object]]) -> dict[str, dict[str, object]]:
    """Job defaults by table, the later ones winning field by field."""
    out: dict[str, dict[str, object]] = {}
    for table in defaults:
        for name, values in table.items():
            out[name] = {**out.get(name, {}), **values}
    return out


def trains_sessions(up: UpSettings) -> bool:
    """Whether every task of the run is a session: ``--environment``, or a multi-turn toy task
    (a dataset's rows may name environments of their own; those runs keep ``UP_DEFAULTS``)."""
    return bool(up.environment) or (up.dataset is None and up.task in CHAT_TASKS)


def compose(
    args: argparse.Namespace,
    env: typing.Mapping[str, str] | None = None,
    defaults: typing.Mapping[str, typing.Mapping[str, object]] | None = None,
) -> RunSpec:
    """The spec of `centerline up`'s flags ``args`` (``--config FILE`` among them) and ``env``
    (``os.environ`` when None). ``defaults``: this job's defaults by table (``cfg``, ``trainer``...),
    which every source overrides (the file too). The services' tables take no flags here but
    ``UP_TRAINER_FLAGS``."""
    env = os.environ if env is None else env
    moved = [(f"up.{n} in {args.config}", n) for n in _moved_keys(args)]
    moved += [(env_name(n, UpSettings), n) for n in MOVED_TO_TRAINER if env_name(n, UpSettings) in env]
    if moved:
        where, name = moved[0]
        new = TrainerSettings.renamed.get(name, name)
        raise ConfigError(
            f"{where}: {name} is the trainer's setting; set {key_name(new, TrainerSettings)} in the TOML file, "
            f"{env_name(new, TrainerSettings)} or {flag(new)} (docs/config.md)"
        )
    read = load_toml(args.config) if "config" in vars(args) else {}
    defaults = defaults or {}
    cfg = resolve(args, env, defaults=defaults.get("cfg"))
    spec = {}
    for section in (UpSettings, TrainerSettings, WorkerSettings, ProxySettings):
        flags = None if section is UpSettings else UP_TRAINER_FLAGS if section is TrainerSettings else ()
        spec[section.name] = resolve_section(section, args, env, cfg, only=flags, defaults=defaults.get(section.name))
    tables = {name: values for name, values in read.items() if name in SECTIONS and name not in spec}
    return RunSpec(cfg=cfg, tables=tables, **spec)


def _moved_keys(args: argparse.Namespace) -> list[str]:
    """The keys of ``MOVED_TO_TRAINER`` in the ``[up]`` table of ``--config FILE``."""
    if "config" not in vars(args):
        return []
    try:
        table = tomllib.loads(Path(args.config).read_text()).get(UpSettings.name, {})
    except (OSError, tomllib.TOMLDecodeError):
        return []  # no file, or one ``load_toml`` refuses in its own words
    return [name for name in MOVED_TO_TRAINER if name in table]


def load(path: Path) -> RunSpec:
    """The spec a run's ``config.toml`` holds, as its services read it (the file alone)."""
    return compose(argparse.Namespace(config=str(path)), env={})


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
    the model and dataset ``prepare`` made, the run directory."""
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
            "run_dir": spec.up.run_dir,
            "heldout_dataset": task.heldout,
        },
        worker={"chat_template": task.chat_template},
        proxy={"upstream": router_url, "port": int(proxy_url.rsplit(":", 1)[1])},
    )


# The settings ``with_launch_settings`` fills in, marked LAUNCHED, by table ("": the shared ones): where a
# run ran, not what it is (``centerline experiment`` compares the rest).
LAUNCH_SETTINGS = {"": marked(Config, LAUNCHED)} | {
    cls.name: names for cls in SECTIONS.values() if (names := marked(cls, LAUNCHED))
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

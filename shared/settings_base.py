"""The base of every settings model: ``Settings``, ``CommandSettings`` (one command's), a
``SettingsGroup`` of the shared ``Config``, and ``refuse_if``.

A model is typed fields with a description each; simple bounds are field constraints, a rule
across fields the model's validator, a rule across a command's settings and the shared ones its
``check_with(cfg)``; each rule is one ``refuse_if``, whose refusal ``shared.config`` words as
``--<flag> <value>: <fix>``. The models: the shared ``Config`` of four groups (``shared/settings.py``) and one
``CommandSettings`` per command (``shared/trainer_settings.py``, ``worker_settings.py``,
``proxy_settings.py``, ``up_settings.py``); how they are read: ``shared/config.py``.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

# What `centerline up` does with a setting, said once on its field (``json_schema_extra``) and read by
# centerline/up/run_spec.py: its flags, and what it fills in as a run starts.
UP_FLAG = {"up": "flag"}  # a trainer setting `centerline up` takes as a flag too
LAUNCHED = {"up": "launched"}  # filled in by `centerline up` as it starts a run: where the run ran, not what it is

REFUSED = "setting_refused"  # the error type of ``refuse_if``, which shared.config.invalid_setting words


def refuse_if(failed: bool, name: str, value: object, fix: str) -> None:
    """Refuse ``value`` of field ``name`` when ``failed`` (in a validator, or ``CommandSettings.check_with``);
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
    def public_fields(cls) -> dict[str, FieldInfo]:
        """Each setting by its public name (its flag's, TOML key's and variable's), in order."""
        return dict(cls.model_fields)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource, **others
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


class SettingsGroup(BaseModel):
    """A group of the shared ``Config`` (``cfg.rollout``, ``cfg.loss``...), taken whole by the code
    that uses it. A field's alias is its public name, flat as users write it (``top_logprobs_num`` of
    ``rollout`` is ``rollout_top_logprobs_num``); a field without one is public by its own name. Built
    in code, a group takes either name."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )

    @classmethod
    def public_fields(cls) -> dict[str, FieldInfo]:
        """Each setting by its public name (its flag's, TOML key's and variable's), in order."""
        return {info.alias or name: info for name, info in cls.model_fields.items()}


class CommandSettings(Settings):
    """The settings of one command: flags of ``command``, TOML table ``[name]``, ``CENTERLINE_<NAME>_<KEY>``."""

    name: ClassVar[str]
    command: ClassVar[str]
    required: ClassVar[tuple[str, ...]] = ()
    # old name -> field, for one release: the old flag, TOML key and variable still set the field,
    # with a deprecation note (the held-out settings were once eval_*: docs/config.md)
    renamed: ClassVar[dict[str, str]] = {}

    def check_with(self, cfg) -> None:
        """The rules across this section and the shared ``cfg``, each a ``refuse_if``."""


def check_max_deliver(value: int) -> int:
    """JetStream's ``max_deliver`` of the trainer's and the worker's consumers: -1 or at least 1."""
    refuse_if(value != -1 and value < 1, "max_deliver", value, "must be at least 1, or -1 for no limit")
    return value

"""Write docs/config.md from the settings models (shared/settings.py), or check it is current.

python scripts/gen_config_docs.py          # rewrite docs/config.md
python scripts/gen_config_docs.py --check  # exit 1 if docs/config.md is stale (run by make test)
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from centerline import nats_users
from centerline.up import run_spec
from router_proxy import upstream
from shared import admin_key, nats_auth
from shared.config import ENV_PREFIX, Config, env_name, flag, key_name
from shared.settings import SECTIONS

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the models of `shared/settings.py` (each command's in its own module beside it) by",
        "`scripts/gen_config_docs.py`; do not edit by hand.",
        "",
        "Every setting is a flag, a key of the TOML file given with `--config FILE`, and an",
        "environment variable; flags win over the environment, the environment over the file, the",
        "file over the defaults. pydantic-settings merges the three (`shared/config.py`, `_build`):",
        "each model is a `BaseSettings` whose sources are the flags given, the variables spelled as",
        "below (in capitals exactly) and the file's keys or table; no `.env` file or secrets",
        "directory is read. `centerline config [--config FILE]` prints the resolved values, and every",
        "run directory holds them in `config.toml` (written by the trainer).",
        "",
        "## Shared settings",
        "",
        "Read by every service. TOML key: the field name at the top of the file (`rollout_n = 4`);",
        f"variable: `{ENV_PREFIX}<KEY>` (`{ENV_PREFIX}ROLLOUT_N`); a list is comma-separated there.",
        "In code they are the groups of `Config` (`shared/settings.py`), each taken whole by its users,",
        "a setting there by its field's name (its public one in brackets where that differs): "
        + "; ".join(f"`cfg.{field}`: {_in_code(info.annotation)}" for field, info in Config.model_fields.items())
        + ".",
        "",
        *table(Config, lambda name: f"`{flag(name)}`"),
    ]
    for cls in SECTIONS.values():
        first = cls.model_fields and next(iter(cls.model_fields))
        lines += [
            "",
            f"## `{cls.command}`",
            "",
            " ".join(cls.__doc__.split()).replace("``", "`"),
            f"TOML key: in the table `[{cls.name}]` (`{cls.name}.{first}`); variable:",
            f"`{env_name('<KEY>', cls)}` (`{env_name(first, cls)}`).",
            "",
            *table(cls, lambda name, cls=cls: f"`{flag(name)}`"),
        ]
        if cls.name == "up":
            taken = ", ".join(f"`{flag(name)}`" for name in run_spec.UP_TRAINER_FLAGS)
            job = ", ".join(
                f"`{key_name(name, SECTIONS[table]) if table in SECTIONS else name} = {value!r}`"
                for table, values in run_spec.UP_DEFAULTS.items()
                for name, value in values.items()
            )
            moved = ", ".join(f"`up.{name}`" for name in run_spec.MOVED_TO_TRAINER)
            lines += [
                "",
                f"`centerline up` takes the trainer's {taken} too (see `centerline trainer`); the trainer's",
                "other settings come from the `[trainer]` table of `--config FILE` or their variables.",
                f"`up`'s defaults differ from those above where a default run needs it: {job}",
                "(`centerline/up/run_spec.py`, `UP_DEFAULTS`); a flag, variable or file key still wins.",
                f"{moved} and their `CENTERLINE_UP_*` variables are the trainer's `trainer.*` and",
                "`CENTERLINE_TRAINER_*`: `up` refuses the old names, naming the new.",
            ]
    lines += [
        "",
        "## NATS credentials",
        "",
        "Not settings, since the resolved configuration is written beside every run and printed by",
        "`centerline config`: each service reads its NATS user and password from its environment only",
        "(`shared/nats_auth.py`; users and permissions in `docs/operations.md`, section Security).",
        "",
        "| variable | meaning |",
        "|---|---|",
        f"| `{nats_auth.USER_ENV}` | the user to log in as: {', '.join(nats_users.USERS)}; unset = no credentials |",
        f"| `{nats_auth.PASSWORD_ENV}` | its password |",
        f"| `{nats_auth.PASSWORD_FILE_ENV}` | a file holding its password (a mounted secret), instead of the above |",
        "",
        "## Engine keys",
        "",
        "Not settings either. The SGLang servers' admin endpoints (weight updates, cache flushes) need",
        "`Authorization: Bearer <key>` when the server has a key (SGLang's `--admin-api-key`): `centerline",
        "sglang` passes it to SGLang in a private `--config` file, never as a flag (`centerline/engine_key.py`),",
        "the trainer sends it. An SGLang router or server started with",
        "`--api-key` needs that key on every request: the proxy and `centerline probe` send their own",
        "(`shared/admin_key.py`; `docs/operations.md`, section Security).",
        "",
        "| variable | meaning |",
        "|---|---|",
        f"| `{admin_key.KEY_ENV}` | the admin key: `centerline sglang` gives it to SGLang in its `--config` file, the "
        "trainer sends it; unset = none |",
        f"| `{admin_key.KEY_FILE_ENV}` | a file holding the admin key (a mounted secret), instead of the above |",
        f"| `{upstream.UPSTREAM_KEY_ENV}` | the upstream's `--api-key`, sent by the proxy and the probe; unset = none "
        "|",
        f"| `{upstream.UPSTREAM_KEY_FILE_ENV}` | a file holding the upstream key, instead of the above |",
    ]
    return "\n".join(lines) + "\n"


def _in_code(group) -> str:
    """A group's fields as code reads them, each with its public name where that differs."""
    return ", ".join(
        f"`{name}`" if info.alias in (None, name) else f"`{name}` (`{info.alias}`)"
        for name, info in group.model_fields.items()
    )


def table(model, flag_text) -> list[str]:
    rows = ["| flag | type | default | meaning |", "|---|---|---|---|"]
    for name, info in model.public_fields().items():
        default = info.default_factory() if info.default_factory else info.default
        bounds = [f"{word} {getattr(m, attr)}" for m in info.metadata for attr, word in BOUNDS if hasattr(m, attr)]
        meaning = info.description + (f" Must be {' and '.join(bounds)}." if bounds else "")
        old = [o for o, n in getattr(model, "renamed", {}).items() if n == name]
        if old:  # CommandSettings.renamed: the old flag, key and variable still set it, with a deprecation note
            names = f"`{flag(old[0])}` (`{model.name}.{old[0]}`, `{env_name(old[0], model)}`)"
            meaning += f" Old name {names}, read for one release."
        default_text = "unset" if default is None else f"`{str(default) if isinstance(default, Path) else default!r}`"
        rows.append(f"| {flag_text(name)} | {type_text(info.annotation)} | {default_text} | {meaning} |")
    return rows


BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def type_text(kind) -> str:
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) is typing.Literal:
        return " \\| ".join(args)
    if args and typing.get_origin(kind) is not list:  # X | None
        return type_text(args[0])
    return getattr(kind, "__name__", str(kind))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if docs/config.md is not current")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is stale: run `python scripts/gen_config_docs.py`", file=sys.stderr)
            return 1
        print(f"{DOC.name} is current")
        return 0
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

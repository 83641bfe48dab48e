"""Write docs/config.md from the config schema (shared/config.py), or check it is current.

python scripts/gen_config_docs.py          # rewrite docs/config.md
python scripts/gen_config_docs.py --check  # exit 1 if docs/config.md is stale (run by make test)
"""

from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared import admin_key, nats_auth
from shared.config import ENV_PREFIX, Config, flag

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from `shared/config.py` by `scripts/gen_config_docs.py`; do not edit by hand.",
        "",
        "Every setting is a flag, a key of the TOML file given with `--config FILE`, and an",
        f"environment variable `{ENV_PREFIX}<KEY>`; flags win over the file, the file over the",
        "environment. `centerline config [flags]` prints the resolved values.",
        "",
        "| flag | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for name, info in Config.model_fields.items():
        default = info.default_factory() if info.default_factory else info.default
        kind = info.annotation
        if typing.get_origin(kind) is typing.Literal:
            kind_text = " \\| ".join(typing.get_args(kind))
        else:
            kind_text = getattr(kind, "__name__", str(kind))
        lines.append(f"| `{flag(name)}` | {kind_text} | `{default!r}` | {info.description} |")
    lines += [
        "",
        "## NATS credentials",
        "",
        "Not settings, since the resolved configuration is written beside every run and printed by",
        "`centerline config`: each service reads its NATS user and password from its environment only",
        "(`shared/nats_auth.py`; users and permissions in the README, section Security).",
        "",
        "| variable | meaning |",
        "|---|---|",
        f"| `{nats_auth.USER_ENV}` | the user to log in as: {', '.join(nats_auth.USERS)}; unset = no credentials |",
        f"| `{nats_auth.PASSWORD_ENV}` | its password |",
        f"| `{nats_auth.PASSWORD_FILE_ENV}` | a file holding its password (a mounted secret), instead of the above |",
        "",
        "## Engine keys",
        "",
        "Not settings either. The SGLang servers' admin endpoints (weight updates, cache flushes) need",
        "`Authorization: Bearer <key>` when the server has a key (SGLang's `--admin-api-key`): `centerline",
        "sglang` passes it to SGLang, the trainer sends it. An SGLang router or server started with",
        "`--api-key` needs that key on every request: the proxy and `centerline probe` send their own",
        "(`shared/admin_key.py`; README, section Security).",
        "",
        "| variable | meaning |",
        "|---|---|",
        f"| `{admin_key.KEY_ENV}` | the admin key: `centerline sglang` gives it to SGLang as `--admin-api-key`, the "
        "trainer sends it; unset = none |",
        f"| `{admin_key.KEY_FILE_ENV}` | a file holding the admin key (a mounted secret), instead of the above |",
        f"| `{admin_key.UPSTREAM_KEY_ENV}` | the upstream's `--api-key`, sent by the proxy and the probe; unset = none "
        "|",
        f"| `{admin_key.UPSTREAM_KEY_FILE_ENV}` | a file holding the upstream key, instead of the above |",
    ]
    return "\n".join(lines) + "\n"


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

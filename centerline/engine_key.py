"""How the engines' admin key (``shared/admin_key.py``) reaches SGLang without a command line.

SGLang 0.5.23 takes ``--admin-api-key`` as a flag, or from the YAML file ``--config FILE`` names,
which it merges into its arguments inside the process (``prepare_server_args``,
``sglang/srt/utils/server_args_config_parser.py``): a flag shows in ``/proc/PID/cmdline`` and in
``ps`` to every process of the machine, the file does not. So the key travels as the one-line
file ``admin-api-key: "<key>"`` (a JSON string, which YAML reads as written: a bare ``0x10``,
``yes`` or ``null`` would not stay text):

- ``centerline sglang`` writes it into a private temporary directory (``private_config``), passes
  ``--config`` and removes it once the server answers HTTP, which it does only after reading it
  (``forget_once_read``);
- ``centerline engine-key DIR`` (compose's one-shot) writes a random key, ``DIR/admin-api-key``,
  for the trainer and ``centerline sglang``, and ``DIR/sglang-admin.yaml`` from it, for the
  official SGLang image, which has no centerline (deploy/compose-gpu.yml).

What the file does not change: SGLang still reports the key to whoever reaches its port
(``/server_info``: ``admin_api_key`` and ``launch_command``) and logs it at start (its
``server_args=`` line), which is why only the trainer and the router reach an engine
(docs/design.md section 11).

    centerline engine-key /credentials   # keeps an existing key; rewrites the YAML from it
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from shared import admin_key

KEY_FILE = "admin-api-key"  # the key alone (CENTERLINE_ENGINE_ADMIN_API_KEY_FILE)
CONFIG_FILE = "sglang-admin.yaml"  # the key as SGLang's --config file
MAKE_ONE = "python -c 'import secrets; print(secrets.token_hex(32))'"


def new_key() -> str:
    """A random admin key: 256 bits as hex, which never begins with "-"."""
    return secrets.token_hex(32)


def sglang_config(key: str) -> str:
    """The YAML that gives SGLang ``key`` as its ``--admin-api-key``. Raises ``AdminKeyError``
    for a key that SGLang would read back as a flag (it turns the file into ``--admin-api-key
    <key>``, two arguments, and argparse takes one beginning with "-" for an option)."""
    if key.startswith("-"):
        raise admin_key.AdminKeyError(
            f"the engines' admin key ({admin_key.KEY_ENV} or the file {admin_key.KEY_FILE_ENV} names) begins "
            f'with "-", which SGLang reads back from its --config file as a flag; make a new one: {MAKE_ONE}'
        )
    return f"admin-api-key: {json.dumps(key)}\n"


def _write_private(path: Path, text: str) -> None:
    """``path`` whole or absent, owner-only (mode 600) from its first byte."""
    partial = path.with_name(path.name + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    partial.replace(path)


def private_config(key: str) -> Path:
    """``sglang_config(key)`` in a new directory only this user may enter; remove both with
    ``forget``."""
    text = sglang_config(key)
    directory = Path(tempfile.mkdtemp(prefix="centerline-sglang-"))  # mode 700
    path = directory / CONFIG_FILE
    _write_private(path, text)
    return path


def forget(config: Path) -> None:
    shutil.rmtree(config.parent, ignore_errors=True)


def answers(url: str) -> bool:
    """Whether anything answers HTTP at ``url``/health (any status: 503 while starting counts)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=5):
            return True
    except urllib.error.HTTPError:
        return True
    except (OSError, ValueError):
        return False


def forget_once_read(url: str, config: Path, server_pid: int, poll: float = 0.2) -> None:
    """Remove ``config`` once the server at ``url`` answers (it read its arguments before it
    listened) or once the process ``server_pid`` is gone, whichever comes first."""
    while os.getppid() == server_pid and not answers(url):
        time.sleep(poll)  # polling interval of the server's port
    forget(config)


def write_key_files(directory: Path) -> dict[str, str]:
    """``directory/admin-api-key`` (a new random key, unless one is there) and
    ``directory/sglang-admin.yaml`` (rewritten from that key), both mode 600."""
    directory.mkdir(parents=True, exist_ok=True)
    key_path = directory / KEY_FILE
    made = not key_path.exists()
    if made:
        _write_private(key_path, new_key())
    key = key_path.read_text().rstrip("\n")
    if not key:
        raise admin_key.AdminKeyError(f"{key_path}: the key file is empty; delete it to make a new key")
    _write_private(directory / CONFIG_FILE, sglang_config(key))
    return {"key": str(key_path), "config": str(directory / CONFIG_FILE), "new_key": made}


def main(argv: list[str]) -> int:
    """``centerline engine-key DIR``: the engines' admin key for compose, and SGLang's --config file of it."""
    parser = argparse.ArgumentParser(
        prog="centerline engine-key",
        description=main.__doc__,
        epilog=f"An existing {KEY_FILE} is kept; delete it to rotate the key.",
    )
    parser.add_argument("dir", type=Path, help=f"where to write {KEY_FILE} and {CONFIG_FILE}")
    args = parser.parse_args(argv)
    try:
        print(json.dumps(write_key_files(args.dir)))
    except admin_key.AdminKeyError as exc:
        parser.error(str(exc))
    return 0

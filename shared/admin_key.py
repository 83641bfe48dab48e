"""The engines' admin key: who may load weights into an engine or flush its cache.

As SGLang's ``--admin-api-key`` (0.5.23, ``sglang/srt/utils/auth.py``): with a key set, an
admin endpoint answers 401 ``{"error": "Unauthorized"}`` unless the request carries
``Authorization: Bearer <key>``; health, readiness and metrics never need it
(``tests/sglang/test_admin_key.py``). ``centerline sglang`` passes the key to SGLang in a
private ``--config`` file, never on a command line (``centerline/engine_key.py``); the trainer,
the one client of those endpoints, sends the key (``trainer_service/weights.py``); the proxy
refuses admin paths and never forwards an ``Authorization`` header (``router_proxy/server.py``,
docs/design.md section 7).

A secret, so not a ``shared.config`` setting (the resolved configuration is written beside
every run and printed by ``centerline config``, and flags show in ``ps``): engine and trainer
read it from ``CENTERLINE_ENGINE_ADMIN_API_KEY``, or from the file named by
``CENTERLINE_ENGINE_ADMIN_API_KEY_FILE`` (a mounted secret). ``centerline up`` makes one per
run and gives it to the engine and the trainer only (``centerline/engine_key.py``: ``new_key``).
The proxy's upstream API key is read the same way (``router_proxy/upstream.py``).
"""

from __future__ import annotations

import os
import typing

KEY_ENV = "CENTERLINE_ENGINE_ADMIN_API_KEY"
KEY_FILE_ENV = "CENTERLINE_ENGINE_ADMIN_API_KEY_FILE"


class AdminKeyError(RuntimeError):
    """An admin key that is contradictory, unreadable or refused; the message names the setting and the fix."""


def key_from_env(
    env: typing.Mapping[str, str] | None = None, *, variable: str = KEY_ENV, file_variable: str = KEY_FILE_ENV
) -> str | None:
    """The key from ``variable`` or the file ``file_variable`` names (trailing newline dropped);
    None when neither is set (an empty value counts as unset). The defaults are the admin key's."""
    env = os.environ if env is None else env
    key, path = env.get(variable) or None, env.get(file_variable) or None
    if key is not None and path is not None:
        raise AdminKeyError(f"both {variable} and {file_variable} are set: keep one")
    if path is not None:
        try:
            with open(path) as f:
                key = f.read().rstrip("\n")
        except OSError as exc:
            raise AdminKeyError(f"{file_variable}={path}: cannot read the key file ({exc.strerror})") from None
        if not key:
            raise AdminKeyError(f"{file_variable}={path}: the key file is empty")
    return key

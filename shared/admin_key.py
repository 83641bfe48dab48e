"""The engines' admin key: who may load weights into an engine or flush its cache.

As SGLang's ``--admin-api-key`` (0.5.23, ``sglang/srt/utils/auth.py``): with a key set, an
admin endpoint answers 401 ``{"error": "Unauthorized"}`` unless the request carries
``Authorization: Bearer <key>``; health, readiness and metrics never need it
(``tests/sglang/test_admin_key.py``). ``centerline sglang`` passes the key to SGLang; the trainer, the one client of
those endpoints,
sends the key (``trainer_service/weights.py``); the proxy refuses admin paths and never
forwards an ``Authorization`` header (``router_proxy/server.py``, docs/design.md section 7).

The same holds for the upstream API key (``upstream_key_from_env``): an SGLang router or
server started with ``--api-key`` answers 401 to every request without it, so the proxy and
``centerline probe`` send their own, from ``CENTERLINE_UPSTREAM_API_KEY`` or the file
``CENTERLINE_UPSTREAM_API_KEY_FILE`` names, and never forward a client's.

A secret, so not a ``shared.config`` setting (the resolved configuration is written beside
every run and printed by ``centerline config``, and flags show in ``ps``): engine and trainer
read it from ``CENTERLINE_ENGINE_ADMIN_API_KEY``, or from the file named by
``CENTERLINE_ENGINE_ADMIN_API_KEY_FILE`` (a mounted secret). ``centerline up`` makes one per
run and gives it to the engine and the trainer only.
"""

from __future__ import annotations

import os
import secrets
import typing

KEY_ENV = "CENTERLINE_ENGINE_ADMIN_API_KEY"
KEY_FILE_ENV = "CENTERLINE_ENGINE_ADMIN_API_KEY_FILE"
VARIABLES = (KEY_ENV, KEY_FILE_ENV)
UPSTREAM_KEY_ENV = "CENTERLINE_UPSTREAM_API_KEY"
UPSTREAM_KEY_FILE_ENV = "CENTERLINE_UPSTREAM_API_KEY_FILE"


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


def upstream_key_from_env(env: typing.Mapping[str, str] | None = None) -> str | None:
    """The API key the proxy and the probe send to their upstream (an SGLang router or server
    started with ``--api-key``): ``CENTERLINE_UPSTREAM_API_KEY`` or the file
    ``CENTERLINE_UPSTREAM_API_KEY_FILE`` names. The proxy's own, never a client's."""
    key = key_from_env(env, variable=UPSTREAM_KEY_ENV, file_variable=UPSTREAM_KEY_FILE_ENV)
    if key is not None and not all(33 <= ord(c) < 127 for c in key):  # it goes into an HTTP header line as it is
        raise AdminKeyError(
            f"{UPSTREAM_KEY_ENV}: the key holds whitespace, control or non-ASCII characters; use printable ASCII"
        )
    return key


def new_key() -> str:
    """A random key (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)

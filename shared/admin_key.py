"""The engines' admin key: who may load weights into an engine or flush its cache.

As SGLang's ``--admin-api-key`` (0.5.23, ``sglang/srt/utils/auth.py``): with a key set, an
admin endpoint answers 401 ``{"error": "Unauthorized"}`` unless the request carries
``Authorization: Bearer <key>``; health, readiness and metrics never need it. The embedded
engine does the same (``engine/server.py``); the trainer, the one client of those endpoints,
sends the key (``trainer_service/weights.py``); the proxy refuses admin paths and never
forwards an ``Authorization`` header (``router_proxy/server.py``, DESIGN section 7).

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


class AdminKeyError(RuntimeError):
    """An admin key that is contradictory, unreadable or refused; the message names the setting and the fix."""


def key_from_env(env: typing.Mapping[str, str] | None = None) -> str | None:
    """The key from ``CENTERLINE_ENGINE_ADMIN_API_KEY`` or the file ``CENTERLINE_ENGINE_ADMIN_API_KEY_FILE``
    names (trailing newline dropped); None when neither is set (an empty value counts as unset)."""
    env = os.environ if env is None else env
    key, path = env.get(KEY_ENV) or None, env.get(KEY_FILE_ENV) or None
    if key is not None and path is not None:
        raise AdminKeyError(f"both {KEY_ENV} and {KEY_FILE_ENV} are set: keep one")
    if path is not None:
        try:
            with open(path) as f:
                key = f.read().rstrip("\n")
        except OSError as exc:
            raise AdminKeyError(f"{KEY_FILE_ENV}={path}: cannot read the admin key file ({exc.strerror})") from None
        if not key:
            raise AdminKeyError(f"{KEY_FILE_ENV}={path}: the admin key file is empty")
    return key


def new_key() -> str:
    """A random key (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def authorized(header: str | None, key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <key>`` (scheme in any case), compared in
    constant time; as bytes, so a non-ASCII header is a refusal rather than compare_digest's TypeError."""
    scheme, _, token = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(token.encode("utf-8", "surrogateescape"), key.encode("utf-8"))

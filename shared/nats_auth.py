"""A service's NATS credentials: its user and password from the environment, and how it logs in.

A service reads its own user and password from ``CENTERLINE_NATS_USER`` and
``CENTERLINE_NATS_PASSWORD`` (or ``CENTERLINE_NATS_PASSWORD_FILE``), never from
``shared.config``: the resolved configuration is written beside every run and printed by
``centerline config``, and flags show in ``ps``. A user's inbox is ``_INBOX_<user>.>``
(``shared.nats_client.connect`` sets nats-py's ``inbox_prefix``), the only subjects it may
subscribe to; the server holds user ``<user>``'s password as ``CENTERLINE_NATS_<USER>_PASSWORD``.

Not here: the users and their permissions, the server's accounts block and the passwords made
for it (``centerline/nats_users.py``).
"""

from __future__ import annotations

import os
import typing
from pathlib import Path

USER_ENV = "CENTERLINE_NATS_USER"
PASSWORD_ENV = "CENTERLINE_NATS_PASSWORD"
PASSWORD_FILE_ENV = "CENTERLINE_NATS_PASSWORD_FILE"


class CredentialsError(RuntimeError):
    """NATS credentials that are missing, contradictory or refused; the message says which and the fix."""


def password_variable(user: str) -> str:
    """The server-side variable holding ``user``'s password: ``CENTERLINE_NATS_WORKER_PASSWORD``."""
    return f"CENTERLINE_NATS_{user.upper()}_PASSWORD"


def inbox_prefix(user: str) -> str:
    return f"_INBOX_{user}"


def credentials_from_env(env: typing.Mapping[str, str] | None = None) -> tuple[str | None, str | None]:
    """``(user, password)`` from ``CENTERLINE_NATS_USER`` and ``CENTERLINE_NATS_PASSWORD`` or
    ``CENTERLINE_NATS_PASSWORD_FILE`` (trailing newline dropped); ``(None, None)`` when no user is set."""
    env = os.environ if env is None else env
    user, password, path = (env.get(k) or None for k in (USER_ENV, PASSWORD_ENV, PASSWORD_FILE_ENV))  # empty = unset
    if password is not None and path is not None:
        raise CredentialsError(f"both {PASSWORD_ENV} and {PASSWORD_FILE_ENV} are set: keep one")
    if path is not None:
        try:
            password = Path(path).read_text().rstrip("\r\n")
        except OSError as exc:
            raise CredentialsError(
                f"{PASSWORD_FILE_ENV}={path}: cannot read the password file ({exc.strerror})"
            ) from None
    if user is None and password is not None:
        raise CredentialsError(f"a NATS password is set but no user: set {USER_ENV} (trainer, worker, proxy or admin)")
    if user is not None and not password:
        raise CredentialsError(f"{USER_ENV}={user} has no password: set {PASSWORD_ENV} or {PASSWORD_FILE_ENV}")
    return user, password


def redact(url: str) -> str:
    """``url`` without a password in its user part (``nats://u:secret@h`` -> ``nats://u:***@h``), for logs."""
    scheme, sep, rest = url.rpartition("://")
    userinfo, at, host = rest.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    return f"{scheme}{sep}{userinfo.split(':', 1)[0]}:***@{host}"

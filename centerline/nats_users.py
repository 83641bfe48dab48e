"""Who may do what on NATS: the centerline account, its users and their permissions, for the
servers centerline runs (``centerline/nats_server.py``) and deploys (``deploy/``).

One account, ``CENTERLINE`` (JetStream on), holds every centerline connection; ``SYS`` is the
system account. Each service connects as its own user and may touch only its own subjects:

| user | publishes | consumes (durable pull consumer) | stream admin |
|---|---|---|---|
| ``trainer`` | ``prompts.tasks``, ``weights.updated``, ``rollouts.dlq`` | ROLLOUTS via ``trainer`` | create, update,
info; purge ROLLOUTS |
| ``worker`` | ``rollouts.batches``, ``rollouts.dlq`` (contract failures) | PROMPTS via ``rollout_workers`` | info |
| ``proxy`` | ``audit.proxy`` (core publish) | none | info |
| ``admin`` | everything in the account: operator tools (``centerline record``/``replay``, the ``nats`` CLI), stream
provisioning, tests | | all |

Nobody but ``admin`` may delete a stream or purge one, but for the trainer, which purges the batches
it trained from ROLLOUTS to keep room under its byte cap (docs/design.md section 3), and no user but
``admin`` can see another's replies: a user's inbox is ``_INBOX_<user>.>`` (``shared.nats_auth.inbox_prefix``), the only
subjects it may subscribe to. JetStream delivers a fetch to the fetching user's inbox, so a
user reads a stream only through the one consumer it may fetch from (and create or update: the
worker and the trainer each set up their own).

Passwords never sit in a config file: the server config says ``$CENTERLINE_NATS_<USER>_PASSWORD``
and nats-server takes the value from its environment (``EmbeddedNats`` sets it for its child;
compose from ``centerline nats-credentials``' file; Kubernetes from a Secret). nats-server parses
such a value as a config value, so a password must start with a letter and contain only letters,
digits, ``-`` and ``_`` (what ``new_password`` makes); ``12MB`` or ``true`` would not be strings.
A service reads its own user and password from its environment (``shared/nats_auth.py``).

``accounts_config()`` is the one spelling of these permissions: the embedded server writes it,
and tests/deploy checks that deploy/nats/nats.conf and the Kubernetes ConfigMap carry it unchanged.

    centerline nats-credentials DIR   # random passwords for compose and Kubernetes (keeps existing ones)
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import string
import typing
from pathlib import Path

from shared import names
from shared.nats_auth import PASSWORD_ENV, PASSWORD_FILE_ENV, USER_ENV, inbox_prefix, password_variable

ACCOUNT = "CENTERLINE"
SYSTEM_ACCOUNT = "SYS"
USERS = ("admin", "trainer", "worker", "proxy")
SERVER_ENV_FILE = "nats.env"  # in a credentials directory: every user's password variable, for nats-server


def _consumer(stream: str, durable: str, filter_subject: str) -> list[str]:
    """JetStream API and ack subjects of one durable pull consumer: create or update it (the
    legacy durable form nats-py sends, and the 2.9+ named form), read its info, fetch, ack."""
    api = "$JS.API.CONSUMER"
    return [
        f"{api}.DURABLE.CREATE.{stream}.{durable}",
        f"{api}.CREATE.{stream}.{durable}",
        f"{api}.CREATE.{stream}.{durable}.{filter_subject}",
        f"{api}.INFO.{stream}.{durable}",
        f"{api}.MSG.NEXT.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",
    ]


STREAM_INFO = "$JS.API.STREAM.INFO.*"  # ensure_streams reads every stream's settings first


def permissions() -> dict[str, dict[str, list[str]]]:
    """``{user: {"publish": [...], "subscribe": [...]}}``: allow lists, everything else is denied.
    A JetStream publish is a request whose PubAck comes back to the user's inbox."""
    return {
        "admin": {"publish": [">"], "subscribe": [">"]},
        "trainer": {
            "publish": [
                names.PROMPTS_SUBJECT,
                names.WEIGHTS_SUBJECT,
                names.DLQ_SUBJECT,
                STREAM_INFO,
                "$JS.API.STREAM.CREATE.*",
                "$JS.API.STREAM.UPDATE.*",
                # trained batches purged to make room in ROLLOUTS (trainer_service/store.py); updating a
                # stream's limits could delete as much
                f"$JS.API.STREAM.PURGE.{names.ROLLOUTS_STREAM}",
                *_consumer(names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER, names.ROLLOUTS_SUBJECT),
            ],
            "subscribe": [inbox_prefix("trainer") + ".>"],
        },
        "worker": {
            "publish": [
                names.ROLLOUTS_SUBJECT,
                names.DLQ_SUBJECT,
                STREAM_INFO,
                *_consumer(names.PROMPTS_STREAM, names.WORKERS_CONSUMER, names.PROMPTS_SUBJECT),
            ],
            "subscribe": [inbox_prefix("worker") + ".>"],
        },
        "proxy": {"publish": [names.AUDIT_SUBJECT, STREAM_INFO], "subscribe": [inbox_prefix("proxy") + ".>"]},
    }


def accounts_config() -> str:
    """The ``accounts`` and ``system_account`` blocks of a nats-server config, passwords as
    ``$CENTERLINE_NATS_<USER>_PASSWORD`` references. Identical in every deployment."""
    q = json.dumps  # a quoted subject is literal: "$JS..." is no variable, ">" no syntax
    lines = [
        "# centerline's users and what each may do: rendered by centerline/nats_users.py, which tests compare",
        "# this block with. Passwords come from nats-server's environment (CENTERLINE_NATS_<USER>_PASSWORD).",
        "accounts {",
        f"  {ACCOUNT} {{",
        "    jetstream: enabled",
        "    users: [",
    ]
    for user, perms in permissions().items():
        lines.append(f"      {{user: {user}, password: ${password_variable(user)}, permissions: {{")
        for action in ("publish", "subscribe"):
            if len(perms[action]) == 1:
                lines.append(f"        {action}: [{q(perms[action][0])}]")
            else:
                lines += [
                    f"        {action}: [",
                    *(f"          {q(subject)}" for subject in perms[action]),
                    "        ]",
                ]
        lines.append("      }}")
    lines += [
        "    ]",
        "  }",
        f"  {SYSTEM_ACCOUNT} {{}}  # the server's own account; add a user here for `nats server` commands",
        "}",
        f"system_account: {SYSTEM_ACCOUNT}",
    ]
    return "\n".join(lines) + "\n"


def new_password() -> str:
    """A random password nats-server reads back unchanged from its environment: a letter, then 32 URL-safe
    characters."""
    return secrets.choice(string.ascii_letters) + secrets.token_urlsafe(24)


def new_passwords() -> dict[str, str]:
    return {user: new_password() for user in USERS}


def server_env(passwords: typing.Mapping[str, str]) -> dict[str, str]:
    """The variables nats-server resolves ``accounts_config``'s password references from."""
    return {password_variable(user): passwords[user] for user in USERS}


def client_env(user: str, password: str) -> dict[str, str]:
    """The environment that makes ``shared.nats_client.connect`` log in as ``user``."""
    return {USER_ENV: user, PASSWORD_ENV: password}


def is_secret_variable(name: str) -> bool:
    """Whether an environment variable carries NATS credentials (a service must get only its own)."""
    return name in (USER_ENV, PASSWORD_ENV, PASSWORD_FILE_ENV) or name in {password_variable(u) for u in USERS}


def write_credentials(directory: Path) -> dict[str, list[str]]:
    """Give every user a password in ``directory``, keeping those already there.

    Writes ``<user>/password`` (one directory per user, so a container can mount only its own)
    and ``nats.env`` (``CENTERLINE_NATS_<USER>_PASSWORD=...`` lines, for nats-server), owner-only.
    """
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    outcome: dict[str, list[str]] = {"created": [], "kept": []}
    passwords = {}
    for user in USERS:
        path = directory / user / "password"
        if path.exists():
            passwords[user] = path.read_text().rstrip("\r\n")
            outcome["kept"].append(user)
            continue
        path.parent.mkdir(mode=0o700, exist_ok=True)
        passwords[user] = new_password()
        _write_private(path, passwords[user])
        outcome["created"].append(user)
    _write_private(directory / SERVER_ENV_FILE, "".join(f"{k}={v}\n" for k, v in server_env(passwords).items()))
    return outcome


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def main(argv: list[str]) -> int:
    """``centerline nats-credentials DIR``: random NATS passwords for compose and Kubernetes."""
    parser = argparse.ArgumentParser(
        prog="centerline nats-credentials",
        description=main.__doc__,
        epilog="Existing passwords are kept; delete a user's directory to rotate it.",
    )
    parser.add_argument("dir", type=Path, help="credentials directory: <user>/password and nats.env")
    args = parser.parse_args(argv)
    print(json.dumps({"dir": str(args.dir), **write_credentials(args.dir)}))
    return 0

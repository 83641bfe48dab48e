"""NATS users and permissions (centerline/nats_users.py) against a real nats-server: each service's
user can do its job and nothing else; refused credentials fail at once with the fix named.

nats-server drops a publish the user's permissions refuse and reports it to the client
asynchronously (nats-py lower-cases the text), at times after answering a later PING: so a
test waits, with a deadline, for the number of reports it expects, and ``nc.flush()`` is no
sync point for them.
"""

import asyncio
import json
import os
import re
import signal
import stat
import subprocess
import sys

import nats
import pytest
from nats.js.api import StreamConfig

from centerline import nats_users
from centerline.nats_server import EmbeddedNats, provision
from centerline.synth import make_batch
from rollout_worker.publish import publish_batch
from shared import names, nats_auth
from shared.nats_auth import CredentialsError
from shared.nats_client import connect, pull_consumer
from shared.streams import StreamConfigError, ensure_streams, stream_configs

STREAMS = {c.name for c in stream_configs()}


def violation(action: str, subject: str) -> str:
    return f'nats: permissions violation for {action} to "{subject.lower()}"'


@pytest.fixture
def secure(tmp_path):
    """An embedded nats-server with centerline's users, the streams created as admin."""
    server = EmbeddedNats(tmp_path / "nats", passwords=nats_users.new_passwords()).start()
    asyncio.run(provision(server.url, **server.credentials("admin")))
    yield server
    server.stop()


class Session:
    """One user's connection and the asynchronous errors the server reported to it."""

    def __init__(self, server: EmbeddedNats, user: str):
        self.server, self.user, self.errors = server, user, []
        self.arrived = asyncio.Event()

    async def __aenter__(self):
        async def record(exc):
            self.errors.append(str(exc))
            self.arrived.set()

        self.nc = await connect(
            self.server.url, name=f"test-{self.user}", error_cb=record, **self.server.credentials(self.user)
        )
        self.js = self.nc.jetstream(timeout=1.0)  # a refused request is never answered: fail fast
        return self

    async def __aexit__(self, *exc):
        await self.nc.close()

    async def reported(self, count: int) -> list[str]:
        """The errors reported so far, once there are ``count`` of them (5 s deadline)."""

        async def enough():
            while len(self.errors) < count:
                await self.arrived.wait()
                self.arrived.clear()

        await asyncio.wait_for(enough(), 5)
        return self.errors


async def messages(server: EmbeddedNats, stream: str) -> int:
    async with Session(server, "admin") as admin:
        return (await admin.js.stream_info(stream)).state.messages


# ---------------------------------------------------------------------------- worker


@pytest.mark.integration
def test_a_worker_cannot_publish_weights_updated(secure):
    async def body():
        async with Session(secure, "worker") as worker:
            with pytest.raises(nats.errors.TimeoutError):  # no PubAck: the server dropped it
                await worker.js.publish(names.WEIGHTS_SUBJECT, b'{"version": 99}')
            assert await worker.reported(1) == [violation("publish", names.WEIGHTS_SUBJECT)]
        assert await messages(secure, names.WEIGHTS_STREAM) == 0

    asyncio.run(body())


@pytest.mark.integration
def test_a_worker_cannot_publish_audit_events_or_prompt_tasks(secure):
    async def body():
        async with Session(secure, "worker") as worker:
            await worker.nc.publish(names.AUDIT_SUBJECT, b"{}")
            await worker.nc.publish(names.PROMPTS_SUBJECT, b"{}")
            assert await worker.reported(2) == [
                violation("publish", names.AUDIT_SUBJECT),
                violation("publish", names.PROMPTS_SUBJECT),
            ]
        assert [await messages(secure, s) for s in (names.AUDIT_STREAM, names.PROMPTS_STREAM)] == [0, 0]

    asyncio.run(body())


@pytest.mark.integration
def test_a_worker_cannot_create_or_delete_a_stream(secure):
    async def body():
        async with Session(secure, "worker") as worker:
            with pytest.raises(nats.errors.TimeoutError):
                await worker.js.add_stream(StreamConfig(name="EXTRA", subjects=["extra"]))
            with pytest.raises(nats.errors.TimeoutError):
                await worker.js.delete_stream(names.ROLLOUTS_STREAM)
            assert await worker.reported(2) == [
                violation("publish", "$JS.API.STREAM.CREATE.EXTRA"),
                violation("publish", f"$JS.API.STREAM.DELETE.{names.ROLLOUTS_STREAM}"),
            ]
        async with Session(secure, "admin") as admin:
            assert {s.config.name for s in await admin.js.streams_info()} == STREAMS

    asyncio.run(body())


@pytest.mark.integration
def test_a_worker_on_a_server_without_streams_is_told_who_creates_them(tmp_path):
    with EmbeddedNats(tmp_path / "nats", passwords=nats_users.new_passwords()) as server:

        async def body():
            async with Session(server, "worker") as worker:
                with pytest.raises(
                    StreamConfigError,
                    match=r"^stream PROMPTS does not exist and the request to create it "
                    r"got no answer: this NATS user is probably not allowed to manage streams",
                ):
                    await ensure_streams(worker.js)

        asyncio.run(body())


@pytest.mark.integration
def test_a_worker_cannot_take_from_the_trainers_consumer_or_listen_to_batches(secure):
    async def body():
        async with Session(secure, "worker") as worker:
            with pytest.raises(nats.errors.TimeoutError):
                await pull_consumer(worker.js, names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER)
            await worker.nc.subscribe(names.ROLLOUTS_SUBJECT)
            await worker.nc.subscribe("_INBOX.>")  # another user's replies
            assert await worker.reported(3) == [
                violation(
                    "publish", f"$JS.API.CONSUMER.DURABLE.CREATE.{names.ROLLOUTS_STREAM}.{names.TRAINER_CONSUMER}"
                ),
                violation("subscription", names.ROLLOUTS_SUBJECT),
                violation("subscription", "_INBOX.>"),
            ]

    asyncio.run(body())


@pytest.mark.integration
def test_a_worker_takes_acks_and_naks_prompt_tasks_and_publishes_batches(secure):
    async def body():
        async with Session(secure, "trainer") as trainer:
            for i in range(2):
                await trainer.js.publish(
                    names.PROMPTS_SUBJECT, f"task-{i}".encode(), headers={names.MSG_ID_HEADER: f"t-{i}"}
                )
        async with Session(secure, "worker") as worker:
            assert set((await ensure_streams(worker.js)).values()) == {"unchanged"}
            consumer = await pull_consumer(
                worker.js, names.PROMPTS_STREAM, names.WORKERS_CONSUMER, filter_subject=names.PROMPTS_SUBJECT
            )
            first, second = await consumer.fetch(2, timeout=5)
            await consumer.in_progress(first)
            await consumer.ack(first)
            await consumer.nak(second)
            [again] = await consumer.fetch(1, timeout=5)
            assert (again.data, again.metadata.num_delivered) == (b"task-1", 2)
            await consumer.ack(again)
            batch = make_batch(samples=2, tokens_per_sample=4, k=8, vocab_size=64, batch_id="b-1")
            [ack] = await publish_batch(worker.js, batch, max_payload=worker.nc.max_payload)
            assert (ack.stream, ack.seq) == (names.ROLLOUTS_STREAM, 1)
            await worker.js.publish(names.DLQ_SUBJECT, b"rejected batch")  # contract failures go to the DLQ
            assert worker.nc.new_inbox().startswith("_INBOX_worker.")
            assert worker.errors == []  # every step above was acknowledged: a refused one would have timed out
        assert [await messages(secure, s) for s in (names.PROMPTS_STREAM, names.ROLLOUTS_STREAM, names.DLQ_STREAM)] == [
            0,
            1,
            1,
        ]

    asyncio.run(body())


# ---------------------------------------------------------------------------- proxy and trainer


@pytest.mark.integration
def test_the_proxy_publishes_audit_events_and_nothing_else(secure):
    async def body():
        async with Session(secure, "proxy") as proxy:
            assert set((await ensure_streams(proxy.js)).values()) == {"unchanged"}
            await proxy.nc.publish(names.AUDIT_SUBJECT, b'{"verdict": "complete"}')
            for subject in (names.ROLLOUTS_SUBJECT, names.WEIGHTS_SUBJECT, names.PROMPTS_SUBJECT, names.DLQ_SUBJECT):
                await proxy.nc.publish(subject, b"{}")
            assert await proxy.reported(4) == [
                violation("publish", s)
                for s in (names.ROLLOUTS_SUBJECT, names.WEIGHTS_SUBJECT, names.PROMPTS_SUBJECT, names.DLQ_SUBJECT)
            ]
        async with Session(secure, "admin") as admin:
            audit = await pull_consumer(admin.js, names.AUDIT_STREAM, "test-reader")
            [event] = await audit.fetch(1, timeout=5)  # waits until JetStream stored it
            assert event.data == b'{"verdict": "complete"}'
        assert [
            await messages(secure, s)
            for s in (names.ROLLOUTS_STREAM, names.WEIGHTS_STREAM, names.PROMPTS_STREAM, names.DLQ_STREAM)
        ] == [0, 0, 0, 0]

    asyncio.run(body())


@pytest.mark.integration
def test_the_trainer_creates_the_streams_drives_tasks_consumes_batches_and_publishes_weights(tmp_path):
    with EmbeddedNats(tmp_path / "nats", passwords=nats_users.new_passwords()) as server:

        async def body():
            async with Session(server, "trainer") as trainer:
                assert set((await ensure_streams(trainer.js)).values()) == {"created"}
                consumer = await pull_consumer(
                    trainer.js, names.ROLLOUTS_STREAM, names.TRAINER_CONSUMER, filter_subject=names.ROLLOUTS_SUBJECT
                )
                await trainer.js.publish(names.PROMPTS_SUBJECT, b"task", headers={names.MSG_ID_HEADER: "t-0"})
                async with Session(server, "worker") as worker:
                    await worker.js.publish(names.ROLLOUTS_SUBJECT, b"batch", headers={names.MSG_ID_HEADER: "b-0"})
                [batch] = await consumer.fetch(1, timeout=5)
                await consumer.in_progress(batch)
                await consumer.ack(batch)
                await trainer.js.publish(names.WEIGHTS_SUBJECT, b'{"version": 1}')
                await trainer.js.publish(names.DLQ_SUBJECT, b"batch", headers={"Centerline-Reason": "stale"})
                with pytest.raises(nats.errors.TimeoutError):
                    await trainer.js.delete_stream(names.ROLLOUTS_STREAM)  # managing is not deleting
                assert await trainer.reported(1) == [
                    violation("publish", f"$JS.API.STREAM.DELETE.{names.ROLLOUTS_STREAM}")
                ]
            counts = [
                await messages(server, s)
                for s in (names.PROMPTS_STREAM, names.ROLLOUTS_STREAM, names.WEIGHTS_STREAM, names.DLQ_STREAM)
            ]
            assert counts == [1, 1, 1, 1]

        asyncio.run(body())


# ---------------------------------------------------------------------------- logging in


@pytest.mark.integration
def test_a_wrong_password_is_refused_at_once_naming_both_settings(secure):
    async def body():
        with pytest.raises(CredentialsError) as err:
            await asyncio.wait_for(
                connect(secure.url, user="worker", password="wrong"), 10
            )  # nats-py alone retries forever
        assert str(err.value) == (
            f"NATS at {secure.url} refused user 'worker' (Authorization Violation): an unknown user, "
            "or a password (CENTERLINE_NATS_PASSWORD or CENTERLINE_NATS_PASSWORD_FILE) that differs "
            "from the server's CENTERLINE_NATS_WORKER_PASSWORD"
        )

    asyncio.run(body())


@pytest.mark.integration
def test_a_connection_without_credentials_is_refused_naming_the_variables(secure, monkeypatch):
    for name in (nats_auth.USER_ENV, nats_auth.PASSWORD_ENV, nats_auth.PASSWORD_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(
        CredentialsError, match=f"^NATS at {secure.url} requires a user and password: set CENTERLINE_NATS_USER"
    ):
        asyncio.run(asyncio.wait_for(connect(secure.url), 10))


@pytest.mark.integration
def test_connect_logs_in_with_the_user_and_password_file_of_the_environment(secure, monkeypatch, tmp_path):
    (tmp_path / "password").write_text(secure.passwords["proxy"] + "\n")
    monkeypatch.setenv(nats_auth.USER_ENV, "proxy")
    monkeypatch.delenv(nats_auth.PASSWORD_ENV, raising=False)
    monkeypatch.setenv(nats_auth.PASSWORD_FILE_ENV, str(tmp_path / "password"))

    async def body():
        nc = await connect(secure.url)
        try:
            assert nc.new_inbox().startswith("_INBOX_proxy.")
            assert set((await ensure_streams(nc.jetstream())).values()) == {"unchanged"}
        finally:
            await nc.close()

    asyncio.run(body())


@pytest.mark.integration
def test_the_server_config_file_holds_no_password(secure):
    text = (secure.data_dir / "nats.conf").read_text()
    assert nats_users.accounts_config() in text and "no_auth_user" not in text
    assert [p for p in secure.passwords.values() if p in text] == []


@pytest.mark.integration
def test_a_store_made_without_passwords_is_served_again_with_them(tmp_path, monkeypatch):
    monkeypatch.delenv(nats_auth.USER_ENV, raising=False)
    with EmbeddedNats(tmp_path / "nats") as open_server:  # no passwords: everyone is admin
        asyncio.run(provision(open_server.url))
    with EmbeddedNats(tmp_path / "nats", passwords=nats_users.new_passwords()) as server:
        assert set(asyncio.run(provision(server.url, **server.credentials("admin"))).values()) == {"unchanged"}


@pytest.mark.integration
def test_centerline_nats_creates_the_streams_as_admin_whatever_user_the_shell_sets(tmp_path):
    env = {**os.environ, "CENTERLINE_NATS_USER": "worker", "CENTERLINE_NATS_PASSWORD": "from-another-terminal"}
    argv = [sys.executable, "-m", "centerline", "nats", "--data-dir", str(tmp_path / "nats"), "--port", "0"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # printed once the streams exist
        assert set(json.loads(line)["streams"].values()) == {"created"}, line or proc.stderr.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    assert proc.returncode == 0


def test_a_password_without_a_user_is_refused_before_connecting():
    with pytest.raises(CredentialsError, match="^connect: a password without a user$"):
        asyncio.run(connect("nats://127.0.0.1:1", password="pw"))


# ---------------------------------------------------------------------------- credentials, no server


def test_every_user_has_permissions_and_a_password_variable_in_the_config():
    assert set(nats_users.permissions()) == set(nats_users.USERS) == {"admin", "trainer", "worker", "proxy"}
    text = nats_users.accounts_config()
    assert [v for v in re.findall(r"password: \$(\w+)", text)] == [
        nats_auth.password_variable(u) for u in nats_users.USERS
    ]


def test_only_the_trainer_and_admin_may_manage_streams_and_only_admin_delete():
    perms = nats_users.permissions()
    managing = {u for u, p in perms.items() if {">", "$JS.API.STREAM.CREATE.*"} & set(p["publish"])}
    assert managing == {"admin", "trainer"}
    assert [u for u, p in perms.items() if any("DELETE" in s or s == ">" for s in p["publish"])] == ["admin"]
    # the trainer purges ROLLOUTS only: the batches it trained, to keep room under the cap
    purging = {u: [s for s in p["publish"] if "PURGE" in s] for u, p in perms.items()}
    assert purging == {"admin": [], "trainer": ["$JS.API.STREAM.PURGE.ROLLOUTS"], "worker": [], "proxy": []}
    assert [u for u, p in perms.items() if names.WEIGHTS_SUBJECT in p["publish"]] == ["trainer"]


def test_new_passwords_are_distinct_and_of_the_form_nats_server_reads_back_unchanged():
    passwords = [nats_users.new_password() for _ in range(200)]
    assert len(set(passwords)) == 200
    assert all(re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{32}", p) for p in passwords)


def test_credentials_come_from_the_environment():
    assert nats_auth.credentials_from_env({}) == (None, None)
    assert nats_auth.credentials_from_env({"CENTERLINE_NATS_USER": "worker", "CENTERLINE_NATS_PASSWORD": "pw"}) == (
        "worker",
        "pw",
    )


@pytest.mark.parametrize(
    "env,error",
    [
        (
            {"CENTERLINE_NATS_PASSWORD": "pw"},
            "a NATS password is set but no user: set CENTERLINE_NATS_USER (trainer, worker, proxy or admin)",
        ),
        (
            {"CENTERLINE_NATS_USER": "worker"},
            "CENTERLINE_NATS_USER=worker has no password: set CENTERLINE_NATS_PASSWORD or "
            "CENTERLINE_NATS_PASSWORD_FILE",
        ),
        (
            {"CENTERLINE_NATS_USER": "worker", "CENTERLINE_NATS_PASSWORD": "pw", "CENTERLINE_NATS_PASSWORD_FILE": "/f"},
            "both CENTERLINE_NATS_PASSWORD and CENTERLINE_NATS_PASSWORD_FILE are set: keep one",
        ),
        (
            {"CENTERLINE_NATS_USER": "worker", "CENTERLINE_NATS_PASSWORD_FILE": "/nonexistent/password"},
            "CENTERLINE_NATS_PASSWORD_FILE=/nonexistent/password: cannot read the password file (No such file or "
            "directory)",
        ),
    ],
    ids=["password-without-user", "user-without-password", "password-and-file", "unreadable-file"],
)
def test_contradictory_or_missing_credentials_are_refused(env, error):
    with pytest.raises(CredentialsError) as err:
        nats_auth.credentials_from_env(env)
    assert str(err.value) == error


def test_redact_hides_a_password_in_a_url():
    assert nats_auth.redact("nats://worker:s3cret@nats:4222") == "nats://worker:***@nats:4222"
    assert nats_auth.redact("nats://nats:4222") == "nats://nats:4222"


def test_credentials_directory_gives_each_user_a_private_password_and_keeps_it(tmp_path):
    out = tmp_path / "creds"
    assert nats_users.write_credentials(out) == {"created": list(nats_users.USERS), "kept": []}
    first = {u: (out / u / "password").read_text() for u in nats_users.USERS}
    assert nats_users.write_credentials(out) == {"created": [], "kept": list(nats_users.USERS)}
    assert {u: (out / u / "password").read_text() for u in nats_users.USERS} == first
    env = dict(line.split("=", 1) for line in (out / "nats.env").read_text().splitlines())
    assert env == nats_users.server_env(first)
    modes = {p.relative_to(out).as_posix(): stat.S_IMODE(os.stat(p).st_mode) for p in [out, *out.rglob("*")]}
    assert modes == {
        ".": 0o700,
        "nats.env": 0o600,
        **{u: 0o700 for u in nats_users.USERS},
        **{f"{u}/password": 0o600 for u in nats_users.USERS},
    }

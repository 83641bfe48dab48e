"""The NATS client side of centerline: connecting, publishing with PubAck, pull consumers.

- ``connect`` logs in as ``CENTERLINE_NATS_USER`` (``shared/nats_auth.py``; the users and their
  permissions: ``centerline/nats_users.py``) and reconnects forever, so a server restart does not end a service.
- ``publish_acked`` publishes one message with its ``Nats-Msg-Id`` (JetStream drops a re-publish
  inside the duplicate window), repeated until JetStream confirms it; a worker publishes its
  batches through it, split by sample where needed (``rollout_worker/publish.py``).
- ``pull_consumer`` binds a durable pull consumer with explicit acks.

Not here: the batch format (``shared/wire.py``), the checks (``shared/contract.py``), the
streams (``shared/streams.py``), the server (``centerline/nats_server.py``).
"""

from __future__ import annotations

import asyncio
import logging

import nats
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, PubAck
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError, ServiceUnavailableError

from shared import nats_auth
from shared.nats_auth import CredentialsError

log = logging.getLogger("centerline.nats")

# JetStream's answer to a publish whose Nats-Msg-Id a cluster is still storing from an earlier copy
DUPLICATE_IN_PROCESS = 10158


class PublishError(RuntimeError):
    """JetStream did not confirm a published message."""


# JetStream's answers to a publish when the store is full (docs/design.md section 3): 10077 with
# "maximum bytes exceeded", a stream at its byte cap that discards new messages (ROLLOUTS); 10023
# "insufficient resources", the server's store (jetstream ``max_file_store``) used up by every stream.
_STREAM_FULL, _SERVER_FULL = 10077, 10023


class StoreFull(PublishError):
    """JetStream refused a message because a byte cap is reached: nothing stored, retrying later can
    succeed once the store has room (the trainer frees ROLLOUTS as it trains). ``rule``: ``store_full``;
    ``description``: JetStream's words."""

    rule = "store_full"

    def __init__(self, message: str, description: str):
        super().__init__(message)
        self.description = description


def _store_full(exc: APIError, what: str, subject: str) -> StoreFull | None:
    """``exc`` as a ``StoreFull`` naming what filled and the fix, or None for any other refusal."""
    said = exc.description or ""
    if exc.err_code == _STREAM_FULL and "maximum bytes exceeded" in said:
        where = (
            f"the stream of {subject!r} is at its byte cap (JetStream: {said}); ROLLOUTS refuses new batches while "
            "batches not yet trained fill it, and the trainer frees it as it trains (docs/design.md section 3): "
            "raise --rollouts-max-bytes if it stays full"
        )
    elif exc.err_code == _SERVER_FULL:
        where = (
            f"the NATS server's JetStream store is full (JetStream: {said}): raise its max_file_store (jetstream "
            "block) or free the streams that filled it"
        )
    else:
        return None
    return StoreFull(f"{what} not stored: {where}", said)


async def connect(
    url: str, *, name: str | None = None, user: str | None = None, password: str | None = None, **options
) -> nats.NATS:
    """Connect with reconnects that never give up, so a server restart does not end a service.

    Logs in as ``user``, else as ``CENTERLINE_NATS_USER`` with ``CENTERLINE_NATS_PASSWORD`` (or
    ``CENTERLINE_NATS_PASSWORD_FILE``), else with no credentials. A user's replies come to its own
    inbox, ``_INBOX_<user>``, the subjects its permissions let it subscribe to. Credentials the
    server refuses raise ``CredentialsError`` at once, since no retry can fix them (nats-py would
    retry forever). Asynchronous errors, permission violations among them, go to ``error_cb``
    (default: one log line each).
    """
    if user is None:
        if password is not None:
            raise CredentialsError("connect: a password without a user")
        user, password = nats_auth.credentials_from_env()
    if user is not None:
        options.update(user=user, password=password)
        options.setdefault("inbox_prefix", nats_auth.inbox_prefix(user))
    options.setdefault("max_reconnect_attempts", -1)
    options.setdefault("reconnect_time_wait", 0.5)
    report = options.pop("error_cb", None) or _log_error
    connecting = True

    async def error_cb(exc: Exception) -> None:
        if connecting and "authorization violation" in str(exc).lower():
            raise _refused(url, user)  # out of nats-py's connect loop
        await report(exc)

    nc = nats.NATS()
    try:
        await nc.connect(servers(url), name=name, error_cb=error_cb, **options)
    except CredentialsError:
        await nc.close()
        raise
    connecting = False
    return nc


def servers(url: str) -> str | list[str]:
    """``url`` as nats-py takes it: a comma-separated list (``nats://a:4222,nats://b:4222``, as
    the NATS CLI and the Go client take it) becomes a list of servers; one URL stays as it is."""
    parts = [part.strip() for part in url.split(",") if part.strip()]
    return parts if len(parts) > 1 else url


def _refused(url: str, user: str | None) -> CredentialsError:
    where = f"NATS at {nats_auth.redact(url)}"
    if user is None:
        return CredentialsError(
            f"{where} requires a user and password: set {nats_auth.USER_ENV} and "
            f"{nats_auth.PASSWORD_ENV} (or {nats_auth.PASSWORD_FILE_ENV})"
        )
    return CredentialsError(
        f"{where} refused user {user!r} (Authorization Violation): an unknown user, or a password "
        f"({nats_auth.PASSWORD_ENV} or {nats_auth.PASSWORD_FILE_ENV}) that differs from the "
        f"server's {nats_auth.password_variable(user)}"
    )


async def _log_error(exc: Exception) -> None:
    log.error("NATS: %s", exc)


async def publish_acked(
    js: JetStreamContext,
    subject: str,
    data: bytes,
    headers: dict | None = None,
    *,
    what: str = "message",
    timeout: float = 10.0,
    attempts: int = 3,
) -> PubAck:
    """JetStream-publish and wait for the PubAck, repeating a publish that got none (lost in
    a server restart or a reconnect, or stored with its PubAck lost) ``attempts`` times in all,
    then raise ``PublishError`` naming ``what``. Repeating is safe only where a second copy is
    harmless: a ``Nats-Msg-Id`` in ``headers`` (deduplicated), or a last-value stream.

    A publish that no stream answered (no responders: on a cluster, the stream's leader was
    lost and the others are electing a new one) stored nothing; it is repeated every 0.2 s for
    up to ``attempts * timeout`` seconds, the same budget, before ``PublishError``. So is a
    repeat that a cluster answers "duplicate message id is in process" (``DUPLICATE_IN_PROCESS``:
    the first copy is still being replicated; once it is stored, the repeat gets its PubAck,
    marked duplicate). A refusal because a byte cap is reached raises ``StoreFull`` (a ``PublishError``) at once.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + attempts * timeout
    timeouts = 0
    while True:
        try:
            return await js.publish(subject, data, timeout=timeout, headers=headers)
        except nats.errors.TimeoutError:
            timeouts += 1
            if timeouts == attempts:
                raise PublishError(
                    f"no PubAck for {what} on {subject!r} after {attempts} attempts of {timeout}s: "
                    "is the NATS server reachable?"
                ) from None
        except NoStreamResponseError:
            if loop.time() > deadline:
                raise PublishError(
                    f"no stream answered {what} on {subject!r} for {attempts * timeout:.0f}s: on a cluster, "
                    "has the stream lost its leader with too few nodes left to elect one?"
                ) from None
            await asyncio.sleep(0.2)  # the election of a new stream leader
        except APIError as exc:
            full = _store_full(exc, what, subject)
            if full is not None:  # not repeated here: the caller retries later (a NAK with a delay)
                raise full from None
            if exc.err_code != DUPLICATE_IN_PROCESS:
                raise
            if loop.time() > deadline:
                raise PublishError(
                    f"{what} on {subject!r} was still being stored by the cluster after {attempts * timeout:.0f}s "
                    "(duplicate message id is in process): is a stream replica stuck?"
                ) from None
            await asyncio.sleep(0.2)  # the first copy's replication


class PullConsumer:
    """A bound durable pull consumer with explicit acks."""

    def __init__(self, sub: JetStreamContext.PullSubscription, max_payload: int = 0):
        self.sub = sub
        # nats-py drops what arrives past the subscription's pending-bytes limit (a "slow consumer"),
        # and each drop costs the message a delivery: one fetch asks for no more messages than fit.
        limit = getattr(sub._sub, "_pending_bytes_limit", 0) if hasattr(sub, "_sub") else 0
        self.most = max(1, limit // max_payload) if limit > 0 and max_payload > 0 else None

    async def fetch(self, max_msgs: int = 1, timeout: float = 1.0) -> list:
        """Up to ``max_msgs`` messages (no more than fit the client's pending-bytes limit at the server's
        ``max_payload`` each), fewer (or none) if ``timeout`` seconds pass first."""
        if self.most is not None:
            max_msgs = min(max_msgs, self.most)
        try:
            return await self.sub.fetch(max_msgs, timeout=timeout)
        except (TimeoutError, nats.errors.TimeoutError):  # nats-py raises either, by code path
            return []
        except ServiceUnavailableError:
            # No consumer leader answers: on a cluster, the node that led it is gone and the others
            # are electing a new one (seconds). Nothing was delivered; the caller fetches again.
            await asyncio.sleep(min(timeout, 0.25))
            return []

    @staticmethod
    async def ack(msg, timeout: float = 5.0) -> None:
        """Ack and wait until the server has recorded it (a lost plain ack means a redelivery)."""
        await msg.ack_sync(timeout=timeout)

    @staticmethod
    async def nak(msg, delay: float | None = None) -> None:
        """Ask for redelivery, after ``delay`` seconds if given."""
        await msg.nak(delay=delay)

    @staticmethod
    async def in_progress(msg) -> None:
        """Restart the message's ack_wait clock: still working on it."""
        await msg.in_progress()

    async def ack_wait(self, timeout: float = 2.0) -> float | None:
        """The consumer's ack_wait on the server now, in seconds; None if the server does not
        answer within ``timeout``. Every process that binds a durable consumer sets its own
        ``ack_wait`` (``pull_consumer``), so the last one started decides it for all."""
        try:
            info = await asyncio.wait_for(self.sub.consumer_info(), timeout)
        # NATS restarting or the consumer's leader moving: the caller keeps what it knew
        except Exception:  # noqa: BLE001
            return None
        return info.config.ack_wait

    async def close(self) -> None:
        await self.sub.unsubscribe()


async def pull_consumer(
    js: JetStreamContext,
    stream: str,
    durable: str,
    *,
    filter_subject: str | None = None,
    ack_wait: float = 30.0,
    max_deliver: int = -1,
    max_ack_pending: int = 1000,
    shared: bool = False,
) -> PullConsumer:
    """Create (or update to these settings) the durable pull consumer ``durable`` on ``stream`` and bind it.

    Unacked messages are redelivered ``ack_wait`` seconds after delivery, at most
    ``max_deliver`` deliveries in all (-1 = no limit). ``shared``: several processes bind this
    consumer, each setting its own ack_wait (the last one started decides for all); a warning
    says when this one changes it (reading the consumer's info first, which the process must
    be allowed to).
    """
    config = ConsumerConfig(
        durable_name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait,
        max_deliver=max_deliver,
        max_ack_pending=max_ack_pending,
        filter_subject=filter_subject,
    )
    before = None
    if shared:  # several processes bind it (the workers'): say when this one changes what the others set
        try:
            before = (await js.consumer_info(stream, durable)).config.ack_wait
        except NotFoundError:
            pass
    if before is not None and abs(before - ack_wait) > 1e-6:
        log.warning(
            "consumer %s on %s had ack_wait %gs; this process sets %gs for every process bound to it "
            "(give them all the same --ack-wait)",
            durable,
            stream,
            before,
            ack_wait,
        )
    await js.add_consumer(stream, config)
    sub = await js.pull_subscribe_bind(durable=durable, stream=stream)
    return PullConsumer(sub, max_payload=getattr(getattr(js, "_nc", None), "max_payload", 0) or 0)

"""The JetStream streams of docs/design.md section 3: their settings and their creation.

``ensure_streams`` creates every stream, or reconciles an existing one with centerline's
settings; on a deployment with the same settings it changes nothing (``centerline/nats_server.py``'s
``provision`` does it in one connection of its own).

Not here: the stream and subject names (``shared/names.py``), the server
(``centerline/nats_server.py``), publishing and consuming (``shared/nats_client.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import nats
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from shared import names


class StreamConfigError(RuntimeError):
    """An existing stream differs from centerline's settings in a way JetStream cannot update."""


@dataclass(frozen=True)
class StreamLimits:
    """Retention settings of the streams (docs/design.md section 3). Times in seconds, sizes in bytes, -1 = no limit."""

    rollouts_max_age: float = 7 * 86400.0  # batches are kept this long for replay
    # Byte caps of ROLLOUTS and the DLQ (the trainer's, from its settings: ``store_caps``). A full ROLLOUTS
    # refuses new batches (discard new: no batch leaves it untrained; the trainer purges trained ones,
    # ``trainer_service/store.py``); a full DLQ drops its oldest letters. None: keep what an existing stream
    # has (no cap for a new one), as for ``replicas``: a worker or the proxy never undoes the trainer's caps.
    rollouts_max_bytes: int | None = None
    duplicate_window: float = 600.0  # a re-publish of the same batch_id within this is dropped
    dlq_max_age: float = 30 * 86400.0
    dlq_max_bytes: int | None = None
    audit_max_age: float = 86400.0
    audit_max_bytes: int = 1 << 30
    advisories_max_age: float = 30 * 86400.0
    # Copies of each stream (nats_stream_replicas), > 1 only on a NATS cluster. None: keep what
    # an existing stream has (1 for a new one): the services that only use the streams (workers,
    # the proxy, replay) never change what the trainer, which creates them, set.
    replicas: int | None = None


def stream_configs(limits: StreamLimits = StreamLimits()) -> list[StreamConfig]:
    """The streams of docs/design.md section 3. Every compared field is set, so server defaults never differ."""

    def stream(
        name, subject, retention=RetentionPolicy.LIMITS, max_age=0.0, max_bytes=-1, per_subject=-1, discard=None
    ):
        return StreamConfig(
            name=name,
            subjects=list(subject) if isinstance(subject, tuple) else [subject],
            retention=retention,
            storage=StorageType.FILE,
            discard=discard or DiscardPolicy.OLD,
            max_msgs=-1,
            max_bytes=max_bytes,
            max_age=max_age,
            max_msgs_per_subject=per_subject,
            # the server clamps the window to max_age, so do it here to compare equal later
            duplicate_window=min(limits.duplicate_window, max_age) if max_age else limits.duplicate_window,
            num_replicas=limits.replicas or 1,
        )

    return [
        stream(names.PROMPTS_STREAM, names.PROMPTS_SUBJECT, retention=RetentionPolicy.WORK_QUEUE),
        stream(
            names.ROLLOUTS_STREAM,
            names.ROLLOUTS_SUBJECT,
            max_age=limits.rollouts_max_age,
            max_bytes=-1 if limits.rollouts_max_bytes is None else limits.rollouts_max_bytes,
            # full: refuse new batches rather than drop untrained ones (docs/design.md section 3)
            discard=DiscardPolicy.NEW,
        ),
        stream(
            names.DLQ_STREAM,
            names.DLQ_SUBJECT,
            max_age=limits.dlq_max_age,
            max_bytes=-1 if limits.dlq_max_bytes is None else limits.dlq_max_bytes,
        ),
        stream(names.WEIGHTS_STREAM, names.WEIGHTS_SUBJECT, per_subject=1),
        stream(names.AUDIT_STREAM, names.AUDIT_SUBJECT, max_age=limits.audit_max_age, max_bytes=limits.audit_max_bytes),
        stream(names.ADVISORIES_STREAM, names.ADVISORIES_SUBJECTS, max_age=limits.advisories_max_age),
    ]


def sample_max_bytes(rollout) -> int:
    """Wire bytes of the longest sample the ``rollout`` settings (``Config.rollout``) allow: a
    session's whole token budget (``session_max_tokens``, its prompt included), each token with its
    id, log-probability, mask, version and K candidates (13 + 8K bytes, ``rollout_worker/publish.py``)."""
    return rollout.session_max_tokens * (13 + 8 * rollout.top_logprobs_num) + 4096


def store_caps(rollout, prompts_per_step: int, retention_steps: int, rollouts: int | None, dlq: int | None):
    """``(rollouts_max_bytes, dlq_max_bytes)``: the caps given, or where unset: ``retention_steps``
    steps of samples at their largest (``sample_max_bytes``) for ROLLOUTS, a quarter of that for the DLQ
    (docs/design.md section 3)."""
    step = prompts_per_step * rollout.n * sample_max_bytes(rollout)
    rollouts = rollouts if rollouts is not None else retention_steps * step
    return rollouts, dlq if dlq is not None else max(step, rollouts // 4)


# Fields compared with an existing stream; JetStream refuses to change the first two in place.
FIXED_FIELDS = ("retention", "storage")
COMPARED_FIELDS = (
    *FIXED_FIELDS,
    "subjects",
    "discard",
    "max_msgs",
    "max_bytes",
    "max_age",
    "max_msgs_per_subject",
    "duplicate_window",
    "num_replicas",
)


async def ensure_streams(js: JetStreamContext, limits: StreamLimits = StreamLimits()) -> dict[str, str]:
    """Create or reconcile every stream; returns ``{stream: "created" | "unchanged" | "updated"}``.

    A stream with the same settings is left alone (no API write at all). Differing settings
    are updated in place where JetStream allows; ``retention`` or ``storage`` differences
    raise ``StreamConfigError``, since changing them would need a delete that loses messages.
    """
    outcome = {}
    for want in stream_configs(limits):
        try:
            have = (await js.stream_info(want.name)).config
        except NotFoundError:
            try:
                await js.add_stream(want)
            except APIError as exc:
                raise StreamConfigError(_refused_creation(want, exc)) from exc
            except nats.errors.TimeoutError:
                raise StreamConfigError(
                    f"stream {want.name} does not exist and the request to create it got no answer: " + _REFUSED
                ) from None
            outcome[want.name] = "created"
            continue
        compared = COMPARED_FIELDS if limits.replicas is not None else COMPARED_FIELDS[:-1]
        if {names.ROLLOUTS_STREAM: limits.rollouts_max_bytes, names.DLQ_STREAM: limits.dlq_max_bytes}.get(
            want.name, 0
        ) is None:
            # the cap and what a full stream does are the trainer's: a worker of a new release meeting an
            # earlier ROLLOUTS (discard old) leaves it to the trainer, which may update streams
            compared = tuple(f for f in compared if f not in ("max_bytes", "discard"))
        diffs = {f: (getattr(have, f), getattr(want, f)) for f in compared if getattr(have, f) != getattr(want, f)}
        if not diffs:
            outcome[want.name] = "unchanged"
            continue
        fixed = {f: d for f, d in diffs.items() if f in FIXED_FIELDS}
        if fixed:
            raise StreamConfigError(
                _diff_message(want.name, fixed) + "; JetStream cannot change this in place: "
                "delete the stream (its messages are lost) or change the setting back"
            )
        try:
            await js.update_stream(replace(have, **{f: getattr(want, f) for f in diffs}))
        except APIError as exc:
            if "num_replicas" in diffs or exc.err_code == _NO_ROOM:
                raise StreamConfigError(_refused_creation(want, exc)) from exc
            raise StreamConfigError(_diff_message(want.name, diffs) + f"; the update was refused: {exc}") from exc
        except nats.errors.TimeoutError:
            raise StreamConfigError(
                _diff_message(want.name, diffs) + "; the update got no answer: " + _REFUSED
            ) from None
        outcome[want.name] = "updated"
    return outcome


# nats-server drops a request the user's permissions refuse (the client logs a "Permissions Violation").
_REFUSED = (
    "this NATS user is probably not allowed to manage streams (centerline/nats_users.py). The trainer, "
    "`centerline up` and the admin user create them: start the trainer first, or fix the setting as admin"
)


# JetStream's answer when a stream's byte cap does not fit what the server's store has left
# (jetstream max_file_store): a stream's max_bytes is reserved there as it is created.
_NO_ROOM = 10047
# JetStream's answers when a stream's replicas cannot be placed: more than the cluster's
# JetStream nodes (10005 "no suitable peers for placement", 10023 "insufficient resources"),
# or more than one on a server that is not in a cluster (10074).
_PLACEMENT_ERRORS = {10005, 10023, 10074}


def _refused_creation(want: StreamConfig, exc: APIError) -> str:
    if exc.err_code == _NO_ROOM:
        return (
            f"stream {want.name}: max_bytes={want.max_bytes}, but the NATS server's store has no room left to reserve "
            f"it (JetStream: {exc.description}): every capped stream's max_bytes is reserved in the server's "
            "max_file_store (jetstream block). Raise max_file_store, or lower the caps: --rollouts-max-bytes, "
            "--dlq-max-bytes, --store-retention-steps"
        )
    if want.num_replicas > 1 and exc.err_code in _PLACEMENT_ERRORS:
        return (
            f"stream {want.name}: nats_stream_replicas={want.num_replicas}, but the NATS deployment cannot place "
            f"that many copies (JetStream: {exc.description}). A stream has at most one replica per JetStream "
            f"node of the cluster: lower nats_stream_replicas to the cluster size (1 for a single server) "
            f"or add nodes"
        )
    return f"stream {want.name} could not be created: {exc}"


def _diff_message(stream: str, diffs: dict) -> str:
    show = lambda v: repr(getattr(v, "value", v))  # noqa: E731  (enums by their JetStream spelling)
    parts = ", ".join(f"{f} is {show(have)}, centerline wants {show(want)}" for f, (have, want) in diffs.items())
    return f"stream {stream}: {parts}"

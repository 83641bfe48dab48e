"""Wire format v2 for `rollouts.batches` (docs/design.md section 4).

A batch is one msgpack map. Arrays are maps ``{"dtype", "shape", "data"}`` whose ``data``
is little-endian C-order bytes; per-token arrays of all samples are concatenated and
``offsets[i]:offsets[i+1]`` selects sample ``i``. That array encoding, and the strict reader
that decodes it without copying the arrays, are ``shared/msgpack_arrays.py``, which the proxy's
binary answer to a worker (``shared/response_arrays.py``) is written in too; this module is the
batch: its fields, their wire dtypes, and the version.

v2 is v1 plus ``token_versions`` (the weight version that sampled each response token) and the
batch's ``task_id``, ``attempt`` and ``parts``; ``finish_reasons`` (each sample's, a string) is
optional: a batch without it (recorded before it existed) decodes with none, and so are a session
batch's ``tool_calls`` and ``tool_call_parse_errors`` (each sample's counts, written only when
recorded: an older decoder keeps them as unknown keys). A v1 message is
refused by name, as any other version is: every producer is this codebase, and a v1 batch
cannot say which weights sampled a token of a response that spans an update.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from shared.msgpack_arrays import WireError, WireLimits, array_value, decode_map, encode_map, required_field

WIRE_VERSION = 2
MODES = ("selected", "support")

# Array fields and the dtype each must carry on the wire.
ARRAY_FIELDS = {
    "rewards": "float32",
    "advantages": "float32",
    "offsets": "int64",
    "prompt_offsets": "int64",
    "prompt_ids": "int32",
    "response_ids": "int32",
    "sampled_logprobs": "float32",
    "loss_mask": "uint8",
    "token_versions": "int32",
    "cand_ids": "int32",
    "cand_logprobs": "float32",
}
SCALAR_FIELDS = {
    "batch_id": str,
    "producer": str,
    "task_id": str,
    "attempt": int,
    "parts": int,
    "weight_version": int,
    "mode": str,
    "k": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
}
LIST_FIELDS = ("sample_ids", "group_ids")
# Optional lists of strings, one per sample; a message without one decodes to [].
OPTIONAL_LIST_FIELDS = ("finish_reasons",)
# Optional lists of non-negative ints, one per sample, written only when not empty.
OPTIONAL_COUNT_FIELDS = ("tool_calls", "tool_call_parse_errors")


# An ``extra`` key: a group of weighted reward components, each component's mean over the group's
# samples by its name (rollout_worker/rewards.py), which the trainer logs per step (trainer_service/commit.py).
REWARD_COMPONENTS = "reward_components"


@dataclass(slots=True)
class Batch:
    """One candidate batch: B samples, N response tokens in all, K candidates per token.

    Array fields are numpy arrays (read-only views of the message bytes after decoding).
    """

    batch_id: str
    producer: str
    task_id: str  # the prompt task whose group this batch holds (all of it, or one part)
    attempt: int  # the task's delivery that sampled it: 1 the first, 2 a redelivery, ...
    parts: int  # how many messages this attempt of the task publishes, this one among them
    weight_version: int  # the newest weights that sampled any of its tokens (SGLang's "default" is 0)
    mode: str  # "selected": unfiltered sampling, top-K head; "support": full realized support
    k: int
    temperature: float
    top_p: float
    top_k: int  # -1 = no top-k filter
    sample_ids: list[str]
    group_ids: list[str]
    rewards: np.ndarray  # float32 [B]
    advantages: np.ndarray  # float32 [B]
    offsets: np.ndarray  # int64 [B+1], offsets into the per-token arrays
    prompt_offsets: np.ndarray  # int64 [B+1], offsets into prompt_ids
    prompt_ids: np.ndarray  # int32 [P]
    response_ids: np.ndarray  # int32 [N], sampled tokens
    sampled_logprobs: np.ndarray  # float32 [N], sampler log-prob of each sampled token
    loss_mask: np.ndarray  # uint8 [N], 1 = trained position (a token SGLang sampled)
    token_versions: np.ndarray  # int32 [N], the weight version that sampled each token (<= weight_version)
    cand_ids: np.ndarray  # int32 [N, K], -1 = empty slot
    cand_logprobs: np.ndarray  # float32 [N, K], -inf = empty slot
    # per sample, why its sampling ended: SGLang's "stop" | "length" (a session's: its last turn's),
    # or "session_budget" (a session ended by --rollout-session-max-tokens); [] = not recorded
    finish_reasons: list[str] = field(default_factory=list)
    # per sample, a session's tool calls parsed from its replies, and its replies whose call markup
    # did not parse (docs/design.md section 12); [] = not recorded (not a session)
    tool_calls: list[int] = field(default_factory=list)
    tool_call_parse_errors: list[int] = field(default_factory=list)
    v: int = WIRE_VERSION
    extra: dict = field(default_factory=dict)  # unknown top-level keys, kept for tooling; written back as they are

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.response_ids.shape[0])

    def sample_slice(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def nbytes(self) -> int:
        return sum(getattr(self, name).nbytes for name in ARRAY_FIELDS)


def encode_batch(batch: Batch) -> bytes:
    """Serialise ``batch`` to wire format v2. Arrays are converted to their wire dtype."""
    head: dict = {"v": WIRE_VERSION}
    for name in SCALAR_FIELDS:
        head[name] = getattr(batch, name)
    head["temperature"] = float(batch.temperature)
    head["top_p"] = float(batch.top_p)
    for name in (*LIST_FIELDS, *OPTIONAL_LIST_FIELDS):
        head[name] = list(getattr(batch, name))
    for name in OPTIONAL_COUNT_FIELDS:
        if getattr(batch, name):
            head[name] = [int(n) for n in getattr(batch, name)]
    head.update({k: v for k, v in batch.extra.items() if k not in _KNOWN_KEYS})
    return encode_map(head, {name: (getattr(batch, name), dtype) for name, dtype in ARRAY_FIELDS.items()})


def decode_batch(data: bytes | bytearray | memoryview, *, limits: WireLimits = WireLimits()) -> Batch:
    """Parse wire format v2; raises ``WireError`` for anything malformed, a v1 message included.

    For ``bytes`` input, array fields of the result are read-only numpy views of ``data``
    (no copy); a ``bytearray`` or ``memoryview`` is copied once first, since it could change.
    """
    return _batch_from_doc(decode_map(data, limits=limits), limits)


def _batch_from_doc(doc: dict, limits: WireLimits) -> Batch:
    version = doc.get("v")
    if (
        type(version) is not int or version != WIRE_VERSION
    ):  # an array-shaped map is read as an ndarray: compare no such thing
        shown = repr(version) if version is None or type(version) in (int, str) else type(version).__name__
        raise WireError(
            f"wire format version {shown} is not supported; this decoder reads version {WIRE_VERSION}"
            + (
                " (v2 adds token_versions, task_id, attempt and parts; re-record with this release)"
                if type(version) is int and version == 1
                else ""
            )
        )
    values: dict = {}
    for name, kind in SCALAR_FIELDS.items():
        value = required_field(doc, name)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise WireError(f"field {name!r} is {type(value).__name__}, expected {kind.__name__}")
        values[name] = value
    for name in LIST_FIELDS:
        value = required_field(doc, name)
        if type(value) is not list or not set(map(type, value)) <= {str}:
            raise WireError(f"field {name!r} must be a list of strings")
        values[name] = value
    for name in OPTIONAL_LIST_FIELDS:
        value = doc.get(name, [])
        if type(value) is not list or not set(map(type, value)) <= {str}:
            raise WireError(f"field {name!r} must be a list of strings")
        values[name] = value
    for name in OPTIONAL_COUNT_FIELDS:
        value = doc.get(name, [])
        if type(value) is not list or not all(type(n) is int and n >= 0 for n in value):
            raise WireError(f"field {name!r} must be a list of non-negative ints")
        if value and len(value) != len(values["sample_ids"]):
            raise WireError(f"field {name!r} has {len(value)} counts for {len(values['sample_ids'])} sample_ids")
        values[name] = value
    for name, dtype in ARRAY_FIELDS.items():
        values[name] = array_value(doc, name, dtype, limits)
    extra = {key: value for key, value in doc.items() if key not in _KNOWN_KEYS}
    return Batch(**values, extra=extra)


_KNOWN_KEYS = {"v", *SCALAR_FIELDS, *LIST_FIELDS, *OPTIONAL_LIST_FIELDS, *OPTIONAL_COUNT_FIELDS, *ARRAY_FIELDS}

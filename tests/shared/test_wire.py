"""Wire format v2: exact round trips, zero-copy decoding, and a typed error for every malformed input."""

import copy
import struct
import time
import tracemalloc
from dataclasses import replace

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from centerline.synth import make_batch
from shared.contract import ContractViolation, check_batch
from shared.msgpack_arrays import WireError, WireLimits
from shared.wire import ARRAY_FIELDS, Batch, decode_batch, encode_batch


def assert_same_batch(a: Batch, b: Batch) -> None:
    for name in (
        "finish_reasons",
        "batch_id",
        "producer",
        "task_id",
        "attempt",
        "parts",
        "weight_version",
        "mode",
        "k",
        "temperature",
        "top_p",
        "top_k",
        "sample_ids",
        "group_ids",
        "v",
    ):
        assert getattr(a, name) == getattr(b, name), name
    for name, dtype in ARRAY_FIELDS.items():
        x, y = getattr(a, name), getattr(b, name)
        assert y.dtype == np.dtype(dtype).newbyteorder("<") and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name  # bit for bit, NaN payloads and -0.0 included


@st.composite
def batches(draw):
    samples = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(0, 6), min_size=samples, max_size=samples))
    prompt_lengths = draw(st.lists(st.integers(0, 4), min_size=samples, max_size=samples))
    n, p, k = sum(lengths), sum(prompt_lengths), draw(st.integers(1, 6))
    floats = st.floats(width=32, allow_nan=True, allow_infinity=True)

    def arr(shape, dtype, elements):
        count = int(np.prod(shape)) if shape else 1
        return np.array(draw(st.lists(elements, min_size=count, max_size=count)), dtype=dtype).reshape(shape)

    text = st.text(max_size=12)
    return Batch(
        batch_id=draw(text),
        producer=draw(text),
        task_id=draw(text),
        attempt=draw(st.integers(1, 2**31)),
        parts=draw(st.integers(1, 2**31)),
        weight_version=draw(st.integers(0, 2**40)),
        mode=draw(st.sampled_from(["selected", "support"])),
        k=k,
        temperature=draw(st.floats(0.01, 10)),
        top_p=draw(st.floats(0.01, 1)),
        top_k=draw(st.integers(-1, 1000)),
        sample_ids=draw(st.lists(text, min_size=samples, max_size=samples)),
        group_ids=draw(st.lists(text, min_size=samples, max_size=samples)),
        rewards=arr((samples,), np.float32, floats),
        advantages=arr((samples,), np.float32, floats),
        offsets=np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        prompt_offsets=np.concatenate([[0], np.cumsum(prompt_lengths)]).astype(np.int64),
        prompt_ids=arr((p,), np.int32, st.integers(-(2**31), 2**31 - 1)),
        response_ids=arr((n,), np.int32, st.integers(-(2**31), 2**31 - 1)),
        sampled_logprobs=arr((n,), np.float32, floats),
        loss_mask=arr((n,), np.uint8, st.integers(0, 1)),
        token_versions=arr((n,), np.int32, st.integers(-(2**31), 2**31 - 1)),
        cand_ids=arr((n, k), np.int32, st.integers(-1, 300)),
        cand_logprobs=arr((n, k), np.float32, floats),
    )


@settings(max_examples=150, deadline=None)
@given(batches())
def test_random_batches_round_trip_bit_for_bit(batch):
    assert_same_batch(batch, decode_batch(encode_batch(batch)))


def test_decoded_arrays_are_read_only_views_of_the_message():
    data = encode_batch(make_batch(samples=3, tokens_per_sample=5, k=4))
    batch = decode_batch(data)
    assert not batch.cand_logprobs.flags.writeable
    assert not batch.cand_logprobs.flags.owndata
    start = data.find(batch.cand_logprobs.tobytes())
    assert batch.cand_logprobs.ctypes.data == np.frombuffer(data, np.uint8).ctypes.data + start


def test_unknown_top_level_keys_are_ignored_and_kept():
    doc = msgpack.unpackb(encode_batch(make_batch()))
    doc["future_field"] = {"nested": [1, 2]}
    batch = decode_batch(msgpack.packb(doc))
    assert batch.extra == {"future_field": {"nested": [1, 2]}}
    assert_same_batch(make_batch(), batch)


def test_other_version_is_rejected_naming_both_versions():
    doc = msgpack.unpackb(encode_batch(make_batch()))
    doc["v"] = 3
    with pytest.raises(WireError, match=r"version 3 is not supported; this decoder reads version 2$"):
        decode_batch(msgpack.packb(doc))


def test_a_v1_batch_is_refused_naming_both_versions_and_what_v2_adds():
    doc = msgpack.unpackb(encode_batch(make_batch()))
    for name in ("token_versions", "task_id", "attempt", "parts"):
        del doc[name]
    doc["v"] = 1
    with pytest.raises(
        WireError, match=r"version 1 is not supported; this decoder reads version 2 \(v2 adds token_versions, task_id"
    ):
        decode_batch(msgpack.packb(doc))


def test_v2_carries_each_tokens_weight_version_and_the_batchs_task_attempt_and_parts():
    batch = replace(make_batch(samples=2, tokens_per_sample=3, weight_version=5), task_id="run/0/3", attempt=2)
    batch.token_versions = np.array([4, 4, 5, 5, 5, 5], np.int32)
    doc = msgpack.unpackb(encode_batch(batch))
    assert (doc["v"], doc["task_id"], doc["attempt"], doc["parts"]) == (2, "run/0/3", 2, 1)
    assert doc["token_versions"]["dtype"] == "int32" and doc["token_versions"]["shape"] == [6]
    assert decode_batch(encode_batch(batch)).token_versions.tolist() == [4, 4, 5, 5, 5, 5]


def _doc():
    return msgpack.unpackb(encode_batch(make_batch(samples=2, tokens_per_sample=3, k=4)))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.pop("cand_ids"), r"required field 'cand_ids' is missing"),
        (lambda d: d.update(k="8"), r"field 'k' is str, expected int"),
        (lambda d: d.update(k=True), r"field 'k' is bool, expected int"),
        (lambda d: d.update(sample_ids=["a", 3]), r"'sample_ids' must be a list of strings"),
        (lambda d: d["cand_ids"].update(dtype="float32"), r"'cand_ids' has dtype 'float32', expected 'int32'"),
        (lambda d: d["cand_ids"].update(dtype="complex128"), r"'cand_ids' has dtype 'complex128'"),
        (lambda d: d["offsets"].update(shape=[4]), r"'offsets': shape \[4\] of int64 needs 32 bytes, data has 24"),
        (lambda d: d["offsets"].update(shape=[-3]), r"'offsets' has shape \[-3\]"),
        (lambda d: d["rewards"].update(data=b"\0" * 7), r"'rewards': shape \[2\] of float32 needs 8 bytes, data has 7"),
        (lambda d: d["rewards"].update(data="text"), r"'rewards' has data of type str, expected bin"),
        (lambda d: d.update(rewards=[1.0, 2.0]), r"'rewards' is list, expected a map"),
        # A map laid out like an array is read as an ndarray wherever it sits; comparing it to 1 raised ValueError.
        (
            lambda d: d.update(v={"dtype": "int32", "shape": [0], "data": b""}),
            r"wire format version ndarray is not supported",
        ),
    ],
)
def test_malformed_fields_raise_wire_error_naming_the_field(mutate, message):
    doc = _doc()
    mutate(doc)
    with pytest.raises(WireError, match=message):
        decode_batch(msgpack.packb(doc, use_bin_type=True))


def test_every_truncation_raises_wire_error():
    data = encode_batch(make_batch(samples=2, tokens_per_sample=3, k=4))
    for cut in range(len(data)):
        with pytest.raises(WireError):
            decode_batch(data[:cut])


def test_trailing_bytes_are_rejected():
    with pytest.raises(WireError, match="1 trailing bytes"):
        decode_batch(encode_batch(make_batch()) + b"\xc0")


@pytest.mark.parametrize(
    "data, message",
    [
        (b"\xc6\xff\xff\xff\xf0", r"truncated message: need 4294967280 bytes"),  # bin32 claiming ~4 GiB
        (b"\xdd\xff\xff\xff\xff", r"list of 4294967295 items"),
        (b"\xdf\x7f\xff\xff\xff", r"map of 2147483647 entries"),
        (b"\xdb\x00\x10\x00\x00" + b"a" * 10, r"string of 1048576 bytes"),
        (b"\x91" * 64 + b"\xc0", r"nesting deeper than 4 levels"),
        (b"\xc7\x01\x05\x00", r"unsupported msgpack type byte 0xc7"),  # ext type
        (b"\x81\x01\x02", r"map key 1 is not a string"),
        (b"\x81\xa1\xff\xc0", r"invalid UTF-8"),
        (b"\x92\x01\x02", r"top level is list, expected a map"),
        (b"", r"truncated message"),
    ],
)
def test_hostile_headers_raise_wire_error(data, message):
    with pytest.raises(WireError, match=message):
        decode_batch(data)


def test_message_above_size_limit_is_rejected_naming_the_limit():
    data = encode_batch(make_batch())
    with pytest.raises(WireError, match=r"max_message_bytes=100"):
        decode_batch(data, limits=WireLimits(max_message_bytes=100))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_raise_only_wire_error(data):
    try:
        decode_batch(data)
    except WireError:
        pass  # the only acceptable failure


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_corrupted_valid_messages_raise_only_wire_error(data):
    message = bytearray(encode_batch(make_batch(samples=2, tokens_per_sample=3, k=4)))
    for _ in range(data.draw(st.integers(1, 4))):
        message[data.draw(st.integers(0, len(message) - 1))] = data.draw(st.integers(0, 255))
    try:
        decode_batch(bytes(message))
    except WireError:
        pass  # corrupting array bytes can still leave a well-formed batch


def allocated_peak(fn) -> int:
    """Bytes allocated at the peak while ``fn()`` ran, above what was allocated when it began.

    tracemalloc traces every Python object and every numpy buffer (numpy reports its buffers to
    it), touched or not, and its peak is reset here, so this counts the call's own allocations
    whole: an untouched ``np.empty`` of 4 GiB counts as 4 GiB. The process's lifetime peak RSS
    (``ru_maxrss``) cannot: it stays put below an earlier peak and never sees untouched pages.
    """
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1] - base
        if started:
            tracemalloc.stop()
    return peak


def test_the_allocation_measure_counts_a_buffer_never_touched():
    assert allocated_peak(lambda: np.empty(1 << 28, np.uint8)) >= 1 << 28


def test_hostile_declared_lengths_allocate_nothing_large():
    # Every length field claims ~4 GiB; the decoder must notice before allocating.
    def decode_all():
        for header in (b"\xc6", b"\xdb", b"\xdd", b"\xdf"):
            for _ in range(200):
                with pytest.raises(WireError):
                    decode_batch(header + struct.pack(">I", 0xFFFFFFF0) + b"\0" * 16)

    # Each 25-byte message may cost a few times its size (shared/wire.py) plus the error raised:
    # kilobytes. 64 KiB leaves room for those and is 65536 times below one declared length.
    assert allocated_peak(decode_all) < 64 << 10


# decode_batch then check_batch, as the trainer runs them, on valid messages with hostile fields:
# shapes that agree with their data (so decoding passes and the contract must judge), wrong
# types, extreme numbers, flipped array bytes.
VOCAB = 64
HOSTILE = [
    None,
    True,
    0,
    -1,
    2**31,
    2**63 - 1,
    2**64 - 1,
    -(2**63),
    1.5,
    float("nan"),
    float("inf"),
    "",
    "selected",
    "support",
    b"",
    b"\0" * 8,
    [],
    [0],
    [2**32 - 1, 0],
    {},
    {"dtype": "int32", "shape": [0], "data": b""},
]
ITEMSIZE = {"int32": 4, "float32": 4, "int64": 8, "uint8": 1}


@st.composite
def mutated_messages(draw) -> bytes:
    mode, k = draw(st.sampled_from(["selected", "support"])), draw(st.sampled_from([1, 2, 4]))
    batch = make_batch(
        samples=draw(st.integers(1, 3)),
        tokens_per_sample=draw(st.integers(0, 3)),
        k=k,
        vocab_size=VOCAB,
        mode=mode,
        top_k=draw(st.integers(1, k)) if mode == "support" else -1,
        seed=draw(st.integers(0, 3)),
    )
    doc = msgpack.unpackb(encode_batch(batch))
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(sorted(doc)))
        spec = doc[name]
        intact = (
            isinstance(spec, dict)
            and isinstance(spec.get("dtype"), str)
            and spec["dtype"] in ITEMSIZE
            and isinstance(spec.get("data"), bytes)
        )
        how = draw(st.sampled_from(["value", "reshape", "flip", "dtype", "shape", "data"])) if intact else "value"
        if how == "value":
            doc[name] = copy.deepcopy(
                draw(st.sampled_from(HOSTILE + ([0, -1, 2**20, 2**63 - 1] if name == "k" else [])))
            )
        elif how == "reshape":  # a shape its bytes agree with
            count = len(spec["data"]) // ITEMSIZE[spec["dtype"]]
            spec["shape"] = draw(
                st.sampled_from(
                    [[count], [count, 1], [1, count], [], [1, 1, count]]
                    + ([[0, 2**28], [2**40, 0], [0] * 65] if count == 0 else [])
                )
            )
        elif how == "flip" and spec["data"]:
            data = bytearray(spec["data"])
            data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
            spec["data"] = bytes(data)
        elif how in ("dtype", "shape", "data"):
            spec[how] = copy.deepcopy(draw(st.sampled_from(HOSTILE)))
    return msgpack.packb(doc, use_bin_type=True)


def test_mutated_valid_messages_raise_only_wire_error_or_contract_violation():
    slowest, largest = [0.0], [0]

    @settings(max_examples=1000, deadline=None)
    @given(message=mutated_messages())
    def one(message):
        def judge():
            try:
                check_batch(decode_batch(message), vocab_size=VOCAB)
            except (WireError, ContractViolation):
                pass  # the only acceptable failures

        started = time.perf_counter()
        largest[0] = max(largest[0], allocated_peak(judge))
        slowest[0] = max(slowest[0], time.perf_counter() - started)

    one()
    assert slowest[0] < 1.0  # seconds for one message of a few hundred bytes: no hang, no quadratic path
    # A message of a few hundred bytes holds arrays of at most a few hundred elements: the decoder's
    # views, the contract's [N, K] temporaries and an error message take kilobytes. 1 MiB is far
    # above that and far below what a hostile number (k = 2**63 - 1, a shape of 2**40) would allocate.
    assert largest[0] < 1 << 20


@pytest.mark.parametrize(
    "shape, message",
    [
        ([0, 2**62], r"'cand_ids' has shape \[0, 4611686018427387904\]: a dimension above max_message_bytes=268435456"),
        ([0] * 65, r"'cand_ids' has 65 dimensions, above max_ndim=2"),
        ([1, 1, 0], r"'cand_ids' has 3 dimensions, above max_ndim=2"),
    ],
)
def test_empty_array_with_impossible_dimensions_is_a_wire_error(shape, message):
    # An empty array needs no bytes, so no size check bounds its other dimensions; numpy refused them with ValueError.
    doc = msgpack.unpackb(encode_batch(make_batch(samples=1, tokens_per_sample=0, k=4)))
    doc["cand_ids"]["shape"] = shape
    with pytest.raises(WireError, match=message):
        decode_batch(msgpack.packb(doc, use_bin_type=True))


def test_each_samples_finish_reason_travels_and_a_batch_without_them_decodes_with_none():
    batch = replace(make_batch(samples=2, tokens_per_sample=3), finish_reasons=["stop", "session_budget"])
    assert decode_batch(encode_batch(batch)).finish_reasons == ["stop", "session_budget"]
    doc = msgpack.unpackb(encode_batch(batch))
    del doc["finish_reasons"]  # a batch recorded before the field existed
    assert decode_batch(msgpack.packb(doc)).finish_reasons == []
    doc["finish_reasons"] = ["stop", 3]
    with pytest.raises(WireError, match=r"field 'finish_reasons' must be a list of strings"):
        decode_batch(msgpack.packb(doc))

"""msgpack maps that carry numpy arrays (docs/design.md section 4): the array encoding that both the
batch wire format (``shared/wire.py``) and the proxy's binary answer (``shared/response_arrays.py``)
are written in. An array is a map ``{"dtype", "shape", "data"}`` whose ``data`` is little-endian
C-order bytes; ``encode_map`` writes a message, ``decode_map`` reads it back and ``array_value``
takes one of its arrays.

Decoding is done by a small strict msgpack reader instead of ``msgpack.unpackb`` for two
reasons: array payloads are wrapped as read-only numpy views of the message bytes (no
copy), and every declared length is checked against the bytes that are actually left
before anything is allocated, so hostile input costs at most a few times its own size.
Encoding uses ``msgpack.packb``, which writes the same subset.
"""

from __future__ import annotations

import functools
import math
import re
import struct
from dataclasses import dataclass

import msgpack
import numpy as np

# The wire dtypes an array may carry, by the name its map gives.
DTYPES = {"int32": np.dtype("<i4"), "float32": np.dtype("<f4"), "uint8": np.dtype("u1"), "int64": np.dtype("<i8")}


class WireError(ValueError):
    """Bytes that are not a valid message: a v2 batch (``shared/wire.py``) or the proxy's binary answer
    (``shared/response_arrays.py``). The message names the field and what was found."""


@dataclass(frozen=True, slots=True)
class WireLimits:
    """Upper bounds applied while decoding untrusted bytes."""

    max_message_bytes: int = 256 << 20
    max_depth: int = 4  # batch map -> array map -> shape list -> int
    max_map_len: int = 64
    max_list_len: int = 1 << 20  # sample ids, group ids, shape dims
    max_str_len: int = 4096
    max_ndim: int = 2


def encode_map(head: dict, arrays: dict[str, tuple[np.ndarray, str]]) -> bytes:
    """One msgpack map: ``head``'s plain values, then ``arrays`` (name -> (array, wire dtype)) in the
    array encoding of section 4. ``encode_batch`` writes batches with it, the proxy its binary answers
    (``shared/response_arrays.py``); ``decode_map`` and ``array_value`` read it back.

    The message is assembled as a list of msgpack fragments and raw array buffers joined
    once, so each array byte is copied exactly once (``msgpack.packb`` on the whole map
    regrows its buffer and copies the payload several times).
    """
    parts = [
        _map_header(len(head) + len(arrays)),
        msgpack.packb(head, use_bin_type=True)[_map_header_len(len(head)) :],
    ]
    for name, (value, dtype) in arrays.items():
        arr = np.ascontiguousarray(value, dtype=DTYPES[dtype])
        # A C-contiguous array is its own buffer: join copies its bytes straight into the message.
        parts += [_array_prefix(name, dtype), msgpack.packb(arr.shape), b"\xa4data", _bin_header(arr.nbytes), arr]
    return b"".join(parts)


@functools.cache
def _array_prefix(name: str, dtype: str) -> bytes:
    """key + '{"dtype": <dtype>, "shape": ' of an array field: the same bytes in every message."""
    return msgpack.packb(name) + b"\x83" + msgpack.packb("dtype") + msgpack.packb(dtype) + msgpack.packb("shape")


def _map_header(n: int) -> bytes:
    return bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")


def _map_header_len(n: int) -> int:
    return 1 if n < 16 else 3


def _bin_header(n: int) -> bytes:
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def decode_map(data: bytes | bytearray | memoryview, *, limits: WireLimits = WireLimits()) -> dict:
    """The top-level map of a message written by ``encode_map``, its array fields still to be taken
    with ``array_value``. Raises ``WireError`` for anything malformed or beyond ``limits``."""
    size = memoryview(data).nbytes
    if size > limits.max_message_bytes:
        raise WireError(
            f"message is {size} bytes, above the decoder limit max_message_bytes="
            f"{limits.max_message_bytes}; raise WireLimits.max_message_bytes if this is intended"
        )
    # Arrays must not change under the caller: mutable buffers are copied once, bytes are wrapped.
    reader = _Reader(data if type(data) is bytes else bytes(data), limits)
    doc = reader.read(0)
    if reader.pos != reader.end:
        raise WireError(f"{reader.end - reader.pos} trailing bytes after the top-level map")
    if not isinstance(doc, dict):
        raise WireError(f"top level is {type(doc).__name__}, expected a map")
    return doc


def array_value(doc: dict, name: str, dtype: str, limits: WireLimits = WireLimits()) -> np.ndarray:
    """Field ``name`` of a ``decode_map`` result as an array of wire dtype ``dtype`` (a read-only view
    of the message), else ``WireError`` naming what is wrong with it."""
    spec = required_field(doc, name)
    # The reader's canonical path already built and size-checked the view; only the dtype is left.
    if type(spec) is np.ndarray and spec.dtype == DTYPES[dtype]:
        return spec
    return _array_from_doc(name, spec, dtype, limits)


def required_field(doc: dict, name: str):
    """Field ``name`` of a ``decode_map`` result, else ``WireError`` naming it."""
    try:
        return doc[name]
    except KeyError:
        raise WireError(f"required field {name!r} is missing") from None


def _array_from_doc(name: str, spec, expected_dtype: str, limits: WireLimits) -> np.ndarray:
    if type(spec) is np.ndarray:
        raise WireError(f"array field {name!r} has dtype {spec.dtype.name!r}, expected {expected_dtype!r}")
    if not isinstance(spec, dict):
        raise WireError(f"array field {name!r} is {type(spec).__name__}, expected a map with dtype, shape, data")
    dtype, shape, data = spec.get("dtype"), spec.get("shape"), spec.get("data")
    if dtype != expected_dtype:
        raise WireError(f"array field {name!r} has dtype {dtype!r}, expected {expected_dtype!r}")
    if type(shape) is not list or not all(type(d) is int and d >= 0 for d in shape):
        raise WireError(f"array field {name!r} has shape {shape!r}, expected a list of non-negative ints")
    # An empty array needs no bytes whatever its other dimensions claim, so the size check below
    # cannot bound them: numpy would refuse [0, 2**62] or 65 dimensions with its own ValueError.
    if len(shape) > limits.max_ndim:
        raise WireError(f"array field {name!r} has {len(shape)} dimensions, above max_ndim={limits.max_ndim}")
    if any(d > limits.max_message_bytes for d in shape):
        raise WireError(
            f"array field {name!r} has shape {shape}: a dimension above max_message_bytes={limits.max_message_bytes}"
        )
    if not isinstance(data, (bytes, memoryview)):
        raise WireError(f"array field {name!r} has data of type {type(data).__name__}, expected bin")
    np_dtype = DTYPES[dtype]
    count = 1
    for d in shape:
        count *= d
    if count * np_dtype.itemsize != len(data):
        raise WireError(
            f"array field {name!r}: shape {shape} of {dtype} needs {count * np_dtype.itemsize} bytes, data has "
            f"{len(data)}"
        )
    return np.ndarray(shape, np_dtype, buffer=data)  # a view: no copy


class _Reader:
    """Strict reader for the msgpack subset used by the wire format (no ext types).

    Headers are read from ``raw`` (bytes indexing is the fastest path in CPython); bin
    payloads are returned as slices of ``view`` so arrays wrap the message without a copy.
    """

    __slots__ = ("raw", "view", "pos", "end", "limits")

    def __init__(self, raw: bytes, limits: WireLimits):
        self.raw, self.view, self.pos, self.end, self.limits = raw, memoryview(raw), 0, len(raw), limits

    def take(self, n: int) -> int:
        """Advance past ``n`` bytes and return where they start."""
        start = self.pos
        if start + n > self.end:
            raise WireError(f"truncated message: need {n} bytes at offset {start}, {self.end - start} left")
        self.pos = start + n
        return start

    def uint(self, n: int) -> int:
        start = self.take(n)
        return int.from_bytes(self.raw[start : start + n], "big")

    def read(self, depth: int):
        if depth > self.limits.max_depth:
            raise WireError(f"nesting deeper than {self.limits.max_depth} levels")
        pos = self.pos
        if pos >= self.end:
            raise WireError(f"truncated message: expected a value at offset {pos}")
        b = self.raw[pos]
        self.pos = pos + 1
        if b <= 0x7F:
            return b
        if 0xA0 <= b <= 0xBF:
            return self.str(b & 0x1F)
        if 0x80 <= b <= 0x8F:
            return self.map(b & 0x0F, depth)
        if 0x90 <= b <= 0x9F:
            return self.list(b & 0x0F, depth)
        if b >= 0xE0:
            return b - 0x100
        if b in (0xC4, 0xC5, 0xC6):
            n = self.uint(1 << (b - 0xC4))
            start = self.take(n)
            return self.view[start : start + n]  # a view of the message, not a copy
        if b == 0xC0:
            return None
        if b == 0xC2:
            return False
        if b == 0xC3:
            return True
        if b == 0xCA:
            return struct.unpack_from(">f", self.raw, self.take(4))[0]
        if b == 0xCB:
            return struct.unpack_from(">d", self.raw, self.take(8))[0]
        if 0xCC <= b <= 0xCF:
            return self.uint(1 << (b - 0xCC))
        if 0xD0 <= b <= 0xD3:
            n = 1 << (b - 0xD0)
            start = self.take(n)
            return int.from_bytes(self.raw[start : start + n], "big", signed=True)
        if b in (0xD9, 0xDA, 0xDB):
            return self.str(self.uint(1 << (b - 0xD9)))
        if b in (0xDC, 0xDD):
            return self.list(self.uint(2 if b == 0xDC else 4), depth)
        if b in (0xDE, 0xDF):
            return self.map(self.uint(2 if b == 0xDE else 4), depth)
        raise WireError(f"unsupported msgpack type byte 0x{b:02x} at offset {pos}")

    def str(self, n: int) -> str:
        if n > self.limits.max_str_len:
            raise WireError(f"string of {n} bytes at offset {self.pos}, above max_str_len={self.limits.max_str_len}")
        start = self.take(n)
        try:
            return self.raw[start : start + n].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise WireError(f"invalid UTF-8 in string at offset {start}: {exc.reason}") from None

    def list(self, n: int, depth: int) -> list:
        # Every element takes at least one byte, so a count above what is left is a lie.
        if n > self.limits.max_list_len or n > self.end - self.pos:
            raise WireError(f"list of {n} items at offset {self.pos} exceeds the limit or the bytes left")
        out = []
        raw, end = self.raw, self.end
        for _ in range(n):  # ids are fixstrs: decoded inline, anything else by the generic reader
            pos = self.pos
            b = raw[pos] if pos < end else 0
            stop = pos + 1 + (b & 0x1F)
            if 0xA0 <= b <= 0xBF and stop <= end:
                try:
                    out.append(raw[pos + 1 : stop].decode())
                    self.pos = stop
                    continue
                except UnicodeDecodeError:
                    pass  # the generic reader reports it with its offset
            out.append(self.read(depth + 1))
        return out

    def fixstr(self) -> str | None:
        """The next value if it is a fixstr (map keys, ids: most strings here), else None without moving."""
        raw, pos, end = self.raw, self.pos, self.end
        if pos < end and 0xA0 <= raw[pos] <= 0xBF:
            stop = pos + 1 + (raw[pos] & 0x1F)
            if stop <= end:
                try:
                    value = raw[pos + 1 : stop].decode()
                except UnicodeDecodeError:
                    return None  # the generic reader reports it with its offset
                self.pos = stop
                return value
        return None

    def map(self, n: int, depth: int) -> dict:
        if n > self.limits.max_map_len or 2 * n > self.end - self.pos:
            raise WireError(
                f"map of {n} entries at offset {self.pos} exceeds max_map_len={self.limits.max_map_len} or the bytes "
                "left"
            )
        out = {}
        raw = self.raw
        for _ in range(n):
            key = self.fixstr()
            if key is None:
                key = self.read(depth + 1)
                if type(key) is not str:
                    raise WireError(f"map key {key!r} is not a string")
            # Array maps of the top-level batch map start with 0x83 (a 3-entry map).
            value = self.canonical_array() if depth == 0 and self.pos < self.end and raw[self.pos] == 0x83 else None
            out[key] = value if value is not None else self.read(depth + 1)
        return out

    def canonical_array(self) -> np.ndarray | None:
        """Fast path for an array map laid out exactly as ``encode_map`` writes it.

        ``{"dtype": <wire dtype>, "shape": [<= 2 dims: fixint | uint8..32], "data": bin}`` in
        that order, matched by one compiled pattern; the result is a view of the message. Any
        other layout or a size that disagrees returns None and goes through the generic reader,
        which names the defect, so this path only saves time.
        """
        match = _CANONICAL_ARRAY.match(self.raw, self.pos)
        if match is None:
            return None
        dtype = _WIRE_DTYPES[match[1] or match[2]]
        shape = [d if d < 0x80 else int.from_bytes(dim[1:], "big") for dim in _DIM.findall(match[4]) for d in (dim[0],)]
        if len(shape) != match[3][0] - 0x90:
            return None
        size = int.from_bytes(match[5][1:], "big")
        start = match.end()
        if start + size > self.end or math.prod(shape) * dtype.itemsize != size:
            return None
        self.pos = start + size
        return np.ndarray(shape, dtype, buffer=self.view[start : start + size])


# The canonical array map: fixstr keys in encode order, dtype as a fixstr of its exact length,
# a fixarray of up to two dims (positive fixint or uint8/16/32), a bin header.
_CANONICAL_ARRAY = re.compile(
    rb"\x83\xa5dtype(?:\xa5(int32|int64|uint8)|\xa7(float32))\xa5shape([\x90-\x92])"
    rb"((?:[\x00-\x7f]|\xcc.|\xcd..|\xce....){0,2})\xa4data(\xc4.|\xc5..|\xc6....)",
    re.DOTALL,
)
_WIRE_DTYPES = {name.encode(): dtype for name, dtype in DTYPES.items()}
_DIM = re.compile(rb"[\x00-\x7f]|\xcc.|\xcd..|\xce....", re.DOTALL)

"""SGLang's candidate rows read straight from the response bytes, without a general JSON parse.

    b'[[[-2.903360335819789,10477,null],...],...]' -> ids int64 [R, K], log-probs float64 [R, K]

A native response with K=128 candidates for 1,024 tokens is 4.2 MB, nearly all of it
``output_top_logprobs``: ``orjson.loads`` spends its time building ~400k Python objects
that are then turned back into arrays. This module reads that one value as SGLang writes it
(orjson's compact output: rows of exactly K ``[logprob,id,null]`` entries) and returns None
for anything else; the caller then parses the whole body the general way, so a verdict never
depends on which way was taken. Two scanners do it, with the same results bit for bit:

- ``c``: ``router_proxy/_rowscan.c``, one pass over the bytes. ``setup.py`` builds it where a C
  compiler is present.
- ``numpy``: where it is not. It finds every ``null`` (one per entry), checks every other byte
  against the layout, and parses the numbers 8 bytes at a time (SWAR: digit lanes combined by
  multiply-and-shift in uint64).

``centerline bench proxy --audit-only`` times both against ``orjson.loads`` of the same body
(``docs/results.md``, Benchmarks).

``SCANNER`` says which one ``cut`` uses (None: neither, every body is parsed whole).

Exactness: floats are correctly rounded, so equal to orjson's bit for bit. A log-prob's decimal
digits become an exact integer m < 10^19 and a power of ten 10^e; with m < 2^53 and |e| <= 22
one float64 division or product is correctly rounded (C only); with |e| <= 27, both are exact
in x87 80-bit long double, m / 10^e (or m * 10^e) there is correctly rounded to 64 bits, and
rounding that to float64 is correct unless it lands exactly on a float64 midpoint (low 11 bits
0x400), where double rounding could err. Those, and numbers outside that range, are parsed one
by one by a correctly rounded parser (CPython's in C, ``orjson.loads`` in numpy). Where long
double is not the x87 format, ``EXACT`` is False and the numpy scanner is off.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import orjson

# The x87 80-bit format (64-bit mantissa, explicit integer bit) in 16 bytes: what the
# midpoint test below reads. Elsewhere (aarch64 quad, MSVC double) the scanner stays off.
EXACT = np.finfo(np.longdouble).nmant == 63 and np.dtype(np.longdouble).itemsize == 16

try:
    from router_proxy import _rowscan
except ImportError:  # built without a C compiler (setup.py)
    _rowscan = None

SCANNER = "c" if _rowscan is not None else "numpy" if EXACT else None

KEY = b'"output_top_logprobs":'
# A cut-out value is replaced by the integer -(_MARK * 10**8 + i), i its index; bodies holding these
# digits are never cut, so such an integer in the parsed remainder can only be a cut.
_MARK = 7205759403
_MARK_TEXT = b"%d" % _MARK


@dataclass(frozen=True)
class Scanned:
    """Rows read by ``scan_rows``, standing in a parsed response for its ``output_top_logprobs`` list."""

    ids: np.ndarray  # int64 [R, K]
    logprobs: np.ndarray  # float64 [R, K]

    def __len__(self) -> int:
        return len(self.ids)


_PAD = 32  # zero bytes appended to the body, so that every 8-byte read stays inside it
WIDTH = 24  # longest log-prob orjson writes ("-0.000012345678901234568"); a longer one: not scanned
_MAX_EXP10 = 27  # 5**27 < 2**64: 10**e is exact in long double up to here

_U = np.uint64
_ZEROS = _U(0x3030303030303030)  # eight ASCII '0'
_SEVEN = _U(0x7F7F7F7F7F7F7F7F)
_MOVEMASK = _U(0x0102040810204080)  # (0/1 per byte) * this >> 56: bit i = byte i


def _word(text: bytes) -> np.uint64:
    return _U(int.from_bytes(text, "little"))


_INNER = _word(b",null],[")  # the word at each entry's ",null": another entry of the row follows
_ROW_END = _word(b",null]],")  # ... the row's last entry, another row follows ("[[")
_LAST = _word(b",null]]]")  # ... the last entry of the last row
_POW10 = np.array([10**i for i in range(20)], np.uint64)
_POW10L = np.cumprod(np.full(_MAX_EXP10 + 1, 10, np.longdouble)) / 10  # 10**0 .. 10**27, each product exact
# [24, 3] words: bytes from column i on kept (0xFF), and 2 at column i (adding it turns a "." into "0").
_KEEP_FROM = np.array([np.frombuffer(bytes(i) + b"\xff" * (24 - i), np.uint64) for i in range(25)])
_DOT_TO_ZERO = np.array([np.frombuffer(bytes(i) + b"\x02" + bytes(23 - i), np.uint64) for i in range(24)])
_FLOAT_MID = _U(0x400)  # low 11 bits of a 64-bit mantissa exactly halfway between two float64s


def cut(body: bytes, k: int) -> tuple[bytes, list[Scanned]] | None:
    """``body`` with each ``"output_top_logprobs":`` value scanned and replaced by a marker integer, and
    the scanned rows in body order; None if there is none or one is not the compact K-wide layout.

    The caller must then find marker ``i`` exactly at the i-th sample's ``output_top_logprobs``
    (``marker_index``) before it trusts the result: a key inside a string, a duplicate key or a
    value elsewhere leaves a marker unaccounted for. The markers' digits never occur in the
    remainder otherwise (checked here), so a marker integer can only be a cut.
    """
    first = body.find(KEY)
    if first < 0 or SCANNER is None:
        return None
    read = _c_reader(body, k) if SCANNER == "c" else _numpy_reader(body, k, first)
    pieces, scanned, at = [], [], 0
    found = first
    while found >= 0:
        start = found + len(KEY)
        value = read(start)
        if value is None:
            return None
        rows, end = value
        pieces += (body[at:start], b"-%d%08d" % (_MARK, len(scanned)))
        scanned.append(rows)
        at = end
        found = body.find(KEY, end)
    pieces.append(body[at:])
    rest = b"".join(pieces)
    return (rest, scanned) if rest.count(_MARK_TEXT) == len(scanned) else None


def _c_reader(body: bytes, k: int):
    """``read(start)``: the rows of the value at ``start`` and the offset after it, or None (C scanner)."""

    def read(start: int) -> tuple[Scanned, int] | None:
        value = _rowscan.rows(body, start, k)
        if value is None:
            return None
        ids, logprobs, end = value
        return Scanned(np.frombuffer(ids, np.int64).reshape(-1, k), np.frombuffer(logprobs).reshape(-1, k)), end

    return read


def _numpy_reader(body: bytes, k: int, first: int):
    """``read(start)`` as ``_c_reader``'s, with numpy over the whole body's bytes, indexed once here."""
    padded = body + bytes(_PAD)
    buf = np.frombuffer(padded, np.uint8)
    words = np.ndarray((len(padded) - 7,), np.uint64, padded, 0, (1,))  # the word at every byte offset
    nq = np.flatnonzero(buf[first : len(body)] == 110) + first  # each "n", the entries' among them
    at_n = words[nq - 1]
    lasts = np.flatnonzero(at_n == _LAST)

    def read(start: int) -> tuple[Scanned, int] | None:
        i0 = np.searchsorted(nq, start)
        j = np.searchsorted(lasts, i0)
        if j == len(lasts) or padded[start : start + 3] != b"[[[":
            return None
        i1 = lasts[j] + 1
        rows = _scan(padded, buf, words, nq[i0:i1], at_n[i0:i1], start, k)
        return None if rows is None else (rows, int(nq[i1 - 1]) + 7)

    return read


def _scan(padded: bytes, buf, words, nq, at_n, start: int, k: int) -> Scanned | None:
    """The rows whose entries' ``null`` are at ``nq`` (the value opening at ``start``), or None."""
    e = len(nq)
    if e % k:
        return None
    row_end = np.arange(1, e + 1) % k == 0
    expect = np.where(row_end, _ROW_END, _INNER)
    expect[-1] = _LAST
    fs = np.empty(e, np.int64)  # each log-prob's first byte
    fs[0] = start + 3
    fs[1:] = nq[:-1] + 7 + 2 * row_end[:-1]
    ends = fs[1:][row_end[:-1]]  # rows after the first: "[[" before their first entry
    if not ((at_n == expect).all() and (buf[ends - 1] == 91).all() and (buf[ends - 2] == 91).all()):
        return None
    ids, fe = _ids(words[nq - 9], nq)
    if ids is None:
        return None
    lf = fe - fs
    if lf.min() < 1 or lf.max() > WIDTH:
        return None
    logprobs = _logprobs(padded, words, fe, lf)
    if logprobs is None:
        return None
    return Scanned(ids.reshape(-1, k), logprobs.reshape(-1, k))


def _ids(window: np.ndarray, nq: np.ndarray):
    """Ids from the 8 bytes before each entry's ``,null`` (``...,ID``): (int64 ids, offset of the comma before
    each), or (None, None) unless each is a JSON integer of at most 7 characters."""
    at = _highest(_movemask(_equal(window, 44)))  # the comma before the id, within the window
    if at.min() < 0 or at.max() > 6:
        return None, None
    first = (window >> (_U(8) * (at + 1).astype(np.uint64))) & _U(0xFF)
    neg = first == 45
    digits = 7 - at - neg
    if digits.min() < 1:
        return None, None
    padded = _keep_high(window, digits)
    lead = (window >> (_U(8) * (at + 1 + neg).astype(np.uint64))) & _U(0xFF)
    if not _all_digits(padded).all() or ((lead == 48) & (digits > 1)).any():  # JSON has no leading zeros
        return None, None
    value = _digits8(padded).astype(np.int64)
    return np.where(neg, -value, value), nq - 9 + at


def _logprobs(padded: bytes, words: np.ndarray, fe: np.ndarray, lf: np.ndarray):
    """The JSON numbers of ``lf`` bytes ending before ``fe`` as orjson reads them (float64), or None.

    Each number is read right-aligned in 24 bytes (byte 23 its last). Numbers of the form
    ``-?digits.digits`` are parsed here: the mantissa's digits, the dot read as a 0, give
    V = int * 10^(f+1) + frac, so m = (V + 9 * (V mod 10^f)) / 10 and the value is m / 10^f.
    Any other form (an exponent, no dot, anything unexpected) is read by ``orjson.loads`` alone.
    """
    e = len(fe)
    r = np.empty((e, 3), np.uint64)
    for i in range(3):
        r[:, i] = words[fe - 8 * (3 - i)]
    b = r.view(np.uint8)  # [e, 24]
    lead = _U(24) - lf.astype(np.uint64)  # the number's first byte
    first = _U(1) << lead
    others = _movemask24((b - 48) > 9) & ((_U(1) << _U(24)) - first)  # non-digits of the number
    rest = others & ~first
    dot = _highest(rest)
    rows = np.arange(e)
    plain = ((rest & (rest - _U(1))) == 0) & (rest != 0) & (dot < 23)  # one non-digit after the first byte
    plain &= b[rows, np.maximum(dot, 0)] == 46
    neg = (others & first) != 0
    plain &= ~neg | (b[rows, lead] == 45)
    int_start = lead.astype(np.int64) + neg
    int_len = dot - int_start
    plain &= int_len >= 1
    long_int = np.flatnonzero(plain & (int_len > 1))
    plain[long_int] &= b[long_int, int_start[long_int]] != 48  # JSON has no leading zeros

    keep = _KEEP_FROM[np.clip(int_start, 0, 24)]
    r &= keep
    r |= _ZEROS & ~keep
    r += _DOT_TO_ZERO[np.clip(dot, 0, 23)]  # the digits, "." read as "0"
    v = _digits8(r)
    plain &= v[:, 0] < 100  # V < 10**18
    big_v = v[:, 0] * _U(10**16) + v[:, 1] * _U(10**8) + v[:, 2]
    frac_len = 23 - dot
    scale = _POW10[np.clip(frac_len, 0, 19)]
    m = (big_v + _U(9) * (big_v % scale)) // _U(10)
    value = m.astype(np.longdouble) / _POW10L[np.clip(frac_len, 0, _MAX_EXP10)]
    plain &= (value.view(np.uint64)[::2] & _U(0x7FF)) != _FLOAT_MID  # double rounding could err here
    out = value.astype(np.float64)
    out = np.where(neg, -out, out)
    for i in np.flatnonzero(~plain).tolist():
        try:
            exact = orjson.loads(padded[int(fe[i] - lf[i]) : int(fe[i])])
        except orjson.JSONDecodeError:
            return None
        if type(exact) is int and abs(exact) < 2**53:
            exact = float(exact)
        if type(exact) is not float:
            return None
        out[i] = exact
    return out


def _equal(words: np.ndarray, byte: int) -> np.ndarray:
    """0x80 in each byte of each word equal to ``byte``, 0 elsewhere (exact: no borrow between bytes)."""
    y = words ^ _U(byte * 0x0101010101010101)
    return ~(((y & _SEVEN) + _SEVEN) | y | _SEVEN)


def _movemask(high: np.ndarray) -> np.ndarray:
    """Bytes' high bits (0x80 or 0) -> an 8-bit mask, bit i for byte i."""
    return ((high >> _U(7)) * _MOVEMASK) >> _U(56)


def _movemask24(flags: np.ndarray) -> np.ndarray:
    """[e, 24] bools -> 24-bit masks (uint64), bit i for column i."""
    m = (flags.view(np.uint64) * _MOVEMASK) >> _U(56)
    return m[:, 0] | (m[:, 1] << _U(8)) | (m[:, 2] << _U(16))


def _highest(mask: np.ndarray) -> np.ndarray:
    """The highest set bit of each mask (< 2**53), -1 where none."""
    return np.frexp(mask.astype(np.float64))[1].astype(np.int64) - 1


def _digits8(words: np.ndarray) -> np.ndarray:
    """Eight ASCII digits per word (first byte most significant) -> their value; words must hold only digits.

    Works in place on ``words`` (a temporary): a fresh multi-megabyte array per step costs page faults.
    """
    v = words
    v -= _ZEROS
    for lane, mask in ((8, 0x00FF00FF00FF00FF), (16, 0x0000FFFF0000FFFF), (32, 0xFFFFFFFF)):
        high = v >> _U(lane)
        v *= _U(10 ** (lane // 8))
        v += high
        v &= _U(mask)
    return v


def _all_digits(words: np.ndarray) -> np.ndarray:
    """Whether every byte of each word is an ASCII digit."""
    high = _U(0xF0F0F0F0F0F0F0F0)
    return ((words & high) | (((words + _U(0x0606060606060606)) & high) >> _U(4))) == _U(0x3333333333333333)


def _keep_high(words: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
    """Each word's top ``nbytes`` bytes (0..8) kept, the others set to ASCII '0': right-aligned digits."""
    keep = ~_U(0) << (_U(8) * (_U(8) - nbytes.astype(np.uint64)))  # numpy: a shift by 64 gives 0
    return (words & keep) | (_ZEROS & ~keep)


def marker_index(value) -> int | None:
    """The cut index a parsed marker integer stands for, else None."""
    if type(value) is not int:
        return None
    index = -value - _MARK * 10**8
    return index if 0 <= index < 10**8 else None

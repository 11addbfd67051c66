"""Bits at rest: a static rANS entropy coder over bytes, and a row coder that models each byte column.

A packed cache stores every code in a fixed number of bits, which a kernel can read in place. At rest (a saved
file, an LMCache chunk) the bytes are read once, on load, so they can be stored shorter when the codes are not
equally likely: a Lloyd-Max quantizer's inner levels are used more often than its outer ones, an fp16 scale's
high byte takes few values. This module measures and realises that gain; nothing here is on a decode path.

:func:`encode` codes a 1-D ``uint8`` array with a static order-0 model (its normalised byte histogram, stored in
the blob) by rANS (J. Duda, "Asymmetric numeral systems", 2013; F. Giesen's ``rans_word`` form: 32-bit states,
16-bit words, :data:`PROB_BITS`-bit frequencies). The symbols are cut into ``S`` interleaved streams of ``N``
symbols, each coded on its own, so numpy steps all streams at once and a Python loop runs ``N`` times, not once
per symbol. Every stream starts from the state :data:`RANS_L`, so :func:`decode` ends on it exactly: that, the
word counts and the frequency table check a blob on the way back (a damaged blob is refused, not decoded to
garbage).

:func:`encode_rows` codes a ``[rows, width]`` byte array (one row per stored vector: a packed field's bytes, an
fp16 scale's two bytes) with one model per byte column class ``j mod period``: the bytes of a 4-bit code, of a
scale's exponent, or of one position in a 3-byte group of 3-bit codes each have their own histogram. The
period is the one among :data:`PERIODS` whose empirical order-0 entropy, tables counted, is smallest.

Blob layout (little-endian), :func:`encode`::

    "WKVR" | version u8 | prob_bits u8 | reserved u16 | n u64 | streams u32 | per_stream u32
    | freq u16[256] | counts u32[streams] | states u32[streams] | words u16[sum(counts)]

and :func:`encode_rows`: ``"WKVC" | version u8 | period u8 | reserved u16 | rows u64 | width u32 | then per
class: length u64 | an encode blob``; period 0 marks rows stored as they are (``rows * width`` bytes), which
:func:`encode_rows` writes whenever coding would not make them shorter: a blob is never more than 20 bytes longer
than its rows.
"""

from __future__ import annotations

import struct

import numpy as np

__all__ = [
    "PERIODS",
    "PROB_BITS",
    "RANS_L",
    "RansError",
    "decode",
    "decode_rows",
    "encode",
    "encode_rows",
    "order0_bits",
]

#: Frequency precision: the model's probabilities are multiples of ``2**-PROB_BITS``.
PROB_BITS = 14
#: The state's lower bound: states live in ``[RANS_L, 2**32)`` and move 16 bits at a time.
RANS_L = 1 << 16
#: Symbols per stream the coder aims at (fewer Python steps with more streams; 8 bytes of state per stream).
STREAM_SYMBOLS = 8192
#: The byte-column periods :func:`encode_rows` chooses among.
PERIODS = (1, 2, 3, 4, 8)

_MAGIC, _ROWS_MAGIC, _VERSION = b"WKVR", b"WKVC", 1
_HEAD = struct.Struct("<4sBBHQII")
_ROWS_HEAD = struct.Struct("<4sBBHQI")
_TABLE_BYTES = 256 * 2


class RansError(ValueError):
    """A blob :func:`decode` or :func:`decode_rows` refuses: truncated, of another format, or damaged."""


def order0_bits(symbols: np.ndarray) -> float:
    """Total bits an ideal order-0 coder needs for ``symbols`` (``uint8``): ``n`` times their empirical entropy."""
    counts = np.bincount(np.asarray(symbols, dtype=np.uint8).ravel(), minlength=256).astype(np.float64)
    n = counts.sum()
    nz = counts[counts > 0]
    return float(-(nz * np.log2(nz / n)).sum()) if n else 0.0


def _frequencies(symbols: np.ndarray, prob_bits: int) -> np.ndarray:
    """The histogram scaled to sum ``2**prob_bits``, every symbol that occurs at least 1."""
    total = 1 << prob_bits
    hist = np.bincount(symbols, minlength=256).astype(np.int64)
    freq = hist * total // max(int(hist.sum()), 1)
    freq[(hist > 0) & (freq == 0)] = 1
    diff = total - int(freq.sum())
    if diff > 0:
        freq[int(np.argmax(hist))] += diff
    for idx in np.argsort(-freq, kind="stable"):  # too many: take from the largest, none below 1
        if diff >= 0:
            break
        take = min(-diff, int(freq[idx]) - 1)
        freq[idx] -= take
        diff += take
    return freq


def encode(symbols: np.ndarray, *, prob_bits: int = PROB_BITS, stream_symbols: int = STREAM_SYMBOLS) -> bytes:
    """rANS-code a byte array with its own order-0 model.

    Args:
        symbols: ``uint8`` values, any shape (coded flattened).
        prob_bits: frequency precision, 8..15.
        stream_symbols: symbols per interleaved stream (about; the last is padded with the commonest byte).

    Returns:
        The blob (layout in the module docstring); :func:`decode` gives ``symbols.ravel()`` back.

    Raises:
        ValueError: ``symbols`` not ``uint8``, ``prob_bits`` or ``stream_symbols`` out of range.
    """
    sym = np.asarray(symbols)
    if sym.dtype != np.uint8:
        raise ValueError(f"rANS codes bytes: give a uint8 array, got {sym.dtype}")
    if not 8 <= prob_bits <= 15:
        raise ValueError(f"prob_bits must be in 8..15, got {prob_bits}")
    if stream_symbols < 1:
        raise ValueError(f"stream_symbols must be at least 1, got {stream_symbols}")
    sym = sym.ravel()
    n = sym.size
    freq = _frequencies(sym, prob_bits) if n else np.zeros(256, dtype=np.int64)
    streams = max(1, -(-n // stream_symbols))
    per = -(-n // streams) if n else 0
    if n:
        grid = np.full(streams * per, int(np.argmax(freq)), dtype=np.uint8)
        grid[:n] = sym
        grid = grid.reshape(streams, per)
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]]).astype(np.uint64)
    f64 = freq.astype(np.uint64)
    x = np.full(streams, RANS_L, dtype=np.uint64)
    words = np.empty((per, streams), dtype=np.uint16)
    emit = np.zeros((per, streams), dtype=bool)
    shift, pb = np.uint64(32 - prob_bits), np.uint64(prob_bits)
    for t in range(per):  # the last symbol first: rANS decodes in the opposite order
        s = grid[:, per - 1 - t]
        fs, cs = f64[s], cum[s]
        m = x >= (fs << shift)
        words[t] = (x & np.uint64(0xFFFF)).astype(np.uint16)
        emit[t] = m
        x = np.where(m, x >> np.uint64(16), x)
        x = ((x // fs) << pb) + (x % fs) + cs
    counts = emit.sum(axis=0).astype(np.uint32)
    body = words.T[emit.T]  # stream by stream, in the order written
    head = _HEAD.pack(_MAGIC, _VERSION, prob_bits, 0, n, streams, per)
    return b"".join(
        [
            head,
            freq.astype("<u2").tobytes(),
            counts.astype("<u4").tobytes(),
            x.astype("<u4").tobytes(),
            body.astype("<u2").tobytes(),
        ]
    )


def _take(blob: memoryview, at: int, size: int, what: str) -> tuple[memoryview, int]:
    if at + size > len(blob):
        raise RansError(f"truncated: the blob ends inside its {what} ({len(blob)} bytes, {at + size} needed)")
    return blob[at : at + size], at + size


def decode(blob: bytes | memoryview) -> np.ndarray:
    """The ``uint8`` array :func:`encode` coded, flattened.

    Raises:
        RansError: a truncated blob, another format or version, a frequency table that does not sum to
            ``2**prob_bits``, word counts that do not match, or streams that do not end where they began (the
            words were changed).
    """
    view = memoryview(blob)
    raw, at = _take(view, 0, _HEAD.size, "header")
    magic, version, prob_bits, _, n, streams, per = _HEAD.unpack(raw)
    if magic != _MAGIC:
        raise RansError(f"not a walshkv rANS blob (magic {bytes(magic)!r}, expected {_MAGIC!r})")
    if version != _VERSION:
        raise RansError(f"rANS blob version {version}; this walshkv reads version {_VERSION}")
    if not 8 <= prob_bits <= 15 or streams < 1 or streams * per < n or (n and per * (streams - 1) >= n):
        raise RansError(f"damaged header: prob_bits {prob_bits}, {streams} streams of {per} for {n} symbols")
    raw, at = _take(view, at, _TABLE_BYTES, "frequency table")
    freq = np.frombuffer(raw, dtype="<u2").astype(np.int64)
    raw, at = _take(view, at, 4 * streams, "word counts")
    counts = np.frombuffer(raw, dtype="<u4").astype(np.int64)
    raw, at = _take(view, at, 4 * streams, "stream states")
    x = np.frombuffer(raw, dtype="<u4").astype(np.uint64)
    total_words = int(counts.sum())
    raw, at = _take(view, at, 2 * total_words, "words")
    if at != len(view):
        raise RansError(f"{len(view) - at} bytes after the last word: not one blob, or a damaged one")
    body = np.frombuffer(raw, dtype="<u2").astype(np.uint64)
    if n == 0:
        return np.zeros(0, dtype=np.uint8)
    total = 1 << prob_bits
    if int(freq.sum()) != total:
        raise RansError(f"damaged frequency table: it sums to {int(freq.sum())}, not {total}")
    if (x < RANS_L).any():
        raise RansError("damaged stream states: one is below the coder's lower bound")
    cum = np.concatenate([[0], np.cumsum(freq)[:-1]])
    slot_symbol = np.repeat(np.arange(256, dtype=np.uint8), freq)
    f64, c64 = freq.astype(np.uint64), cum.astype(np.uint64)
    ptr = np.cumsum(counts) - 1  # each stream's last word is read first
    first = ptr - counts + 1
    out = np.empty((streams, per), dtype=np.uint8)
    mask, pb = np.uint64(total - 1), np.uint64(prob_bits)
    for i in range(per):
        slot = x & mask
        s = slot_symbol[slot]
        out[:, i] = s
        x = f64[s] * (x >> pb) + slot - c64[s]
        m = x < RANS_L
        if m.any():
            if (ptr[m] < first[m]).any():
                raise RansError("damaged words: a stream needs more words than it holds")
            x[m] = (x[m] << np.uint64(16)) | body[ptr[m]]
            ptr[m] -= 1
    if (ptr != first - 1).any() or (x != RANS_L).any():
        raise RansError("damaged words: the streams do not end where they began")
    return out.ravel()[:n]


def _period_cost(rows: np.ndarray, period: int) -> float:
    """Estimated bits of :func:`encode_rows` at ``period``: each class's order-0 bits plus its table."""
    return sum(order0_bits(rows[:, c::period]) + 8 * _TABLE_BYTES for c in range(period))


def encode_rows(rows: np.ndarray, *, period: int | None = None) -> bytes:
    """Code a ``[rows, width]`` byte array with one model per byte column class (``column mod period``).

    Args:
        rows: ``uint8`` ``[rows, width]`` (one stored vector's bytes per row).
        period: the column period (``None``: the one of :data:`PERIODS` up to ``width`` with the fewest
            estimated bits).

    Returns:
        The blob (module docstring); :func:`decode_rows` gives ``rows`` back. Rows that coding would not make
        shorter are stored as they are (period 0).

    Raises:
        ValueError: ``rows`` not a 2-D ``uint8`` array, or ``period`` below 1.
    """
    arr = np.asarray(rows)
    if arr.dtype != np.uint8 or arr.ndim != 2:
        raise ValueError(f"encode_rows takes a 2-D uint8 array [rows, width], got {arr.dtype} {tuple(arr.shape)}")
    width = arr.shape[1]
    if period is None:
        choices = [p for p in PERIODS if p <= max(width, 1)]
        period = min(choices, key=lambda p: _period_cost(arr, p))
    if period < 1:
        raise ValueError(f"period must be at least 1, got {period}")
    parts = [_ROWS_HEAD.pack(_ROWS_MAGIC, _VERSION, period, 0, arr.shape[0], width)]
    for c in range(period):
        blob = encode(np.ascontiguousarray(arr[:, c::period]))
        parts += [struct.pack("<Q", len(blob)), blob]
    coded = b"".join(parts)
    if len(coded) - _ROWS_HEAD.size < arr.size:
        return coded
    # no shorter coded (near-uniform bytes, or too few for the tables to pay): stored as they are, period 0
    return _ROWS_HEAD.pack(_ROWS_MAGIC, _VERSION, 0, 0, arr.shape[0], width) + np.ascontiguousarray(arr).tobytes()


def decode_rows(blob: bytes | memoryview) -> np.ndarray:
    """The ``uint8`` ``[rows, width]`` array :func:`encode_rows` coded.

    Raises:
        RansError: as :func:`decode`, and a class whose symbol count does not fit the header's shape.
    """
    view = memoryview(blob)
    raw, at = _take(view, 0, _ROWS_HEAD.size, "row header")
    magic, version, period, _, n_rows, width = _ROWS_HEAD.unpack(raw)
    if magic != _ROWS_MAGIC:
        raise RansError(f"not a walshkv row blob (magic {bytes(magic)!r}, expected {_ROWS_MAGIC!r})")
    if version != _VERSION:
        raise RansError(f"row blob version {version}; this walshkv reads version {_VERSION}")
    if period == 0:  # stored
        raw, at = _take(view, at, n_rows * width, "stored bytes")
        if at != len(view):
            raise RansError(f"{len(view) - at} bytes after the stored rows: not one blob, or a damaged one")
        return np.frombuffer(raw, dtype=np.uint8).reshape(n_rows, width).copy()
    out = np.empty((n_rows, width), dtype=np.uint8)
    for c in range(period):
        raw, at = _take(view, at, 8, f"length of class {c}")
        (size,) = struct.unpack("<Q", raw)
        raw, at = _take(view, at, size, f"class {c}")
        cols = out[:, c::period]
        got = decode(raw)
        if got.size != cols.size:
            raise RansError(f"damaged: class {c} holds {got.size} bytes, the header's shape needs {cols.size}")
        out[:, c::period] = got.reshape(cols.shape)
    if at != len(view):
        raise RansError(f"{len(view) - at} bytes after the last class: not one blob, or a damaged one")
    return out

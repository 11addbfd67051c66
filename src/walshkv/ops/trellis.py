"""Tail-biting bitshift trellis quantization: the math of ``tcq`` (walshkv/codecs/trellis.py).

A bitshift trellis (as in QTIP, Tseng, Sun, Hou, De Sa, arXiv:2406.11235) codes a sequence of ``n`` values with
``k_i`` bits each as one bit stream. The reconstruction of value ``i`` is ``table[state_i]``, where ``state_i`` is
the last ``L`` bits of the stream up to and including value ``i``'s own ``k_i`` bits (newest bits lowest):
``state_i = ((state_{i-1} << k_i) | code_i) mod 2**L``. Every value is one table lookup at decode, wherever it
sits, so a reader needs no search; the encoder chooses the whole stream at once with the Viterbi algorithm over the
``2**L`` states, which is what buys the distance to the scalar quantizer (about 1.9 dB at 3 bits with ``L = 8`` on a
unit Gaussian, trained table: 1.52 dB above ``D(R)``, where a scalar Lloyd-Max quantizer sits 3.45 dB above it).

The stream is *tail-biting*: it wraps around, so value 0's state takes its high bits from the end of the stream
and the code costs exactly ``sum(k_i)`` bits, with no start state. The encoder finds a wrapped path in two passes
(the first on the sequence rotated by half picks the state where it wraps, the second is constrained to start and
end there), an approximation of the best wrapped path that loses little.

Tables (``[2**L]`` float32, one per width pattern and ``L``) are trained offline on unit Gaussian samples by
alternating Viterbi coding and per-state centroids (:func:`train_table`, ``scripts/train_trellis_tables.py``) and
ship beside this file, so every machine decodes the same values. They ship in numbered *sets*
(:data:`TABLE_SETS`), one file each, and a set never changes once shipped: set 1 (``trellis_tables.json``, 20
rounds of 8192 vectors) is what ``tcq:B`` means, set 2 (``trellis_tables_2.json``, 60 rounds of 16384 vectors, the
better of two seeded starts, 0.1-0.3 dB closer to ``D(R)``) is what ``tcq:B:tables=2`` means. Set 3
(``trellis_tables_3.json``, ``tcq:B:tables=3``) is *split* (:data:`SPLIT_SETS`): each table is the float32 sum of
two 16-entry parts over the state's low and high four bits, ``table[s] = P[s & 15] + Q[s >> 4]``
(:func:`table_parts`), trained under that structure (:func:`train_table_parts`), so that a CPU
without byte permutes (AVX2) reads it with register permutes instead of a gather; every other reader reads its
256 values as any set's. Set 4 (``trellis_tables_4.json``, ``tcq:B:tables=4``) is set 2 with every value rounded to
bfloat16 (:data:`ROUNDED_SETS`; 0.001 dB or less from set 2 on a Gaussian): each float32 value's low 16 bits are
zero, so the VBMI decoder looks up the two high bytes of each value and not four. A spec therefore names the values
its codes decode to, and a saved cache or a KLD row of one set stays true when another ships.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from importlib import resources

import torch

__all__ = [
    "ROUNDED_SETS",
    "SPLIT_SETS",
    "STATE_BITS",
    "TABLE_SETS",
    "TAP_UNUSED",
    "TRELLIS_BITS",
    "codes_to_states",
    "encode",
    "gaussian_table",
    "round_bf16",
    "split_table",
    "state_taps",
    "step_widths",
    "table",
    "table_file",
    "table_key",
    "table_parts",
    "train_table",
    "train_table_parts",
    "viterbi",
]

#: Bit widths with a shipped table: whole widths 1..5 and the half widths between.
TRELLIS_BITS: tuple[float, ...] = (1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0)
#: State sizes (``L``, bits) with shipped tables: 8 (256 states). A larger state codes closer to D(R) (an untrained
#: L=10 table: 1.49 dB above it at 3 bits, against 2.28 dB untrained and 1.52 dB trained at L=8) but the encoder's
#: work grows as 2**L; a table for another L is one more line here and a run of scripts/train_trellis_tables.py.
STATE_BITS: tuple[int, ...] = (8,)
#: The shipped table sets (:func:`table_file`): 1, the first training, 2, trained three times as long on twice
#: the vectors (``scripts/train_trellis_tables.py --set 2``), 3, split tables (:data:`SPLIT_SETS`), and 4, set 2
#: rounded to bfloat16 (:data:`ROUNDED_SETS`).
TABLE_SETS: tuple[int, ...] = (1, 2, 3, 4)
#: Table sets that are another set's tables with every value rounded to bfloat16 (to nearest, ties to even), by the
#: set they round: a float32 value whose low 16 bits are zero, which a byte-permute decoder reads from two byte planes.
ROUNDED_SETS: dict[int, int] = {4: 2}
#: Table sets whose every table is a sum of small parts over groups of the state's bits, by structure: ``"44"``,
#: ``table[s] = P[s & 15] + Q[s >> 4]`` (float32 sum; :func:`table_parts` gives ``P`` then ``Q``).
SPLIT_SETS: dict[int, str] = {3: "44"}
#: The shift :func:`state_taps` gives a tap a value does not need (a 32-bit lane shifted this far is 0).
TAP_UNUSED = 32
_CHUNK = 4096  # vectors per Viterbi call: the back pointers take n * 2**(L-k) bytes per vector


def step_widths(bits: float, n: int) -> tuple[int, ...]:
    """Bits per value for ``n`` values at ``bits``: the first ``n/2`` at ``ceil(bits)``, the rest at ``floor(bits)``.

    Args:
        bits: a whole or half width.
        n: number of values (even for a half width).

    Returns:
        ``n`` widths.
    """
    if float(bits).is_integer():
        return (int(bits),) * n
    half = n // 2
    return (math.ceil(bits),) * half + (math.floor(bits),) * (n - half)


def table_key(bits: float, state_bits: int) -> str:
    """The key of a table in a table set's file: ``"B/L"`` (``"3/8"``, ``"2.5/8"``)."""
    return f"{bits:g}/{state_bits}"


def table_file(tables: int = 1) -> str:
    """The file name (in ``walshkv.ops``) of table set ``tables``: ``trellis_tables.json``, ``trellis_tables_2.json``.

    Raises:
        ValueError: ``tables`` is not one of :data:`TABLE_SETS`.
    """
    if isinstance(tables, bool) or tables not in TABLE_SETS:
        raise ValueError(
            f"trellis table set is one of {', '.join(map(str, TABLE_SETS))}; got {tables!r} "
            "(set 1 is tcq's default, set 2 the longer-trained tables, set 3 the split tables AVX2 reads by permutes, "
            "set 4 set 2 rounded to bfloat16)"
        )
    return "trellis_tables.json" if tables == 1 else f"trellis_tables_{tables}.json"


def gaussian_table(state_bits: int, seed: int = 0) -> torch.Tensor:
    """The untrained table: the ``2**L`` quantiles of N(0, 1) at ``(i + 1/2) / 2**L``, in a seeded random order.

    Args:
        state_bits: ``L``.
        seed: seed of the permutation.

    Returns:
        float32 ``[2**L]``.
    """
    size = 1 << state_bits
    perm = torch.randperm(size, generator=torch.Generator().manual_seed(seed))
    q = (perm.to(torch.float64) + 0.5) / size
    return (math.sqrt(2.0) * torch.erfinv(2.0 * q - 1.0)).to(torch.float32)


def round_bf16(values: torch.Tensor) -> torch.Tensor:
    """``values`` rounded to bfloat16 (to nearest, ties to even) and back to float32: what a rounded set
    (:data:`ROUNDED_SETS`) holds of its source set's tables."""
    return values.to(torch.float32).to(torch.bfloat16).to(torch.float32)


@functools.cache
def _set(tables: int) -> dict:
    text = resources.files("walshkv.ops").joinpath(table_file(tables)).read_text(encoding="utf-8")
    return json.loads(text)


def _tables(tables: int) -> dict[str, list[float]]:
    return _set(tables)["tables"]


def split_table(parts: torch.Tensor, state_bits: int = 8) -> torch.Tensor:
    """The table of a ``"44"`` split: ``table[s] = P[s & 15] + Q[s >> 4]``, summed in float32.

    Args:
        parts: float32 ``[32]``: ``P`` (16 values) then ``Q`` (16 values).
        state_bits: ``L``; the split covers ``L = 8`` only.

    Returns:
        float32 ``[256]``.

    Raises:
        ValueError: ``parts`` is not 32 values, or ``state_bits`` is not 8.
    """
    if state_bits != 8 or parts.shape != (32,):
        raise ValueError(
            f"a 44 split is 32 parts (P then Q) of an L=8 table; got {tuple(parts.shape)} at L={state_bits}"
        )
    s = torch.arange(256)
    p, q = parts.to(torch.float32)[:16], parts.to(torch.float32)[16:]
    return p[s & 15] + q[s >> 4]


def table_parts(bits: float, state_bits: int, tables: int = 1) -> torch.Tensor | None:
    """The parts of a split set's table (float32 ``[32]``: ``P`` then ``Q``, :data:`SPLIT_SETS`), or ``None`` for a
    set whose tables are 256 free values.

    Raises:
        ValueError: no table ships for this pair or set (as :func:`table`), or its parts do not sum to its table.
    """
    tab = table(bits, state_bits, tables)  # the same checks and message
    if tables not in SPLIT_SETS:
        return None
    parts = torch.tensor(_set(tables)["parts"][table_key(bits, state_bits)], dtype=torch.float32)
    if not torch.equal(split_table(parts, state_bits), tab):  # the AVX2 decoder sums them: they must be the table
        raise ValueError(
            f"table set {tables}'s parts for {bits:g} bits do not sum to its table: the file "
            f"{table_file(tables)} is damaged (reinstall walshkv)"
        )
    return parts


def table(bits: float, state_bits: int, tables: int = 1) -> torch.Tensor:
    """The shipped table for ``bits`` and ``L = state_bits`` from table set ``tables`` (float32 ``[2**L]``, fresh).

    Raises:
        ValueError: no table ships for this pair or set (the message lists the widths, state sizes and sets that do).
    """
    key = table_key(bits, state_bits)
    values = _tables(tables).get(key)
    if values is None:
        raise ValueError(
            f"no trellis table for {bits:g} bits with L={state_bits}; tables ship for bits "
            f"{', '.join(f'{b:g}' for b in TRELLIS_BITS)} and L in {', '.join(map(str, STATE_BITS))}"
        )
    return torch.tensor(values, dtype=torch.float32)


def _viterbi(
    x: torch.Tensor, tab: torch.Tensor, widths: tuple[int, ...], state_bits: int, wrap: torch.Tensor | None
) -> torch.Tensor:
    """States ``[N, n]`` (int64) of the least-squares path; with ``wrap``, the path starts and ends there."""
    count, n = x.shape
    size = 1 << state_bits
    idx = torch.arange(size, device=x.device)
    cost = (x[:, :1] - tab) ** 2
    if wrap is not None:  # value 0's high L-k0 bits are the wrap bits
        cost = torch.where((idx >> widths[0]) == wrap[:, None], cost, torch.inf)
    back: list[torch.Tensor] = []
    for i in range(1, n):
        k = widths[i]
        fan, low = 1 << k, size >> k
        best, arg = cost.view(count, fan, low).min(dim=1)  # predecessor s = j * low + m of s' = m * fan + b
        back.append(arg.to(torch.uint8))
        cost = best.repeat_interleave(fan, dim=1) + (x[:, i : i + 1] - tab) ** 2
    if wrap is not None:  # ... which are the low L-k0 bits of the last state
        cost = torch.where((idx & ((size >> widths[0]) - 1)) == wrap[:, None], cost, torch.inf)
    state = cost.argmin(dim=1)
    states = [state]
    for i in range(n - 1, 0, -1):
        k = widths[i]
        low = state >> k
        state = back[i - 1].gather(1, low[:, None]).squeeze(1).to(torch.int64) * (size >> k) + low
        states.append(state)
    states.reverse()
    return torch.stack(states, dim=1)


def viterbi(x: torch.Tensor, tab: torch.Tensor, widths: tuple[int, ...], state_bits: int) -> torch.Tensor:
    """The tail-biting path for each row of ``x``: states ``[N, n]`` (int64), ``state_i`` indexing ``tab``.

    Args:
        x: float32 ``[N, n]``, the values to code (unit variance for a shipped table).
        tab: float32 ``[2**L]``.
        widths: bits of each of the ``n`` values (``sum(widths) >= L``).
        state_bits: ``L``.

    Returns:
        int64 ``[N, n]``; the codes are ``state_i mod 2**k_i`` (:func:`encode`).
    """
    count, n = x.shape
    if count == 0:
        return torch.zeros(0, n, dtype=torch.int64, device=x.device)
    half = n // 2
    turned = torch.cat([x[:, half:], x[:, :half]], dim=1)
    first = _viterbi(turned, tab, widths[half:] + widths[:half], state_bits, None)
    wrap = first[:, n - 1 - half] & ((1 << (state_bits - widths[0])) - 1)
    return _viterbi(x, tab, widths, state_bits, wrap)


def encode(x: torch.Tensor, tab: torch.Tensor, widths: tuple[int, ...], state_bits: int) -> torch.Tensor:
    """Codes ``[..., n]`` (int32, value ``i`` in ``0 .. 2**k_i - 1``) of the tail-biting path for ``x [..., n]``."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1]).to(torch.float32)
    tab = tab.to(rows.device)
    masks = torch.tensor([(1 << k) - 1 for k in widths], dtype=torch.int64, device=rows.device)
    parts = [
        viterbi(rows[i : i + _CHUNK], tab, widths, state_bits) & masks for i in range(0, max(rows.shape[0], 1), _CHUNK)
    ]
    return torch.cat(parts, dim=0).to(torch.int32).reshape(shape)


@functools.cache
def _taps(widths: tuple[int, ...], state_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = []
    for i in range(len(widths)):  # the codes i, i-1, ... (wrapping) until L bits are covered
        taps, shift, j = [], 0, i
        while shift < state_bits:
            taps.append((j, shift))
            shift += widths[j]
            j = (j - 1) % len(widths)
        rows.append(taps)
    depth = max(len(r) for r in rows)
    src = torch.tensor([[(i - t) % len(widths) for i in range(len(widths))] for t in range(depth)], dtype=torch.int64)
    shift = torch.full((depth, len(widths)), TAP_UNUSED, dtype=torch.int32)
    for i, taps in enumerate(rows):
        shift[: len(taps), i] = torch.tensor([sh for _, sh in taps], dtype=torch.int32)
    return src, shift


def state_taps(widths: tuple[int, ...], state_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which codes make up each value's state, as the kernels and :func:`codes_to_states` read them.

    Tap ``t`` of value ``i`` is code ``(i - t) mod n`` shifted left by ``shift[t, i]``; the taps a value needs end
    where ``L`` bits are covered, the rest are marked :data:`TAP_UNUSED` (a shift of 32: nothing, in a 32-bit lane).

    Args:
        widths: bits of each of the ``n`` values.
        state_bits: ``L``.

    Returns:
        ``(src, shift)``: int64 and int32 ``[taps, n]`` (cached: treat them as read-only).
    """
    return _taps(tuple(widths), state_bits)


def codes_to_states(codes: torch.Tensor, widths: tuple[int, ...], state_bits: int) -> torch.Tensor:
    """The state of every value from the codes of the wrapped stream.

    Args:
        codes: integer ``[..., n]``.
        widths: bits of each value.
        state_bits: ``L``.

    Returns:
        int64 ``[..., n]`` in ``0 .. 2**L - 1``.
    """
    c = codes.to(torch.int64)
    src, shift = state_taps(widths, state_bits)
    src, shift = src.to(c.device), shift.to(device=c.device, dtype=torch.int64)
    gathered = c[..., src.reshape(-1)].reshape(*c.shape[:-1], *src.shape)  # [..., taps, n]
    parts = torch.where(shift < TAP_UNUSED, gathered << shift.clamp(max=TAP_UNUSED - 1), 0)
    return parts.sum(dim=-2) & ((1 << state_bits) - 1)


Coder = Callable[[torch.Tensor, torch.Tensor, tuple[int, ...], int], torch.Tensor | None]


def _code_round(
    x: torch.Tensor, tab: torch.Tensor, widths: tuple[int, ...], state_bits: int, coder: Coder | None
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One training round's coding of ``x`` ``[N, n]``: per state the count and the sum of the values coded there
    (float64 ``[2**L]`` each) and the round's mean squared error (``coder`` as :func:`train_table` takes it)."""
    codes = coder(x, tab, widths, state_bits) if coder is not None else None
    states = viterbi(x, tab, widths, state_bits) if codes is None else codes_to_states(codes, widths, state_bits)
    mse = float(((x - tab[states]) ** 2).mean())
    flat = states.reshape(-1)
    size = 1 << state_bits
    count = torch.zeros(size, dtype=torch.float64).index_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
    sums = torch.zeros(size, dtype=torch.float64).index_add_(0, flat, x.reshape(-1).to(torch.float64))
    return count, sums, mse


def train_table(
    bits: float,
    state_bits: int,
    n: int = 64,
    samples: int = 8192,
    iterations: int = 12,
    seed: int = 0,
    coder: Coder | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """Train a table on unit Gaussian samples: alternate Viterbi coding and per-state centroids.

    Args:
        bits: width pattern (:func:`step_widths`).
        state_bits: ``L``.
        n: values per coded vector.
        samples: vectors per iteration (fresh draws each time).
        iterations: number of rounds.
        seed: seed of the samples and the starting table.
        coder: a search that gives :func:`encode`'s codes ``[N, n]`` for ``(x, table, widths, L)`` (the C++
            kernel's, ``walshkv.attention.cpu.tcq_code_rows``, about 20 times faster), or ``None`` for the torch
            search here; a coder that returns ``None`` leaves that round to the torch search.

    Returns:
        The table (float32 ``[2**L]``) and the mean squared error of each round (on that round's samples,
        before its update).
    """
    gen = torch.Generator().manual_seed(seed)
    widths = step_widths(bits, n)
    tab = gaussian_table(state_bits, seed)
    history = []
    for _ in range(iterations):
        x = torch.randn(samples, n, generator=gen)
        count, sums, mse = _code_round(x, tab, widths, state_bits, coder)
        history.append(mse)
        tab = torch.where(count > 0, sums / count.clamp(min=1), tab.to(torch.float64)).to(torch.float32)
    return tab, history


def train_table_parts(
    bits: float,
    state_bits: int,
    n: int = 64,
    samples: int = 8192,
    iterations: int = 12,
    seed: int = 0,
    coder: Coder | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """:func:`train_table` for a ``"44"`` split (:func:`split_table`): the parts (float32 ``[32]``, ``P`` then ``Q``)
    and the mean squared error of each round. It starts from small seeded random parts (a projection of a free table
    trains worse) and each round fits the parts to the per-state means by least squares weighted by the square roots
    of the state counts (research/scripts/trellis_structured.py measured this refit).

    Raises:
        ValueError: ``state_bits`` is not 8.
    """
    if state_bits != 8:
        raise ValueError(f"a 44 split covers L=8 tables only; got L={state_bits}")
    gen = torch.Generator().manual_seed(seed)
    widths = step_widths(bits, n)
    s = torch.arange(1 << state_bits)
    design = torch.cat((torch.nn.functional.one_hot(s & 15, 16), torch.nn.functional.one_hot(s >> 4, 16)), dim=1).to(
        torch.float64
    )
    params = 0.6 * torch.randn(32, generator=gen, dtype=torch.float64)
    history = []
    for _ in range(iterations):
        tab = split_table(params.to(torch.float32), state_bits)
        x = torch.randn(samples, n, generator=gen)
        count, sums, mse = _code_round(x, tab, widths, state_bits, coder)
        history.append(mse)
        mean = torch.where(count > 0, sums / count.clamp(min=1), tab.to(torch.float64))
        w = count.sqrt()
        params = torch.linalg.lstsq(design * w[:, None], (mean * w)[:, None], driver="gelsd").solution[:, 0]
    return params.to(torch.float32), history

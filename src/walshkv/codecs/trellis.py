"""``tcq:B``: tq's rotation and norm, with a tail-biting bitshift trellis code in place of the scalar quantizer.

Per (batch, kv-head, token) vector ``x`` of ``d = head_dim`` values (d a power of two):

1. rotate and scale exactly as ``tq:B`` (:class:`walshkv.codecs.turbo.TurboQuant`): ``t = H(s * x) / (norm /
   sqrt(d))`` with ``norm = ||x||_2`` stored as fp16 (``t`` is close to N(0, 1));
2. code the ``d`` values of ``t`` as one wrapped bit stream of ``B`` bits per value (a half width: the first
   ``d/2`` at ``ceil(B)`` bits, the rest at ``floor(B)``, as tq) with the bitshift trellis of
   :mod:`walshkv.ops.trellis`: value ``i`` decodes to ``table[state_i]``, ``state_i`` the last ``L`` bits of the
   stream up to value ``i``'s own bits; the encoder picks the stream with a Viterbi search over ``2**L`` states;
3. decode: ``x_hat = s * H(table[states] * norm / sqrt(d))``.

The stream is stored as each value's newest ``k_i`` bits, packed in the same fields as tq (``codes`` or
``codes_hi``/``codes_lo``, and ``norm``), so the bits per element are tq's. A reader decodes any value from the
``ceil(L / k)`` codes that end at it: one table lookup per value, no search. The encoder is the cost: ``d`` steps
over ``2**L`` states per vector, two passes. In torch (:func:`walshkv.ops.trellis.encode`, the reference) that is
about 0.1 s per 1,000 vectors of 64 at L=8 on one core, and 5 ms for a decode step's few, nearly all op overhead. The
search after the rotation is a :class:`walshkv.codecs.accelerated.Step`, :data:`TCQ_CODES`: on the CPU the C++
kernel's (:mod:`walshkv.attention.cpu`) takes it once loaded, the same codes in about 5 us per vector of 64 at L=8
(3 bits, one thread, a Zen 4 EPYC, AVX-512 or AVX2 build).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from walshkv.codecs import accelerated
from walshkv.codecs.accelerated import Step
from walshkv.codecs.base import Codec, Field, Packed
from walshkv.codecs.turbo import TurboQuant, _check_norm_bits, _check_seed, _fmt_bits
from walshkv.ops import trellis
from walshkv.ops.packing import pack_bits_span, unpack_bits

__all__ = ["TCQ_BITS", "TCQ_CODES", "TCQ_STATE_BITS", "TCQ_TABLE_SETS", "TrellisQuant", "parse_tcq_args"]

#: Bit widths of ``tcq`` (those with a shipped table).
TCQ_BITS: tuple[float, ...] = trellis.TRELLIS_BITS
#: State sizes ``L`` of ``tcq`` (default 8).
TCQ_STATE_BITS: tuple[int, ...] = trellis.STATE_BITS
#: Table sets of ``tcq`` (default 1; :data:`walshkv.ops.trellis.TABLE_SETS`).
TCQ_TABLE_SETS: tuple[int, ...] = trellis.TABLE_SETS

#: ``(t, table, widths, state_bits) -> codes | None``: the signature of :data:`TCQ_CODES`' implementations.
TrellisCoder = Callable[[torch.Tensor, torch.Tensor, tuple[int, ...], int], "torch.Tensor | None"]

#: tcq's trellis search after its rotation, a step an accelerated implementation may take over
#: (:mod:`walshkv.codecs.accelerated`; :mod:`walshkv.attention.cpu` registers the C++ kernel's). The torch path,
#: :func:`walshkv.ops.trellis.encode`, is its reference; an implementation must give the same codes.
TCQ_CODES: Step[TrellisCoder] = Step(
    "tcq.codes",
    "takes the scaled rotated values t [N, n] (float32, contiguous, on the CPU), the table (float32 [2**L]), the n "
    "widths and L; returns walshkv.ops.trellis.encode's codes [N, n] (int32), or None to leave them to the torch path",
)


def _valid(values: tuple[float, ...]) -> str:
    return ", ".join(_fmt_bits(v) for v in values)


@dataclass(frozen=True, repr=False)
class TrellisQuant(Codec):
    """``tcq:B[:L=8][:seed=N][:norm=16|8][:tables=1|2|3]``: Hadamard rotation, fp16 norm, a tail-biting trellis code
    of ``B`` bits per value.

    Attributes:
        bits: one of :data:`TCQ_BITS` (a float: ``TrellisQuant(3) == TrellisQuant(3.0)``).
        state_bits: ``L``, the trellis state in bits, one of :data:`TCQ_STATE_BITS` (8: 256 states, the one shipped).
        seed: seed of the rotation's sign flips (tq's).
        norm_bits: 16 (fp16 norm, default) or 8 (a log byte, :mod:`walshkv.ops.lognorm`), as tq's.
        tables: the table set the codes decode through, one of :data:`TCQ_TABLE_SETS` (1, default: the first
            training; 2: trained longer, 0.1-0.3 dB closer to ``D(R)`` on a Gaussian source, the same bytes and
            decode work; 3: split tables, ``P[s & 15] + Q[s >> 4]``, which an AVX2 CPU reads by register permutes
            instead of a gather; 4: set 2 rounded to bfloat16, which a VBMI CPU reads with half the byte permutes,
            0.001 dB or less from set 2). A set never changes once shipped, so a spec names what its codes decode to.
        rotation: the ``tq:B`` codec whose rotation, norm and fields this codec shares (derived).

    Stored per vector: tq's fields at the same width (``codes`` or ``codes_hi``/``codes_lo``, ``norm``).
    """

    bits: float
    state_bits: int = 8
    seed: int = 0
    norm_bits: int = 16
    tables: int = 1
    rotation: TurboQuant = field(init=False, compare=False)

    def __post_init__(self) -> None:
        try:
            bits = float(self.bits)
        except (TypeError, ValueError):
            bits = math.nan
        if isinstance(self.bits, bool) or bits not in TCQ_BITS:
            raise ValueError(f"tcq takes a bit width, one of {_valid(TCQ_BITS)}; got {self.bits!r}")
        if isinstance(self.state_bits, bool) or self.state_bits not in TCQ_STATE_BITS:
            raise ValueError(
                f"tcq's state size L is one of {', '.join(map(str, TCQ_STATE_BITS))} bits; got {self.state_bits!r}"
            )
        _check_seed(self.seed, "tcq")
        _check_norm_bits(self.norm_bits, "tcq")
        if isinstance(self.tables, bool) or self.tables not in TCQ_TABLE_SETS:
            raise ValueError(
                f"tcq's table set is one of {', '.join(map(str, TCQ_TABLE_SETS))} (tables=2: the longer-trained "
                f"tables, tables=3: split tables AVX2 reads by register permutes, tables=4: set 2 rounded to "
                f"bfloat16); got {self.tables!r}"
            )
        self._set(bits=bits, rotation=TurboQuant(bits, self.seed, norm_bits=self.norm_bits))
        super().__post_init__()

    def _spec(self) -> str:
        spec = f"tcq:{_fmt_bits(self.bits)}"
        if self.state_bits != 8:
            spec += f":L={self.state_bits}"
        if self.seed:
            spec += f":seed={self.seed}"
        if self.norm_bits != 16:
            spec += f":norm={self.norm_bits}"
        if self.tables != 1:
            spec += f":tables={self.tables}"
        return spec

    def table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The trellis table (float32 ``[2**L]``) of this codec's table set, on ``device``."""
        return _table(self.bits, self.state_bits, self.tables, torch.device(device))

    def table_parts(self) -> torch.Tensor | None:
        """A split set's parts (float32 ``[32]``, ``P`` then ``Q``: ``table[s] = P[s & 15] + Q[s >> 4]``,
        :func:`walshkv.ops.trellis.table_parts`), or ``None`` where the table is 256 free values."""
        return trellis.table_parts(self.bits, self.state_bits, self.tables)

    def widths(self, head_dim: int) -> tuple[int, ...]:
        """Bits of each rotated coordinate (``head_dim`` entries)."""
        return trellis.step_widths(self.bits, head_dim)

    def layout(self, head_dim: int) -> dict[str, Field]:
        return self.rotation.layout(head_dim)

    def check_head_dim(self, head_dim: int) -> None:
        self.rotation.check_head_dim(head_dim)
        if sum(self.widths(head_dim)) < self.state_bits:
            raise ValueError(
                f"'{self.spec}' codes head_dim {head_dim} in {sum(self.widths(head_dim))} bits, fewer than its "
                f"{self.state_bits}-bit trellis state; use a larger head_dim or a smaller L (one of "
                f"{', '.join(map(str, TCQ_STATE_BITS))})"
            )

    refuses_nonfinite = True  # a NaN or Inf input makes its norm NaN or Inf

    def _encode(self, x: torch.Tensor) -> Packed:
        d = x.shape[-1]
        norm = torch.linalg.vector_norm(x if x.dtype == torch.float64 else x.to(torch.float64), dim=-1, keepdim=True)
        stored, norm16 = self.rotation.store_norm(norm, self.spec)
        t = self.rotation.scaled_rotation(x, norm, norm16, self.spec)
        tab, widths = self.table(x.device), self.widths(d)
        codes = None
        coder = accelerated.implementation(TCQ_CODES)
        if coder is not None and x.device.type == "cpu":
            # the accelerated search (the C++ kernel's: a decode step's one token in microseconds instead of two
            # passes of a few torch ops per value, milliseconds); what it declines takes the torch path
            codes = coder(t.reshape(-1, d).contiguous(), tab, widths, self.state_bits)
        codes = trellis.encode(t, tab, widths, self.state_bits) if codes is None else codes.reshape(t.shape)
        codes = codes.to(torch.int64)  # each segment packed in place (pack_bits_span), not copied out of the row
        tensors = {
            name: pack_bits_span(codes, start, stop, bits) for name, start, stop, bits in self.rotation.segments(d)
        }
        tensors["norm"] = stored
        return Packed(tensors, d, x.dtype)

    def codes(self, packed: Packed) -> torch.Tensor:
        """The per-value codes ``[..., head_dim]`` (int64) of ``packed``."""
        d = packed.head_dim
        parts = [
            unpack_bits(packed.tensors[name], bits, stop - start)
            for name, start, stop, bits in self.rotation.segments(d)
        ]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).to(torch.int64)

    def _decode(self, packed: Packed) -> torch.Tensor:
        d = packed.head_dim
        states = trellis.codes_to_states(self.codes(packed), self.widths(d), self.state_bits)
        t = self.table(states.device)[states]
        scale = self.rotation.stored_norm(packed.tensors["norm"]) / math.sqrt(d)
        return self.rotation.unrotate(t * scale)


#: Tables per (bits, L, device).
_TABLES: dict[tuple[float, int, int, torch.device], torch.Tensor] = {}


def _table(bits: float, state_bits: int, tables: int, device: torch.device) -> torch.Tensor:
    key = (bits, state_bits, tables, device)
    tab = _TABLES.get(key)
    if tab is None:
        tab = _TABLES[key] = trellis.table(bits, state_bits, tables).to(device)
    return tab


def parse_tcq_args(args: str | None) -> TrellisQuant:
    """Factory for ``tcq:BITS[:L=8][:seed=N][:norm=16|8][:tables=1|2]``."""
    usage = (
        f"tcq takes tcq:BITS[:L=8][:seed=N][:norm=16|8][:tables=1|2] with BITS one of {_valid(TCQ_BITS)} (e.g. tcq:3)"
    )
    if not args:
        raise ValueError(f"{usage}; got 'tcq' without a bit width")
    head, *opts = args.split(":")
    try:
        bits: Any = float(head.strip())
    except ValueError:
        raise ValueError(f"{usage}; got {head.strip()!r}") from None
    state_bits, seed, norm_bits, tables = 8, 0, 16, 1
    for opt in opts:
        key, sep, value = opt.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or key not in ("l", "seed", "norm", "tables"):
            raise ValueError(f"{usage}; unknown option {opt!r}")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"{usage}; {key} must be an integer, got {value!r}") from None
        if key == "l":
            state_bits = number
        elif key == "norm":
            norm_bits = number
        elif key == "tables":
            tables = number
        else:
            seed = number
    return TrellisQuant(bits, state_bits, seed, norm_bits, tables)

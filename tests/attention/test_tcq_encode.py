"""tcq's encoder in the CPU kernel (``tcq_encode`` in attention/cpu_kernel_tcq_encode.h) against its torch path.

:func:`walshkv.attention.cpu.tcq_code_rows` is registered as the implementation of
:data:`walshkv.codecs.trellis.TCQ_CODES` (:mod:`walshkv.codecs.accelerated`): once the kernel is loaded,
:meth:`walshkv.codecs.trellis.TrellisQuant._encode` hands it the rotated, norm-scaled rows; the reference is
:func:`walshkv.ops.trellis.encode` (the torch path, which the codec runs under
:func:`walshkv.codecs.accelerated.reference_only`). The codes must be the same bit for bit: every width, L = 8 and 10
(an untrained table where none ships), head sizes 16, 64 and 128, Gaussian rows and edge rows, exact ties (a table and
rows on a grid of 1/2, where equal paths tie everywhere and only the same first-index choice gives the same codes) and
trellises too small for the vector step, in the native build and the AVX2 one. An FMA in the kernel's cost sums, or a
<= for its <, fails these.

The torch path is slow (two passes of a few small ops per value), and slower still where torch's threads split its
small ops: the blocks here stay small.
"""

from __future__ import annotations

import pytest
import torch

# the helpers tq's packer tests and the ISA builds share (tests/attention is on the path, as for test_attention)
from test_isa_builds import _cpu_has
from test_tq_pack import _decode_steps_match, _same, _torch_path

from walshkv.attention import cpu
from walshkv.codecs import accelerated
from walshkv.codecs import trellis as tcq
from walshkv.codecs.registry import parse_codec
from walshkv.ops import trellis

pytestmark = pytest.mark.skipif(not cpu.kernel_available(), reason="the CPU kernel cannot be built here")

HEAD_DIMS = (16, 64, 128)
#: The kernel's search is the same for any L (up to 12): L = 10 runs with an untrained table while none ships.
STATE_BITS = tuple(sorted({*trellis.STATE_BITS, 8, 10}))
AVX2 = ("-O3", "-march=haswell", "-fopenmp", "-std=c++20")  # test_isa_builds' AVX2 build: the same cached module


def _table(bits: float, state_bits: int) -> torch.Tensor:
    """The shipped table, or (an L without shipped tables, such as 10) the untrained one: the search is the same."""
    try:
        return trellis.table(bits, state_bits)
    except ValueError:
        return trellis.gaussian_table(state_bits, seed=int(2 * bits))


def _ships(bits: float, state_bits: int) -> bool:
    try:
        trellis.table(bits, state_bits)
    except ValueError:
        return False
    return True


def _rows(d: int, tab: torch.Tensor, seed: int, count: int = 24) -> torch.Tensor:
    """Gaussian rows (as the codec's rotated, norm-scaled values are), then edge rows."""
    x = torch.randn(count, d, generator=torch.Generator().manual_seed(seed))
    x[0] = 0.0  # every state's cost is its table value squared: ties between +v and -v
    x[1] = 1.0  # a constant row
    x[2] = tab[5]  # a constant row on a table value
    x[3] = tab[torch.arange(d) % tab.numel()]  # every value on a table value
    x[4] = 0.0
    x[4, d // 3] = d**0.5  # one huge coordinate (all the norm in one place)
    x[5] = 0.0
    x[5, 0] = 1e4  # far past the table: its costs dwarf the others
    x[6] = 1e-30  # tiny values
    x[7] = torch.where(torch.arange(d) % 2 == 0, 1.0, -1.0)
    return x


def _kernel_codes(x: torch.Tensor, tab: torch.Tensor, widths: tuple[int, ...], state_bits: int) -> torch.Tensor:
    got = cpu.tcq_code_rows(x.contiguous(), tab, widths, state_bits)
    assert got is not None, "the kernel declined"
    return got


def _assert_codes_equal(x: torch.Tensor, tab: torch.Tensor, widths: tuple[int, ...], state_bits: int) -> None:
    want = trellis.encode(x, tab, widths, state_bits)
    got = _kernel_codes(x, tab, widths, state_bits)
    assert got.dtype == want.dtype == torch.int32 and got.shape == want.shape
    bad = (got != want).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad[:10]} differ (L={state_bits}, widths {widths[0]}..{widths[-1]}, d={x.shape[1]})"


def _tied_groups(x: torch.Tensor, tab: torch.Tensor, widths: tuple[int, ...], state_bits: int) -> int:
    """Predecessor groups with more than one smallest cost along the first pass's search of x's rows (unturned)."""
    size, ties = 1 << state_bits, 0
    cost = (x[:, :1] - tab) ** 2
    for i in range(1, x.shape[1]):
        fan, low = 1 << widths[i], size >> widths[i]
        groups = cost.view(x.shape[0], fan, low)
        best = groups.min(dim=1).values
        ties += int(((groups == best[:, None]).sum(dim=1) > 1).sum())
        cost = best.repeat_interleave(fan, dim=1) + (x[:, i : i + 1] - tab) ** 2
    return ties


def _grid_case(bits: float, state_bits: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A table and rows on a grid of 1/2: every cost is exact, equal paths tie exactly."""
    tab = torch.round(2 * trellis.gaussian_table(state_bits, seed=seed)) / 2
    x = torch.randint(-6, 7, (12, d), generator=torch.Generator().manual_seed(seed)).to(torch.float32) / 2
    return tab, x


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The kernel's coder registered and counting the values it codes."""
    calls: list[int] = []

    def coder(t, tab, widths, state_bits):
        out = cpu.tcq_code_rows(t, tab, widths, state_bits)
        calls.append(0 if out is None else t.numel())
        return out

    monkeypatch.setitem(accelerated._REGISTRY, tcq.TCQ_CODES, coder)
    return calls


def test_the_kernel_is_tcqs_registered_coder() -> None:
    assert accelerated.implementation(tcq.TCQ_CODES) is cpu.tcq_code_rows
    with accelerated.reference_only():
        assert accelerated.implementation(tcq.TCQ_CODES) is None


def test_the_coder_loads_the_kernel_itself_and_declines_where_it_cannot_be_built(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    codec = parse_codec("tcq:3")
    x = torch.randn(1, 2, 3, 64, generator=torch.Generator().manual_seed(2))
    tab, widths = codec.table(), codec.widths(64)
    rows = torch.randn(3, 64)
    loaded = cpu.load_kernel()
    monkeypatch.setattr(cpu, "_kernel", None)  # a process that never used the fused attention: the coder loads it
    got = cpu.tcq_code_rows(rows, tab, widths, 8)
    assert got is not None and cpu._kernel is loaded
    monkeypatch.setattr(cpu, "_kernel", None)
    monkeypatch.setattr(cpu, "_kernel_failed", True)  # no compiler here: the torch path codes, the same codes
    assert cpu.tcq_code_rows(rows, tab, widths, 8) is None
    _same(codec.encode(x), _torch_path(codec, x))


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("state_bits", STATE_BITS)
@pytest.mark.parametrize("bits", trellis.TRELLIS_BITS)
def test_every_width_state_size_and_head_size(bits: float, state_bits: int, d: int) -> None:
    tab, widths = _table(bits, state_bits), trellis.step_widths(bits, d)
    _assert_codes_equal(_rows(d, tab, seed=d + state_bits), tab, widths, state_bits)


@pytest.mark.parametrize("state_bits", STATE_BITS)
@pytest.mark.parametrize("bits", trellis.TRELLIS_BITS)
def test_exact_ties_go_the_same_way(bits: float, state_bits: int) -> None:
    d = 64
    widths = trellis.step_widths(bits, d)
    tab, x = _grid_case(bits, state_bits, d, seed=int(4 * bits) + state_bits)
    assert _tied_groups(x, tab, widths, state_bits) > 100  # the case is made of ties
    _assert_codes_equal(x, tab, widths, state_bits)


@pytest.mark.parametrize(
    ("state_bits", "bits", "d"),
    [(4, 2, 8), (5, 1, 16), (5, 2.5, 16), (6, 3, 16), (6, 4, 8), (7, 3.5, 32), (3, 1, 8), (8, 6, 16), (8, 8, 8)],
)
def test_small_trellises_and_wide_steps(state_bits: int, bits: float, d: int) -> None:
    """Groups fewer than a vector's lanes (or not a multiple of them), and widths above 5 (wider than tcq's), take
    the kernel's plain loops."""
    tab, widths = trellis.gaussian_table(state_bits, seed=state_bits), trellis.step_widths(bits, d)
    _assert_codes_equal(_rows(d, tab, seed=state_bits), tab, widths, state_bits)
    grid_tab, x = _grid_case(bits, state_bits, d, seed=state_bits)
    _assert_codes_equal(x, grid_tab, widths, state_bits)


def test_a_block_the_kernel_threads() -> None:
    """Enough rows take the kernel's threads (an uneven split of rows among 3): the same codes."""
    tab, widths = trellis.table(3, 8), trellis.step_widths(3, 64)
    x = torch.randn(50, 64, generator=torch.Generator().manual_seed(9))  # 50 * 64 * 256 >= 2**18
    want = trellis.encode(x, tab, widths, 8)
    out = torch.empty(50, 64, dtype=torch.int32)
    desc = [50, 64, 8, x.data_ptr(), tab.data_ptr(), out.data_ptr(), *widths]
    assert cpu.load_kernel().tcq_encode(desc, 3)
    assert torch.equal(out, want)


def test_what_the_kernel_declines() -> None:
    tab, widths = trellis.table(3, 8), trellis.step_widths(3, 64)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[2, 7] = bad
        assert cpu.tcq_code_rows(y, tab, widths, 8) is None
    assert cpu.tcq_code_rows(x, tab, (9,) * 64, 8) is None  # a width past L (and the uint8 back pointers)
    assert cpu.tcq_code_rows(x.t().contiguous().t(), tab, widths, 8) is None  # not contiguous
    assert cpu.tcq_code_rows(x.double(), tab, widths, 8) is None
    assert cpu.tcq_code_rows(x, tab[:128], widths, 8) is None  # a table of the wrong size
    assert cpu.tcq_code_rows(x[None], tab, widths, 8) is None  # not [N, n]
    assert cpu.tcq_code_rows(x, tab, widths[:-1], 8) is None
    assert cpu.tcq_code_rows(x[:0], tab, widths, 8).shape == (0, 64)


def _specs() -> list[str]:
    """Every width at L = 8, and at every other L the codec takes, where its table ships."""
    specs = [f"tcq:{b:g}" for b in tcq.TCQ_BITS]
    specs += [f"tcq:{b:g}:L={n}" for n in tcq.TCQ_STATE_BITS if n != 8 for b in tcq.TCQ_BITS if _ships(b, n)]
    return specs


@pytest.mark.parametrize("spec", _specs())
def test_the_codec_packs_the_same_with_and_without_the_kernel(spec: str, counted: list[int]) -> None:
    codec = parse_codec(spec)
    gen = torch.Generator().manual_seed(len(spec))
    x = 3 * torch.randn(1, 2, 9, 64, generator=gen)
    x[0, 1, 4] = 0.0  # a zero row: its scale is 0, t is the rotated row itself
    x[0, 0, 2] = 1e-9  # a norm below fp16's smallest subnormal: stored as 0
    x[0, 1, 6] = 0.0
    x[0, 1, 6, 3] = 50.0  # one coordinate
    got = codec.encode(x)
    assert counted and counted[-1] == x.numel()
    _same(got, _torch_path(codec, x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("d", [16, 128])
def test_input_dtypes_and_head_sizes(dtype: torch.dtype, d: int, counted: list[int]) -> None:
    codec = parse_codec("tcq:2.5")
    x = (4 * torch.randn(1, 3, 5, d, generator=torch.Generator().manual_seed(d))).to(dtype)
    got = codec.encode(x)
    _same(got, _torch_path(codec, x))
    assert got.dtype == dtype and counted[-1] == x.numel()


def test_refused_inputs_raise_what_the_torch_path_raises(counted: list[int]) -> None:
    codec = parse_codec("tcq:3")
    for bad in (float("nan"), float("inf")):
        x = torch.randn(1, 2, 4, 64)
        x[0, 1, 2, 5] = bad
        with pytest.raises(ValueError) as kernel_err:
            codec.encode(x)
        with pytest.raises(ValueError) as torch_err:
            _torch_path(codec, x)
        assert str(kernel_err.value) == str(torch_err.value)


def test_a_decode_step_codes_in_the_kernel(counted: list[int]) -> None:
    """A cache's one-token write of a tcq layer goes through the kernel, and stores what the torch path stores."""
    _decode_steps_match("tcq:3/tcq:2.5", 5, counted)


def test_the_avx2_build_gives_the_same_codes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel built for AVX2 only (8 lanes: other lane permutes, the byte packing of the back pointers, other
    groups on the plain loops) against the torch path; the build is test_isa_builds' (the same flags, one cache)."""
    if not _cpu_has(("avx2", "fma")):
        pytest.skip("this CPU cannot run AVX2 code (test_isa_builds checks that the source compiles for it)")
    module = cpu.build_kernel(list(AVX2))
    assert module.vector_lanes == 8
    monkeypatch.setattr(cpu, "_kernel", module)
    for state_bits in STATE_BITS:
        for bits in trellis.TRELLIS_BITS:
            tab, widths = _table(bits, state_bits), trellis.step_widths(bits, 64)
            _assert_codes_equal(_rows(64, tab, seed=int(2 * bits), count=12), tab, widths, state_bits)
            grid_tab, x = _grid_case(bits, state_bits, 64, seed=int(2 * bits))
            _assert_codes_equal(x, grid_tab, widths, state_bits)
    for state_bits, bits, d in ((4, 2, 8), (6, 3, 16), (6, 4, 8)):  # groups of 4 and 8 lanes or fewer
        tab, widths = trellis.gaussian_table(state_bits), trellis.step_widths(bits, d)
        _assert_codes_equal(_rows(d, tab, seed=1), tab, widths, state_bits)

"""The C++ kernel (cpu_kernel.cpp) and its Python side agree on format names and limits; edits rebuild it."""

from __future__ import annotations

import shutil
import types
import warnings

import pytest

from walshkv.attention import cpu, cpu_formats

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
def test_python_constants_equal_the_compiled_modules() -> None:
    kernel = cpu.load_kernel()
    assert kernel is not None
    assert sorted(kernel.FORMATS) == sorted(cpu_formats.FORMAT_NAMES)
    assert len(set(kernel.FORMATS.values())) == len(kernel.FORMATS)  # one id per format
    assert kernel.MAX_BANDS == cpu_formats.MAX_BANDS
    assert kernel.MAX_SEGS == 2  # tq: codes, or codes_hi and codes_lo
    cpu.check_kernel_constants(kernel)


def test_a_disagreeing_module_is_refused() -> None:
    names = dict.fromkeys(cpu_formats.FORMAT_NAMES, 0)
    with pytest.raises(RuntimeError, match="MAX_BANDS"):
        cpu.check_kernel_constants(types.SimpleNamespace(FORMATS=names, MAX_BANDS=cpu_formats.MAX_BANDS + 1))
    with pytest.raises(RuntimeError, match="make them agree"):
        cpu.check_kernel_constants(types.SimpleNamespace(FORMATS={"int4": 0}, MAX_BANDS=cpu_formats.MAX_BANDS))


def test_the_source_is_package_data_and_its_text_names_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    source = cpu.kernel_source()
    assert "PYBIND11_MODULE" in source and "MAX_BANDS" in source
    builds: list[tuple[str, list[str]]] = []

    def record(*, name: str, cpp_sources: list[str], **kwargs):
        builds.append((name, cpp_sources))
        raise RuntimeError("not built in this test")

    monkeypatch.setattr(cpp_extension, "load_inline", record)
    edited = source + "\n// edited\n"
    for text in (source, edited):
        monkeypatch.setattr(cpu, "kernel_source", lambda text=text: text)
        monkeypatch.setattr(cpu, "_kernel", None)
        monkeypatch.setattr(cpu, "_kernel_failed", False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert cpu.load_kernel() is None
    # each load tries the native flags, then the portable ones: four builds, four names
    assert [srcs for _, srcs in builds] == [[source], [source], [edited], [edited]]
    assert len({name for name, _ in builds}) == 4


def test_token_ranges_keep_every_thread_busy():
    """The kernel's tasks (kv heads x token ranges) come in a multiple of the thread count where ranges stay long
    enough: smollm2-135m's 3 kv heads on 2 threads run 3 x 4 ranges (12 tasks, 6 each), not 3 x 3 (5 and 4)."""
    from walshkv.attention.cpu import _MIN_SPLIT_TOKENS, _nsplit

    assert _nsplit(3, 16384, 1) == 1
    assert _nsplit(3, 16384, 2) == 4 and _nsplit(2, 16384, 2) == 4
    assert _nsplit(7, 1 << 20, 16) == 16  # 7 x 16 = 112 tasks: 7 each
    for n, t, threads in ((3, 16384, 2), (3, 300, 2), (1, 100, 8), (5, 4096, 3), (6, 600, 4)):
        s = _nsplit(n, t, threads)
        assert 1 <= s <= max(1, -(-t // _MIN_SPLIT_TOKENS)), (n, t, threads, s)


def test_small_steps_run_on_one_thread_only_under_passive_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waking passive OpenMP workers costs more than a short step's work (see cpu._SERIAL_WORK)."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert cpu._serial_step(3 * 1024, prerope=True) and cpu._serial_step(3 * 4096, prerope=False)
    assert not cpu._serial_step(3 * 4096, prerope=True) and not cpu._serial_step(3 * 16384, prerope=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert not cpu._serial_step(3 * 128, prerope=True)
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert not cpu._serial_step(3 * 128, prerope=False)

"""The C++ kernel (cpu_kernel.cpp and its headers) and its Python side agree on format names and limits; edits of any
of its files rebuild it, and they all ship."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import tomllib
import types
import warnings
from pathlib import Path

import pytest

from walshkv.attention import cpu, cpu_formats

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
ROOT = Path(__file__).resolve().parents[2]


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

    def load(patch: pytest.MonkeyPatch) -> None:
        patch.setattr(cpu, "_kernel", None)
        patch.setattr(cpu, "_kernel_failed", False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            assert cpu.load_kernel() is None

    monkeypatch.setattr(cpp_extension, "load_inline", record)
    edited = source + "\n// edited\n"
    for text in (source, edited):
        with monkeypatch.context() as patch:
            patch.setattr(cpu, "kernel_source", lambda text=text: text)
            load(patch)
    read = cpu._read_package_file

    def header_edited(name: str) -> str:  # one header's text changed, the .cpp the same
        return read(name) + ("\n// edited\n" if name == "cpu_kernel_score.h" else "")

    with monkeypatch.context() as patch:
        patch.setattr(cpu, "_read_package_file", header_edited)
        load(patch)
    header = cpu.assemble_source(header_edited)[0]
    assert header != source
    # each load tries the native flags, then the portable ones: six builds, six names
    assert [srcs for _, srcs in builds] == [[source], [source], [edited], [edited], [header], [header]]
    assert len({name for name, _ in builds}) == 6


def _kernel_files() -> list[str]:
    folder = Path(cpu.__file__).parent
    return sorted(p.name for p in (*folder.glob("*.cpp"), *folder.glob("*.h")))


def test_every_header_is_in_the_translation_unit_once() -> None:
    text, files = cpu.assemble_source(cpu._read_package_file)
    assert files[0] == cpu.KERNEL_SOURCE and len(set(files)) == len(files)
    assert sorted(files) == _kernel_files()  # no header the .cpp leaves out
    assert text == cpu.kernel_source()
    assert "#pragma once" not in text and '#include "' not in text
    for name in files:
        assert f'#line 1 "{name}"' in text
        body = [ln for ln in cpu._read_package_file(name).splitlines() if ln.strip() and "#pragma once" not in ln]
        assert all(ln in text for ln in body if not ln.startswith('#include "')), name


def test_the_kernel_files_are_package_data() -> None:
    """What setuptools puts in the wheel: every .cpp and .h of the kernel matches a package-data pattern."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["walshkv"]
    for name in _kernel_files():
        assert any(fnmatch.fnmatch(f"attention/{name}", pat) for pat in patterns), name


FILES = {
    "main.cpp": '#include <vector>\n#include "a.h"\n#include "b.h"\nint main() { return A + B; }\n',
    "a.h": "#pragma once\nstatic constexpr int A = 1;\n",
    "b.h": '#pragma once\n#include "a.h"\nstatic constexpr int B = A + 1;\n',
}


def test_the_assembler_inlines_each_header_once_in_include_order() -> None:
    text, files = cpu.assemble_source(FILES.__getitem__, "main.cpp")
    assert files == ("main.cpp", "a.h", "b.h")
    assert text.splitlines() == [
        '#line 1 "main.cpp"',
        "#include <vector>",
        '#line 1 "a.h"',
        "",
        "static constexpr int A = 1;",
        '#line 3 "main.cpp"',
        '#line 1 "b.h"',
        "",
        "",  # a.h again: already in
        "static constexpr int B = A + 1;",
        '#line 4 "main.cpp"',
        "int main() { return A + B; }",
    ]


def test_the_assembler_refuses_an_include_by_path() -> None:
    files = {"main.cpp": '#include "../other/x.h"\n'}
    with pytest.raises(ValueError, match=r"main\.cpp:1 includes .*\.\./other/x\.h.*bare names"):
        cpu.assemble_source(files.__getitem__, "main.cpp")


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
def test_a_compiler_error_names_the_header_and_its_line() -> None:
    files = {**FILES, "b.h": '#pragma once\n#include "a.h"\nstatic constexpr int B = A + undeclared;\n'}
    compiler = next(c for c in ("c++", "g++", "clang++") if shutil.which(c))
    done = subprocess.run(
        [compiler, "-std=c++20", "-fsyntax-only", "-x", "c++", "-"],
        input=cpu.assemble_source(files.__getitem__, "main.cpp")[0],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0 and "b.h:3" in done.stderr, done.stderr


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

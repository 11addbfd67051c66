"""A build of the CPU kernel that was killed leaves torch's build lock behind; the next build clears it instead of
waiting for it forever, and a build held by a live process is waited for with a bound."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
from filelock import FileLock
from torch.utils import cpp_extension

from walshkv.attention import cpu

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
TINY = textwrap.dedent(
    """
    #include <pybind11/pybind11.h>
    PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", [] { return 42; }); }
    """
)


@pytest.fixture
def ext_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return tmp_path


def _build_dir(name: str) -> Path:
    return Path(cpp_extension._get_build_directory(name, verbose=False))


def test_a_stale_torch_lock_is_removed_with_a_warning(ext_dir: Path) -> None:
    stale = _build_dir("walshkv_test_stale") / "lock"
    stale.write_text("")
    with pytest.warns(RuntimeWarning, match="killed"), cpu.build_lock("walshkv_test_stale"):
        assert not stale.exists()
    with warnings.catch_warnings():  # nothing stale now: no warning
        warnings.simplefilter("error")
        with cpu.build_lock("walshkv_test_stale"):
            pass


def test_a_live_build_is_waited_for_with_a_bound(ext_dir: Path) -> None:
    build_dir = _build_dir("walshkv_test_live")
    with (
        FileLock(str(build_dir.with_name(build_dir.name + ".walshkv-lock"))),
        pytest.raises(RuntimeError, match=r"for over 0 s .*walshkv-lock"),
        cpu.build_lock("walshkv_test_live", wait_seconds=0.2),
    ):
        pass
    assert not (build_dir / "lock").exists()


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
def test_a_build_killed_earlier_does_not_hang_the_next(ext_dir: Path) -> None:
    # the real path: build_kernel on a small source whose torch lock a killed build left; in a child process with a
    # deadline, so that a regression fails here instead of hanging the run
    flags = ["-O0"]
    (_build_dir(cpu.kernel_name(TINY, flags)) / "lock").write_text("")
    code = "import sys; from walshkv.attention.cpu import build_kernel\n"
    code += "print(build_kernel(sys.argv[1:], sys.stdin.read()).answer())"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext_dir)}
    run = subprocess.run(
        [sys.executable, "-c", code, *flags], input=TINY, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.stdout.strip() == "42", run.stderr[-2000:]
    assert "a build lock left by a build of the CPU kernel that was killed" in run.stderr  # it said what it removed

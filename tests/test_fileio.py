"""Atomic writes (walshkv.fileio): a failed write leaves the old file as it was and no temporary file behind."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from walshkv.eval.report import write_csv, write_json, write_result_files
from walshkv.export import read_kv_mean_center, write_kv_mean_center
from walshkv.fileio import (
    atomic_path,
    atomic_write,
    check_output_dir,
    check_output_path,
    write_json_atomic,
    write_text_atomic,
)

OLD = b"the old, valid contents\n"


def _old_file(tmp_path: Path, name: str = "target.bin") -> Path:
    path = tmp_path / name
    path.write_bytes(OLD)
    return path


def _only(tmp_path: Path, *names: str) -> None:
    """Nothing but ``names`` is left in ``tmp_path``: no temporary file survived."""
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


@pytest.mark.parametrize("mode", ["wb", "w"])
def test_a_clean_write_replaces_the_file_and_keeps_its_mode(tmp_path: Path, mode: str) -> None:
    path = _old_file(tmp_path)
    path.chmod(0o640)
    with atomic_write(path, mode) as fh:
        fh.write(b"new" if mode == "wb" else "new")
        assert path.read_bytes() == OLD  # readers see the old bytes until the block ends
    assert path.read_bytes() == b"new" and (path.stat().st_mode & 0o777) == 0o640
    _only(tmp_path, "target.bin")


def test_a_new_file_gets_the_umask_mode(tmp_path: Path) -> None:
    umask = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "new.txt", "x")
    finally:
        os.umask(umask)
    assert ((tmp_path / "new.txt").stat().st_mode & 0o777) == 0o644


def test_an_error_in_the_writer_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = _old_file(tmp_path)
    with pytest.raises(KeyError), atomic_write(path) as fh:
        fh.write(b"half a file")
        raise KeyError("the writer failed half-way")
    assert path.read_bytes() == OLD
    _only(tmp_path, "target.bin")
    with pytest.raises(RuntimeError), atomic_path(path) as temp:
        temp.write_bytes(b"half")
        raise RuntimeError("stop")
    assert path.read_bytes() == OLD
    _only(tmp_path, "target.bin")


def test_an_unserialisable_payload_touches_nothing(tmp_path: Path) -> None:
    path = _old_file(tmp_path, "r.json")
    with pytest.raises(TypeError):
        write_json_atomic(path, {"x": object()})
    assert path.read_bytes() == OLD
    _only(tmp_path, "r.json")


def test_the_temporary_keeps_the_suffix_and_errors_name_the_target(tmp_path: Path) -> None:
    with atomic_path(tmp_path / "plot.png") as temp:
        assert temp.parent == tmp_path and temp.name.endswith(".png") and temp.name != "plot.png"
    (tmp_path / "folder").mkdir()
    with pytest.raises(IsADirectoryError) as info, atomic_write(tmp_path / "folder"):
        pass
    assert info.value.filename == str(tmp_path / "folder")
    with pytest.raises(FileNotFoundError) as missing, atomic_write(tmp_path / "no" / "x.json"):
        pass
    assert missing.value.filename == str(tmp_path / "no" / "x.json")
    with pytest.raises(ValueError, match="allowed: 'w', 'wt', 'wb'"), atomic_write(tmp_path / "x", "a"):
        pass


def test_output_checks_refuse_with_the_path_and_leave_nothing(tmp_path: Path) -> None:
    afile = _old_file(tmp_path, "afile")
    (tmp_path / "adir").mkdir()
    assert check_output_path(tmp_path / "ok.json", what="--json") == tmp_path / "ok.json"
    cases = [
        (tmp_path / "adir", IsADirectoryError, "is a directory"),
        (tmp_path / "missing" / "x.json", FileNotFoundError, "does not exist; create it first"),
        (afile / "x.json", NotADirectoryError, "is a file, not a directory"),
        (afile / "deeper" / "x.json", NotADirectoryError, "is a file, not a directory"),
    ]
    for path, kind, words in cases:
        with pytest.raises(kind, match=words) as info:
            check_output_path(path, what="--json")
        assert str(path) in str(info.value) and "--json" in str(info.value)
    assert check_output_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    for path in (afile, afile / "sub"):
        with pytest.raises(NotADirectoryError, match="not a folder"):
            check_output_dir(path)
    _only(tmp_path, "afile", "adir")
    assert afile.read_bytes() == OLD


def test_report_writers_are_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"codec": "int8", "bits_per_element": 8.5}]
    write_json(tmp_path / "r.json", {"meta": {}, "results": rows})
    write_csv(tmp_path / "r.csv", rows)
    write_result_files(tmp_path / "out", "rd", {"x": float("nan")}, rows, ["codec"], ["# rd"])
    assert json.loads((tmp_path / "r.json").read_text())["results"] == rows
    assert (tmp_path / "r.csv").read_text().splitlines() == ["codec,bits_per_element", "int8,8.5"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["rd.csv", "rd.json", "rd.md"]

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    before = {p: p.read_bytes() for p in (tmp_path / "r.json", tmp_path / "r.csv")}
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="No space left") as info:
        write_json(tmp_path / "r.json", {"new": 1})
    assert info.value.filename == str(tmp_path / "r.json")
    with pytest.raises(OSError):
        write_csv(tmp_path / "r.csv", [{"new": 1}])
    with pytest.raises(OSError):
        write_result_files(tmp_path / "out", "rd", {"new": 1}, rows, ["codec"], ["# new"])
    assert {p: p.read_bytes() for p in before} == before
    _only(tmp_path, "r.json", "r.csv", "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["rd.csv", "rd.json", "rd.md"]


def _k_mean_file(path: Path, tokens: int) -> None:
    write_kv_mean_center(path, torch.ones(2, 1, 8), arch="qwen2", basis="plain", tokens=tokens, text="t", model="m")


def test_a_refused_calibration_file_leaves_the_old_one(tmp_path: Path) -> None:
    path = tmp_path / "c.gguf"
    _k_mean_file(path, 64)
    old = path.read_bytes()
    with pytest.raises(ValueError, match="RoPE tables"):
        write_kv_mean_center(
            path,
            torch.ones(2, 1, 8),
            arch="qwen2",
            basis="plain",
            tokens=1,
            text="t",
            model="m",
            rope=(torch.ones(3, 4), torch.ones(2)),
        )
    assert path.read_bytes() == old and read_kv_mean_center(path).meta["walshkv.tokens"] == 64
    _only(tmp_path, "c.gguf")


@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """A full disk for this process: no file may grow past ``limit`` bytes (RLIMIT_FSIZE; Python ignores SIGXFSZ,
    so a write past it fails with EFBIG). The old soft limit is restored on exit (raising a soft limit back up to
    the hard one needs no privilege)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_full_disk_leaves_the_old_files(tmp_path: Path) -> None:
    _k_mean_file(tmp_path / "c.gguf", 64)
    write_json_atomic(tmp_path / "r.json", {"rows": [1]})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    big = torch.ones(8, 4, 64)  # 8 KiB of tensors
    with file_size_limit(4096), pytest.raises(OSError) as gguf_error:
        write_kv_mean_center(tmp_path / "c.gguf", big, arch="qwen2", basis="plain", tokens=8, text="t", model="m")
    with file_size_limit(4096), pytest.raises(OSError) as json_error:
        write_json_atomic(tmp_path / "r.json", {"rows": list(range(5000))})
    # numpy's tofile can lose the error of a short write: gguf_writer then finds the size wrong (EIO)
    assert gguf_error.value.errno in (errno.EFBIG, errno.EIO) and gguf_error.value.filename == str(tmp_path / "c.gguf")
    assert json_error.value.errno == errno.EFBIG and json_error.value.filename == str(tmp_path / "r.json")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # old bytes, no temporary left
    assert read_kv_mean_center(tmp_path / "c.gguf").meta["walshkv.tokens"] == 64

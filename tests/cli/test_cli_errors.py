"""The CLI's fault matrix: every error exits 2 with ONE line on stderr, outputs are checked before any work,
and a failed write leaves an old file as it was.

As root a read-only directory cannot be made with chmod, so unwritable outputs are a path under a regular file,
a missing parent directory and an existing directory; a full disk is RLIMIT_FSIZE.
"""

from __future__ import annotations

import errno
import importlib.util
import sys
from pathlib import Path

import pytest

import walshkv.models
from walshkv.cli import error_line, main
from walshkv.models import LoadedModel, _describe

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/test_fileio.py, imported as "test_fileio"
from test_fileio import file_size_limit

RESEARCH = importlib.util.find_spec("walshkv_research") is not None
TOY_TEXT = "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(3000))

#: Each command with the option that names its output; ``{}`` is replaced by the bad path.
OUTPUT_CASES = [
    ["eval", "--codec", "int8", "--json", "{}"],
    ["eval", "--codec", "int8", "--csv", "{}"],
    ["eval", "--codec", "int8", "--markdown", "{}"],
    ["calibrate", "-o", "{}"],
    ["recommend", "--bits", "4.5", "-o", "{}"],
    ["recommend", "--bits", "4.5", "--json", "{}"],
    ["sweep", "--grid", "baseline", "--out", "{}"],
    ["rd", "--codec", "int8", "--out", "{}"],
    ["bench", "attention", "--out", "{}"],
]
if RESEARCH:
    OUTPUT_CASES += [
        ["rope", "factors", "-o", "{}"],
        ["rope", "sweep", "--out", "{}"],
        ["spectrum", "--out", "{}"],
        ["reconstruct", "--out", "{}"],
    ]
FOLDER_OPTIONS = {"--out"}


def _no_model(name: str, progress: bool = True) -> LoadedModel:
    raise AssertionError(f"the model {name!r} was loaded before the refusal")


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(walshkv.models, "load_model", _no_model)


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch, tiny_llama_hd64, toy_tokenizer, tmp_path: Path) -> Path:
    """``load_model`` hands out a tiny llama (head_dim 64); returns a text file to pass as ``--text``."""
    lm = LoadedModel(tiny_llama_hd64, toy_tokenizer, "tiny-hd64", "test", _describe(tiny_llama_hd64))
    monkeypatch.setattr(walshkv.models, "load_model", lambda name, progress=True: lm)
    text = tmp_path / "toy.txt"
    text.write_text(TOY_TEXT)
    return text


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``walshkv ARGV``; assert exit 2 and one line on stderr, and return that line."""
    assert main([*argv, "--quiet"] if "--quiet" not in argv and argv[0] != "codecs" else argv) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"walshkv {argv[0]}: error: "), err
    return lines[0]


def _bad_outputs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Unwritable outputs: name -> (path, words the message must hold)."""
    afile = tmp_path / "afile"
    afile.write_text("a regular file\n")
    (tmp_path / "adir").mkdir()
    return {
        "under a file": (afile / "out.json", "is a file"),
        "missing parent": (tmp_path / "missing" / "deeper" / "out.json", "does not exist"),
        "a directory": (tmp_path / "adir", "is a directory"),
    }


@pytest.mark.parametrize("template", OUTPUT_CASES, ids=lambda t: " ".join(t[:-1]))
def test_unwritable_outputs_are_refused_before_the_model_loads(template, tmp_path, capsys, no_load) -> None:
    for kind, (path, words) in _bad_outputs(tmp_path).items():
        flag = template[-2]
        if flag in FOLDER_OPTIONS and kind != "under a file":
            continue  # a missing folder is created, an existing one is written into
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
        line = _run([a.replace("{}", str(path)) for a in template], capsys)
        assert str(path) in line and (words in line or "not a folder" in line), (kind, line)
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before, kind  # nothing created


def test_fixable_inputs_fail_in_one_line_before_any_work(capsys, no_load) -> None:
    """What used to be a ZeroDivisionError / AssertionError traceback (or a silent success) is a refusal."""
    cases = {
        ("calibrate", "--ctx", "0"): "--ctx must be at least 4",
        ("calibrate", "--tokens", "0"): "--tokens must be at least 1",
        ("codecs", "--head-dim", "0"): "--head-dim must be a positive number",
        ("codecs", "--head-dim", "-4"): "--head-dim must be a positive number",
        ("recommend", "--bits", "4.5", "--calib-tokens", "0"): "--calib-tokens must be at least 1",
        ("recommend", "--bits", "4.5", "--max-key-work", "-1"): "--max-key-work must be a finite number >= 0",
        ("recommend", "--bits", "4.5", "--max-key-work", "nan"): "--max-key-work must be a finite number >= 0",
        ("bench", "attention", "--repeats", "0"): "--repeats must be at least 1",
        ("bench", "attention", "--threads", "0"): "--threads must be at least 1",
        # sizes and counts from a small argument: refused before anything is allocated (issue 39)
        ("eval", "--codec", "layers:int4@0-99999999999;int3"): "past any model",
        ("eval", "--codec", "rot+" * 2500 + "int4"): "chains 2500 wrappers",
        ("bench", "attention", "--kv-len", "1000000000000", "--codec", "int4"): "use at most",
    }
    if RESEARCH:
        cases[("reconstruct", "--vectors", "0")] = "--vectors must be at least 1"
    for argv, words in cases.items():
        assert words in _run(list(argv), capsys), argv


def test_a_missing_cuda_device_is_one_line(capsys, no_load) -> None:
    line = _run(["bench", "attention", "--device", "cuda:99"], capsys)
    assert "here; use --device cpu or an existing GPU" in line


@pytest.mark.parametrize("content", [b"", b"GGUF" + bytes(range(256)) * 4, b"not a gguf file at all"])
def test_a_garbage_calibration_file_is_one_line(content, tiny, tmp_path, capsys) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    argv = ["eval", "--text", str(tiny), "--ctx", "64", "--windows", "1", "--codec", "center+int8"]
    line = _run([*argv, "--kv-mean-center", str(bad)], capsys)
    assert str(bad) in line and "walshkv calibrate" in line
    assert bad.read_bytes() == content


def test_a_directory_as_calibration_file_is_one_line(tiny, tmp_path, capsys) -> None:
    argv = ["eval", "--text", str(tiny), "--ctx", "64", "--windows", "1", "--codec", "center+int8"]
    assert str(tmp_path) in _run([*argv, "--kv-mean-center", str(tmp_path)], capsys)


def test_a_full_disk_keeps_the_old_files(tiny, tmp_path, capsys) -> None:
    """`calibrate -o EXISTING` and `eval --json EXISTING` on a full disk: exit 2, one line, the old file intact."""
    old_gguf, old_json = tmp_path / "old.gguf", tmp_path / "old.json"
    calibrate = ["calibrate", "--text", str(tiny), "--ctx", "64", "--tokens", "64", "-o", str(old_gguf)]
    assert main([*calibrate, "--quiet"]) == 0
    old_json.write_text('{"valid": true}\n')
    capsys.readouterr()
    saved = {p: p.read_bytes() for p in (old_gguf, old_json)}
    with file_size_limit(256):
        line = _run(calibrate, capsys)
    assert str(old_gguf) in line and "unchanged" in line
    eval_argv = ["eval", "--text", str(tiny), "--ctx", "64", "--windows", "1", "--codec", "int8"]
    with file_size_limit(256):
        assert main([*eval_argv, "--json", str(old_json), "--quiet"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and str(old_json) in err[0] and "ulimit -f" in err[0]
    assert {p: p.read_bytes() for p in saved} == saved
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.gguf", "old.json", "toy.txt"]  # no temporary left


def test_error_lines_name_the_path_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    full = OSError(errno.ENOSPC, "No space left on device", "/data/out.gguf")
    assert error_line(full) == (
        "'/data/out.gguf': the disk is full: free space or write elsewhere (an existing file there is unchanged)"
    )
    assert "permission denied" in error_line(PermissionError(errno.EACCES, "Permission denied", "/x"))
    assert error_line(ValueError("bad\nvalue  here")) == "bad value here"
    assert error_line(AssertionError("x")).startswith("internal error AssertionError: x")


def test_traceback_on_request(monkeypatch: pytest.MonkeyPatch, no_load) -> None:
    monkeypatch.setenv("WALSHKV_TRACEBACK", "1")
    with pytest.raises(ValueError, match="--head-dim"):
        main(["codecs", "--head-dim", "0"])

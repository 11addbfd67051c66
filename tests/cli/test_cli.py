from __future__ import annotations

import pytest

from walshkv.cli import main


def test_help_teaches(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "eval" in out and "rot+int4/int3" in out
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = capsys.readouterr().out
    assert "--codec" in out and "--windows" in out and "compressed on write" in out


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out


def test_bad_codec_fails_fast_with_valid_names(capsys):
    assert main(["eval", "--codec", "int9", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "unknown codec" in err and "int4" in err and "rot+" in err


def test_bad_text_is_reported(capsys):
    assert main(["eval", "--text", "/no/such/file.txt", "--quiet"]) == 2
    assert "python-docs" in capsys.readouterr().err


def test_models_list(capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    for name in ("smollm2-135m", "qwen2.5-1.5b", "gemma3-270m", "head_dim"):
        assert name in out


def test_models_fetch_float_prints_the_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("WALSHKV_HOME", str(tmp_path))
    folder = tmp_path / "float" / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / "walshkv.json").write_text("{}")  # already written: nothing to load
    assert main(["models", "fetch", "smollm2-135m", "--float"]) == 0
    assert capsys.readouterr().out.strip() == str(folder)


def test_codecs_list(capsys):
    assert main(["codecs", "--head-dim", "128"]) == 0
    out = capsys.readouterr().out
    assert "int4" in out and "4.125" in out and "rot+" in out

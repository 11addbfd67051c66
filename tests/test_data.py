from __future__ import annotations

import pytest

from walshkv.data import load_text


def test_python_docs_default_needs_no_download():
    text = load_text()
    assert text.name == "python-docs"
    assert len(text.content) > 300_000
    assert load_text("python-docs").content == text.content  # deterministic


def test_file_text(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("Emma Woodhouse, handsome, clever, and rich", encoding="utf-8")
    text = load_text(str(p))
    assert text.name == "t.txt" and text.content.startswith("Emma")


def test_bad_texts(tmp_path):
    with pytest.raises(ValueError, match="python-docs"):
        load_text(str(tmp_path / "missing.txt"))
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        load_text(str(empty))
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(ValueError, match="UTF-8"):
        load_text(str(binary))


def test_wikitext_offline_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(ValueError, match="datasets"):
        load_text("wikitext-2")

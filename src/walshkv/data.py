"""Evaluation text, offline by default.

* ``python-docs`` (default): Python's own documentation topics
  (``pydoc_data.topics``, ~465k characters of English), shipped with every CPython.
* a path to any UTF-8 text file;
* ``wikitext-2``: the WikiText-2 raw test split through Hugging Face ``datasets``
  (needs the ``datasets`` package and a reachable hub).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_TEXT", "TEXTS", "Text", "load_text"]

DEFAULT_TEXT = "python-docs"
TEXTS = {
    "python-docs": "Python's documentation topics (pydoc_data.topics), offline",
    "wikitext-2": "WikiText-2 raw test split via Hugging Face datasets (needs network)",
}


@dataclass(frozen=True)
class Text:
    """A named text: ``name`` is what result files record, ``source`` where it came from."""

    name: str
    source: str
    content: str


def _python_docs() -> Text:
    from pydoc_data import topics

    body = "\n\n".join(topics.topics[key].strip() for key in sorted(topics.topics))
    return Text("python-docs", "pydoc_data.topics (sorted keys, joined by blank lines)", body)


def _wikitext2() -> Text:
    try:
        import datasets
    except ImportError:
        raise ValueError(
            "text 'wikitext-2' needs the 'datasets' package (pip install 'walshkv[hub]') and network "
            "access; offline, use the default 'python-docs' or --text PATH"
        ) from None
    try:
        ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    except Exception as err:
        raise ValueError(
            f"could not fetch wikitext-2 from the Hugging Face hub ({type(err).__name__}); "
            "offline, use the default 'python-docs' or --text PATH"
        ) from err
    return Text("wikitext-2", "wikitext-2-raw-v1 test split", "".join(ds["text"]))


def load_text(name_or_path: str = DEFAULT_TEXT) -> Text:
    """Load a named text or a UTF-8 file.

    Raises:
        ValueError: unknown name, missing/empty/non-UTF-8 file; the message lists the names.
    """
    if name_or_path == "python-docs":
        return _python_docs()
    if name_or_path == "wikitext-2":
        return _wikitext2()
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ValueError(f"text {name_or_path!r} is neither a known name ({', '.join(TEXTS)}) nor an existing file")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"text file {path} is not valid UTF-8 ({err.reason} at byte {err.start})") from None
    if not content.strip():
        raise ValueError(f"text file {path} is empty")
    return Text(path.name, str(path.resolve()), content)

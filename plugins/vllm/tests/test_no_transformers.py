"""The layers the plugin needs import without transformers (vLLM environments pin another transformers)."""

from __future__ import annotations

import subprocess
import sys

import pytest

BLOCKER = """
import importlib.abc, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "transformers" or name.startswith("transformers."):
            raise ImportError(f"blocked for the test: {name}")
        return None

sys.meta_path.insert(0, Block())
import importlib
importlib.import_module(sys.argv[1])
assert not any(m == "transformers" or m.startswith("transformers.") for m in sys.modules), "transformers loaded"
"""


@pytest.mark.parametrize(
    "module",
    [
        "walshkv",
        "walshkv.codecs",
        "walshkv.ops",
        "walshkv.attention",
        "walshkv.export",
        "walshkv_vllm",
        "walshkv_vllm.paged",
        "walshkv_vllm.registration",
    ],
)
def test_imports_without_transformers(module: str) -> None:
    run = subprocess.run([sys.executable, "-c", BLOCKER, module], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_facade_still_exports_its_names() -> None:
    import walshkv

    assert walshkv.__all__ == [
        "CacheSpec",
        "Codec",
        "CompressedCache",
        "Packed",
        "__version__",
        "parse_cache_spec",
        "parse_codec",
    ]
    from walshkv import CacheSpec, CompressedCache, parse_codec
    from walshkv.cache import CompressedCache as Direct

    assert CompressedCache is Direct and CacheSpec.__name__ == "CacheSpec" and callable(parse_codec)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = walshkv.nope  # type: ignore[attr-defined]
    assert set(walshkv.__all__) <= set(dir(walshkv))

"""The generation targets' arithmetic (walshkv.bench.report): which context measures the memory target's overhead."""

from __future__ import annotations

from walshkv.bench.report import _memory_target

MIB = 2**20


def _row(ctx: int, peak: int, cache: int) -> dict:
    return {
        "ctx": ctx,
        "cache": "fused",
        "codec": "walshkv:3.5",
        "prefill_chunk": 1024,
        "peak_rss": peak * MIB,
        "rss_after_load": 500 * MIB,
        "cache_bytes": cache * MIB,
        "malloc_mmap_threshold": 0,
    }


def test_the_overhead_is_measured_where_every_prefill_tile_shape_ran():
    """3,072 tokens (a later chunk over a whole 2,048-key tile) measures the overhead, not 1,024 (one chunk, no
    packed keys attended) nor 2,048 (half a tile); without such a context, the longest with more than one chunk."""
    rows = [_row(1024, 1100, 5), _row(2048, 1190, 10), _row(3072, 1250, 15), _row(8176, 1270, 40)]
    (line,) = _memory_target(rows, ["walshkv:3.5"])
    assert "measured at 3,072 tokens" in line and line.endswith("met.")
    (line,) = _memory_target([rows[0], rows[1], rows[3]], ["walshkv:3.5"])
    assert "measured at 2,048 tokens" in line and line.endswith("missed.")
    (line,) = _memory_target([rows[0], rows[3]], ["walshkv:3.5"])
    assert "measured at 1,024 tokens" in line and "glibc's default allocator settings" in line
    assert _memory_target(rows[:1], ["walshkv:3.5"]) == []

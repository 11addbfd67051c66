"""``walshkv bench``: decode attention and end-to-end generation speed, as ratios against baselines
measured in the same run (these machines are shared and noisy, so absolute times mean little).

1. **Attention** (``walshkv bench attention``): one decode step (one query token per sequence, GQA) against
   ``kv_len`` cached tokens of random K/V. Baselines: torch SDPA over fp16, bf16 and fp32 caches (query
   in the cache's dtype). Each codec: :func:`walshkv.attention.decode_attention` straight from the
   packed codes (fp32 query). The methods of one ``kv_len`` are timed in interleaved rounds (each
   round calls every method once), so a slow phase of a shared machine slows the baselines and the
   codecs alike. Per row: median time per step, the ratio against SDPA-fp16 and SDPA-fp32 (median
   over rounds of the per-round ratio; above 1: faster), the cache bytes the step reads and the
   effective GB/s they imply,
   against this machine's copy bandwidth measured in the same run (``dst.copy_(src)`` of 256 MB).

2. **Generation** (``walshkv bench generation``): the model reads ``ctx`` tokens of text (prefill in chunks of
   ``--prefill-chunk``, so no ctx x ctx mask is ever built) and then greedily generates ``--new-tokens``
   tokens one at a time, with a ``DynamicCache`` (torch SDPA) in fp32 and in bf16 (``DynamicCache bf16``:
   the model is loaded in bf16, so its cache holds bf16 K/V; ``--dynamic-dtype`` picks them) and with
   ``CompressedCache(codec, fused=True)`` (attention straight from the packed codes) for each
   ``--gen-codec`` (repeatable): a spec, or a preset (``walshkv:3.5``) with its calibration from
   ``--kv-mean-center FILE`` (written by ``walshkv calibrate --preset`` / ``walshkv recommend``; a file made
   for the preset chooses its spec, as in ``walshkv eval``) or ``--calib-text TEXT`` (calibrated in the run,
   on a text other than the bench text). Each row is named by its spec (``walshkv:3.5 = SPEC`` for a
   preset). Without ``--gen-codec``: ``rot+int4``, ``q4_0`` and the model's shipped presets, each with the
   calibration file walshkv ships for it (``walshkv/calibrations/<model>/``, :mod:`walshkv.shipped`; a note names
   the presets without one). Each run is a
   fresh subprocess, so its peak resident memory (``VmHWM``) is its own; ``--gen-runs N`` runs every row N
   times, the rows taking turns, and reports each row's medians and its runs' spread (under glibc's default
   allocator the peak moves by about 100 MiB between identical runs). Per row: decode tokens per
   second and the ratio against DynamicCache fp32 and bf16, the median decode step split into the cache's
   update (``update_ms``: encoding, bookkeeping), the attention function (``attn_ms``) and the rest of the
   model (``other_ms``), prefill seconds (and against DynamicCache fp32), cache bytes, resident memory
   after loading the model (and the calibration), peak, and the peak's excess over (memory after loading
   + cache bytes): the fixed overhead; the CPU, its ISA (``cpu_capability``, ``cpu_flags``) and whether
   the fused C++ kernel was built. The crossover is the smallest measured context at which a compressed
   cache decodes at least as fast as ``DynamicCache`` fp32. The compressed cache is built with
   ``max_cache_len = ctx + new_tokens`` (its store is allocated once; ``--no-reserve``: grown by 1/8 when
   full). Every child runs with glibc's ``MALLOC_MMAP_THRESHOLD_`` set to ``--malloc-mmap-threshold`` bytes
   (default 65536; 0 keeps glibc's default): allocations above it are mapped and returned to the system
   when freed. With glibc's default, the heap keeps freed blocks of the growing per-chunk tensors (for
   either cache), and the peak grows with context by more than the cache does; both settings are in
   docs/performance.md.

``walshkv bench`` alone runs both parts (attention first) and takes the options of both.

Outputs in ``--out``: ``bench.json``, ``bench.csv``, ``bench.md`` and ``bench.png``.
"""

# This docstring after its first paragraph is ``walshkv bench --help``'s description. Modules: machine
# (machine description, copy bandwidth, timers), attention, generation, report (tables, targets, markdown,
# plot).

from walshkv.bench.attention import (
    DEFAULT_ATTENTION_CODECS,
    DEFAULT_KV_LENS,
    SDPA_DTYPES,
    AttentionBenchConfig,
    attention_shapes,
    bench_attention,
)
from walshkv.bench.generation import (
    DEFAULT_CONTEXTS,
    DEFAULT_GENERATION_CODECS,
    DYNAMIC_DTYPES,
    GenerationBenchConfig,
    GenerationCodec,
    bench_generation,
    combine_runs,
    crossover,
    default_generation_codecs,
    position_notes,
    resolve_generation_codecs,
)
from walshkv.bench.machine import copy_bandwidth, interleaved_seconds, machine_description, median_seconds
from walshkv.bench.report import (
    bench_markdown,
    format_attention_table,
    format_generation_table,
    format_run_spread,
    generation_label,
    plot_bench,
    targets,
)

__all__ = [
    "DEFAULT_ATTENTION_CODECS",
    "DEFAULT_CONTEXTS",
    "DEFAULT_GENERATION_CODECS",
    "DEFAULT_KV_LENS",
    "DYNAMIC_DTYPES",
    "SDPA_DTYPES",
    "AttentionBenchConfig",
    "GenerationBenchConfig",
    "GenerationCodec",
    "attention_shapes",
    "bench_attention",
    "bench_generation",
    "bench_markdown",
    "combine_runs",
    "copy_bandwidth",
    "crossover",
    "default_generation_codecs",
    "format_attention_table",
    "format_generation_table",
    "format_run_spread",
    "generation_label",
    "interleaved_seconds",
    "machine_description",
    "median_seconds",
    "plot_bench",
    "position_notes",
    "resolve_generation_codecs",
    "targets",
]

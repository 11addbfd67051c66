"""``walshkv bench attention``: one decode step from packed codes against torch SDPA over float caches."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from walshkv.attention import cpu_supports, decode_attention, triton_supports
from walshkv.attention.cpu import prerope_key_map
from walshkv.attention.keys import split_prerope
from walshkv.bench.machine import COLD_FLUSH_BYTES, available_memory, interleaved_seconds, median_seconds
from walshkv.codecs import CacheSpec, NamedSpec, Packed
from walshkv.codecs.spec import check_spec_list
from walshkv.constants import Backend
from walshkv.identity import head_dim_of
from walshkv.models import layout_config
from walshkv.presets import name_specs

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike

__all__ = [
    "DEFAULT_ATTENTION_CODECS",
    "DEFAULT_KV_LENS",
    "SDPA_DTYPES",
    "TRANSFORM_SUFFIX",
    "AttentionBenchConfig",
    "attention_shapes",
    "bench_attention",
]

DEFAULT_ATTENTION_CODECS: tuple[str, ...] = (
    "rot+int4",
    "int4",
    "rot+int3",
    "rot+int8",
    "q4_0",
    "q8_0",
    "vht2:5,5,4,3",
    "tq:4/tq:2.5",
)
DEFAULT_KV_LENS: tuple[int, ...] = (1024, 4096, 16384, 65536)
SDPA_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
#: The suffix of the rows that time the pure-torch reference backend (``reference=True``).
REFERENCE_SUFFIX = " (reference)"
#: The suffix of the timings of a ``prerope+`` row's K transform done by torch alone (never a row of its own).
TRANSFORM_SUFFIX = " [K transform as a torch matmul]"


def attention_shapes(model: str) -> dict[str, int]:
    """The attention shapes of ``model`` as :func:`bench_attention` takes them, read from its config (no weights).

    Args:
        model: a registry name (``walshkv models list``) or a local model folder.

    Returns:
        ``{"head_dim", "kv_heads", "q_heads"}``.

    Raises:
        ValueError: the config cannot be read without loading the model (a ``.gguf`` path or a hub id).
    """
    config = layout_config(model)
    if config is None:
        raise ValueError(
            f"--model {model!r}: its attention shapes cannot be read without loading it; pass a registry name "
            "(walshkv models list) or a local folder with a config.json"
        )
    q_heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or q_heads)
    return {"head_dim": head_dim_of(config), "kv_heads": kv_heads, "q_heads": q_heads}


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _check_cuda(device: str) -> None:
    """Refuse ``cuda[:N]`` without a CUDA device (the name itself :class:`AttentionBenchConfig` checked)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch has no CUDA device; use --device cpu")


#: Bytes per cached element a case holds at once: K and V in float32 (the source) and in each SDPA dtype
#: (float16, bfloat16), with room for the packed codes and the query-side temporaries.
_CASE_BYTES_PER_ELEMENT = 2 * (4 + 2 + 2) + 4


def _check_memory(kv_lens: Sequence[int], elements_per_token: int, device: str) -> None:
    """Refuse a ``kv_len`` whose K/V copies cannot fit before any is allocated (an allocator error or a swap storm)."""
    free = available_memory(device)
    if free is None or not kv_lens:
        return
    per_token = elements_per_token * _CASE_BYTES_PER_ELEMENT
    worst = max(kv_lens)
    if worst * per_token > free:
        raise ValueError(
            f"--kv-len {worst:,} needs about {worst * per_token / 2**30:,.1f} GiB for the K/V the bench times "
            f"(float32, float16 and bfloat16 copies), but {device} has {free / 2**30:,.1f} GiB available: use at most "
            f"{free // per_token:,} tokens"
        )


@dataclass(frozen=True)
class AttentionBenchConfig:
    """What :func:`bench_attention` times: the contexts, the caches, the attention's shape and how it is timed.

    Random K/V ``[batch, kv_heads, kv_len, head_dim]`` and one query token ``[batch, q_heads, 1, head_dim]``
    (GQA; the defaults are smollm2-135m's attention, :func:`attention_shapes` gives another model's).

    Attributes:
        kv_lens: cached tokens per case. Kept as a tuple.
        codecs: cache specs or presets to time. Kept as a tuple.
        head_dim, kv_heads, q_heads, batch: the attention's shape (``q_heads`` a multiple of ``kv_heads``).
        repeats: timed rounds at least (more while within the time budget).
        seed: seed of the random K/V and queries.
        device: ``cpu`` or ``cuda[:N]`` (SDPA on CUDA tensors against the Triton backend, which
            ``decode_attention`` picks for CUDA tensors; codecs it does not read use the reference).
        reference: also time every codec on the pure-torch reference backend (rows ``SPEC (reference)``).
        check: record each codec row's ``max_abs_err_vs_sdpa_on_decoded``: the largest difference between
            its output and SDPA in float32 over the decoded cache.
        calibration: for presets (``walshkv:3.5``) and calibrated specs (``center+``, ``eq+``, ``prerope+``): a
            preset file (``read_kv_mean_center``; a file written by ``walshkv recommend`` also names the spec)
            or statistics; the codecs are bound to ``layer`` (its kv heads and head_dim must be the bench's).
            A spec's ``sink:N:`` tokens are left out (N full-precision tokens join the window at decode).
        calibrations: ``{codec: calibration}`` for codecs that take their own (e.g. two presets with their own
            files, side by side); the others take ``calibration``. Its keys must be among ``codecs``.
        layer: the layer whose calibration (and, for a ``layers:`` spec, whose codecs) a row uses.
        model: the model whose shipped spec a preset stands for (``walshkv models list``; the bench's shapes must be
            its), unless its calibration file names one; ``None``: the built-in spec.
        progress: show a progress bar.
        cold: flush the caches before every timed call (:data:`walshkv.bench.machine.COLD_FLUSH_BYTES` written), so
            each method starts cold, as a layer's attention does inside a model; ``False``: the methods run in turn,
            each after the one before it (which of them find their data still cached depends on the round's order).

    Raises:
        ValueError: ``device`` not ``cpu`` or ``cuda[:N]``; ``kv_lens`` or ``codecs`` empty, ``codecs`` a single
            string; a token count, shape, ``repeats`` or ``layer`` out of range; ``q_heads`` not a multiple of
            ``kv_heads``; a ``calibrations`` key that is not one of ``codecs``.
    """

    kv_lens: Sequence[int] = DEFAULT_KV_LENS
    codecs: Sequence[str] = DEFAULT_ATTENTION_CODECS
    head_dim: int = 64
    kv_heads: int = 3
    q_heads: int = 9
    batch: int = 1
    repeats: int = 7
    seed: int = 0
    device: str = "cpu"
    reference: bool = False
    check: bool = False
    calibration: CalibrationLike | None = None
    calibrations: Mapping[str, CalibrationLike] | None = field(default=None, compare=False)
    layer: int = 0
    model: str | None = None
    progress: bool = True
    cold: bool = False

    def __post_init__(self) -> None:
        if not (self.device == "cpu" or str(self.device).startswith("cuda")):
            raise ValueError(f"--device must be cpu or cuda[:N], got {self.device!r}")
        if isinstance(self.kv_lens, (int, str)) or not self.kv_lens:
            raise ValueError(f"kv_lens (--kv-len) is a non-empty list of token counts, got {self.kv_lens!r}")
        if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.kv_lens):
            raise ValueError(f"kv_lens (--kv-len) must be token counts of at least 1, got {list(self.kv_lens)}")
        check_spec_list(self.codecs, "cache specs or presets")
        if not self.codecs:
            raise ValueError("codecs (--codec) is empty: name at least one cache spec or preset, e.g. ['rot+int4']")
        for name in ("head_dim", "kv_heads", "q_heads", "batch", "repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads}): each kv head serves "
                "q_heads / kv_heads query heads"
            )
        if isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0:
            raise ValueError(f"layer (--layer) must be a layer index of at least 0, got {self.layer!r}")
        unknown = sorted(set(self.calibrations or {}) - set(self.codecs))
        if unknown:
            raise ValueError(
                f"calibrations names {unknown}, which are not among codecs {list(self.codecs)}: key each calibration "
                "by a codec it calibrates"
            )
        object.__setattr__(self, "kv_lens", tuple(self.kv_lens))
        object.__setattr__(self, "codecs", tuple(self.codecs))


@torch.inference_mode()
def bench_attention(config: AttentionBenchConfig | None = None) -> list[dict[str, Any]]:
    """Time one decode step per method and kv_len (see :mod:`walshkv.bench`).

    Args:
        config: the contexts, caches and shapes (default ``AttentionBenchConfig()``: the default codecs at
            :data:`DEFAULT_KV_LENS` in smollm2-135m's shapes).

    Returns:
        Rows ``{"kv_len", "method", "seconds", "ms", "cache_bytes", "gb_per_s", "backend",
        "speedup_vs_sdpa_fp16", "speedup_vs_sdpa_fp32", "speedup_vs_best_sdpa", "rounds"}``
        (``speedup_vs_best_sdpa``: against the fastest SDPA dtype of each round); codec rows also ``encode_ms``,
        the time to write one token's K and V (what every decode step adds), and ``spec`` (a preset's spec).
        Rows whose K is stored before RoPE (``prerope+``) say how the CPU kernel maps each cached key to its
        pre-RoPE vector (``k_map``: ``matrix``, one ``[head_dim, head_dim]`` matrix per kv head, for ``eq+``;
        ``matrix-amx``, the same on AMX tiles as three bf16 products of hi/lo parts; ``hadamard``, a fast
        Walsh-Hadamard transform, without it); ``matrix`` rows also time, in the same rounds, the multiply-adds
        of that mapping done by torch alone as one float32 batched matmul (``matrix-amx`` rows: one bf16 batched
        matmul three times as deep, the same products):
        ``k_transform_macs``, ``k_transform_matmul_ms``, ``k_transform_matmul_gmacs`` (torch's rate),
        ``k_transform_kernel_gmacs`` (the kernel's rate if it did nothing else) and
        ``k_transform_bound_vs_best_sdpa`` (the fastest SDPA over the matmul's time: what a float32 kernel that
        maps every key at torch's matmul rate could reach at most).

    Raises:
        ValueError: CUDA without a CUDA device, a spec that does not fit ``head_dim``, or K/V copies that cannot fit
            in the device's memory.
    """
    config = AttentionBenchConfig() if config is None else config
    kv_lens, codecs, device = config.kv_lens, config.codecs, config.device
    head_dim, kv_heads, batch, repeats = config.head_dim, config.kv_heads, config.batch, config.repeats
    calibration, model, layer, seed = config.calibration, config.model, config.layer, config.seed
    reference = config.reference
    _check_cuda(device)
    cuda = device.startswith("cuda")
    supports = triton_supports if cuda else cpu_supports
    own = dict(config.calibrations or {})
    named: dict[str, tuple[NamedSpec, CalibrationLike | None]] = {}  # canonical text: each spec measured once
    for codec in codecs:
        cal = own.get(codec, calibration)
        (n,) = name_specs([codec], cal, model=model)
        named.setdefault(n.text, (n, cal))
    specs: dict[str, CacheSpec] = {}
    spec_text: dict[str, str] = {}
    for n, cal in named.values():
        parsed = n.spec
        if not isinstance(parsed, CacheSpec):
            raise ValueError(f"{n.asked}: the attention bench measures walshkv's kernels, not Hugging Face's caches")
        parsed.check_head_dim(head_dim)
        name = n.label if n.source is not None else n.text  # a preset's row is named by the preset
        specs[name] = parsed.bind(layer, cal if parsed.needs_calibration else None)  # a layers: part
        spec_text[name] = n.text
    _check_memory(kv_lens, batch * kv_heads * head_dim, device)
    gen = torch.Generator().manual_seed(seed)
    rows: list[dict[str, Any]] = []
    jobs = len(kv_lens) * (len(SDPA_DTYPES) + len(codecs) * (2 if reference else 1))
    bar = tqdm(total=jobs, desc="bench attention", unit="case", disable=not config.progress)
    for n in kv_lens:
        k = torch.randn(batch, kv_heads, n, head_dim, generator=gen).to(device)
        v = torch.randn(batch, kv_heads, n, head_dim, generator=gen).to(device)
        q = torch.randn(batch, config.q_heads, 1, head_dim, generator=gen).to(device)
        fns: dict[str, Callable[[], Any]] = {}
        info: dict[str, tuple[int, str]] = {}  # method -> (cache bytes, backend)
        for name, dt in SDPA_DTYPES.items():
            kc, vc, qc = k.to(dt), v.to(dt), q.to(dt)
            fns[f"sdpa-{name}"] = lambda qc=qc, kc=kc, vc=vc: _sdpa(qc, kc, vc)
            info[f"sdpa-{name}"] = (2 * kc.numel() * kc.element_size(), "torch")
        encode_ms: dict[str, float] = {}
        errors: dict[str, float] = {}
        macs: dict[str, int] = {}
        key_map: dict[str, str] = {}  # prerope+ rows: how the CPU kernel maps keys (matrix, hadamard)
        for spec_name, spec in specs.items():
            kmap = None if cuda else prerope_key_map(spec.k, spec.v, head_dim, kv_heads)
            if kmap is not None:
                key_map[spec_name] = kmap
            if kmap in ("matrix", "matrix-amx") or (cuda and split_prerope(spec.k) is not None):
                # torch's matmul of the same work: float32, or (AMX) bf16 over the hi/lo parts' three products
                three = kmap == "matrix-amx"
                width, mdt = (3 * head_dim, torch.bfloat16) if three else (head_dim, torch.float32)
                tgen = torch.Generator().manual_seed(seed + 1)
                rows_in = torch.randn(batch * kv_heads, n, width, generator=tgen).to(device=device, dtype=mdt)
                mats = torch.randn(batch * kv_heads, width, head_dim, generator=tgen).to(device=device, dtype=mdt)
                fns[spec_name + TRANSFORM_SUFFIX] = lambda a=rows_in, m=mats: torch.bmm(a, m)
                macs[spec_name] = batch * kv_heads * n * head_dim * head_dim
            pk, pv = spec.k.encode(k, spec.sink), spec.v.encode(v, spec.sink)
            fast = supports(spec.k, head_dim) and supports(spec.v, head_dim)
            fns[spec_name] = _step(q, pk, pv, spec, "auto")
            info[spec_name] = (pk.nbytes() + pv.nbytes(), ("triton" if cuda else "cpu") if fast else "reference")
            if reference:
                fns[spec_name + REFERENCE_SUFFIX] = _step(q, pk, pv, spec, "reference")
                info[spec_name + REFERENCE_SUFFIX] = (info[spec_name][0], "reference")
            if config.check:
                want = _sdpa(q.float(), spec.k.decode(pk, spec.sink).float(), spec.v.decode(pv, spec.sink).float())
                for method in (spec_name, spec_name + REFERENCE_SUFFIX) if reference else (spec_name,):
                    errors[method] = float((fns[method]().float() - want).abs().max())
            k1, v1 = k[:, :, -1:], v[:, :, -1:]  # writing one decode step's token (quantize on write)
            encode_ms[spec_name] = 1e3 * median_seconds(
                lambda s=spec, a=k1, b=v1, at=n: (s.k.encode(a, at), s.v.encode(b, at)), repeats, device=device
            )
        times = interleaved_seconds(fns, repeats, device=device, flush_bytes=COLD_FLUSH_BYTES if config.cold else 0)
        best = [min(times[f"sdpa-{d}"][i] for d in SDPA_DTYPES) for i in range(len(times["sdpa-fp16"]))]
        for method, ts in times.items():
            if method.endswith(TRANSFORM_SUFFIX):
                continue  # reported in its codec's row
            nbytes, backend = info[method]
            row = _row(n, method, statistics.median(ts), nbytes, backend)
            # paired ratios: each round times every method once, so a slow phase of a shared machine
            # hits the baseline and the method alike; the median over rounds of the per-round ratio
            row["speedup_vs_sdpa_fp16"] = statistics.median(b / t for b, t in zip(times["sdpa-fp16"], ts, strict=True))
            row["speedup_vs_sdpa_fp32"] = statistics.median(b / t for b, t in zip(times["sdpa-fp32"], ts, strict=True))
            row["speedup_vs_best_sdpa"] = statistics.median(b / t for b, t in zip(best, ts, strict=True))
            row["rounds"] = len(ts)
            if method in spec_text and spec_text[method] != method:
                row["spec"] = spec_text[method]
            if method in encode_ms:
                row["encode_ms"] = encode_ms[method]
            if method in errors:
                row["max_abs_err_vs_sdpa_on_decoded"] = errors[method]
            if method in key_map:
                row["k_map"] = key_map[method]
            if method in macs:
                tm = times[method + TRANSFORM_SUFFIX]
                row["k_transform_macs"] = macs[method]
                row["k_transform_matmul_ms"] = 1e3 * statistics.median(tm)
                row["k_transform_matmul_gmacs"] = macs[method] / statistics.median(tm) / 1e9
                row["k_transform_kernel_gmacs"] = macs[method] / row["seconds"] / 1e9
                row["k_transform_bound_vs_best_sdpa"] = statistics.median(b / t for b, t in zip(best, tm, strict=True))
            rows.append(row)
            bar.update()
    bar.close()
    return rows


def _step(q: torch.Tensor, pk: Packed, pv: Packed, spec: CacheSpec, backend: Backend) -> Callable[[], torch.Tensor]:
    """One decode step over the packed cache on ``backend`` (``auto``: as the cache calls it); the packed tokens
    start after the spec's sink tokens (which this bench leaves out)."""
    return lambda: decode_attention(q, pk, pv, spec.k, spec.v, backend=backend, start=spec.sink)


def _row(n: int, method: str, sec: float, nbytes: int, backend: str) -> dict[str, Any]:
    return {
        "kv_len": n,
        "method": method,
        "seconds": sec,
        "ms": 1e3 * sec,
        "cache_bytes": nbytes,
        "gb_per_s": nbytes / sec / 1e9,
        "backend": backend,
    }

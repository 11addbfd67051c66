"""Save and restore a :class:`~walshkv.cache.CompressedCache`: the packed codes as stored, in one safetensors file.

The file is a safetensors file (8 bytes of header length, a JSON header, the tensors' bytes). Tensors, per
layer ``i``, hold only the tokens the layer holds (never the reserved capacity of its packed store):

* ``layers.{i}.packed_k.{field}``, ``layers.{i}.packed_v.{field}``: the codec's fields as stored,
  ``[batch, num_kv_heads, tokens, *field.shape]`` (KIVI's ``packed_k`` counts groups of tokens);
* ``layers.{i}.keys``, ``layers.{i}.values``: the full-precision window ``[batch, num_kv_heads, r, head_dim]``
  (``residual`` tokens, or KIVI's fp16 window; ``r`` may be 0);
* ``layers.{i}.sink_k``, ``layers.{i}.sink_v``: the fp16 sink tokens of a ``sink:N:`` spec.

``save_cache(..., at_rest="rans")`` stores every packed field entropy-coded instead
(:func:`walshkv.ops.rans.encode_rows`: one rANS model per byte column class of the field, rows stored as they are
where coding would not shorten them):
the tensor is then a 1-D ``uint8`` blob, the header records the field's dtype and shape under ``coded``, the file's
format is :data:`RANS_FORMAT_VERSION`, and :func:`load_cache` decodes it back to the same bytes before any other
check of the layout. Nothing else changes: the checksum covers the blobs as stored.

The safetensors metadata holds ``walshkv.cache``, a JSON header (:data:`FORMAT_VERSION`, the walshkv version,
the canonical spec, ``residual``/``fused``/``max_cache_len``, the model identity, the calibration identity, and
per layer its kind, dtype, positions and parts), and ``walshkv.sha256``, a checksum over the header text and
every tensor (name, dtype, shape, bytes). A file costs the bytes the cache holds (:meth:`CompressedCache.nbytes`)
plus about 1 KiB of header per layer. :func:`load_cache` refuses a file that is missing, truncated, changed
after it was written, of another format or walshkv version, or made for another model, calibration or spec,
with a :class:`CacheFileError` whose ``reason`` names which.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from walshkv._version import __version__
from walshkv.cache.identity import calibration_digest, checksum, layer_codecs, model_identity
from walshkv.cache.kivi import KiviLayer, KiviSlidingWindowLayer
from walshkv.cache.layers import CompressedLayer, CompressedSlidingWindowLayer
from walshkv.codecs.base import Codec, Packed
from walshkv.codecs.spec import parse_cache_spec
from walshkv.fileio import atomic_path
from walshkv.ops.rans import RansError, decode_rows, encode_rows

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from walshkv.cache.compressed import CompressedCache
    from walshkv.codecs.calibration import Calibration
    from walshkv.codecs.spec import CacheSpec
    from walshkv.constants import AtRest

__all__ = ["FORMAT_VERSION", "RANS_FORMAT_VERSION", "CacheFileError", "load_cache", "save_cache", "saved_tensors"]

#: The version of this file format; :func:`load_cache` refuses any other (but :data:`RANS_FORMAT_VERSION`).
FORMAT_VERSION = 1
#: The format of a file whose packed fields are entropy-coded (``at_rest="rans"``); a reader of format 1 only
#: refuses it by its version, naming the walshkv that reads it.
RANS_FORMAT_VERSION = 2
_FORMATS = {"packed": FORMAT_VERSION, "rans": RANS_FORMAT_VERSION}
_HEADER, _CHECKSUM = "walshkv.cache", "walshkv.sha256"
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


class CacheFileError(ValueError):
    """A saved cache that :func:`load_cache` refuses; ``reason`` names why.

    Reasons: ``truncated``, ``corrupt`` (unreadable header), ``not-a-cache``, ``format``, ``checksum``,
    ``version``, ``spec``, ``model``, ``dtype``, ``calibration``, ``rebuild`` (the cache cannot be built for this
    model: e.g. fused without the fused attention), ``layout``.
    """

    def __init__(self, path: str | os.PathLike[str], reason: str, message: str) -> None:
        super().__init__(f"{os.fspath(path)}: {reason}: {message}")
        self.reason = reason


# ---- save ---------------------------------------------------------------------------------------------


def _cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous()


def _packed_meta(name: str, packed: Packed | None, prefix: str, out: dict[str, torch.Tensor]) -> dict | None:
    if packed is None:
        return None
    for field, t in packed.tensors.items():
        out[f"{prefix}.{name}.{field}"] = _cpu(t)
    return {
        "head_dim": packed.head_dim,
        "dtype": str(packed.dtype).removeprefix("torch."),
        "fields": list(packed.tensors),
    }


def _layer_state(i: int, layer: CompressedLayer, out: dict[str, torch.Tensor]) -> dict[str, Any]:
    meta: dict[str, Any] = {"kind": type(layer).__name__, "initialized": bool(layer.is_initialized)}
    if not layer.is_initialized:
        return meta
    prefix = f"layers.{i}"
    out[f"{prefix}.keys"], out[f"{prefix}.values"] = _cpu(layer.keys), _cpu(layer.values)
    has_sink = layer.sink_k is not None
    if has_sink:
        out[f"{prefix}.sink_k"], out[f"{prefix}.sink_v"] = _cpu(layer.sink_k), _cpu(layer.sink_v)  # type: ignore[arg-type]
    meta |= {
        "dtype": str(layer.dtype).removeprefix("torch."),
        "cumulative_length": layer.cumulative_length,
        "sink": has_sink,
        "packed_k": _packed_meta("packed_k", layer.packed_k, prefix, out),
        "packed_v": _packed_meta("packed_v", layer.packed_v, prefix, out),
    }
    return meta


def saved_tensors(cache: CompressedCache) -> dict[str, torch.Tensor]:
    """The tensors :func:`save_cache` writes for ``cache``, by name, on the CPU: what a file holds besides its
    header (packed fields ``[batch, num_kv_heads, tokens, *field.shape]``, full-precision windows, sink tokens)."""
    tensors: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(cache.layers):
        _layer_state(i, layer, tensors)  # type: ignore[arg-type]
    return tensors


def _code_fields(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Replace every packed field of ``tensors`` by its rANS blob (1-D ``uint8``); ``{name: {dtype, shape}}``."""
    coded = {}
    for name, t in tensors.items():
        if ".packed_" not in name or t.numel() == 0:
            continue
        rows = t.contiguous().view(torch.uint8).reshape(t.shape[0] * t.shape[1] * t.shape[2], -1)
        tensors[name] = torch.frombuffer(bytearray(encode_rows(rows.numpy())), dtype=torch.uint8)
        coded[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    return coded


_BYTE_DTYPES = {"uint8": torch.uint8, "int8": torch.int8, **_DTYPES}


def _decode_fields(path: Path, coded: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Undo :func:`_code_fields` in place, refusing a blob that does not decode to its recorded dtype and shape."""
    if not isinstance(coded, dict):
        raise CacheFileError(path, "corrupt", "the header's coded fields are not a mapping; save the cache again")
    for name, what in coded.items():
        blob = _take(path, tensors, name)
        try:
            dtype, shape = _BYTE_DTYPES[what["dtype"]], [int(n) for n in what["shape"]]
            rows = decode_rows(blob.numpy().tobytes())
            t = torch.from_numpy(rows).reshape(-1).view(dtype).reshape(shape)
        except (RansError, KeyError, TypeError, ValueError, RuntimeError) as err:
            raise CacheFileError(
                path, "corrupt", f"{name} does not decode to its saved field ({err}); save the cache again"
            ) from err
        tensors[name] = t


def save_cache(cache: CompressedCache, path: str | os.PathLike[str], *, at_rest: AtRest = "packed") -> None:
    """Write ``cache`` to ``path`` (safetensors, atomically: a temporary file beside it, then a rename).

    Args:
        cache: the cache.
        path: the file to write.
        at_rest: ``"packed"`` (the fields as held in memory) or ``"rans"`` (every packed field entropy-coded:
            smaller where the codes are not equally likely, decoded once by :func:`load_cache`;
            research/scripts/bits_at_rest.py measures the gain per spec).

    Raises:
        ValueError: the cache was built without ``config=model.config`` (its model is unknown), or its layers
            hold different positions (saved in the middle of a forward), or ``at_rest`` is not one of
            ``packed``, ``rans``.
        OSError: the file could not be written; an existing ``path`` is unchanged.
    """
    if at_rest not in _FORMATS:
        raise ValueError(f"at_rest must be one of {', '.join(_FORMATS)}, got {at_rest!r}")
    if cache.model_config is None:
        raise ValueError(
            "this CompressedCache was built without config=model.config, so the model it belongs to is unknown; "
            "build it with CompressedCache(spec, config=model.config) (or from_preset / from_model) to save it"
        )
    lengths = sorted({layer.cumulative_length for layer in cache.layers if layer.is_initialized})  # type: ignore[attr-defined]
    if len(lengths) > 1:
        raise ValueError(
            f"the layers hold different positions ({lengths}): a forward is half done; save between forwards"
        )
    tensors: dict[str, torch.Tensor] = {}
    layers = [_layer_state(i, layer, tensors) for i, layer in enumerate(cache.layers)]  # type: ignore[arg-type]
    header = {
        "format": _FORMATS[at_rest],
        "walshkv": __version__,
        "spec": cache.cache_spec.spec,
        "residual": cache.residual,
        "fused": cache.fused,
        "max_cache_len": cache.max_cache_len,
        "model": model_identity(cache.model_config),
        "calibration": calibration_digest(cache),
        "layers": layers,
    }
    if at_rest == "rans":
        header["coded"] = _code_fields(tensors)
    text = json.dumps(header, sort_keys=True, separators=(",", ":"))
    metadata = {_HEADER: text, _CHECKSUM: checksum(text, tensors)}
    with atomic_path(path) as temp:
        _write_file(tensors, metadata, temp)


def _write_file(tensors: dict[str, torch.Tensor], metadata: dict[str, str], temp: Path) -> None:
    """safetensors' ``save_file`` into ``temp``, its errors as ``OSError`` and its size checked.

    safetensors reports a failed write as its own ``SafetensorError`` (no path, no errno) and a short one not
    at all: the error becomes the ``OSError`` of the ``(os error N)`` it quotes (``atomic_path`` then names
    the file asked for), and a file shorter than its header says is ``EIO`` (a full disk or a file-size limit).
    """
    try:
        save_file(tensors, os.fspath(temp), metadata=metadata)
    except SafetensorError as err:
        found = re.search(r"os error (\d+)", str(err))
        if found is None:
            raise
        code = int(found[1])
        raise OSError(code, f"{os.strerror(code)} (safetensors: {err})", os.fspath(temp)) from err
    size = temp.stat().st_size
    with open(temp, "rb") as handle:
        n = int.from_bytes(handle.read(8), "little")
    expected = 8 + n + sum(t.numel() * t.element_size() for t in tensors.values())
    if size != expected:
        raise OSError(
            errno.EIO,
            f"short write: {size} of {expected} bytes reached the disk (disk full or a file-size limit?)",
            os.fspath(temp),
        )


# ---- load ---------------------------------------------------------------------------------------------


def _read_header(path: Path) -> tuple[str, str]:
    """The walshkv header text and checksum of the file, after checking its safetensors frame is whole."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no saved cache there; check the path, or save one with cache.save(path)")
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; give the file that cache.save(path) wrote")
    size = path.stat().st_size
    again = "copy it again or save the cache again"
    with open(path, "rb") as handle:
        head = handle.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise CacheFileError(
                path,
                "truncated",
                f"its {size} bytes cannot hold the header they announce: the file is incomplete (an interrupted "
                f"copy?) or not a saved cache; {again}",
            )
        raw = handle.read(n)
    try:
        entries = json.loads(raw)
        meta = entries.pop("__metadata__", None) or {}
        end = max((int(e["data_offsets"][1]) for e in entries.values()), default=0)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
        raise CacheFileError(
            path, "corrupt", f"the safetensors header cannot be read ({err}); the file was damaged, save it again"
        ) from err
    if _HEADER not in meta or _CHECKSUM not in meta:
        raise CacheFileError(
            path,
            "not-a-cache",
            "a safetensors file without walshkv's cache header; load a file CompressedCache.save wrote",
        )
    if 8 + n + end != size:
        short = 8 + n + end > size
        what = "is incomplete (an interrupted copy?)" if short else "has bytes after its last tensor"
        raise CacheFileError(
            path,
            "truncated" if short else "corrupt",
            f"its tensors end at byte {8 + n + end}, the file has {size} bytes: it {what}; {again}",
        )
    return meta[_HEADER], meta[_CHECKSUM]


def _parse(path: Path, text: str) -> dict[str, Any]:
    try:
        header = json.loads(text)
    except ValueError as err:
        raise CacheFileError(path, "corrupt", f"walshkv's header is not JSON ({err}); save the cache again") from err
    if not isinstance(header, dict) or header.get("format") not in _FORMATS.values():
        found = header.get("format") if isinstance(header, dict) else None
        raise CacheFileError(
            path,
            "format",
            f"format version {found!r}; this walshkv ({__version__}) reads formats {FORMAT_VERSION} and "
            f"{RANS_FORMAT_VERSION} (entropy-coded): load it with the walshkv that wrote it, or save the cache again",
        )
    if (header["format"] == RANS_FORMAT_VERSION) != ("coded" in header):
        raise CacheFileError(path, "corrupt", "the header's format and its coded fields disagree; save it again")
    return header


def _check_identity(path: Path, header: dict[str, Any], model: PreTrainedModel, spec: str | CacheSpec | None) -> None:
    if header["walshkv"] != __version__:
        raise CacheFileError(
            path,
            "version",
            f"written by walshkv {header['walshkv']}, this is walshkv {__version__} (its codecs may store or read "
            f"bytes differently); load it with walshkv {header['walshkv']}, or rebuild the cache from the prompt",
        )
    try:
        canonical = parse_cache_spec(header["spec"]).spec
    except ValueError as err:
        raise CacheFileError(path, "spec", f"this walshkv cannot read the spec {header['spec']!r}: {err}") from err
    if canonical != header["spec"]:
        raise CacheFileError(path, "spec", f"{header['spec']!r} now reads as {canonical!r}; save the cache again")
    if spec is not None and parse_cache_spec(spec).spec != canonical:
        asked = parse_cache_spec(spec).spec
        raise CacheFileError(path, "spec", f"the file holds a {canonical} cache, not {asked}; load the matching file")
    saved, ours = header["model"], model_identity(model.config)
    if saved != ours:
        differ = ", ".join(k for k in ours if saved.get(k) != ours[k])
        raise CacheFileError(
            path,
            "model",
            f"saved for a {saved.get('config_class')} with {saved.get('num_layers')} layers, "
            f"{saved.get('num_kv_heads')} kv heads, head_dim {saved.get('head_dim')}; this model differs in {differ}: "
            "load it with the model whose cache it is",
        )


def _take(path: Path, tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise CacheFileError(path, "layout", f"tensor {name} is missing; save the cache again")
    return tensors.pop(name)


def _packed(
    path: Path, name: str, meta: dict | None, codec: Codec, window: torch.Tensor, tensors: dict[str, torch.Tensor]
) -> Packed | None:
    if meta is None:
        return None
    layout = codec.layout(window.shape[-1])
    if list(meta["fields"]) != list(layout) or meta["head_dim"] != window.shape[-1] or meta["dtype"] not in _DTYPES:
        raise CacheFileError(
            path,
            "layout",
            f"{name} holds {meta['fields']} of head_dim {meta['head_dim']}, {codec.spec} stores "
            f"{list(layout)} of head_dim {window.shape[-1]}; save the cache again with this walshkv",
        )
    fields = {f: _take(path, tensors, f"{name}.{f}") for f in layout}
    tokens = next(iter(fields.values())).shape[2:3]
    for f, t in fields.items():
        want = (*window.shape[:2], *tokens, *layout[f].shape)
        if tuple(t.shape) != want or t.dtype != layout[f].dtype:
            raise CacheFileError(
                path,
                "layout",
                f"{name}.{f} is {t.dtype} {tuple(t.shape)}, {codec.spec} stores {layout[f].dtype} {want}",
            )
    return Packed(fields, meta["head_dim"], _DTYPES[meta["dtype"]])


def _restore_layer(path: Path, i: int, layer: CompressedLayer, meta: dict, tensors: dict, model: Any) -> None:
    """Put layer ``i``'s saved state into ``layer`` (a fresh layer of the rebuilt cache), checking its shapes."""
    if meta.get("kind") != type(layer).__name__:
        raise CacheFileError(
            path, "layout", f"layer {i} was a {meta.get('kind')}, this model's is a {type(layer).__name__}"
        )
    if not meta["initialized"]:
        return
    if meta["dtype"] != str(model.dtype).removeprefix("torch."):
        raise CacheFileError(
            path,
            "dtype",
            f"the cache holds {meta['dtype']} activations, the model runs in {model.dtype}; "
            f"load the model in {meta['dtype']} (dtype=torch.{meta['dtype']})",
        )
    prefix = f"layers.{i}"
    keys, values = _take(path, tensors, f"{prefix}.keys"), _take(path, tensors, f"{prefix}.values")
    sink = (
        (_take(path, tensors, f"{prefix}.sink_k"), _take(path, tensors, f"{prefix}.sink_v")) if meta["sink"] else None
    )
    codec_k, codec_v = layer_codecs(layer)
    packed_k = _packed(path, f"{prefix}.packed_k", meta["packed_k"], codec_k, keys, tensors)
    packed_v = _packed(path, f"{prefix}.packed_v", meta["packed_v"], codec_v, values, tensors)
    n_k, n_v = (0 if p is None else p.seq_len for p in (packed_k, packed_v))
    n_sink = 0 if sink is None else sink[0].shape[2]
    stored = n_sink + n_v + keys.shape[2]
    consistent = keys.shape[:3] == values.shape[:3] and (sink is None or sink[0].shape == sink[1].shape)
    consistent &= n_k * (layer.group if isinstance(layer, KiviLayer) else 1) == n_v
    consistent &= keys.shape[2] <= layer.residual or isinstance(layer, KiviLayer)
    length = meta["cumulative_length"]
    if isinstance(layer, CompressedSlidingWindowLayer):
        consistent &= stored <= min(length, layer.sliding_window - 1)
    elif isinstance(layer, KiviSlidingWindowLayer):  # drops whole K groups: up to G - 1 tokens past the window
        consistent &= stored <= length and (length - stored) % layer.group == 0
        consistent &= length - stored <= max(0, length - layer.sliding_window + 1)
    else:
        consistent &= stored == length
    if not consistent:
        raise CacheFileError(
            path, "layout", f"layer {i}'s tokens do not add up ({stored} held of {length}); save again"
        )
    device = model.device
    layer.device, layer.dtype, layer.cumulative_length = device, model.dtype, length
    layer.keys, layer.values = keys.to(device), values.to(device)
    layer.sink_k, layer.sink_v = (None, None) if sink is None else (sink[0].to(device), sink[1].to(device))
    layer.packed_k = None if packed_k is None else packed_k.to(device)
    layer.packed_v = None if packed_v is None else packed_v.to(device)
    layer.is_initialized = True


def load_cache(
    cls: type[CompressedCache],
    path: str | os.PathLike[str],
    model: PreTrainedModel,
    calibration: Calibration | None = None,
    *,
    spec: str | CacheSpec | None = None,
    fused: bool | None = None,
) -> CompressedCache:
    """Read a cache :func:`save_cache` wrote, for ``model``: the same bytes, positions and next logits.

    Everything is checked before the cache is built (see :class:`CacheFileError` for the reasons).

    Args:
        cls: the cache class (:class:`CompressedCache`).
        path: the file.
        model: the model the cache was saved from (same config; its tensors land on ``model.device``).
        calibration: the calibration the cache was built with (its bound codecs must hash the same).
        spec: if given, the spec the file must hold.
        fused: read the packed codes with the fused attention (default: as saved).

    Raises:
        FileNotFoundError: no file at ``path``.
        CacheFileError: the file is refused; ``reason`` says why and the message names the fix.
    """
    path = Path(path)
    text, saved_sum = _read_header(path)
    header = _parse(path, text)
    try:
        with safe_open(os.fspath(path), framework="pt") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
    except SafetensorError as err:
        raise CacheFileError(path, "corrupt", f"the tensors cannot be read ({err}); save the cache again") from err
    if checksum(text, tensors) != saved_sum:
        raise CacheFileError(
            path,
            "checksum",
            "its sha256 differs from the one saved: the file changed after it was written (a "
            "flipped bit, an edit, a bad copy); copy it again or save the cache again",
        )
    _check_identity(path, header, model, spec)
    if "coded" in header:  # entropy-coded fields: the same bytes again before the layout is checked
        _decode_fields(path, header["coded"], tensors)
    saved = header["calibration"]
    if saved is not None and calibration is None:
        raise CacheFileError(
            path,
            "calibration",
            f"{header['spec']} was bound to a calibration (sha256 {saved[:12]}...); pass "
            "calibration=, the one the cache was built with",
        )
    fused = header["fused"] if fused is None else fused
    try:
        cache = cls(
            header["spec"],
            config=model.config,
            residual=header["residual"],
            calibration=calibration,
            fused=fused,
            max_cache_len=header["max_cache_len"],
        )
    except ValueError as err:
        raise CacheFileError(path, "rebuild", f"the cache cannot be rebuilt for this model: {err}") from err
    ours = calibration_digest(cache)
    if ours != saved:
        raise CacheFileError(
            path,
            "calibration",
            f"this calibration binds other codecs (sha256 {str(ours)[:12]}... instead of "
            f"{str(saved)[:12]}...); pass the calibration the cache was built with",
        )
    if len(header["layers"]) != len(cache.layers):
        raise CacheFileError(path, "layout", f"{len(header['layers'])} layers saved, the model has {len(cache.layers)}")
    for i, (layer, meta) in enumerate(zip(cache.layers, header["layers"], strict=True)):
        _restore_layer(path, i, layer, meta, tensors, model)  # type: ignore[arg-type]
    if tensors:
        raise CacheFileError(path, "layout", f"unexpected tensors {sorted(tensors)[:3]}; save the cache again")
    return cache

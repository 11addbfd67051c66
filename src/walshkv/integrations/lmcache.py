"""walshkv codecs as an LMCache serializer ("serde") for its L2 storage (LMCache 0.5.6, ``lmcache.v1.distributed``).

LMCache's multiprocess server (``lmcache server``, what vLLM's ``LMCacheMPConnector`` talks to) keeps KV chunks
in CPU memory (L1) and writes them to L2 backends (Redis/Valkey through the ``resp`` adapter, a filesystem through
``fs``, ...). An L2 adapter may name a serde that turns each chunk into bytes on the way out and back on the way
in: ``{"type": "resp", "host": ..., "port": ..., "serde": {"type": "walshkv", "spec": "q8_0/q4_0",
"head_dim": 64}}``. This module is that serde: it packs each chunk with a walshkv cache spec, so L2 (and every
byte that moves between machines through it) holds the codes, and a chunk loaded back is decoded into the
``[2, num_layers, num_tokens, hidden]`` buffer LMCache hands to the serving engine.

LMCache 0.5.6 finds serdes only in its own registry (``register_serde_factory``), which nothing outside it
fills from configuration or entry points: call :func:`register` in the server process before the storage
manager is built, or start the server through this module, which registers and then runs LMCache's CLI::

    python -m walshkv.integrations.lmcache server --l1-size-gb 20 --eviction-policy LRU \\
        --l2-adapter '{"type": "resp", "host": "10.0.0.5", "port": 6379,
                       "serde": {"type": "walshkv", "spec": "q8_0/q4_0", "head_dim": 128}}'

Serde options (the ``"serde"`` block, see :class:`SerdeOptions`): ``spec`` (a fixed-size cache spec),
``head_dim``, optionally ``num_kv_heads`` (checked against the chunk), ``calibration`` (the ``.gguf`` file
``walshkv calibrate`` writes, for ``center+`` and ``eq+``), ``model`` and ``model_arch`` (checked against the
file), ``max_workers`` (serde threads).

Layout. LMCache's chunk is ``[2, num_layers, num_tokens, hidden]`` (K then V; ``hidden = kv_heads * head_dim``,
heads major, as vLLM lays out a token). Each layer's K and V become walshkv's ``[1, kv_heads, num_tokens,
head_dim]`` and are encoded at position 0 (position-dependent specs are refused: a chunk does not know its
position). The serialized bytes are a header (little-endian)::

    offset size field
    0      8    magic b"WALSHKV\\0"
    8      2    format version (1)
    10     2    flags (0)
    12     4    header length in bytes (this table + the spec string)
    16     8    payload length in bytes
    24     4    CRC-32 of the payload
    28     1    dtype of the chunk (1 float16, 2 bfloat16, 3 float32)
    29     3    zero
    32     4    num_layers
    36     4    num_tokens
    40     4    num_kv_heads
    44     4    head_dim
    48     32   sha256 of the calibration file's bytes (zeros for a spec without calibration)
    80     2    length of the spec string
    82     n    the canonical spec string (UTF-8)

then the payload: for each layer, K then V, each field of the layer's codec in ``codec.layout(head_dim)`` order,
``[1, kv_heads, num_tokens, *field.shape]`` C-contiguous. Its size follows from the layout alone
(:meth:`ChunkCodec.serialized_size`), which is what LMCache's ``estimate_serialized_size`` returns: the
estimate is exact, never a margin.

Decoding returns what walshkv's own ``decode`` returns, bit for bit, except for ``center+`` K: walshkv leaves K
centered (exact for attention over one cache), but the serving engine puts the loaded chunk next to keys it
computes itself, so the serde adds the calibrated mean back (``Centered.plain_offset``).
"""

from __future__ import annotations

import hashlib
import math
import os
import struct
import sys
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from walshkv.codecs.base import Codec, Packed, find_wrapper, unwrap, wrappers
from walshkv.codecs.center import Centered
from walshkv.codecs.kivi import KiviCodec
from walshkv.codecs.spec import CacheSpec, LayeredCacheSpec, parse_cache_spec
from walshkv.export import KMeanBias, read_kv_mean_center
from walshkv.presets import Preset, is_preset, resolve_engine_preset

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "SERDE_NAME",
    "ChunkCodec",
    "SerdeOptions",
    "WalshkvDeserializer",
    "WalshkvSerializer",
    "create_serde_processor",
    "load_calibration",
    "main",
    "register",
]

#: The name an L2 adapter's ``"serde": {"type": ...}`` block uses.
SERDE_NAME = "walshkv"
#: First bytes of every serialized chunk.
MAGIC = b"WALSHKV\0"
#: Version of the byte format described in the module docstring.
FORMAT_VERSION = 1

_FIXED = struct.Struct("<8sHHIQIB3xIIII32sH")  # the header up to the spec string
_DTYPE_CODES: dict[torch.dtype, int] = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_CODE_DTYPES = {code: dtype for dtype, code in _DTYPE_CODES.items()}
_NO_CALIBRATION = bytes(32)

#: Fixed-size specs named in refusals (any spec whose codecs store a fixed number of bytes per vector works).
FIXED_SIZE_EXAMPLES = (
    "rot+int4, q8_0/q4_0, q8_0, tq:4/tq:3, center+tq:4/tq:2.5 or center+eq+tq:3.5/eq+tq:3 (with calibration)"
)
_LIST_THEM = "`walshkv codecs --head-dim N` lists every codec with its bits per element"


@dataclass(frozen=True)
class SerdeOptions:
    """The ``"serde"`` block of an L2 adapter (everything but ``"type"``).

    Attributes:
        spec: a fixed-size walshkv cache spec, ``KSPEC/VSPEC`` or one spec for both (``q8_0/q4_0``,
            ``rot+int4``, ``tq:4/tq:3``, ``center+tq:4/tq:2.5``, ``layers:...``), or a preset name (``walshkv:3.5``):
            the model's own preset spec (``model`` names the model, or ``calibration`` is the file ``walshkv
            calibrate --preset`` wrote for it), refused where the serde cannot hold a part of it; never the
            built-in spec in its place.
        head_dim: the model's K/V head size; ``hidden`` of a chunk must be a multiple of it.
        num_kv_heads: KV heads per chunk (the model's KV heads divided by the tensor-parallel size); checked
            against ``hidden / head_dim`` when given.
        calibration: path of the ``.gguf`` file ``walshkv calibrate`` wrote (needed by ``center+`` and ``eq+``).
        model: the model name (``walshkv models list``): the calibration file must record it (checked when both
            name one), and a preset name in ``spec`` resolves to this model's shipped spec.
        model_arch: the architecture the calibration file is used with (as ``read_kv_mean_center`` takes it).
        max_workers: threads LMCache's serde pool runs (serialization is CPU-bound).
    """

    spec: str
    head_dim: int
    num_kv_heads: int | None = None
    calibration: str | None = None
    model: str | None = None
    model_arch: str | None = None
    max_workers: int = 1

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, object]) -> SerdeOptions:
        """Validate the JSON block LMCache hands the factory.

        Raises:
            ValueError: an unknown key, a missing ``spec``/``head_dim``, or a value of the wrong type.
        """
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ValueError(
                f"walshkv serde: unknown option(s) {', '.join(map(repr, unknown))}; the options are "
                f'{", ".join(known)} (e.g. {{"type": "walshkv", "spec": "q8_0/q4_0", "head_dim": 128}})'
            )
        for name in ("spec", "head_dim"):
            if name not in kwargs:
                raise ValueError(
                    f"walshkv serde: {name!r} is required: write "
                    '"serde": {"type": "walshkv", "spec": "q8_0/q4_0", "head_dim": 128} (head_dim is the '
                    "model's K/V head size)"
                )

        def whole(name: str, value: object, least: int) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"walshkv serde: {name} must be a whole number >= {least}, got {value!r}")
            return value

        def text(name: str, value: object) -> str | None:
            if value is None:
                return None
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"walshkv serde: {name} must be a non-empty string, got {value!r}")
            return value

        spec = kwargs["spec"]
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"walshkv serde: spec must be a cache spec string such as 'q8_0/q4_0', got {spec!r}")
        heads = kwargs.get("num_kv_heads")
        return cls(
            spec=spec,
            head_dim=whole("head_dim", kwargs["head_dim"], 1),
            num_kv_heads=None if heads is None else whole("num_kv_heads", heads, 1),
            calibration=text("calibration", kwargs.get("calibration")),
            model=text("model", kwargs.get("model")),
            model_arch=text("model_arch", kwargs.get("model_arch")),
            max_workers=whole("max_workers", kwargs.get("max_workers", 1), 1),
        )


_CALIBRATIONS: dict[tuple[str, str | None], tuple[KMeanBias, bytes]] = {}
_CALIBRATIONS_LOCK = threading.Lock()


def load_calibration(path: str | os.PathLike[str], model_arch: str | None = None) -> tuple[KMeanBias, bytes]:
    """A calibration file and the sha256 of its bytes, read once per process (later calls return the same).

    Args:
        path: the ``.gguf`` file ``walshkv calibrate`` wrote.
        model_arch: passed to :func:`walshkv.export.read_kv_mean_center`.

    Raises:
        ValueError: the file is missing or not a valid calibration file (the message names the fix).
    """
    key = (str(Path(path).resolve()), model_arch)
    with _CALIBRATIONS_LOCK:
        held = _CALIBRATIONS.get(key)
        if held is None:
            calibration = read_kv_mean_center(key[0], model_arch)
            digest = hashlib.sha256(Path(key[0]).read_bytes()).digest()
            held = _CALIBRATIONS[key] = (calibration, digest)
    return held


def _is_positional(codec: Codec) -> bool:
    """True if any part of the chain reads the tokens' positions (it overrides ``_decode_at``, as ``prerope+``)."""
    return any(type(part)._decode_at is not Codec._decode_at for part in (*wrappers(codec), unwrap(codec)))


def _plain_parts(spec: CacheSpec) -> list[CacheSpec]:
    return [part for part, _ in spec.parts] if isinstance(spec, LayeredCacheSpec) else [spec]


def _check_fixed_size(spec_text: str, spec: object, preset: Preset | None = None) -> CacheSpec:
    """The parsed spec if every chunk's bytes follow from its layout and none depends on positions, else raise.

    ``preset``: the preset ``spec_text`` stands for (messages name it and its source).
    """
    if preset is not None:
        try:
            return _check_fixed_size(spec_text, spec)
        except ValueError as e:
            why = str(e).removeprefix("walshkv serde: ")
            raise ValueError(
                f"walshkv serde: {preset.name} ({preset.source}) is {spec_text!r}, which the serde cannot hold: {why}. "
                "Store a fixed-size spec in its place, or leave the serde off for this model"
            ) from None
    if not isinstance(spec, CacheSpec):
        raise ValueError(
            f"walshkv serde: {spec_text!r} is Hugging Face's own quantized cache, which has no byte format to "
            f"store; use a walshkv spec: {FIXED_SIZE_EXAMPLES}"
        )
    if spec.sink:
        rest = spec_text.split(":", 2)[-1]
        raise ValueError(
            f"walshkv serde: {spec_text!r} keeps the first {spec.sink} tokens of each sequence in fp16, and an LMCache "
            f"chunk does not know where in the sequence it starts; drop sink:N: ({rest!r}) or use another fixed-size "
            f"spec: {FIXED_SIZE_EXAMPLES}"
        )
    for part in _plain_parts(spec):
        for side in (part.k, part.v):
            if isinstance(unwrap(side), KiviCodec):
                raise ValueError(
                    f"walshkv serde: {spec_text!r} is KIVI, which keeps a full-precision window of recent tokens "
                    f"and groups K over tokens, so its size depends on the sequence; use a fixed-size spec: "
                    f"{FIXED_SIZE_EXAMPLES}; {_LIST_THEM}"
                )
            if _is_positional(side):
                frame = next((w.prefix for w in wrappers(side) if w.name == "prerope"), "prerope")
                plain = side.spec.replace(f"{frame}+", "")
                raise ValueError(
                    f"walshkv serde: {side.spec!r} depends on the tokens' positions ({frame}+ turns K back by its "
                    f"position: prerope+ before RoPE, ropeblock:G+ to its block's start), and an LMCache chunk is "
                    f"stored without its position; use the same spec without {frame}+ ({plain!r}) or another "
                    f"fixed-size spec: {FIXED_SIZE_EXAMPLES}"
                )
    return spec


@dataclass(frozen=True)
class _Header:
    payload_len: int
    crc32: int
    dtype: torch.dtype
    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    calibration: bytes
    spec: str
    length: int


class ChunkCodec:
    """Encodes LMCache chunks ``[2, num_layers, num_tokens, hidden]`` into walshkv's bytes and back.

    Independent of LMCache (tests and scripts use it directly); :class:`WalshkvSerializer` and
    :class:`WalshkvDeserializer` adapt it to LMCache's interfaces.

    Args:
        options: the serde block (see :class:`SerdeOptions`).

    Raises:
        ValueError: a spec that is not fixed-size (``sink:``, KIVI, ``prerope+``, ``hf-``), a head size the
            spec refuses, a calibrated spec without ``calibration``, a calibration file that cannot serve it.
    """

    def __init__(self, options: SerdeOptions) -> None:
        self.options = options
        spec_text = options.spec
        self.preset: Preset | None = None
        if is_preset(spec_text):  # the model's own preset (or the file's), never the built-in spec in its place
            file = load_calibration(options.calibration, options.model_arch)[0] if options.calibration else None
            self.preset = resolve_engine_preset(
                spec_text,
                engine="walshkv serde",
                model=options.model,
                calibration=file,
                how='set "model" in the serde block (a name from `walshkv models list`)',
            )
            spec_text = self.preset.spec
        self.spec = _check_fixed_size(spec_text, parse_cache_spec(spec_text), self.preset)
        self.head_dim = options.head_dim
        self.spec.check_head_dim(self.head_dim)
        self.calibration: KMeanBias | None = None
        self.calibration_sha256 = _NO_CALIBRATION
        if options.calibration is not None:
            if not self.spec.needs_calibration:
                raise ValueError(
                    f"walshkv serde: {self.spec.spec!r} reads no calibration, but 'calibration' names "
                    f"{options.calibration}; drop it, or use a calibrated spec (center+..., eq+...)"
                )
            self.calibration, self.calibration_sha256 = load_calibration(options.calibration, options.model_arch)
            self._check_calibration(None, options.num_kv_heads)
        elif self.spec.needs_calibration:
            raise ValueError(
                f"walshkv serde: {self.spec.spec!r} is calibrated (center+ / eq+ / order=variance): add "
                '"calibration": "/path/calib.gguf" to the serde block, a file written by `walshkv calibrate '
                "--model MODEL -o calib.gguf` (with --eq for eq+)"
            )
        self._spec_bytes = self.spec.spec.encode()
        self._bound: dict[int, CacheSpec] = {}
        self._checked: set[tuple[int, int]] = set()
        self._lock = threading.Lock()

    # -- layout ------------------------------------------------------------------------------------------------

    def _check_calibration(self, num_layers: int | None, num_kv_heads: int | None) -> None:
        """Refuse a calibration file made for another model (``None``: that count is not known yet)."""
        cal = self.calibration
        if cal is not None:
            layers = cal.num_layers if num_layers is None else num_layers
            heads = cal.plain.shape[1] if num_kv_heads is None else num_kv_heads
            cal.check_matches(layers, heads, self.head_dim, self.options.model)

    def chunk_shape(self, shape: Sequence[int], dtype: torch.dtype) -> tuple[int, int, int]:
        """``(num_layers, num_tokens, num_kv_heads)`` of a chunk ``[2, num_layers, num_tokens, hidden]``.

        Raises:
            ValueError: another rank (MLA's ``[num_layers, num_tokens, hidden]``), a dtype other than fp16,
                bf16, fp32, ``hidden`` not a multiple of ``head_dim``, a ``num_kv_heads`` or calibration file
                that does not match, a ``layers:`` spec naming layers the chunk lacks.
        """
        shape = tuple(int(s) for s in shape)
        if len(shape) != 4 or shape[0] != 2:
            raise ValueError(
                f"walshkv serde: a chunk must be [2, num_layers, num_tokens, hidden] (K and V), got {list(shape)}; "
                "MLA's single latent plane ([num_layers, num_tokens, hidden]) has no K/V heads for walshkv codecs: "
                "leave the serde off for MLA models"
            )
        if dtype not in _DTYPE_CODES:
            raise ValueError(
                f"walshkv serde: chunk dtype {dtype} is not float16, bfloat16 or float32; run the engine's KV cache "
                "in one of them (an fp8 KV cache is already quantized: leave the serde off)"
            )
        _, num_layers, num_tokens, hidden = shape
        if hidden % self.head_dim:
            raise ValueError(
                f"walshkv serde: the chunk's hidden size {hidden} is not a multiple of head_dim {self.head_dim}; set "
                "head_dim to the model's K/V head size (hidden = num_kv_heads * head_dim per tensor-parallel rank)"
            )
        heads = hidden // self.head_dim
        key = (num_layers, heads)
        if key not in self._checked:
            if self.options.num_kv_heads is not None and heads != self.options.num_kv_heads:
                raise ValueError(
                    f"walshkv serde: the chunk holds {heads} KV heads (hidden {hidden} / head_dim {self.head_dim}), "
                    f"but num_kv_heads is {self.options.num_kv_heads}; set num_kv_heads to the model's KV heads per "
                    "tensor-parallel rank, or leave it out"
                )
            if isinstance(self.spec, LayeredCacheSpec):
                self.spec.check_layers(num_layers)
            self._check_calibration(num_layers, heads)
            with self._lock:
                self._checked.add(key)
        return num_layers, num_tokens, heads

    def layer_spec(self, layer: int) -> CacheSpec:
        """The K and V codecs of ``layer``, bound to the calibration once per process."""
        bound = self._bound.get(layer)
        if bound is None:
            bound = self.spec.bind(layer, self.calibration)
            with self._lock:
                bound = self._bound.setdefault(layer, bound)
        return bound

    def _header_len(self) -> int:
        return _FIXED.size + len(self._spec_bytes)

    def payload_size(self, num_layers: int, num_tokens: int, num_kv_heads: int) -> int:
        """Payload bytes of a chunk: ``num_tokens * num_kv_heads`` vectors per layer and side, each the codec's
        ``bytes_per_vector(head_dim)`` (``bits_per_element * head_dim / 8``)."""
        per_token = sum(
            side.bytes_per_vector(self.head_dim)
            for layer in range(num_layers)
            for side in (self.layer_spec(layer).k, self.layer_spec(layer).v)
        )
        return per_token * num_tokens * num_kv_heads

    def serialized_size(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """Exact bytes :meth:`serialize` writes for a chunk of this shape and dtype (header included)."""
        num_layers, num_tokens, heads = self.chunk_shape(shape, dtype)
        return self._header_len() + self.payload_size(num_layers, num_tokens, heads)

    # -- bytes -------------------------------------------------------------------------------------------------

    def serialize(self, chunk: torch.Tensor, out: torch.Tensor) -> int:
        """Encode ``chunk`` ``[2, num_layers, num_tokens, hidden]`` into ``out`` (flat ``uint8``, at least
        :meth:`serialized_size` bytes); returns the bytes written."""
        num_layers, num_tokens, heads = self.chunk_shape(chunk.shape, chunk.dtype)
        if out.dtype != torch.uint8 or out.dim() != 1:
            raise ValueError(f"walshkv serde: the output buffer must be flat uint8, got {out.dtype} {list(out.shape)}")
        size = self._header_len() + self.payload_size(num_layers, num_tokens, heads)
        if out.numel() < size:
            raise ValueError(f"walshkv serde: the output buffer holds {out.numel()} bytes, the chunk needs {size}")
        offset = self._header_len()
        crc = 0
        for layer in range(num_layers):
            bound = self.layer_spec(layer)
            for side, codec in enumerate((bound.k, bound.v)):
                x = chunk[side, layer].reshape(num_tokens, heads, self.head_dim).transpose(0, 1).unsqueeze(0)
                packed = codec.encode(x)
                for name, field in codec.layout(self.head_dim).items():
                    t = packed.tensors[name]
                    want = (1, heads, num_tokens, *field.shape)
                    if tuple(t.shape) != want or t.dtype != field.dtype:  # a codec breaking its own layout
                        raise RuntimeError(
                            f"{codec.spec}: field {name!r} is {t.dtype} {list(t.shape)}, its layout says "
                            f"{field.dtype} {list(want)}"
                        )
                    raw = t.contiguous().reshape(-1).view(torch.uint8)
                    out[offset : offset + raw.numel()].copy_(raw)
                    crc = zlib.crc32(raw.numpy(), crc)
                    offset += raw.numel()
        header = _FIXED.pack(
            MAGIC,
            FORMAT_VERSION,
            0,
            self._header_len(),
            offset - self._header_len(),
            crc,
            _DTYPE_CODES[chunk.dtype],
            num_layers,
            num_tokens,
            heads,
            self.head_dim,
            self.calibration_sha256,
            len(self._spec_bytes),
        )
        out[: self._header_len()].copy_(torch.frombuffer(bytearray(header + self._spec_bytes), dtype=torch.uint8))
        return offset

    @staticmethod
    def read_header(data: torch.Tensor) -> _Header:
        """Parse and check the header of serialized bytes (flat ``uint8``); the payload is checked by
        :meth:`deserialize`.

        Raises:
            ValueError: fewer bytes than a header, another magic (bytes another serde wrote), another format
                version, a header length that does not fit.
        """
        if data.numel() < _FIXED.size:
            raise ValueError(
                f"walshkv serde: {data.numel()} bytes are fewer than a header ({_FIXED.size}): the L2 object is "
                "truncated or empty"
            )
        fixed = _FIXED.unpack(bytes(data[: _FIXED.size].numpy()))
        magic, version, _flags, header_len, payload_len, crc, dtype_code = fixed[:7]
        num_layers, num_tokens, heads, head_dim, calibration, spec_len = fixed[7:]
        if magic != MAGIC:
            raise ValueError(
                f"walshkv serde: the L2 object starts with {magic!r}, not {MAGIC!r}: another serde (or none) wrote "
                "it; give each serde its own L2 backend (or clear it) before switching"
            )
        if version != FORMAT_VERSION:
            raise ValueError(
                f"walshkv serde: the L2 object has format version {version}, this walshkv reads {FORMAT_VERSION}; "
                "read it with the walshkv release that wrote it, or clear the L2 backend"
            )
        if header_len != _FIXED.size + spec_len or data.numel() < header_len:
            raise ValueError(
                f"walshkv serde: bad header (length {header_len}, spec {spec_len} bytes, object {data.numel()} "
                "bytes): the L2 object is truncated or corrupt"
            )
        if dtype_code not in _CODE_DTYPES:
            raise ValueError(f"walshkv serde: bad dtype code {dtype_code} in the header: the L2 object is corrupt")
        spec = bytes(data[_FIXED.size : header_len].numpy()).decode("utf-8", errors="replace")
        return _Header(
            payload_len,
            crc,
            _CODE_DTYPES[dtype_code],
            num_layers,
            num_tokens,
            heads,
            head_dim,
            calibration,
            spec,
            header_len,
        )

    def deserialize(self, data: torch.Tensor, out: torch.Tensor) -> None:
        """Decode serialized bytes ``data`` (flat ``uint8``; extra bytes after the chunk are ignored) into ``out``
        ``[2, num_layers, num_tokens, hidden]``.

        Raises:
            ValueError: another magic or version, another spec, head size or calibration than this serde's,
                a chunk shape or dtype other than ``out``'s, truncated bytes, a CRC mismatch (corrupt bytes).
        """
        h = self.read_header(data)
        if h.spec != self.spec.spec:
            raise ValueError(
                f"walshkv serde: the L2 object was written with spec {h.spec!r}, this serde reads {self.spec.spec!r}; "
                "every LMCache server sharing an L2 backend must use the same spec (or clear the backend)"
            )
        if h.calibration != self.calibration_sha256:
            raise ValueError(
                f"walshkv serde: the L2 object was written with {_calibration_name(h.calibration)}, this serde has "
                f"{_calibration_name(self.calibration_sha256)} ({self.options.calibration}); use the same "
                "calibration file on every server sharing the backend (or clear it)"
            )
        if h.head_dim != self.head_dim:
            raise ValueError(
                f"walshkv serde: the L2 object has head_dim {h.head_dim}, this serde {self.head_dim}; set head_dim "
                "to the model's K/V head size on every server"
            )
        num_layers, num_tokens, heads = self.chunk_shape(out.shape, out.dtype)
        if (h.num_layers, h.num_tokens, h.num_kv_heads, h.dtype) != (num_layers, num_tokens, heads, out.dtype):
            raise ValueError(
                f"walshkv serde: the L2 object holds (layers, tokens, kv_heads, dtype) = "
                f"{(h.num_layers, h.num_tokens, h.num_kv_heads, h.dtype)}, the buffer LMCache loads into is "
                f"{(num_layers, num_tokens, heads, out.dtype)}: another model or KV dtype wrote it"
            )
        size = self.payload_size(num_layers, num_tokens, heads)
        if h.payload_len != size or data.numel() < h.length + size:
            raise ValueError(
                f"walshkv serde: the L2 object holds {data.numel() - h.length} payload bytes (header says "
                f"{h.payload_len}), the layout needs {size}: it is truncated or corrupt"
            )
        payload = data[h.length : h.length + size]
        if zlib.crc32(payload.numpy()) != h.crc32:
            raise ValueError("walshkv serde: the L2 object's payload fails its CRC-32: it is corrupt")
        offset = 0
        for layer in range(num_layers):
            bound = self.layer_spec(layer)
            for side, codec in enumerate((bound.k, bound.v)):
                tensors = {}
                for name, field in codec.layout(self.head_dim).items():
                    n = math.prod((heads, num_tokens, field.nbytes))
                    raw = payload[offset : offset + n].clone()
                    tensors[name] = raw.view(field.dtype).reshape(1, heads, num_tokens, *field.shape)
                    offset += n
                out[side, layer].copy_(self._decode(codec, tensors, out.dtype).squeeze(0).transpose(0, 1).flatten(1))

    def _decode(self, codec: Codec, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """``[1, kv_heads, tokens, head_dim]`` in ``dtype``: walshkv's ``decode``; ``center+`` K with its mean back."""
        centered = find_wrapper(codec, Centered)
        if centered is None:
            return codec.decode(Packed(tensors, self.head_dim, dtype))
        decoded = codec.decode(Packed(tensors, self.head_dim, torch.float32))
        return (decoded + centered.plain_offset().to(decoded.device)[None, :, None, :]).to(dtype)


def _calibration_name(digest: bytes) -> str:
    return "no calibration" if digest == _NO_CALIBRATION else f"calibration sha256 {digest.hex()[:16]}..."


class WalshkvSerializer:
    """LMCache ``Serializer`` (registered as its virtual subclass by :func:`register`) over a :class:`ChunkCodec`."""

    def __init__(self, codec: ChunkCodec) -> None:
        self.codec = codec

    def serialize(self, src: Any, dst: Any, key: Any) -> int:
        """Encode ``src.tensor`` ``[2, L, T, hidden]`` into the byte buffer ``dst``; returns the bytes written."""
        _single_group(src)
        return self.codec.serialize(src.tensor, dst.tensor.reshape(-1))

    def estimate_serialized_size(self, layout_desc: Any) -> int:
        """Exact serialized bytes of a chunk of ``layout_desc`` (one ``[2, L, T, hidden]`` shape)."""
        if len(layout_desc.shapes) != 1:
            raise ValueError(_GROUPS.format(n=len(layout_desc.shapes)))
        return self.codec.serialized_size(layout_desc.shapes[0], layout_desc.dtypes[0])


class WalshkvDeserializer:
    """LMCache ``Deserializer`` (registered as its virtual subclass by :func:`register`) over a :class:`ChunkCodec`."""

    def __init__(self, codec: ChunkCodec) -> None:
        self.codec = codec

    def deserialize(self, src: Any, dst: Any, key: Any) -> None:
        """Decode the bytes of ``src`` into ``dst.tensor`` ``[2, L, T, hidden]``."""
        _single_group(dst)
        self.codec.deserialize(src.tensor.reshape(-1), dst.tensor)


_GROUPS = (
    "walshkv serde: the chunk has {n} kernel groups (a hybrid model's layers of several shapes); the serde "
    "reads one [2, num_layers, num_tokens, hidden] tensor per chunk: leave it off for this model"
)


def _single_group(obj: Any) -> None:
    shapes = obj.get_shapes()
    if len(shapes) != 1:
        raise ValueError(_GROUPS.format(n=len(shapes)))


def create_serde_processor(kwargs: dict[str, object]) -> Any:
    """LMCache's serde factory: the ``"serde"`` block (without ``"type"``) to an ``AsyncSerdeProcessor``."""
    from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor

    options = SerdeOptions.from_kwargs(kwargs)
    codec = ChunkCodec(options)
    return AsyncSerdeProcessor(WalshkvSerializer(codec), WalshkvDeserializer(codec), max_workers=options.max_workers)


def register() -> None:
    """Register the ``walshkv`` serde in LMCache's serde registry (idempotent; needs ``lmcache`` installed).

    Call it in the LMCache server process before the storage manager is built (``python -m
    walshkv.integrations.lmcache server ...`` does).
    """
    try:
        from lmcache.v1.distributed.serde import Deserializer, Serializer
        from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory
    except ImportError as e:
        raise ImportError(
            f"the walshkv LMCache serde needs LMCache 0.5.6 ({e}); install it: pip install 'walshkv[lmcache]'"
        ) from e
    Serializer.register(WalshkvSerializer)
    Deserializer.register(WalshkvDeserializer)
    if SERDE_NAME not in get_registered_serde_types():
        register_serde_factory(SERDE_NAME, create_serde_processor)


def main(argv: Sequence[str] | None = None) -> None:
    """Register the serde, then run LMCache's CLI with ``argv`` (``server --l2-adapter ...``)."""
    register()
    from lmcache.cli.main import main as lmcache_main

    lmcache_main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()

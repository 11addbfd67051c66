"""K mean-centering bias files (GGUF) that llama.cpp forks with ``--kv-mean-center FILE`` read.

Format (the fork's documented layout):

* one F32 tensor per layer named ``kv_bar.blk.<il>.k`` holding ``n_embd_head_k x n_head_kv``
  values, GGUF shape ``[n_embd_head_k, n_head_kv]`` (channel fastest);
* metadata ``kv_mean_center.k_rot`` (bool): True if the bias is in the Hadamard-rotated basis
  (what llama.cpp subtracts after rotating K), False for the plain basis;
* walshkv's own metadata under ``walshkv.``: architecture, layer count, head_dim, n_head_kv,
  calibration tokens, calibration text, walshkv version;
* for specs with ``eq+`` (walshkv only; llama.cpp forks ignore them): one F32 tensor per layer named
  ``walshkv.k_eq.blk.<il>`` holding the ``n_head_kv`` K transforms ``A`` (numpy ``[n_head_kv,
  head_dim, head_dim]``, ``y = A k`` with rows and columns in llama.cpp's channel order), and
  ``walshkv.v_eq.blk.<il>`` likewise for V (V channels are never permuted);
* for ``prerope+`` specs (walshkv only): ``walshkv.k_basis = "pre-rope"``, and the model's RoPE tables
  ``walshkv.rope.inv_freq`` (numpy ``[layers, head_dim/2]``) and ``walshkv.rope.scaling`` (``[layers]``).
  The K mean and K transforms of such a file are those of K *before* RoPE: a llama.cpp fork that
  subtracts its ``kv_bar`` tensors from K after RoPE must not read it.

Channel order: llama-architecture GGUF files store Q and K permuted relative to Hugging Face's
layout (transformers undoes it on load). A K channel ``a * head_dim/2 + b`` of the Hugging Face
model (``a`` in {0, 1}) is channel ``2 * b + a`` in llama.cpp. Biases are written in llama.cpp's
order and mapped back when walshkv reads them. qwen2 and gemma3 use the NEOX layout: no change.
In the rotated basis the rotation is applied in llama.cpp's channel order, as llama.cpp does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch

from walshkv._version import __version__
from walshkv.codecs.equalize import checked_inverse
from walshkv.constants import Keys
from walshkv.export.gguf_file import gguf_writer
from walshkv.identity import check_identity
from walshkv.ops.hadamard import hadamard_transform
from walshkv.ops.rope import RopeTable

if TYPE_CHECKING:
    from walshkv.constants import Basis, KBasis, Kind

__all__ = [
    "PERMUTED_ARCHS",
    "KMeanBias",
    "from_llamacpp_channel_order",
    "read_kv_mean_center",
    "to_llamacpp_channel_order",
    "write_kv_mean_center",
]

#: Architectures whose GGUF K weights are permuted relative to Hugging Face.
PERMUTED_ARCHS = ("llama", "mistral")
BASES = ("plain", "rot")
K_BASES = ("post-rope", "pre-rope")
_TENSOR = Keys.Tensor.K_MEAN
_EQ_TENSOR = {"k": Keys.Tensor.K_EQ, "v": Keys.Tensor.V_EQ}


def to_llamacpp_channel_order(x: torch.Tensor, arch: str) -> torch.Tensor:
    """Hugging Face K channel order -> llama.cpp's, over the last dimension (``head_dim``)."""
    if arch not in PERMUTED_ARCHS:
        return x
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], 2, d // 2).transpose(-1, -2).reshape(x.shape)


def _permute_matrix(m: torch.Tensor, arch: str, to_llamacpp: bool) -> torch.Tensor:
    """Both channel dimensions (the last two) of ``m`` mapped between the two orders."""
    f = to_llamacpp_channel_order if to_llamacpp else from_llamacpp_channel_order
    return f(f(m, arch).transpose(-1, -2), arch).transpose(-1, -2)


def from_llamacpp_channel_order(x: torch.Tensor, arch: str) -> torch.Tensor:
    """llama.cpp's K channel order -> Hugging Face's (inverse of :func:`to_llamacpp_channel_order`)."""
    if arch not in PERMUTED_ARCHS:
        return x
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], d // 2, 2).transpose(-1, -2).reshape(x.shape)


@dataclass
class KMeanBias:
    """A per-(layer, kv-head, channel) K bias, in Hugging Face channel order.

    Attributes:
        plain: ``[layers, kv_heads, head_dim]`` mean K in the plain basis (Hugging Face order).
        basis: the basis the file was written in (``plain`` or ``rot``); codecs must match it.
        arch, source: architecture and where the bias came from (file path or text name).
        meta: walshkv metadata read from the file.
    """

    plain: torch.Tensor
    basis: Basis
    arch: str
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    k_eq: torch.Tensor | None = None  # [layers, kv_heads, head_dim, head_dim], Hugging Face order
    v_eq: torch.Tensor | None = None  # [layers, kv_heads, head_dim, head_dim]
    k_basis: KBasis = "post-rope"  # "pre-rope": K mean and K transforms of K before RoPE (prerope+ specs)
    rope_inv_freq: torch.Tensor | None = None  # [layers, head_dim / 2]
    rope_scaling: torch.Tensor | None = None  # [layers]

    def pre_rope(self) -> KMeanBias:
        """This file as ``prerope+`` codecs read it; refused unless it was written for one."""
        if self.k_basis != "pre-rope":
            raise ValueError(
                f"{self.source} holds K statistics after RoPE; a prerope+ spec needs a file written for it "
                "(`walshkv calibrate --preset` / `walshkv recommend` with a prerope+ spec), or --calib-text TEXT"
            )
        return self

    def rope_table(self, layer: int) -> RopeTable:
        """``layer``'s RoPE table (:class:`walshkv.ops.rope.RopeTable`) as recorded in the file."""
        if self.rope_inv_freq is None or self.rope_scaling is None:
            raise ValueError(
                f"{self.source} holds no RoPE tables ({Keys.Rope.PREFIX}*); rewrite it for the prerope+ spec"
            )
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"{self.source} has {self.num_layers} layers; layer {layer} requested")
        return RopeTable(self.rope_inv_freq[layer].to(torch.float32), float(self.rope_scaling[layer]))

    @property
    def num_layers(self) -> int:
        return self.plain.shape[0]

    @property
    def has_k_equalizer(self) -> bool:
        """True if the file holds the ``eq+`` K transforms."""
        return self.k_eq is not None

    @property
    def has_v_equalizer(self) -> bool:
        """True if the file holds the ``eq+`` V transforms."""
        return self.v_eq is not None

    def _equalizer(self, kind: Kind, layer: int) -> torch.Tensor:
        eq = self.k_eq if kind == "k" else self.v_eq
        if eq is None:
            name = _EQ_TENSOR[kind].format("<il>")
            raise ValueError(
                f"{self.source} holds no eq+ {kind.upper()} transforms ({name} tensors): write the file with "
                "`walshkv calibrate --eq ...` or `walshkv calibrate --preset NAME` for a spec with eq+, or pass "
                "--calib-text TEXT"
            )
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"{self.source} has {self.num_layers} layers; layer {layer} requested")
        return eq[layer].to(torch.float32)

    def k_equalizer(self, layer: int) -> torch.Tensor:
        """The ``eq+`` K transform ``[kv_heads, head_dim, head_dim]`` of ``layer``."""
        return self._equalizer("k", layer)

    @property
    def k_equalizer_fit(self) -> str | None:
        """How the K transforms were fitted when not ``eq+``'s way (``eqr:L:Q``), else ``None``."""
        fit = self.meta.get(Keys.General.K_EQ_FIT)
        return None if fit is None else str(fit)

    def k_equalizer_fitted(self, fit: str, layer: int) -> torch.Tensor:
        """The K transform of ``layer`` if this file's were fitted as ``fit`` (``eqr:L:Q``), else an error."""
        if self.k_equalizer_fit != fit:
            held = f"K transforms fitted as {self.k_equalizer_fit}" if self.k_equalizer_fit else "no eqr+ transforms"
            raise ValueError(
                f"{self.source} holds {held}, not {fit}: write the file for this spec (`walshkv calibrate --preset` / "
                "`walshkv recommend`), or pass --calib-text TEXT"
            )
        return self._equalizer("k", layer)

    def v_equalizer(self, layer: int) -> torch.Tensor:
        """The ``eq+`` V transform ``[kv_heads, head_dim, head_dim]`` of ``layer``."""
        return self._equalizer("v", layer)

    def k_bias(self, layer: int, basis: Basis) -> torch.Tensor:
        """Bias ``[kv_heads, head_dim]`` for ``layer`` in walshkv's ``basis`` (``plain`` or ``rot``)."""
        if basis != self.basis:
            fix = "center+rot+SPEC" if self.basis == "rot" else "center+SPEC without rot+"
            raise ValueError(
                f"{self.source}: the bias is in the {self.basis!r} basis but the codec needs {basis!r}; "
                f"use {fix}, or recalibrate with --basis {basis}"
            )
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"{self.source} has {self.num_layers} layers; layer {layer} requested")
        bias = self.plain[layer]
        return hadamard_transform(bias) if basis == "rot" else bias

    @property
    def text(self) -> str | None:
        return self.meta.get(Keys.General.TEXT)

    def describe(self) -> dict[str, Any]:
        """Provenance for result files."""
        return {"kind": "kv-mean-center file", "file": self.source, "basis": self.basis, **self.meta}

    @property
    def model_config(self) -> dict[str, Any] | None:
        """The recorded config of the model the file was calibrated on (``None`` in files older than the key)."""
        text = self.meta.get(Keys.General.MODEL_CONFIG)
        return json.loads(text) if text else None

    def check_matches(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        model: str | None = None,
        *,
        model_config: dict[str, Any] | None = None,
    ) -> None:
        """Refuse a file made for another model (recorded name, config, or layer/head/head_dim shape).

        Args:
            num_layers, num_kv_heads, head_dim: the model's shape.
            model: the model's name (``smollm2-135m``), where known.
            model_config: the model's identity (:func:`walshkv.identity.identity_config`), where known;
                checked against the file's ``walshkv.model_config`` (files older than that key skip it).

        Raises:
            ValueError: naming both models and the command that makes a file for this one.
        """
        made_for = self.meta.get(Keys.General.MODEL)
        if model and made_for and made_for != model:
            raise ValueError(
                f"{self.source} was calibrated on {made_for!r}, not {model!r}: a K mean (and a preset chosen with "
                f"it) belongs to one model; run `walshkv calibrate --model {model} ...` for this one"
            )
        have = tuple(self.plain.shape)
        want = (num_layers, num_kv_heads, head_dim)
        if have != want:
            raise ValueError(
                f"{self.source} was made for a model with (layers, kv_heads, head_dim) = {have}, but this "
                f"model{' ' + repr(model) if model else ''} has {want}; run `walshkv calibrate` for this model"
            )
        check_identity(self.source, made_for, self.model_config, model_config, model)


def write_kv_mean_center(
    path: str | Path,
    plain_mean: torch.Tensor,
    *,
    arch: str,
    basis: Basis = "plain",
    tokens: int = 0,
    text: str = "",
    model: str = "",
    extra: dict[str, str] | None = None,
    k_equalizer: torch.Tensor | None = None,
    v_equalizer: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    model_config: dict[str, Any] | None = None,
) -> None:
    """Write a K bias file.

    Args:
        path: output ``.gguf`` path.
        plain_mean: ``[layers, kv_heads, head_dim]`` mean post-RoPE K, Hugging Face channel order.
        arch: model architecture (``llama`` triggers the channel permutation).
        basis: ``plain`` or ``rot`` (Hadamard-rotated in llama.cpp's channel order).
        tokens, text, model: provenance written under ``walshkv.``.
        extra: more string metadata, each key under ``walshkv.`` (e.g. ``walshkv.preset.spec``).
        k_equalizer: ``[layers, kv_heads, head_dim, head_dim]`` ``eq+`` K transforms (Hugging Face
            order), written as ``walshkv.k_eq.blk.<il>``; ``None`` writes none.
        v_equalizer: the same for V, written as ``walshkv.v_eq.blk.<il>``.
        rope: ``(inv_freq [layers, head_dim/2], scaling [layers])``: the statistics are of K *before* RoPE
            (``prerope+``); written as ``walshkv.rope.*`` with ``walshkv.k_basis = "pre-rope"``.
        model_config: the model's identity (:func:`walshkv.identity.identity_config`), written as JSON under
            ``walshkv.model_config``: :meth:`KMeanBias.check_matches` refuses a model whose config differs.
    """
    if basis not in BASES:
        raise ValueError(f"--basis must be one of {', '.join(BASES)}, got {basis!r}")
    if plain_mean.dim() != 3:
        raise ValueError(f"the bias must be [layers, kv_heads, head_dim], got {tuple(plain_mean.shape)}")
    if not bool(torch.isfinite(plain_mean).all()):
        raise ValueError("the K mean has NaN/Inf values; calibrate on finite activations")
    layers, heads, head_dim = plain_mean.shape
    for name, eq in (("eq+ K", k_equalizer), ("eq+ V", v_equalizer)):
        if eq is None:
            continue
        if tuple(eq.shape) != (layers, heads, head_dim, head_dim):
            raise ValueError(
                f"the {name} transforms must be [layers, kv_heads, head_dim, head_dim] = "
                f"{(layers, heads, head_dim, head_dim)}, got {tuple(eq.shape)}"
            )
        if not bool(torch.isfinite(eq).all()):
            raise ValueError(f"the {name} transforms have NaN/Inf values; recalibrate")
    data = to_llamacpp_channel_order(plain_mean.to(torch.float64), arch)
    if basis == "rot":
        data = hadamard_transform(data)
    if rope is not None:
        inv_freq, scaling = rope
        if tuple(inv_freq.shape) != (layers, head_dim // 2) or tuple(scaling.shape) != (layers,):
            raise ValueError(
                f"the RoPE tables must be [layers, head_dim/2] = {(layers, head_dim // 2)} and [layers], got "
                f"{tuple(inv_freq.shape)} and {tuple(scaling.shape)}"
            )
    for key in extra or {}:
        if not key.startswith(Keys.General.PREFIX):
            raise ValueError(f"extra metadata keys live under {Keys.General.PREFIX!r}, got {key!r}")
    # Through a temporary file: an error or a full disk leaves an existing file at ``path`` as it was.
    with gguf_writer(path, Keys.KvMeanCenter.ARCH) as writer:
        writer.add_bool(Keys.KvMeanCenter.K_ROT, basis == "rot")
        for key, value in (
            (Keys.General.ARCHITECTURE, arch),
            (Keys.General.MODEL, model),
            (Keys.General.TEXT, text),
            (Keys.General.VERSION, __version__),
            (Keys.General.CHANNEL_ORDER, "llama.cpp"),
            *(((Keys.General.K_BASIS, "pre-rope"),) if rope is not None else ()),
            *(((Keys.General.MODEL_CONFIG, json.dumps(model_config, sort_keys=True)),) if model_config else ()),
            *(extra or {}).items(),
        ):
            writer.add_string(key, value)
        for key, value in (
            (Keys.General.LAYER_COUNT, layers),
            (Keys.General.HEAD_DIM, head_dim),
            (Keys.General.N_HEAD_KV, heads),
            (Keys.General.TOKENS, tokens),
        ):
            writer.add_uint32(key, int(value))
        for il in range(layers):
            # numpy [n_head_kv, head_dim] -> GGUF ne [head_dim, n_head_kv], channel fastest
            writer.add_tensor(_TENSOR.format(il), data[il].to(torch.float32).numpy().astype(np.float32))
        if k_equalizer is not None:
            eq = _permute_matrix(k_equalizer.to(torch.float64), arch, to_llamacpp=True)
            for il in range(layers):
                writer.add_tensor(_EQ_TENSOR["k"].format(il), eq[il].to(torch.float32).numpy().astype(np.float32))
        if v_equalizer is not None:
            for il in range(layers):
                writer.add_tensor(
                    _EQ_TENSOR["v"].format(il), v_equalizer[il].to(torch.float32).numpy().astype(np.float32)
                )
        if rope is not None:
            inv_freq, scaling = rope
            writer.add_tensor(Keys.Rope.INV_FREQ, inv_freq.to(torch.float32).numpy().astype(np.float32))
            writer.add_tensor(Keys.Rope.SCALING, scaling.to(torch.float32).numpy().astype(np.float32))


def _field(reader: Any, key: str) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return None
    value = f.parts[f.data[0]]
    if f.types and f.types[0].name == "STRING":
        return bytes(value).decode("utf-8")
    return value.tolist()[0] if hasattr(value, "tolist") else value


def read_kv_mean_center(path: str | Path, model_arch: str | None = None) -> KMeanBias:
    """Read and validate a K bias file; refuse anything incomplete or inconsistent.

    Args:
        path: the ``.gguf`` file.
        model_arch: architecture of the model it will be used with; decides the channel mapping
            (files written by other tools may not record it) and must match a recorded one.

    Raises:
        ValueError: not a GGUF file, truncated, missing ``kv_mean_center.k_rot``, missing or
            misshapen tensors, non-finite values; each message names the problem and the fix.
    """
    path = Path(path)
    fix = "rewrite it with `walshkv calibrate ... -o FILE`"
    if not path.is_file():  # a FIFO is refused here too: opening one to read would block
        what = "is a directory" if path.is_dir() else "is not a regular file" if path.exists() else "does not exist"
        raise ValueError(f"K bias file {path} {what}; pass the .gguf file `walshkv calibrate ... -o FILE` wrote")
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic); {fix}")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:
        raise ValueError(f"{path} is truncated or damaged ({type(err).__name__}: {err}); {fix}") from err
    k_rot = _field(reader, Keys.KvMeanCenter.K_ROT)
    if k_rot is None:
        raise ValueError(f"{path} has no {Keys.KvMeanCenter.K_ROT} key: not a K mean-centering file; {fix}")
    tensors = {t.name: t for t in reader.tensors}
    prefix = Keys.Tensor.K_MEAN_PREFIX
    names = sorted((n for n in tensors if n.startswith(prefix)), key=lambda n: int(n[len(prefix) :].split(".")[0]))
    if not names:
        raise ValueError(f"{path} holds no {_TENSOR.format('<il>')} tensors; {fix}")
    layers = len(names)
    declared = _field(reader, Keys.General.LAYER_COUNT)
    if declared is not None and declared != layers:
        raise ValueError(f"{path} declares {declared} layers but holds {layers} kv_bar tensors; {fix}")
    missing = [_TENSOR.format(i) for i in range(layers) if _TENSOR.format(i) not in tensors]
    if missing:
        raise ValueError(f"{path} is missing tensors {', '.join(missing[:5])}; {fix}")
    arrays = []
    shape0 = None
    for i in range(layers):
        t = tensors[_TENSOR.format(i)]
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{path}: {t.name} is {t.tensor_type.name}, expected F32; {fix}")
        arr = np.asarray(t.data, dtype=np.float32).reshape(int(t.shape[1]) if len(t.shape) > 1 else 1, -1)
        if shape0 is None:
            shape0 = arr.shape
        if arr.shape != shape0:
            raise ValueError(f"{path}: {t.name} has shape {arr.shape}, layer 0 has {shape0}; {fix}")
        arrays.append(arr)
    data = torch.from_numpy(np.stack(arrays)).to(torch.float64)
    if not bool(torch.isfinite(data).all()):
        raise ValueError(f"{path} holds NaN/Inf values; recalibrate")
    heads, head_dim = data.shape[1:]
    for key, want in ((Keys.General.HEAD_DIM, head_dim), (Keys.General.N_HEAD_KV, heads)):
        got = _field(reader, key)
        if got is not None and got != want:
            raise ValueError(f"{path}: {key} = {got} but the tensors say {want}; {fix}")
    arch = _field(reader, Keys.General.ARCHITECTURE)
    if model_arch is not None and arch is not None and arch != model_arch:
        raise ValueError(f"{path} was calibrated on a {arch!r} model, not {model_arch!r}; calibrate on this model")
    arch = model_arch or arch or "unknown"
    basis = "rot" if bool(k_rot) else "plain"
    if basis == "rot":
        data = hadamard_transform(data)  # self-inverse: back to the plain basis, llama.cpp order
    plain = from_llamacpp_channel_order(data, arch)
    meta = {k: _field(reader, k) for k in reader.fields if k.startswith(Keys.General.PREFIX)}
    recorded = meta.get(Keys.General.MODEL_CONFIG)
    if recorded is not None:
        try:
            ok = isinstance(json.loads(recorded), dict)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{path}: {Keys.General.MODEL_CONFIG} is not a JSON object (a damaged file); {fix}")
    k_eq = _read_eq(path, tensors, "k", layers, heads, head_dim)
    v_eq = _read_eq(path, tensors, "v", layers, heads, head_dim)
    if k_eq is not None:
        k_eq = _permute_matrix(k_eq, arch, to_llamacpp=False)
    k_basis = meta.get(Keys.General.K_BASIS) or "post-rope"
    if k_basis not in K_BASES:
        raise ValueError(
            f"{path}: {Keys.General.K_BASIS} is {k_basis!r}, expected {' or '.join(map(repr, K_BASES))}; {fix}"
        )
    rope: list[torch.Tensor | None] = [None, None]
    if k_basis == "pre-rope":
        wanted = ((Keys.Rope.INV_FREQ, layers * (head_dim // 2)), (Keys.Rope.SCALING, layers))
        for i, (name, want) in enumerate(wanted):
            t = tensors.get(name)
            if t is None or t.tensor_type != gguf.GGMLQuantizationType.F32 or int(np.asarray(t.data).size) != want:
                raise ValueError(
                    f"{path} is written for K before RoPE but its {name} tensor is missing or misshapen; {fix}"
                )
            rope[i] = torch.from_numpy(np.asarray(t.data, dtype=np.float32).reshape(layers, -1).copy())
            if not bool(torch.isfinite(rope[i]).all()) or (i == 1 and not bool((rope[i] > 0).all())):
                raise ValueError(f"{path}: {name} holds NaN/Inf values or a scaling <= 0; recalibrate, {fix}")
        assert rope[1] is not None
        rope[1] = rope[1].reshape(layers)
    return KMeanBias(plain, basis, arch, str(path), meta, k_eq, v_eq, k_basis, rope[0], rope[1])


def _read_eq(
    path: Path, tensors: dict[str, Any], kind: Kind, layers: int, heads: int, head_dim: int
) -> torch.Tensor | None:
    """The ``walshkv.{k,v}_eq.blk.<il>`` tensors (as stored), or ``None`` if the file has none."""
    fix = "rewrite it with `walshkv calibrate --eq ... -o FILE`"
    pattern = _EQ_TENSOR[kind]
    present = [n for n in tensors if n.startswith(pattern.format(""))]
    if not present:
        return None
    missing = [pattern.format(i) for i in range(layers) if pattern.format(i) not in tensors]
    if missing or len(present) != layers:
        raise ValueError(
            f"{path} holds {len(present)} {pattern.format('')[:-1]} tensors for {layers} layers"
            f"{' (missing ' + ', '.join(missing[:3]) + ')' if missing else ''}; {fix}"
        )
    arrays = []
    for i in range(layers):
        t = tensors[pattern.format(i)]
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise ValueError(f"{path}: {t.name} is {t.tensor_type.name}, expected F32; {fix}")
        arr = np.asarray(t.data, dtype=np.float32)
        if arr.size != heads * head_dim * head_dim:
            raise ValueError(
                f"{path}: {t.name} holds {arr.size} values, expected {heads} x {head_dim} x {head_dim}; {fix}"
            )
        arrays.append(arr.reshape(heads, head_dim, head_dim))
    eq = torch.from_numpy(np.stack(arrays)).to(torch.float64)
    for i in range(layers):  # finite, well conditioned, not near zero, inverse checked: named, before any use
        checked_inverse(eq[i], f"{path}: {pattern.format(i)}", f"recalibrate, {fix}")
    return eq

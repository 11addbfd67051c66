"""walshkv-vllm: a vLLM attention backend that keeps the paged KV cache in walshkv's fixed-size codecs.

The core (:mod:`.layout`: the slot layout of a page; :mod:`.specs`: which specs fit and the
``--kv-cache-dtype`` names; :mod:`.paged`: slot writes, block-table reads, decode and prefill attention) needs
only torch and walshkv. vLLM is imported by :mod:`.registration` (run through the ``vllm.general_plugins`` entry
point, :func:`register`) and by :mod:`.vllm_backend` (which vLLM imports by its class path).
"""

from __future__ import annotations

from walshkv_vllm.layout import SlotLayout
from walshkv_vllm.specs import KV_CACHE_DTYPES, resolve_spec

__all__ = ["KV_CACHE_DTYPES", "SlotLayout", "register", "resolve_spec"]


def register() -> None:
    """vLLM's ``vllm.general_plugins`` entry point: register the backend and the ``walshkv_*`` cache dtypes."""
    from walshkv_vllm.registration import register_all  # imports vllm

    register_all()

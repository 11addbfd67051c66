"""Names shared across walshkv: GGUF metadata keys (one namespace, as gguf-py's ``constants.Keys``) and the
small closed vocabularies (``Literal`` types) that functions and parsers accept.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["Backend", "Basis", "Feed", "KBasis", "Keys", "Kind", "Score"]

#: Which half of the cache a codec serves.
Kind = Literal["k", "v"]
#: The basis a K mean is subtracted in: plain, or after a Walsh-Hadamard rotation.
Basis = Literal["plain", "rot"]
#: Whether K statistics were taken after RoPE (as the cache sees K) or before it (``prerope+``).
KBasis = Literal["post-rope", "pre-rope"]
#: How the harness feeds a window to a compressed cache.
Feed = Literal["auto", "window", "decode"]
#: Which positions of a window are scored.
Score = Literal["half", "all"]
#: Where decode attention runs.
Backend = Literal["auto", "reference", "cpu", "triton"]


class Keys:
    """GGUF metadata keys and tensor names walshkv writes and reads."""

    class General:
        ARCHITECTURE = "walshkv.architecture"
        MODEL = "walshkv.model"
        TEXT = "walshkv.text"
        VERSION = "walshkv.version"
        CHANNEL_ORDER = "walshkv.channel_order"
        K_BASIS = "walshkv.k_basis"
        LAYER_COUNT = "walshkv.layer_count"
        HEAD_DIM = "walshkv.head_dim"
        N_HEAD_KV = "walshkv.n_head_kv"
        TOKENS = "walshkv.tokens"

    class Preset:
        NAME = "walshkv.preset.name"
        SPEC = "walshkv.preset.spec"
        BUDGET = "walshkv.preset.budget"
        NOTE = "walshkv.preset.note"

    class Rope:
        PREFIX = "walshkv.rope."
        INV_FREQ = "walshkv.rope.inv_freq"
        SCALING = "walshkv.rope.scaling"
        CONVENTION = "walshkv.rope.convention"
        TENSOR_MEANING = "walshkv.rope.tensor_meaning"

    class Tensor:
        #: llama.cpp forks' K mean per layer (``.format(il)``).
        K_MEAN = "kv_bar.blk.{}.k"
        K_MEAN_PREFIX = "kv_bar.blk."

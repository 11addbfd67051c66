"""Names shared across walshkv: GGUF metadata keys (one namespace, as gguf-py's ``constants.Keys``) and the
small closed vocabularies (``Literal`` types) that functions and parsers accept.
"""

from __future__ import annotations

from typing import Literal

__all__ = ["MAX_LAYERS", "MAX_WRAPPERS", "Backend", "Basis", "Feed", "KBasis", "Keys", "Kind", "Prefill", "Score"]

#: The most layers a spec may name (``layers:SPEC@0-N``): far above any model (the largest have about 200), so a
#: typo such as ``0-99999999999`` is refused when the spec is parsed, before anything is built or allocated.
MAX_LAYERS = 4096
#: The most wrappers one codec spec may chain (``prerope+center+eq+rot+rot+SPEC`` is 5): each of ``prerope+``,
#: ``center+`` and ``eq+`` appears at most once, and a rotation repeated more than twice is always a mistake.
MAX_WRAPPERS = 6

#: Which half of the cache a codec serves.
Kind = Literal["k", "v"]
#: The basis a K mean is subtracted in: plain, or after a Walsh-Hadamard rotation.
Basis = Literal["plain", "rot"]
#: Whether K statistics were taken after RoPE (as the cache sees K) or before it (``prerope+``).
KBasis = Literal["post-rope", "pre-rope"]
#: How the harness feeds a window to a compressed cache.
Feed = Literal["auto", "window", "decode"]
#: What a multi-token forward (a prompt) attends to: its own K/V as stored (``"quantized"``, quantize on write,
#: the default) or as computed (``"exact"``, serving-engine style: stored compressed all the same).
Prefill = Literal["quantized", "exact"]
#: Which positions of a window are scored.
Score = Literal["half", "all"]
#: Where decode attention runs.
Backend = Literal["auto", "reference", "cpu", "triton"]
#: How a saved cache stores its packed fields: as held in memory (``"packed"``), or entropy-coded (``"rans"``:
#: :mod:`walshkv.ops.rans`, decoded once on load).
AtRest = Literal["packed", "rans"]


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
        #: JSON of the model's text config (:func:`walshkv.identity.identity_config`): a file is refused by a
        #: model whose config differs in a key both hold.
        MODEL_CONFIG = "walshkv.model_config"
        #: Every key walshkv writes lives under this prefix (extra metadata included).
        PREFIX = "walshkv."
        #: How the K transforms were fitted when not ``eq+``'s way: ``eqr:L:Q`` (after RoPE, moments averaged over
        #: ``L`` and ``Q`` positions, ``0`` for the limit). Absent: ``eq+`` / ``eqd+``.
        K_EQ_FIT = "walshkv.k_eq.fit"

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
        #: A PrimePE ``rope_freqs`` file (``walshkv rope factors -o``): its GGUF ``general.architecture``
        #: and its one F32 tensor, the per-pair divisor llama.cpp applies to the rotation angle.
        FREQS_ARCH = "rope_freqs"
        FREQS_TENSOR = "rope_freqs.weight"

    class Tensor:
        #: llama.cpp forks' K mean per layer (``.format(il)``).
        K_MEAN = "kv_bar.blk.{}.k"
        K_MEAN_PREFIX = "kv_bar.blk."
        #: ``eq+`` K / V transforms per layer (``.format(il)``; walshkv only, llama.cpp forks ignore them).
        K_EQ = "walshkv.k_eq.blk.{}"
        V_EQ = "walshkv.v_eq.blk.{}"

    class KvMeanCenter:
        """The llama.cpp forks' own keys of a ``--kv-mean-center`` file."""

        #: The file's GGUF ``general.architecture``.
        ARCH = "kv_mean_center"
        #: bool: the K mean is in the Hadamard-rotated basis.
        K_ROT = "kv_mean_center.k_rot"

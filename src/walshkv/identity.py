"""A model's identity, the one check that calibration files, statistics and saved caches share.

* :func:`model_identity`: the model's config class, layers, kv heads, head size, and a sha256 of its text config
  (keys that only say how the model runs, such as the attention implementation, left out), which a saved cache
  records (:mod:`walshkv.cache.persist`);
* :func:`identity_config`: that text config itself, which calibration files (``walshkv.model_config``) and
  statistics record;
* :func:`check_identity`: refuse calibration whose recorded config differs from the model's in a key both hold.

Two models with equal shapes (layers, kv heads, head size) but other configs are told apart here: a K mean or
an ``eq+`` transform measured on one is wrong for the other, and nothing in the shapes would say so.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["check_identity", "config_differences", "head_dim_of", "identity_config", "model_identity"]

#: Config keys that say how a model runs, not what it computes: left out of the config hash.
_RUNTIME_KEYS = frozenset(
    {
        "transformers_version",
        "_name_or_path",
        "_commit_hash",
        "architectures",
        "dtype",
        "torch_dtype",
        "attn_implementation",
        "_attn_implementation",
        "_attn_implementation_autoset",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "use_cache",
    }
)


def head_dim_of(config: Any) -> int:
    """The K/V head size of a (text) config: its ``head_dim``, else ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def identity_config(config: PretrainedConfig) -> dict[str, Any]:
    """The model's text config as JSON values, without the keys that only say how it runs (the identity)."""
    text = config.get_text_config(decoder=True)
    kept = {k: v for k, v in text.to_dict().items() if k not in _RUNTIME_KEYS}
    return json.loads(json.dumps(kept, sort_keys=True, default=str))


def model_identity(config: PretrainedConfig) -> dict[str, Any]:
    """What a saved cache records of its model: config class, layers, kv heads, head size, a hash of the config."""
    text = config.get_text_config(decoder=True)
    head_dim = head_dim_of(text)
    digest = hashlib.sha256(json.dumps(identity_config(config), sort_keys=True).encode()).hexdigest()
    return {
        "config_class": type(text).__name__,
        "num_layers": text.num_hidden_layers,
        "num_kv_heads": text.num_key_value_heads,
        "head_dim": head_dim,
        "config_sha256": digest,
    }


def config_differences(recorded: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """The keys both configs hold with different values, sorted.

    A key only one side holds is not a difference: transformers adds and renames config keys between
    releases, and a calibration file must stay valid for the same model under another release.
    """
    return sorted(k for k in recorded.keys() & ours.keys() if recorded[k] != ours[k])


def check_identity(
    source: str,
    made_for: str | None,
    recorded: dict[str, Any] | None,
    ours: dict[str, Any] | None,
    model: str | None = None,
) -> None:
    """Refuse calibration measured on a model whose config differs from this model's.

    Args:
        source: where the calibration came from (a path, or a description), for the message.
        made_for: the model name it records, if any.
        recorded, ours: its recorded :func:`identity_config` and this model's (either ``None``: no check, as
            for files written before walshkv recorded it).
        model: this model's name, if known, for the fix.

    Raises:
        ValueError: a key both configs hold differs; names the keys, both values of the first, and the
            command that calibrates this model.
    """
    if not recorded or not ours:
        return
    differ = config_differences(recorded, ours)
    if not differ:
        return
    first = differ[0]
    raise ValueError(
        f"{source} was calibrated on {made_for or 'another model'}, whose config differs from this model's in "
        f"{', '.join(differ[:6])}{' ...' if len(differ) > 6 else ''} ({first}: {recorded[first]!r} there, "
        f"{ours[first]!r} here): a calibration (the K mean, eq+ transforms and the preset chosen with them) belongs "
        f"to the model it was measured on, even where the shapes agree; calibrate this model: "
        f"`walshkv calibrate --model {model or 'NAME'} --preset walshkv:B -o FILE`, or "
        "walshkv.calibration.collect_kv_stats"
    )

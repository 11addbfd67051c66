"""Every spec of a run checked against the model before anything runs: :func:`fit_specs`.

A run calibrates its presets and runs the reference forward before the first codec's cache is built, so a spec
the model cannot hold (a head size its codec does not take, a ``layers:`` index past the model's last layer, a
layer type its cache has no form for) would otherwise fail minutes in. :func:`fit_specs` reads only the model's
config (:func:`walshkv.models.layout_config` gives it without loading the weights): an explicitly requested
spec that does not fit is refused with the reason and the fix; a default set leaves it out, with the reason to
print.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from walshkv.cache import check_spec_fits
from walshkv.presets import name_specs

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from walshkv.codecs import NamedSpec, SpecLike

__all__ = ["fit_specs"]


def fit_specs(
    codecs: Sequence[SpecLike], config: PretrainedConfig, *, model: Any = None, required: bool = True
) -> tuple[list[NamedSpec], dict[str, str]]:
    """Check each spec (or preset) of a run against the model's config; no calibration, no forward.

    A preset is checked as the spec it stands for on ``model`` (:func:`walshkv.presets.name_specs` without
    calibration: a known model's shipped spec, else the built-in one). A calibration file made for a preset may
    name another spec; that one is checked when its cache is first built, still before any forward.

    Args:
        codecs: the run's cache specs and preset names, as given (or already named).
        config: the model's config (:func:`walshkv.models.layout_config`, or a loaded model's ``config``).
        model: the model's name (or loaded model) the presets resolve for; ``None``: the built-in specs.
        required: True for specs the user asked for (the first one that does not fit raises); False for a
            default set (those that do not fit are left out and returned with the reason).

    Returns:
        ``(kept, left_out)``: the codecs that fit, in order, as :class:`~walshkv.codecs.NamedSpec` objects (what
        the run goes on with), and ``{codec as asked: why}`` for the others.

    Raises:
        ValueError: with ``required``, the first codec that does not fit: the spec, what the model has that it
            cannot hold, and the fix (``hf-*`` specs whose backend package is missing raise ``ImportError``).
    """
    kept: list[NamedSpec] = []
    left_out: dict[str, str] = {}
    for named in name_specs(codecs, model=model):
        try:
            check_spec_fits(named.spec, config)
        except (ValueError, ImportError) as err:
            what = f"{named.asked} (= {named.text})" if named.text != named.asked else named.asked
            if required:
                raise type(err)(f"{what} cannot run on this model: {err}") from None
            left_out[named.asked] = str(err)
        else:
            kept.append(named)
    return kept, left_out

"""Calibration inputs for an evaluation: a calibration file, calibration text, or both.

Every command that evaluates codecs (``walshkv eval``, ``sweep``, ``rd``, the research commands) gets the
calibration its specs need from :func:`calibration_for`; the command line only supplies the inputs
(``--kv-mean-center FILE``, ``--calib-text TEXT``, ``--calib-tokens N``). Calibration never uses the
evaluation text. With neither input, presets on a model walshkv ships calibration for read the shipped files
(:func:`shipped_for`, :mod:`walshkv.shipped`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from walshkv.calibration import MergedCalibration, collect_kv_stats
from walshkv.codecs import name_spec
from walshkv.codecs.base import unwrap, wrappers
from walshkv.data import Text, load_text
from walshkv.defaults import CALIB_TOKENS
from walshkv.export import read_kv_mean_center
from walshkv.identity import identity_config
from walshkv.presets import is_preset, resolve_preset
from walshkv.shipped import CalibrationSet, shipped_calibration

if TYPE_CHECKING:
    from walshkv.codecs import CacheSpec, Codec, SpecLike
    from walshkv.codecs.calibration import Calibration
    from walshkv.models import LoadedModel

__all__ = ["calibration_for", "only_centering", "shipped_for"]

#: What a calibration file can stand in for: the K bias of ``center+`` and the transforms of ``eq+``.
_FILE_WRAPPERS = ("center", "eq")


def only_centering(spec: CacheSpec) -> bool:
    """True if the spec's only calibrated parts are a ``center+`` K bias and ``eq+`` transforms.

    Those are what a calibration file from ``walshkv calibrate`` holds, so such a spec needs no
    calibration text once a file is given.
    """

    def ok(codec: Codec) -> bool:
        return all(w.name in _FILE_WRAPPERS for w in wrappers(codec)) and not unwrap(codec).needs_calibration

    return ok(spec.k) and ok(spec.v)


def calibration_for(
    lm: LoadedModel,
    specs: Sequence[SpecLike],
    *,
    kv_mean_center: str | None = None,
    calib_text: str | None = None,
    calib_tokens: int = CALIB_TOKENS,
    eval_text: Text | None = None,
    progress: bool = True,
) -> Calibration | None:
    """The calibration the specs need: from a file, from calibration text, or both merged.

    Args:
        lm: the loaded model the specs will run on.
        specs: cache specs (text, parsed, or :class:`~walshkv.codecs.NamedSpec`).
        kv_mean_center: a calibration file from ``walshkv calibrate`` / ``recommend`` (K mean for ``center+``,
            transforms for ``eq+``); it is checked against the model and returned even when no spec needs it.
        calib_text: a text name or path for the statistics (``order=variance``, ``auto@BITS``, ...).
        calib_tokens: tokens of ``calib_text`` to collect statistics over.
        eval_text: the evaluation text; ``calib_text`` may not be the same text.
        progress: show progress bars.

    Returns:
        ``None`` when nothing needs calibration and no file is given; the file's bias
        (:class:`~walshkv.export.KMeanBias`) when it is enough; else the statistics of ``calib_text``
        (:class:`~walshkv.calibration.KVStats`, or :class:`~walshkv.calibration.MergedCalibration` with the
        file's bias when a file is given).

    Raises:
        ValueError: a spec needs calibration and neither input can provide it, or ``calib_text`` is the
            evaluation text.
    """
    named = [name_spec(s) for s in specs]
    parsed = [n.spec for n in named]
    bias = None
    if kv_mean_center:
        shape = lm.shape
        bias = read_kv_mean_center(kv_mean_center, model_arch=shape.arch)
        bias.check_matches(
            shape.layers, shape.kv_heads, shape.head_dim, lm.name, model_config=identity_config(lm.model.config)
        )
    if not any(s.needs_calibration for s in parsed):
        return bias
    # a preset's file (calibrate --preset, recommend) holds what its spec needs, in the basis its spec reads K in
    only_bias = all(only_centering(n.spec) or is_preset(n.asked) for n in named if n.spec.needs_calibration)
    if bias is not None and only_bias:
        return bias
    if not calib_text:
        need = "--kv-mean-center FILE or --calib-text TEXT" if only_bias else "--calib-text TEXT"
        raise ValueError(f"a codec needs calibration (center+, order=variance or auto@BITS): add {need}")
    calib = load_text(calib_text)
    if eval_text is not None and calib.content == eval_text.content:
        raise ValueError("--calib-text is the evaluation text; calibrate on different text")
    stats = collect_kv_stats(lm, calib, tokens=calib_tokens, progress=progress)
    return stats if bias is None else MergedCalibration(stats, bias)


def shipped_for(lm: LoadedModel, specs: Sequence[SpecLike]) -> CalibrationSet | None:
    """The shipped calibration of a run's presets (:func:`walshkv.shipped.shipped_calibration`), checked, or ``None``.

    It serves a run only where it serves all of it: some spec is a preset, every preset resolves to the model's
    shipped spec (:func:`walshkv.presets.resolve_preset`), and no other spec needs calibration. Otherwise ``None``,
    and the run's calibration comes from its inputs as before (:func:`calibration_for`).

    Args:
        lm: the loaded model.
        specs: the run's codecs: text as given, or :class:`~walshkv.codecs.NamedSpec` (a preset is one asked by
            its name).

    Raises:
        walshkv.shipped.ShippedCalibrationError: a shipped file is missing, damaged or made for another model
            (never replaced by a calibration in the run).
    """
    named = [name_spec(s) for s in specs]
    presets = [n.asked for n in named if is_preset(n.asked)]
    others = [n for n in named if not is_preset(n.asked)]
    if not presets or any(n.spec.needs_calibration for n in others):
        return None
    if not all(resolve_preset(p, model=lm).source.startswith("shipped:") for p in presets):
        return None
    return shipped_calibration(lm, presets)

"""What a preset's calibration file holds for its spec, and the writer of that file.

``walshkv calibrate --preset`` and ``walshkv recommend`` write one GGUF per (model, preset): the K mean in the basis
the spec centers in (:func:`k_mean_basis`), K statistics before RoPE where the spec stores K before it
(:func:`k_pre_rope`), and the ``eq+``/``eqd+`` transforms of each side it equalizes (:func:`equalized_kinds`,
:func:`diagonal_equalizers`). :func:`write_preset_file` writes it from statistics
(:class:`walshkv.calibration.KVStats`); :mod:`walshkv.presets` reads a preset back out of such a file.

Those parts together are a spec's :class:`CalibrationNeeds` (:func:`calibration_needs`): specs with equal needs read
the same file, which :func:`write_calibration_file` writes without naming a preset. The calibrations that ship with
the package (:mod:`walshkv.shipped`, ``scripts/ship_calibrations.py``) are such files, one per model and needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from walshkv.codecs.base import find_wrapper
from walshkv.codecs.blockrope import RopeAveragedEqualized, RopeBlock, eqr_transform
from walshkv.codecs.center import Centered
from walshkv.codecs.equalize import DiagonalEqualized, Equalized
from walshkv.codecs.prerope import PreRope
from walshkv.codecs.spec import CacheSpec
from walshkv.constants import Keys
from walshkv.export import write_kv_mean_center
from walshkv.presets import Preset, spec_name, spec_parts

if TYPE_CHECKING:
    from walshkv.calibration import KVStats
    from walshkv.constants import Basis, Kind
    from walshkv.models import LoadedModel

__all__ = [
    "CalibrationNeeds",
    "calibration_needs",
    "diagonal_equalizers",
    "equalized_kinds",
    "k_mean_basis",
    "k_pre_rope",
    "write_calibration_file",
    "write_preset_file",
]

#: The transforms a side of a spec reads: ``eq+``'s dense ones, ``eqd+``'s diagonal ones (or, as a string
#: ``eqr:L:Q``, ``eqr+``'s fitted after RoPE), or none.
EqKind = Literal["eq", "eqd"]


def k_mean_basis(spec: str | CacheSpec) -> Basis:
    """The basis a spec's K mean is subtracted in: ``rot`` for ``center+rot+...``, else ``plain``."""
    bases = {p.k.basis if isinstance(p.k, Centered) else "plain" for p in spec_parts(spec)} or {"plain"}
    if len(bases) > 1:
        raise ValueError(
            f"{spec_name(spec)!r} centers K in different bases per layer ({', '.join(sorted(bases))}); a preset file "
            "holds one K mean basis: use the same K wrapper (center+ or center+rot+) in every part"
        )
    return bases.pop()


def k_pre_rope(spec: str | CacheSpec) -> bool:
    """True if ``spec`` reads K statistics before RoPE and the RoPE tables (``prerope+``, ``ropeblock:G+``); every
    part of a per-layer spec must agree."""
    kinds = {isinstance(p.k, (PreRope, RopeBlock)) for p in spec_parts(spec)} or {False}
    if len(kinds) > 1:
        raise ValueError(
            f"{spec_name(spec)!r} quantizes K before RoPE in some layers only; a preset file holds K statistics of one "
            "kind: write prerope+ in every part or in none"
        )
    return kinds.pop()


def equalized_kinds(spec: str | CacheSpec) -> set[Kind]:
    """``{"k", "v"}`` or part of it: where some part of ``spec`` has ``eq+`` or ``eqd+`` (its file must hold those)."""
    kinds: set[Kind] = set()
    for part in spec_parts(spec):
        if find_wrapper(part.k, Equalized) is not None:
            kinds.add("k")
        if find_wrapper(part.v, Equalized) is not None:
            kinds.add("v")
    return kinds


def diagonal_equalizers(spec: str | CacheSpec, kind: Kind) -> bool:
    """True if ``spec``'s ``kind`` transforms are ``eqd+``'s (diagonal), False if ``eq+``'s (dense).

    Raises:
        ValueError: some parts of a per-layer spec write ``eq+`` and others ``eqd+`` on ``kind``: a file holds
            transforms of one kind.
    """
    found = set()
    for part in spec_parts(spec):
        eq = find_wrapper(part.k if kind == "k" else part.v, Equalized)
        if eq is not None:
            found.add(isinstance(eq, DiagonalEqualized))
    if len(found) > 1:
        raise ValueError(
            f"{spec_name(spec)!r} writes eq+ in some layers and eqd+ in others on {kind.upper()}; a preset file holds "
            "transforms of one kind: write the same one in every part"
        )
    return found == {True}


@dataclass(frozen=True)
class CalibrationNeeds:
    """What a spec reads from its calibration file; specs with equal needs can read the same file.

    Attributes:
        pre_rope: K statistics before RoPE and the RoPE tables (``prerope+``), else after RoPE.
        basis: the K mean's basis (:func:`k_mean_basis`).
        k_eq, v_eq: the transforms each side reads (``eq``: dense, ``eqd``: diagonal), or ``None``.
    """

    pre_rope: bool
    basis: Basis
    k_eq: EqKind | str | None = None
    v_eq: EqKind | None = None

    @property
    def name(self) -> str:
        """The file name stem: ``prerope-plain-keq`` (K before RoPE, K mean in the plain basis, ``eq+`` on K)."""
        parts = ["prerope" if self.pre_rope else "postrope", self.basis]
        parts += [
            f"{side}{eq.replace(':', '_')}" for side, eq in (("k", self.k_eq), ("v", self.v_eq)) if eq is not None
        ]
        return "-".join(parts)


def calibration_needs(spec: str | CacheSpec) -> CalibrationNeeds | None:
    """What ``spec`` reads from a calibration file, or ``None`` if it reads none (nothing in it is calibrated).

    Raises:
        ValueError: a per-layer spec whose parts read different things (one file holds one of each).
    """
    parts = spec_parts(spec)
    if not any(p.needs_calibration for p in parts):
        return None
    kinds = equalized_kinds(spec)

    def eq(kind: Kind) -> EqKind | str | None:
        if kind not in kinds:
            return None
        fits = {w.fit for p in parts if isinstance(w := find_wrapper(p.k, Equalized), RopeAveragedEqualized)}
        if kind == "k" and fits:
            if len(fits) > 1 or any(not isinstance(find_wrapper(p.k, Equalized), RopeAveragedEqualized) for p in parts):
                raise ValueError(
                    f"{spec_name(spec)!r} fits K's transforms in more than one way across layers; a preset file holds "
                    "transforms of one kind: write the same eqr:L+ (or eq+) in every part"
                )
            return fits.pop()
        return "eqd" if diagonal_equalizers(spec, kind) else "eq"

    return CalibrationNeeds(k_pre_rope(spec), k_mean_basis(spec), eq("k"), eq("v"))


def write_calibration_file(
    path: str | Path, lm: LoadedModel, needs: CalibrationNeeds, stats: KVStats, extra: dict[str, str] | None = None
) -> Basis:
    """Write what specs with ``needs`` read, from ``stats``: the K mean (before RoPE, with the RoPE tables, where
    ``needs.pre_rope``) in ``needs.basis``, and the ``eq+``/``eqd+`` transforms of each side that has them.

    The file records the model, its identity (``walshkv.model_config``), the calibration text and tokens; it names
    no preset unless ``extra`` does (:func:`write_preset_file`).

    Returns:
        The basis written (``rot`` or ``plain``).
    """
    k_stats = stats.pre_rope() if needs.pre_rope else stats
    mean = torch.stack([k_stats.mean("k", i, "plain") for i in range(stats.num_layers)])
    if needs.k_eq is not None and needs.k_eq.startswith("eqr:"):  # eqr+: fitted after RoPE, from moments before it
        if not needs.pre_rope:
            raise ValueError(
                "a file for eqr+ K transforms holds them inside ropeblock:G+ only (it needs the RoPE tables); "
                "pass --calib-text TEXT for eqr+ elsewhere"
            )
        length, q_length = (int(x) or None for x in needs.k_eq.split(":")[1:])
        k_eq = torch.stack([eqr_transform(k_stats, i, length, q_length) for i in range(stats.num_layers)])
        extra = {**(extra or {}), Keys.General.K_EQ_FIT: needs.k_eq}
    else:
        k_eq = k_stats.equalizers("k", needs.k_eq == "eqd") if needs.k_eq else None
    v_eq = stats.equalizers("v", needs.v_eq == "eqd") if needs.v_eq else None
    rope = None
    if needs.pre_rope:
        assert stats.rope_inv_freq is not None and stats.rope_scaling is not None  # pre_rope() above checked
        rope = (stats.rope_inv_freq, stats.rope_scaling)
    write_kv_mean_center(
        path,
        mean,
        arch=lm.shape.arch,
        basis=needs.basis,
        tokens=stats.tokens,
        text=stats.text,
        model=lm.name,
        model_config=stats.model_config,
        extra=extra,
        k_equalizer=k_eq,
        v_equalizer=v_eq,
        rope=rope,
    )
    return needs.basis


def write_preset_file(path: str | Path, lm: LoadedModel, preset: Preset, stats: KVStats, note: str = "") -> Basis:
    """Write the calibration file of ``preset`` for ``lm``: the K mean in the basis its spec needs
    (and the ``eq+`` K / V transforms where its spec has ``eq+``).

    The GGUF holds llama.cpp's ``kv_bar.blk.<il>.k`` tensors and, under ``walshkv.``, the model,
    the calibration text and the preset's name and spec (``walshkv.preset.name/spec/budget``).

    Returns:
        The basis written (``rot`` or ``plain``).
    """
    needs = calibration_needs(preset.spec) or CalibrationNeeds(k_pre_rope(preset.spec), k_mean_basis(preset.spec))
    extra = {Keys.Preset.NAME: preset.name, Keys.Preset.SPEC: preset.spec, Keys.Preset.BUDGET: f"{preset.budget:g}"}
    if note:
        extra[Keys.Preset.NOTE] = note
    return write_calibration_file(path, lm, needs, stats, extra)

"""The calibration files that ship with walshkv: each known model's preset calibrations, checksummed.

A preset (``walshkv:3.5``) on a model walshkv has measured (``model_presets.json``) is that model's spec plus the
calibration it reads: the K mean, the ``eq+``/``eqd+`` transforms and, for ``prerope+`` specs, the RoPE tables. Those
ship as package data, so that ``walshkv eval`` and :meth:`walshkv.cache.CompressedCache.from_preset` need no
calibration step for a known model:

* ``walshkv/calibrations/<model>/<needs>.gguf``: the files (:mod:`walshkv.export`'s format). One file serves every
  preset of the model whose spec reads the same parts (K before or after RoPE, the K mean's basis, dense or
  diagonal transforms: :func:`walshkv.preset_file.calibration_needs`), so a model ships one or two files;
* ``walshkv/calibrations/manifest.json``: for every file its sha256 and size, the presets it serves, the identity
  of the model it was made for (:func:`walshkv.identity.model_identity`), the calibration text and its tokens, and
  the commit, command and library versions that wrote it (``scripts/ship_calibrations.py``, which regenerates all
  of it). Every file of a model comes from one run of the statistics, the one ``walshkv eval`` collected in the
  run before the files shipped: the first 8,192 tokens of python-docs' first half, in windows of 512 tokens.

Nothing here calibrates. A file is used only after its sha256 matches the manifest and the config it records
matches the model's (:func:`walshkv.identity.check_identity`); anything else is refused by name, with the fix
(:class:`ShippedCalibrationError`), never replaced by a calibration in the run. An explicit calibration (a file,
statistics) always wins: callers ask for the shipped one only when none is given.

Example:
    >>> cal = shipped_calibration(lm, ["walshkv:3.5"])  # doctest: +SKIP
    >>> cal.describe()["files"][0]["sha256"]  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from walshkv.codecs.builtin_presets import check_preset_name
from walshkv.export import KMeanBias, read_kv_mean_center
from walshkv.identity import head_dim_of, identity_config, model_identity
from walshkv.presets import known_model, preset_key

if TYPE_CHECKING:
    from walshkv.constants import Basis, KBasis, Kind
    from walshkv.ops.rope import RopeTable

__all__ = [
    "CALIBRATIONS_DIR",
    "MANIFEST_FILE",
    "CalibrationSet",
    "ShippedCalibrationError",
    "ShippedFile",
    "check_file",
    "load_shipped",
    "manifest",
    "shipped_calibration",
    "shipped_file",
    "shipped_files",
]

#: The package folder of the shipped calibrations (``walshkv/calibrations``).
CALIBRATIONS_DIR = "calibrations"
#: The manifest, relative to the package.
MANIFEST_FILE = f"{CALIBRATIONS_DIR}/manifest.json"
#: What every refusal ends with: how to get a good file back, or to go without it.
_FIX = (
    "reinstall walshkv (`pip install --force-reinstall walshkv`; in a source checkout `git checkout -- "
    "src/walshkv/calibrations`, or regenerate every file and the manifest with `python scripts/ship_calibrations.py`), "
    "or give your own calibration (CLI: --kv-mean-center FILE, written by `walshkv calibrate --preset NAME --model "
    "MODEL -o FILE`, or --calib-text TEXT; Python: calibration=read_kv_mean_center(FILE))"
)


class ShippedCalibrationError(ValueError):
    """A shipped calibration file that is missing, damaged, or made for another model; the message names the file
    and the fix."""


@cache
def manifest() -> dict[str, Any]:
    """The shipped manifest: ``{"format": 1, "models": {model: {"identity", "presets", "files"}}}``.

    Raises:
        ShippedCalibrationError: the manifest is missing or of another format.
    """
    try:
        text = resources.files("walshkv").joinpath(MANIFEST_FILE).read_text(encoding="utf-8")
    except OSError as err:
        raise ShippedCalibrationError(f"walshkv/{MANIFEST_FILE} cannot be read ({err}): {_FIX}") from err
    data = json.loads(text)
    if data.get("format") != 1:
        raise ShippedCalibrationError(
            f"walshkv/{MANIFEST_FILE} has format {data.get('format')!r}, this walshkv reads format 1: {_FIX}"
        )
    return data


@dataclass(frozen=True)
class ShippedFile:
    """One shipped calibration file, as the manifest records it.

    Attributes:
        model: the model it was made for (a name of ``walshkv models list``).
        name: the file name in ``walshkv/calibrations/<model>/``.
        path: where it lies in the installed package.
        sha256: its checksum (hex).
        size: its size in bytes.
        presets: the presets of ``model`` it serves.
        info: the manifest's whole entry (calibration text, tokens, commit, command, versions).
    """

    model: str
    name: str
    path: Path
    sha256: str
    size: int
    presets: tuple[str, ...]
    info: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @property
    def label(self) -> str:
        """``walshkv/calibrations/<model>/<name>``: the file as messages and result files name it."""
        return f"walshkv/{CALIBRATIONS_DIR}/{self.model}/{self.name}"

    def describe(self) -> dict[str, Any]:
        """What a result file records of it: the file, its checksum, size and presets, and its provenance."""
        return {
            "file": self.label,
            "sha256": self.sha256,
            "size": self.size,
            "presets": list(self.presets),
            **{k: v for k, v in self.info.items() if k not in ("sha256", "size", "presets")},
        }


def _package_path(*parts: str) -> Path:
    return Path(str(resources.files("walshkv").joinpath(*parts)))


def shipped_files(model: str) -> list[ShippedFile]:
    """Every file the manifest lists for ``model`` (a name of ``walshkv models list``); ``[]`` for another name."""
    entry = manifest()["models"].get(model)
    if entry is None:
        return []
    return [
        ShippedFile(
            model,
            name,
            _package_path(CALIBRATIONS_DIR, model, name),
            info["sha256"],
            int(info["size"]),
            tuple(info["presets"]),
            info,
        )
        for name, info in sorted(entry["files"].items())
    ]


def shipped_file(model: Any, preset: str) -> ShippedFile | None:
    """The file the package ships for ``preset`` on ``model``, or ``None`` (an unknown model, or a preset whose
    spec reads no calibration).

    Args:
        model: a model name, a :class:`~walshkv.models.LoadedModel` or a transformers model (matched as
            :func:`walshkv.presets.known_model` matches it).
        preset: a preset name (``walshkv:3.5``).

    Raises:
        ValueError: an unknown preset name.
    """
    key = check_preset_name(preset)
    known = known_model(model)
    if known is None:
        return None
    name = manifest()["models"].get(known, {}).get("presets", {}).get(preset_key(known, key))
    return next((f for f in shipped_files(known) if f.name == name), None) if name else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_file(file: ShippedFile) -> None:
    """Refuse a shipped file that is missing or whose size or sha256 differs from the manifest's.

    Raises:
        ShippedCalibrationError: naming the file, what differs, and the fix.
    """
    if not file.path.is_file():
        raise ShippedCalibrationError(f"shipped calibration {file.label} is missing (looked at {file.path}): {_FIX}")
    size = file.path.stat().st_size
    digest = _sha256(file.path)
    if size != file.size or digest != file.sha256:
        raise ShippedCalibrationError(
            f"shipped calibration {file.label} fails its checksum: sha256 {digest[:16]}... ({size:,} bytes), the "
            f"manifest records {file.sha256[:16]}... ({file.size:,} bytes); the file is damaged or was changed, and "
            f"it is not used: {_FIX}"
        )


def _config_of(model: Any) -> Any:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "get_text_config"):
        raise TypeError(
            f"a shipped calibration is checked against the model it runs on: pass the loaded model (walshkv.models."
            f"load_model(...) or a transformers model), not {type(model).__name__}"
        )
    return config


def load_shipped(files: Sequence[ShippedFile], model: Any) -> CalibrationSet:
    """Check and read shipped files for ``model``: sha256 and size (:func:`check_file`), then the model's identity.

    Args:
        files: files of one model (:func:`shipped_files`, :func:`shipped_file`).
        model: the loaded model they will run on (a :class:`~walshkv.models.LoadedModel` or a transformers model).

    Returns:
        The files as one calibration (:class:`CalibrationSet`), described with each file's checksum and provenance.

    Raises:
        ShippedCalibrationError: a missing or damaged file, a file that records no model identity, or a model whose
            config differs from the one the file was made for.
    """
    if not files:
        raise ValueError("load_shipped needs at least one file")
    config = _config_of(model)
    text = config.get_text_config(decoder=True)
    ours = identity_config(config)
    ours_sha = model_identity(config)["config_sha256"]
    biases, described = [], []
    for file in files:
        check_file(file)
        bias = read_kv_mean_center(file.path)
        bias.source = file.label
        if bias.model_config is None:
            raise ShippedCalibrationError(
                f"shipped calibration {file.label} records no model identity (walshkv.model_config): {_FIX}"
            )
        try:
            bias.check_matches(
                text.num_hidden_layers, text.num_key_value_heads, head_dim_of(text), file.model, model_config=ours
            )
        except ValueError as err:
            raise ShippedCalibrationError(
                f"shipped calibration {file.label} was made for {file.model} and does not fit this model: {err}. "
                "A known model's shipped calibration serves that model only; give this model its own calibration"
            ) from err
        made_for = (file.info.get("model_identity") or {}).get("config_sha256")
        biases.append(bias)
        described.append({**file.describe(), "checked": "sha256", "config_sha256_equal": made_for == ours_sha})
    first = files[0].info.get("calibration") or {}
    return CalibrationSet(
        biases,
        label=f"the shipped calibration of {files[0].model}",
        text=first.get("text"),
        description={
            "kind": "shipped",
            "model": files[0].model,
            "text": first.get("text"),
            "tokens": first.get("tokens"),
            "files": described,
        },
    )


def shipped_calibration(model: Any, presets: Iterable[str] | None = None) -> CalibrationSet | None:
    """The checked shipped calibration of ``model`` for ``presets`` (every shipped preset of the model by default).

    Args:
        model: the loaded model (a :class:`~walshkv.models.LoadedModel` or a transformers model).
        presets: preset names; the files they read are loaded once each.

    Returns:
        ``None`` for a model walshkv ships no calibration for, or presets whose specs read none; else the files as
        one calibration (:func:`load_shipped`).

    Raises:
        ShippedCalibrationError: a file is missing, damaged, or made for another model (see :func:`load_shipped`).
        ValueError: an unknown preset name.
    """
    known = known_model(model)
    if known is None:
        return None
    entry = manifest()["models"].get(known)
    if entry is None:
        return None
    # the manifest is keyed by the table's entries; a preset name asked for stands for one of them (preset_key)
    keys = list(entry["presets"]) if presets is None else [preset_key(known, name) for name in presets]
    wanted: list[str] = []
    for key in keys:
        file = entry["presets"].get(key)
        if file and file not in wanted:
            wanted.append(file)
    if not wanted:
        return None
    by_name = {f.name: f for f in shipped_files(known)}
    return load_shipped([by_name[n] for n in wanted], model)


def _is_diagonal(eq: torch.Tensor) -> bool:
    return not bool((eq - torch.diag_embed(torch.diagonal(eq, dim1=-2, dim2=-1)) != 0).any())


class CalibrationSet:
    """Calibration files of one model acting as one calibration: each part is read from the file that holds it.

    A model's presets may read different parts (K after RoPE for one, before RoPE for another; ``eq+``'s dense
    transforms or ``eqd+``'s diagonal ones), each held by its own file; statistics (:class:`~walshkv.calibration.
    KVStats`) hold all of them at once, and so does this set for the parts its files hold. Every file of a set must
    come from the same statistics (the shipped ones do: one run per model), so the K means agree where two files
    hold one. Satisfies :class:`walshkv.codecs.calibration.Calibration`; ``eqd+`` reads
    :meth:`k_equalizer_diagonal`.

    Attributes:
        files: the files (:class:`~walshkv.export.KMeanBias`).
        k_basis: ``post-rope``, as statistics are: specs that read nothing bind to it, specs that read K after RoPE
            read the files that hold it; :meth:`pre_rope` is the view of the files that hold K before RoPE.
        text: the calibration text's name.
    """

    def __init__(
        self,
        files: Sequence[KMeanBias],
        *,
        label: str = "these calibration files",
        text: str | None = None,
        description: dict[str, Any] | None = None,
        k_basis: KBasis | None = None,
    ) -> None:
        if not files:
            raise ValueError("a CalibrationSet needs at least one file")
        self.files = tuple(files)
        self.label = label
        self.text = text if text is not None else self.files[0].text
        self._description = description or {"kind": "calibration files", "files": [f.describe() for f in files]}
        self.k_basis: KBasis = k_basis or "post-rope"
        self._diagonal = {
            (id(f), kind): _is_diagonal(eq)
            for f in self.files
            for kind, eq in (("k", f.k_eq), ("v", f.v_eq))
            if eq is not None
        }

    def _here(self) -> list[KMeanBias]:
        return [f for f in self.files if f.k_basis == self.k_basis]

    def _find(self, what: str, held: Any) -> KMeanBias:
        for f in self._here():
            if held(f):
                return f
        names = ", ".join(f.source for f in self.files)
        raise ValueError(
            f"{self.label} holds no {what} (K {self.k_basis}; files: {names}): the spec reads a part none of its "
            "presets needs; give it its own calibration (--kv-mean-center FILE from `walshkv calibrate --preset` / "
            "`walshkv recommend` for this spec, or --calib-text TEXT)"
        )

    def _eq(self, kind: Kind, diagonal: bool) -> KMeanBias:
        what = f"{'diagonal eqd+' if diagonal else 'dense eq+'} {kind.upper()} transforms"
        return self._find(
            what,
            lambda f: self._diagonal.get((id(f), kind)) is diagonal and (kind == "v" or f.k_equalizer_fit is None),
        )

    def k_equalizer_fitted(self, fit: str, layer: int) -> torch.Tensor:
        """The K transform of ``layer`` fitted as ``fit`` (``eqr:L:Q``: ``eqr+``'s), from the file that holds it."""
        return self._find(f"K transforms fitted as {fit}", lambda f: f.k_equalizer_fit == fit).k_equalizer(layer)

    def k_bias(self, layer: int, basis: Basis) -> torch.Tensor:
        """The K mean ``[kv_heads, head_dim]`` of ``layer`` in ``basis``, from the file written in that basis."""
        return self._find(f"K mean in the {basis} basis", lambda f: f.basis == basis).k_bias(layer, basis)

    def k_equalizer(self, layer: int) -> torch.Tensor:
        """``eq+``'s dense K transform of ``layer``."""
        return self._eq("k", False).k_equalizer(layer)

    def k_equalizer_diagonal(self, layer: int) -> torch.Tensor:
        """``eqd+``'s diagonal K transform of ``layer``."""
        return self._eq("k", True).k_equalizer(layer)

    def v_equalizer(self, layer: int) -> torch.Tensor:
        """``eq+``'s dense V transform of ``layer``."""
        return self._eq("v", False).v_equalizer(layer)

    def v_equalizer_diagonal(self, layer: int) -> torch.Tensor:
        """``eqd+``'s diagonal V transform of ``layer``."""
        return self._eq("v", True).v_equalizer(layer)

    def rope_table(self, layer: int) -> RopeTable:
        """``layer``'s RoPE table, from a file written for K before RoPE."""
        return self._find("RoPE tables", lambda f: f.rope_inv_freq is not None).rope_table(layer)

    def pre_rope(self) -> CalibrationSet:
        """The files that hold K before RoPE, as one calibration (what ``prerope+`` reads)."""
        if self.k_basis == "pre-rope":
            return self
        if not any(f.k_basis == "pre-rope" for f in self.files):
            raise ValueError(
                f"{self.label} holds K after RoPE only; a prerope+ spec needs a file written for one (`walshkv "
                "calibrate --preset` / `walshkv recommend` with a prerope+ spec), or --calib-text TEXT"
            )
        return CalibrationSet(
            self.files, label=self.label, text=self.text, description=self._description, k_basis="pre-rope"
        )

    def check_matches(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        model: str | None = None,
        *,
        model_config: dict[str, Any] | None = None,
    ) -> None:
        """Refuse a model any of the files was not made for (:meth:`walshkv.export.KMeanBias.check_matches`)."""
        for f in self.files:
            f.check_matches(num_layers, num_kv_heads, head_dim, model, model_config=model_config)

    def describe(self) -> dict[str, Any]:
        """Provenance for result files: each file with its checksum (shipped files: and where it came from)."""
        return self._description

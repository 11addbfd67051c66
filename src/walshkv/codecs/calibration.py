"""What a codec's :meth:`~walshkv.codecs.base.Codec.bind` may read from calibration: typed protocols.

Calibration comes in two shapes, both defined above this layer (codecs only see these protocols):

* a calibration **file** (:class:`walshkv.export.KMeanBias`, written by ``walshkv calibrate``): the K mean,
  optionally the ``eq+`` transforms and the RoPE tables; it satisfies :class:`Calibration`;
* **statistics** collected from text (:class:`walshkv.calibration.KVStats`, or
  :class:`walshkv.calibration.MergedCalibration`: statistics with a file's K mean): everything a file has
  plus per-channel means and variances; they satisfy :class:`Statistics`.

Each wrapper or codec needs one part only, and tests hand codecs small stand-ins that hold just that
part, so every part is its own ``runtime_checkable`` protocol and ``bind`` checks for the part it reads with
``isinstance`` (a structural check: the object has the methods), then raises an error that names the part
and where to get it. Shapes: ``[kv_heads, head_dim]`` for means and variances, ``[kv_heads, head_dim,
head_dim]`` for transforms.

Parts, and who reads them:

* :class:`KMean` ``k_bias(layer, basis)``: ``center+``;
* :class:`Means` ``mean(kind, layer, basis)``: ``center+rrot+`` (random signs: the bias is rotated here);
* :class:`Variances` ``variance(kind, layer, basis)``: ``vht2:...:order=variance`` and ``vht2:auto@B``;
* :class:`KEqualizer` ``k_equalizer(layer)`` and :class:`VEqualizer` ``v_equalizer(layer)``: ``eq+``;
* :class:`KMoments` ``k_covariance(layer)``, ``query_moment(layer)`` (statistics before RoPE): ``eqr+``, or, from
  files, :class:`KEqualizerFitted` ``k_equalizer_fitted(fit, layer)``;
* :class:`PreRopeSource` ``pre_rope()`` and, on the view it returns, :class:`RopeTables`
  ``rope_table(layer)``: ``prerope+``;
* :class:`Provenance` ``k_basis``, ``check_matches(...)``, ``describe()``: :meth:`CacheSpec.bind` and the cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, runtime_checkable

if TYPE_CHECKING:
    import torch

    from walshkv.constants import Basis, KBasis, Kind
    from walshkv.ops.rope import RopeTable

__all__ = [
    "Calibration",
    "CalibrationLike",
    "KEqualizer",
    "KEqualizerFitted",
    "KMean",
    "KMoments",
    "Means",
    "PreRopeSource",
    "Provenance",
    "RopeTables",
    "Statistics",
    "VEqualizer",
    "Variances",
    "k_basis_of",
]


@runtime_checkable
class KMean(Protocol):
    """The K mean ``center+`` subtracts."""

    def k_bias(self, layer: int, basis: Basis) -> torch.Tensor:
        """Mean K ``[kv_heads, head_dim]`` of ``layer`` in the ``plain`` or ``rot`` (Walsh-Hadamard) basis."""
        ...


@runtime_checkable
class Means(Protocol):
    """Per-channel means of K or V (statistics only: a file holds the K mean of one basis)."""

    def mean(self, kind: Kind, layer: int, basis: str = "plain") -> torch.Tensor:
        """Mean ``[kv_heads, head_dim]`` of K (``kind="k"``) or V of ``layer`` in ``basis`` (``plain``, ``wht``)."""
        ...


@runtime_checkable
class Variances(Protocol):
    """Per-channel variances of K or V (statistics only)."""

    def variance(self, kind: Kind, layer: int, basis: str = "wht") -> torch.Tensor:
        """Variance ``[kv_heads, head_dim]`` of K or V of ``layer`` in ``basis`` (``plain``, ``wht``)."""
        ...


@runtime_checkable
class KEqualizer(Protocol):
    """The ``eq+`` K transforms."""

    def k_equalizer(self, layer: int) -> torch.Tensor:
        """The K transform ``[kv_heads, head_dim, head_dim]`` (float32) of ``layer``."""
        ...


@runtime_checkable
class KEqualizerFitted(Protocol):
    """K transforms fitted another way than ``eq+``'s, as files hold them (``eqr+``'s: ``eqr:L:Q``)."""

    def k_equalizer_fitted(self, fit: str, layer: int) -> torch.Tensor:
        """The K transform ``[kv_heads, head_dim, head_dim]`` of ``layer`` fitted as ``fit`` (``eqr:L:Q``, ``0``: the
        limit).

        Raises:
            ValueError: no transform fitted that way is held (the message names what is).
        """
        ...


@runtime_checkable
class KMoments(Protocol):
    """K covariance and query second moments (statistics only), which ``eqr+`` turns by RoPE and averages."""

    def k_covariance(self, layer: int) -> torch.Tensor:
        """K covariance ``[kv_heads, head_dim, head_dim]`` (float64) of ``layer``."""
        ...

    def query_moment(self, layer: int) -> torch.Tensor:
        """``E[q qᵀ]`` ``[kv_heads, head_dim, head_dim]`` of the queries of each kv head's group in ``layer``."""
        ...


@runtime_checkable
class VEqualizer(Protocol):
    """The ``eq+`` V transforms."""

    def v_equalizer(self, layer: int) -> torch.Tensor:
        """The V transform ``[kv_heads, head_dim, head_dim]`` (float32) of ``layer``."""
        ...


@runtime_checkable
class RopeTables(Protocol):
    """The model's RoPE tables, one per layer."""

    def rope_table(self, layer: int) -> RopeTable:
        """``layer``'s RoPE table (inverse frequencies and attention scaling)."""
        ...


@runtime_checkable
class PreRopeSource(Protocol):
    """Calibration that can present its K statistics as taken before RoPE (what ``prerope+`` reads)."""

    def pre_rope(self) -> Calibration:
        """The same calibration with K (and query) statistics before RoPE.

        Raises:
            ValueError: the calibration holds no K before RoPE (a file written for a spec without ``prerope+``).
        """
        ...


@runtime_checkable
class Provenance(Protocol):
    """Where calibration comes from and which model it fits."""

    @property
    def k_basis(self) -> KBasis:
        """``post-rope`` (K as the cache sees it) or ``pre-rope`` (made for a ``prerope+`` spec)."""
        ...

    def check_matches(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        model: str | None = None,
        *,
        model_config: dict[str, Any] | None = None,
    ) -> None:
        """Raise ``ValueError`` if the calibration was made for a model of another shape, name or identity.

        ``model_config`` is the model's (:func:`walshkv.identity.identity_config`); calibration that records a
        config differing in a key both hold is refused even where the shapes agree.
        """
        ...

    def describe(self) -> dict[str, Any]:
        """Provenance for result files (JSON-serialisable)."""
        ...


@runtime_checkable
class Calibration(KMean, KEqualizer, VEqualizer, RopeTables, PreRopeSource, Provenance, Protocol):
    """Everything a calibration file (:class:`walshkv.export.KMeanBias`) provides.

    A part that the file does not hold (``eq+`` transforms, RoPE tables) raises ``ValueError`` naming the
    command that writes it.
    """


@runtime_checkable
class Statistics(Calibration, Means, Variances, Protocol):
    """Everything collected statistics (:class:`walshkv.calibration.KVStats`) provide."""


#: What ``bind`` accepts: any object with one or more of the parts above (a file, statistics, a test stand-in).
CalibrationLike: TypeAlias = (
    "Calibration | KMean | Means | Variances | KEqualizer | VEqualizer | RopeTables | PreRopeSource | Provenance"
)


def k_basis_of(calibration: object) -> KBasis:
    """Whether ``calibration``'s K statistics are before RoPE; ``post-rope`` for objects that do not say."""
    return calibration.k_basis if isinstance(calibration, Provenance) else "post-rope"

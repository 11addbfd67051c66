"""What attention takes off a codec before a kernel reads its codes: rotations, ``center+`` and ``eq+``.

Every backend reads the packed bytes of one *core* codec and moves the wrappers' work onto the query
(once, before the tokens) and the weighted V sum (once, after them):

* ``rot+``/``rrot+`` (:class:`walshkv.codecs.rotation.Rotated`): orthonormal, so ``q·Uc = (Uᵀq)·c``.
* ``center+`` (:class:`walshkv.codecs.center.Centered`): dropped; its decode adds nothing back (the bias
  shifts every score of a query by the same amount, which softmax ignores).
* ``eq+`` (:class:`walshkv.codecs.equalize.Equalized`): a per-kv-head matrix, ``q·A⁻¹y = (A⁻ᵀq)·y``.

Any other wrapper (``prerope+``) stops the walk: it is returned as the core, which no kernel reads, so
such codecs go to the reference. The chain is walked with :func:`walshkv.codecs.base.wrappers`.
"""

from __future__ import annotations

import torch

from walshkv.codecs.base import Codec, unwrap, wrappers
from walshkv.codecs.center import Centered
from walshkv.codecs.equalize import Equalized
from walshkv.codecs.rotation import Rotated

__all__ = ["core_codec", "peel", "peel_equalizer"]


def _first_other(codec: Codec, skip: tuple[type[Codec], ...]) -> Codec:
    """The outermost wrapper of ``codec`` that is none of ``skip``, else the storing codec."""
    for w in wrappers(codec):
        if not isinstance(w, skip):
            return w
    return unwrap(codec)


def peel(codec: Codec) -> tuple[list[Rotated], Codec]:
    """Split a codec into its rotation wrappers (outermost first) and the codec that stores the codes.

    ``center+`` is dropped: its decode adds nothing back, so the packed bytes decode exactly as its
    inner codec's. The walk stops at the first other wrapper, which is returned as the core.
    """
    core = _first_other(codec, (Centered, Rotated))
    rots: list[Rotated] = []
    for w in wrappers(codec):
        if w is core:
            break
        if isinstance(w, Rotated):
            rots.append(w)
    return rots, core


def peel_equalizer(codec: Codec) -> tuple[torch.Tensor | None, Codec]:
    """Split off an ``eq+`` wrapper: ``(inverse, inner)``, or ``(None, codec)`` when there is none.

    ``center+eq+X`` stores ``X(A x)`` and decodes ``A⁻¹ X⁻¹(...)`` per kv head. Attention reads it as
    ``X``'s cache with the query multiplied by ``A⁻ᵀ`` once and the weighted V sum by ``A⁻¹`` once
    (``inverse`` is ``A⁻¹``, ``[kv_heads, head_dim, head_dim]``); ``center+`` goes too (see :func:`peel`).

    Raises:
        ValueError: an ``eq+`` codec that is not bound to a layer's transform.
    """
    eq = _first_other(codec, (Centered,))
    if not isinstance(eq, Equalized):
        return None, codec
    if eq.inverse is None:
        raise ValueError(f"{codec.spec} is not bound to a layer's transform; build it through CompressedCache")
    return eq.inverse, eq.inner


def core_codec(codec: Codec) -> Codec:
    """The codec that stores the codes: ``codec`` without its ``center+``, ``eq+`` and rotation wrappers.

    ``center+`` and ``eq+`` are taken off the outside first, then rotations (and ``center+``) as in
    :func:`peel`; a wrapper that attention does not peel is returned as it is.
    """
    return peel(_first_other(codec, (Centered, Equalized)))[1]

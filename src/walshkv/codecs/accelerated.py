"""Accelerated implementations of codec steps: declared by the codec, registered by the layer that holds them.

A codec whose encode or decode has a step that faster code can take over declares that step as a :class:`Step`
(tq's packing of its rotated rows into Lloyd-Max codes: :data:`walshkv.codecs.turbo.PACK_ROWS`) and asks
:func:`implementation` for it each time it runs. The codec's own torch code stays the reference: an implementation
returns what the torch path would, bit for bit, or ``None`` to decline (the torch path runs), and the tests compare
the two (:func:`reference_only` runs the torch path).

The implementations live above the codecs (the C++ kernel is in :mod:`walshkv.attention.cpu`, which imports
codecs, never the other way round), so each registers itself with :func:`register` where it is defined, at import,
once; a step has at most one implementation. The registrations, in one place (keep this list true):

- ``tq.pack_rows`` (:data:`walshkv.codecs.turbo.PACK_ROWS`): :func:`walshkv.attention.cpu.tq_pack_rows`, the
  kernel's ``tq_pack``; it declines until the kernel is loaded.
- ``tcq.codes`` (:data:`walshkv.codecs.trellis.TCQ_CODES`): :func:`walshkv.attention.cpu.tcq_code_rows`, the
  kernel's ``tcq_encode``; it declines until the kernel is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["Step", "implementation", "reference_only", "register"]

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Step(Generic[F]):
    """A step of a codec that an accelerated implementation may take over.

    Attributes:
        name: ``codec.step``, as messages name it.
        contract: what an implementation takes and returns (the codec's torch path is the reference).
    """

    name: str
    contract: str


_REGISTRY: dict[Step[Any], Callable[..., Any]] = {}
_REFERENCE_ONLY: ContextVar[bool] = ContextVar("walshkv_reference_only", default=False)


def register(step: Step[F], impl: F) -> None:
    """Register ``impl`` as the accelerated implementation of ``step`` (the same one again is a no-op).

    Raises:
        ValueError: another implementation is registered for ``step`` already (a step has one; register only the
            faster one, where it is defined).
    """
    current = _REGISTRY.get(step)
    if current is not None and current is not impl:
        raise ValueError(
            f"{step.name} has an accelerated implementation already ({current.__module__}.{current.__qualname__}); "
            f"refusing {impl.__module__}.{impl.__qualname__}: register one implementation per step"
        )
    _REGISTRY[step] = impl


def implementation(step: Step[F]) -> F | None:
    """The implementation registered for ``step``, or ``None`` (none registered, or inside :func:`reference_only`)."""
    if _REFERENCE_ONLY.get():
        return None
    return _REGISTRY.get(step)  # type: ignore[return-value]


@contextmanager
def reference_only() -> Iterator[None]:
    """Within this block (this thread or task only) codecs run their torch paths, the reference."""
    token = _REFERENCE_ONLY.set(True)
    try:
        yield
    finally:
        _REFERENCE_ONLY.reset(token)

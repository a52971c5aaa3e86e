"""ATen op lowerings, one module per op family, each registering its ops in :mod:`jaxbackend.ops.registry` when
imported here; :func:`get` looks one up."""

from __future__ import annotations

from jaxbackend.ops import (  # noqa: F401  (registration side effects)
    attention,
    elementwise,
    fused_loss,
    indexing,
    linalg,
    nn,
    pooling,
    random_ops,
    reduction,
    shape,
    upsample,
)
from jaxbackend.ops.registry import Lowering, registered


def get(target: str) -> Lowering | None:
    """The lowering of ``target`` (an ATen overload name, ``"aten.mm.default"``), or ``None`` if it has none."""
    return registered(target)

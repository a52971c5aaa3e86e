"""Specs → JAX shardings on a device mesh.

A spec (see ``torchpar.ir.layout``) has one entry per tensor dim: ``None`` or a tuple of
logical mesh axes. Axis ``a`` is the mesh axis named ``"d{a}"``.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

AXIS_NAMES = ("d0", "d1")


def make_mesh(shape: tuple[int, int], devices: Sequence[Any] | None = None) -> Mesh:
    """A 2-D mesh of the first ``shape[0]·shape[1]`` devices (row-major: axis 1 is the inner one)."""
    devices = list(devices if devices is not None else jax.devices())
    count = shape[0] * shape[1]
    if len(devices) < count:
        raise ValueError(f"a {shape[0]}×{shape[1]} mesh needs {count} devices, JAX has {len(devices)}; "
                         "call torchpar.init(num_devices=...) before JAX is imported")
    return Mesh(np.array(devices[:count]).reshape(shape), AXIS_NAMES)


def partition_spec(spec: Sequence[Sequence[int] | None]) -> PartitionSpec:
    entries = []
    for entry in spec:
        if not entry:
            entries.append(None)
        elif len(entry) == 1:
            entries.append(AXIS_NAMES[entry[0]])
        else:
            entries.append(tuple(AXIS_NAMES[a] for a in entry))
    return PartitionSpec(*entries)


def axes_of(spec: PartitionSpec, rank: int) -> tuple[tuple[int, ...] | None, ...]:
    """The inverse of :func:`partition_spec`: a ``PartitionSpec`` over this module's axis names as a spec of
    ``rank`` entries (tuples of axis numbers or ``None``)."""
    entries = list(spec) + [None] * (rank - len(spec))
    out = []
    for entry in entries[:rank]:
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        out.append(tuple(AXIS_NAMES.index(name) for name in names) or None)
    return tuple(out)


def named_sharding(mesh: Mesh, spec: Sequence[Sequence[int] | None]) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(spec))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def constrain(value: Any, sharding: NamedSharding | None) -> Any:
    """``with_sharding_constraint`` for arrays; other values pass through."""
    if sharding is None or not isinstance(value, jax.Array | jax.core.Tracer):
        return value
    return jax.lax.with_sharding_constraint(value, sharding)

"""Specs → JAX shardings on a device mesh.

A spec (see ``torchpar.ir.layout``) has one entry per tensor dim: ``None`` or a tuple of
logical mesh axes. Axis ``a`` is the mesh axis named ``"d{a}"``.

A stage replicated over a data axis (``StagePlan.data_replicas`` > 1) runs on a 3-D mesh
``(DATA_AXIS, "d0", "d1")``: specs never name the data axis; the step is a ``shard_map`` manual over it
(each replica a GSPMD program over ``d0 × d1``), inside which shardings and nested ``shard_map`` calls must use
the abstract mesh with the data axis manual (:func:`region_mesh`, :func:`constrain` do).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

F = TypeVar("F", bound=Callable[..., object])
T = TypeVar("T")

AXIS_NAMES = ("d0", "d1")
DATA_AXIS = "dp"
"""The outer mesh axis of data replicas of a 2-D plan (never named by a spec)."""


def make_mesh(shape: tuple[int, int], devices: Sequence[jax.Device] | None = None, data_replicas: int = 1) -> Mesh:
    """A 2-D mesh of the first ``shape[0]·shape[1]`` devices (row-major: axis 1 is the inner one); with
    ``data_replicas`` R > 1 the 3-D mesh ``(DATA_AXIS, d0, d1)`` of the first ``R·shape[0]·shape[1]``, replica
    ``r`` holding devices ``[r·d0·d1, (r+1)·d0·d1)``."""
    devices = list(devices if devices is not None else jax.devices())
    count = data_replicas * shape[0] * shape[1]
    if len(devices) < count:
        mesh = f"{data_replicas}×" if data_replicas > 1 else ""
        raise ValueError(
            f"a {mesh}{shape[0]}×{shape[1]} mesh needs {count} devices, JAX has {len(devices)}; "
            "call torchpar.init(num_devices=...) before JAX is imported"
        )
    if data_replicas > 1:
        return Mesh(np.array(devices[:count]).reshape(data_replicas, *shape), (DATA_AXIS, *AXIS_NAMES))
    return Mesh(np.array(devices[:count]).reshape(shape), AXIS_NAMES)


def data_replicas_of(mesh: Mesh) -> int:
    """How many data replicas ``mesh`` holds (1 for a 2-D mesh)."""
    return int(mesh.shape[DATA_AXIS]) if DATA_AXIS in mesh.axis_names else 1


def region_mesh(mesh: Mesh | AbstractMesh) -> Mesh | AbstractMesh:
    """The mesh to build shardings and nested ``shard_map`` calls on where this code is traced: inside a ``shard_map``
    manual over some axes (the data axis), the current abstract mesh (those axes ``Manual``); else ``mesh``."""
    current = jax.sharding.get_abstract_mesh()
    if not current.empty and current.manual_axes and tuple(current.axis_names) == tuple(mesh.axis_names):
        return current
    return mesh


def partition_spec(spec: Sequence[Sequence[int] | None]) -> PartitionSpec:
    entries: list[str | tuple[str, ...] | None] = []
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


def in_data_replica() -> bool:
    """Whether the code being traced runs in a data replica's step (a ``shard_map`` manual over :data:`DATA_AXIS`)."""
    current = jax.sharding.get_abstract_mesh()
    return not current.empty and DATA_AXIS in current.manual_axes


def shard_map(body: F, mesh: Mesh | AbstractMesh, in_specs: object, out_specs: object) -> F:
    """``jax.shard_map`` of ``body`` manual over every axis of ``mesh`` not already manual where it is traced (inside
    a data replica's step: ``d0`` and ``d1``, on the abstract mesh, :func:`region_mesh`, and not varying-typed, as
    that step is: ``torchpar.runtime.train_step.over_data_replicas``); over all of them elsewhere."""
    region = region_mesh(mesh)
    manual = set(getattr(region, "manual_axes", ()) or ())
    free = {name for name in region.axis_names if name not in manual}
    return jax.shard_map(
        body, mesh=region, in_specs=in_specs, out_specs=out_specs, axis_names=free, check_vma=not manual
    )


def constrain(value: T, sharding: NamedSharding | None) -> T:
    """``with_sharding_constraint`` for arrays; other values pass through."""
    if sharding is None or not isinstance(value, jax.Array | jax.core.Tracer):
        return value
    mesh = region_mesh(sharding.mesh)
    if mesh is not sharding.mesh:
        sharding = NamedSharding(mesh, sharding.spec)
    return jax.lax.with_sharding_constraint(value, sharding)

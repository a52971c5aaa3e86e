"""Arrays that may span processes: host data onto a sharding, and pieces of a sharded array back to a host.

In one process every sharding is fully addressable and these are ``jax.device_put`` / ``np.asarray``.
In a multi-controller system (host actors joined by ``jax.distributed``) a sharding's devices belong to
several processes and each holds only the shards of its own devices:

- :func:`put` builds a global array from a host value every participating process holds in full (the
  state the driver loaded, a batch), each process placing only its own devices' slices;
- :func:`owned_pieces` is what one process contributes when the array goes back to the driver: replica
  0 of each distinct shard it holds, so over all processes every element is sent exactly once;
- :func:`assemble` puts such pieces back together.

An *index* is a tuple of ``(start, stop)`` per dim, in global coordinates; a *piece* is
``(index, data)`` with ``data.shape`` equal to the index's extent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
import numpy.typing as npt
from jax.typing import ArrayLike

Index = tuple[tuple[int, int], ...]
Piece = tuple[Index, np.ndarray]


def fitting(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> jax.sharding.Sharding:
    """``sharding`` if it tiles ``shape`` evenly, else the same sharding with each dimension it cannot split evenly
    left whole (e.g. a last batch of 6 rows on a 4-way data axis: replicated along the rows). JAX places arrays
    only in even tiles; inside a compiled step XLA pads uneven ones, so a plan's layouts still hold there."""
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return sharding
    try:
        sharding.shard_shape(tuple(shape))
        return sharding
    except ValueError:
        pass
    sizes = dict(sharding.mesh.shape)
    spec = [*sharding.spec, *([None] * (len(shape) - len(sharding.spec)))]
    for dim, entry in enumerate(spec):
        axes = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        if shape[dim] % math.prod(sizes[a] for a in axes):
            spec[dim] = None
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


def put_batch(value: ArrayLike, sharding: jax.sharding.Sharding) -> jax.Array:
    """A batch leaf or an activation (:func:`put`) laid out as ``sharding``, or as :func:`fitting` makes it where
    ``sharding`` does not split its shape evenly (an epoch's last batch). The state is never fitted: a plan
    whose parameter layout does not split it is an error at load."""
    return put(value, fitting(sharding, np.shape(value)))


def put(value: ArrayLike, sharding: jax.sharding.Sharding) -> jax.Array:
    """``value`` (a host array, the same in every process that calls this) laid out as ``sharding``."""
    if sharding.is_fully_addressable:
        return jax.device_put(value, sharding)
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def normalize(index: Sequence[slice], shape: Sequence[int]) -> Index:
    """A shard's tuple of slices as ``(start, stop)`` per dim."""
    return tuple((s.start or 0, size if s.stop is None else s.stop) for s, size in zip(index, shape))


def intersect(a: Index, b: Index) -> Index | None:
    """The overlap of two indices, ``None`` if empty."""
    result = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return None if any(lo >= hi for lo, hi in result) else result


def extent(index: Index) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in index)


def relative(inner: Index, outer: Index) -> tuple[slice, ...]:
    """Slices selecting ``inner`` out of an array that holds ``outer``."""
    return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer))


def owned_pieces(array: jax.Array) -> list[Piece]:
    """This process's share of ``array`` for a host copy: replica 0 of each shard it holds."""
    return [
        (normalize(shard.index, array.shape), np.asarray(shard.data))
        for shard in array.addressable_shards
        if shard.replica_id == 0
    ]


def to_host(array: jax.Array) -> np.ndarray | list[Piece]:
    """The whole array if this process holds all of it, else its owned pieces."""
    if array.is_fully_addressable:
        return np.asarray(array)
    return owned_pieces(array)


def assemble(shape: Sequence[int], dtype: npt.DTypeLike, pieces: Sequence[Piece]) -> np.ndarray:
    """A host array of ``shape`` from pieces that tile it; raises if some element is missing."""
    out = np.empty(tuple(shape), dtype)
    covered = 0
    whole = tuple((0, size) for size in shape)
    for index, data in pieces:
        out[relative(index, whole)] = data
        covered += math.prod(extent(index))
    if covered != math.prod(shape):
        raise RuntimeError(f"pieces cover {covered} of the {math.prod(shape)} elements of a {list(shape)} array")
    return out


def local_scalar(array: jax.Array) -> float:
    """A replicated scalar as a float, read from this process's first copy."""
    return float(np.asarray(array.addressable_data(0)))


def local_copy(array: jax.Array) -> np.ndarray:
    """A replicated array as a host array, read from this process's first copy."""
    return np.asarray(array.addressable_data(0))

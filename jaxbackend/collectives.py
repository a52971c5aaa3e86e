"""Collectives inside ``shard_map`` bodies that give the same values on every backend this project runs on.

**Reduce-scatter over gloo is wrong at times.** With ``jax.distributed`` initialized on CPU, XLA:CPU runs every
collective through gloo (between the devices of one process too), and gloo's reduce-scatter
(``ReduceScatterHalvingDoubling``, which ``GlooCommunicator::ReduceScatter`` calls) sends from a buffer its peers
write into: rank 0's chunk intermittently ends in wrong values, with no error (jax-ml/jax#40830; seen here in
jaxlib 0.10.2 as the last ~65 elements of device 0's chunk wrong in 2 of 60 steps of a program with eight
reduce-scatters in flight, and as a ZeRO-2 Mixtral parameter off by 4e-5 after two SGD steps on the Ray runtime).
All-reduce over gloo is right on the same programs. So there :func:`reduce_scatter` all-reduces and keeps the
device's chunk — the same values, twice the bytes on the wire, on CPU processes only; GPUs (NCCL) and one-process
CPU meshes (in-process rendezvous) keep the one reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax


def _names(axes: str | Sequence[str]) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def gloo_reduce_scatter_is_unsafe() -> bool:
    """Whether the collectives traced now run over gloo: a CPU backend in a ``jax.distributed`` system."""
    return jax.default_backend() == "cpu" and jax.distributed.is_initialized()


def reduce_scatter(x: jax.Array, axes: str | Sequence[str], dim: int, tiled: bool = True) -> jax.Array:
    """``jax.lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=tiled)`` inside a ``shard_map`` body: the sum
    of ``x`` over the devices along ``axes``, of which this device keeps chunk ``i`` along ``dim`` (``i`` its index
    along ``axes``, major to minor; ``x.shape[dim]`` divisible by their size; ``tiled=False``: ``x.shape[dim]``
    equals it and the dim is dropped). Over gloo: ``psum`` and a slice (see the module docstring)."""
    names = _names(axes)
    if not gloo_reduce_scatter_is_unsafe():
        return jax.lax.psum_scatter(x, names, scatter_dimension=dim, tiled=tiled)
    chunks = jax.lax.axis_size(names)
    if x.shape[dim] % chunks:
        raise ValueError(f"reduce-scatter of dim {dim} ({x.shape[dim]}) over {chunks} devices ({names}): not divisible")
    size = x.shape[dim] // chunks
    mine = jax.lax.dynamic_slice_in_dim(jax.lax.psum(x, names), jax.lax.axis_index(names) * size, size, axis=dim)
    return mine if tiled else mine.squeeze(dim)


def all_gather(x: jax.Array, axes: str | Sequence[str], *, axis: int, tiled: bool = True) -> jax.Array:
    """``jax.lax.all_gather(x, axes, axis=axis, tiled=tiled)`` inside a ``shard_map`` body, the result varying
    along ``axes`` as ``x`` does: its gradient is the sum of the devices' cotangents scattered back onto the shards.
    JAX transposes it into a reduce-scatter; over gloo the backward is :func:`reduce_scatter`'s instead."""
    names = _names(axes)
    if not gloo_reduce_scatter_is_unsafe():
        return jax.lax.all_gather(x, names, axis=axis, tiled=tiled)

    @jax.custom_vjp
    def gather(shard: jax.Array) -> jax.Array:
        return jax.lax.all_gather(shard, names, axis=axis, tiled=tiled)

    def backward(_: None, cotangent: jax.Array) -> tuple[jax.Array]:
        return (reduce_scatter(cotangent, names, dim=axis, tiled=tiled),)

    gather.defvjp(lambda shard: (gather(shard), None), backward)
    return gather(x)

"""Rows moved between devices by a whole index: ``table[idx]`` and ``base.index_put([idx], values)`` with the rows
of ``table``/``base``/``values`` and of the result split over mesh axes ``R`` (``P`` devices, contiguous chunks),
the index ``idx [S]`` whole on every device.

This is how a mixture-of-experts layer's token dispatch follows a row split (HF's ``hidden[perm // k]`` sorting
token rows by expert, ``out[inv_perm]`` putting them back; a hand-written ``empty_like(y).index_put((perm,), y)``):
under GSPMD such a gather all-gathers the whole table to every device and its backward all-reduces the whole
table's gradient. Here every device knows from ``idx`` alone which of its rows each peer needs, so only those rows
travel, by one all-to-all (and its transpose in the backward).

A *pair* ``p`` moves one row: for the gather from table row ``idx[p]`` to output row ``p``; for the put from
values row ``p`` to result row ``idx[p]``. Sources live in chunks of ``L_src`` rows, destinations in chunks of
``L_dst``; device ``d`` holds chunk ``d`` of both (its place along ``R``). For a pair whose source and destination
devices differ, the source device sends the row in *slot* ``dst`` of its send buffer ``[P, T, …]``, at the pair's
rank among the pairs between the two devices (pairs in index order); ``all_to_all`` delivers slot ``s`` of the
receive buffer from device ``s``, whose order the receiver recomputes from ``idx``. A pair within one device moves
no data. Nothing is dropped: ``T = ⌈2·L_dst/P⌉`` rows (:func:`torchpar.ir.costs.expert_slot_rows`: twice a
uniform permutation's share) on the fast path; when some device pair has more (a skewed routing, or an index that
is mostly not a permutation), the exact path runs with ``T = L_dst`` for a gather and ``T = L_src`` for a put —
a ``lax.cond`` on counts computed from the whole ``idx``, so every device takes the same branch and the
collectives in it complete. Both branches' buffers are compiled in (the planner's memory estimate counts them:
``torchpar.planner.sharding.exchange_strategies``). On GPUs the slots travel by ``jax.lax.ragged_all_to_all``, so only
the rows sent move; XLA:CPU lacks it and moves the padded slots by ``all_to_all`` (:mod:`.exchange_collective`).

The backward needs no rule: ``jax.grad`` transposes the local gathers into scatter-adds and the all-to-all (ragged or
not) into the reverse one. A put with ``accumulate=False`` and a repeated index keeps one of the rows written there,
as PyTorch does (which one is unspecified in both).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import cast

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxbackend.ops.exchange_collective import slots_all_to_all
from jaxbackend.sharding import shard_map
from torchpar.ir.costs import expert_slot_rows

Axes = str | tuple[str, ...]
"""A mesh axis name, or the names of the axes a dim is split over (major first), as in a ``PartitionSpec``."""


def _kth_in_rows(mask: jax.Array, slot: int) -> tuple[jax.Array, jax.Array]:
    """For each row ``c`` of ``mask [P, L]``: the positions of its first ``slot`` set entries, in order
    (``[P, slot]``, clipped into range), and which of them exist."""
    counts = jnp.cumsum(mask.astype(jnp.int32), axis=1)
    wanted = jnp.arange(1, slot + 1, dtype=jnp.int32)
    position = jax.vmap(lambda row: jnp.searchsorted(row, wanted, side="left"))(counts)
    return jnp.clip(position, 0, mask.shape[1] - 1).astype(jnp.int32), wanted[None, :] <= counts[:, -1:]


def _rank_by_key(keys: jax.Array, groups: int) -> jax.Array:
    """``rank [L]``: how many positions before ``j`` have the key ``keys[j]`` (keys in ``0 … groups−1``)."""
    one_hot = (keys[:, None] == jnp.arange(groups, dtype=keys.dtype)[None, :]).astype(jnp.int32)
    seen = jnp.cumsum(one_hot, axis=0)
    return jnp.take_along_axis(seen, keys[:, None].astype(jnp.int32), axis=1)[:, 0] - 1


def _pair_counts(src_dev: jax.Array, dst_dev: jax.Array, peers: int) -> jax.Array:
    """``n [P, P]``: pairs from device ``s`` (row) to device ``d`` (column)."""
    flat = src_dev.reshape(-1) * peers + dst_dev.reshape(-1)
    return jnp.zeros((peers * peers,), jnp.int32).at[flat].add(1, mode="drop").reshape(peers, peers)


def _spill(counts: jax.Array) -> jax.Array:
    """The most pairs between two different devices."""
    return jnp.where(jnp.eye(counts.shape[0], dtype=bool), 0, counts).max()


def _exact_or_fast(spill: jax.Array, exact: int, fast: int, run: Callable[[int], jax.Array]) -> jax.Array:
    """``run(fast)`` when no device pair has more than ``fast`` rows to move, else ``run(exact)``; ``spill`` is
    computed from the whole index, the same on every device."""
    if fast >= exact:
        return run(exact)
    return jax.lax.cond(spill > fast, lambda: run(exact), lambda: run(fast))


def rows_from_end(idx: jax.Array, rows: int) -> jax.Array:
    """``idx`` as ``int32`` row numbers in ``0 … rows−1`` (PyTorch's negative indices count from the end)."""
    idx = idx.astype(jnp.int32)
    return jnp.where(idx < 0, idx + rows, idx)


def _masked(valid: jax.Array, rows: jax.Array) -> jax.Array:
    return jnp.where(valid.reshape(valid.shape + (1,) * (rows.ndim - valid.ndim)), rows, jnp.zeros((), rows.dtype))


def gather_rows_local(table: jax.Array, idx: jax.Array, axes: Axes, peers: int, slot: int | None = None) -> jax.Array:
    """This device's rows of ``table[idx]`` inside a ``shard_map`` manual over the mesh axes ``axes`` (``peers``
    devices): ``table [L_src, …]`` its chunk of the table's rows, ``idx [S]`` whole (``S`` divisible by
    ``peers``). Returns rows ``me·S/P … (me+1)·S/P − 1`` of the gather, ``[S/P, …]`` (module docstring).
    ``slot``: run only the exchange with slots of this many rows (rows past a slot come back zero; tests)."""
    rows = table.shape[0]
    out_rows = idx.shape[0] // peers
    me = jax.lax.axis_index(axes)
    idx = rows_from_end(idx, rows * peers).reshape(peers, out_rows)  # [dst chunk, row]
    owner = idx // rows  # the source device of each pair
    peer = jnp.arange(peers, dtype=jnp.int32)
    dst = jnp.broadcast_to(peer[:, None], owner.shape)
    mine = jax.lax.dynamic_index_in_dim(idx, me, keepdims=False)  # my output rows' table rows
    keys = jax.lax.dynamic_index_in_dim(owner, me, keepdims=False)
    rank = _rank_by_key(keys, peers)
    own = table[jnp.clip(mine - me * rows, 0, rows - 1)]

    def run(slot: int) -> jax.Array:
        taken, valid = _kth_in_rows(owner == me, slot)  # slot c: my rows chunk c needs
        valid = valid & (peer != me)[:, None]
        source = jnp.clip(jnp.take_along_axis(idx, taken, axis=1) - me * rows, 0, rows - 1)
        came = jnp.where(peer != me, jnp.minimum((keys[None, :] == peer[:, None]).sum(axis=1), slot), 0)
        received = slots_all_to_all(_masked(valid, table[source]), valid.sum(axis=1), came, axes)
        got = received[keys, jnp.clip(rank, 0, slot - 1)]
        return jnp.where((keys == me).reshape((-1,) + (1,) * (own.ndim - 1)), own, got)

    if slot is not None:
        return run(slot)
    spill = _spill(_pair_counts(owner, dst, peers))
    return _exact_or_fast(spill, out_rows, expert_slot_rows(out_rows, peers), run)


def put_rows_local(
    base: jax.Array,
    idx: jax.Array,
    values: jax.Array,
    axes: Axes,
    peers: int,
    accumulate: bool = False,
    slot: int | None = None,
) -> jax.Array:
    """This device's rows of ``base.index_put([idx], values, accumulate)`` inside a ``shard_map`` manual over
    ``axes`` (``peers`` devices): ``base [L_dst, …]`` and ``values [S/P, …]`` its row chunks, ``idx [S]`` whole.
    Returns ``[L_dst, …]`` (module docstring). ``slot``: as for :func:`gather_rows_local` (rows past a slot are not
    written)."""
    rows = base.shape[0]
    value_rows = values.shape[0]
    me = jax.lax.axis_index(axes)
    idx = rows_from_end(idx, rows * peers).reshape(peers, value_rows)  # [src chunk, row]
    dest = idx // rows
    local = idx - me * rows  # row on me, where dest == me
    peer = jnp.arange(peers, dtype=jnp.int32)
    src = jnp.broadcast_to(peer[:, None], dest.shape)
    my_dest = jax.lax.dynamic_index_in_dim(dest, me, keepdims=False)
    values = values.astype(base.dtype)
    own_target = jnp.where(my_dest == me, jax.lax.dynamic_index_in_dim(local, me, keepdims=False), rows)

    def run(slot: int) -> jax.Array:
        taken, valid = _kth_in_rows(my_dest[None, :] == peer[:, None], slot)  # slot c: my rows bound for c
        valid = valid & (peer != me)[:, None]
        arrived, present = _kth_in_rows(dest == me, slot)  # slot s: chunk s's rows for me
        present = present & (peer != me)[:, None]
        received = slots_all_to_all(_masked(valid, values[taken]), valid.sum(axis=1), present.sum(axis=1), axes)
        target = jnp.where(present, jnp.take_along_axis(local, arrived, axis=1), rows)
        rows_in = jnp.concatenate([values, received.reshape((peers * slot,) + values.shape[1:])])
        targets = jnp.concatenate([own_target, target.reshape(-1)])
        at = base.at[targets]
        return at.add(rows_in, mode="drop") if accumulate else at.set(rows_in, mode="drop")

    if slot is not None:
        return run(slot)
    spill = _spill(_pair_counts(src, dest, peers))
    return _exact_or_fast(spill, value_rows, expert_slot_rows(value_rows, peers), run)


def _peers(mesh: Mesh, entry: Axes) -> int:
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    return math.prod(mesh.shape[name] for name in names)


def row_axes_of(spec: Sequence[Axes | None] | None) -> Axes | None:
    """The mesh axis name(s) splitting dim 0 of a ``PartitionSpec``-like ``spec`` (``None``: not split)."""
    return spec[0] if spec and len(spec) else None


def gather_rows(table: jax.Array, idx: jax.Array, mesh: Mesh, table_spec: Sequence[Axes | None]) -> jax.Array:
    """``table[idx]`` of global arrays under ``jit`` (GSPMD): ``table`` laid out as ``table_spec`` (its dim 0 split),
    ``idx`` whole; the result laid out as ``table_spec`` too. A ``shard_map`` of :func:`gather_rows_local`."""
    axes = cast(Axes, row_axes_of(table_spec))  # its dim 0 is split
    spec = PartitionSpec(*table_spec)
    body = lambda t, i: gather_rows_local(t, i, axes, _peers(mesh, axes))
    return shard_map(body, mesh, in_specs=(spec, PartitionSpec()), out_specs=spec)(table, idx)


def put_rows(
    base: jax.Array,
    idx: jax.Array,
    values: jax.Array,
    mesh: Mesh,
    base_spec: Sequence[Axes | None],
    accumulate: bool = False,
) -> jax.Array:
    """``base.index_put([idx], values, accumulate)`` of global arrays under ``jit``: ``base`` and ``values`` laid
    out as ``base_spec`` (dim 0 split), ``idx`` whole. A ``shard_map`` of :func:`put_rows_local`."""
    axes = cast(Axes, row_axes_of(base_spec))  # its dim 0 is split
    spec = PartitionSpec(*base_spec)
    body = lambda b, i, v: put_rows_local(b, i, v, axes, _peers(mesh, axes), accumulate)
    return shard_map(body, mesh, in_specs=(spec, PartitionSpec(), spec), out_specs=spec)(base, idx, values)


__all__ = ["gather_rows", "gather_rows_local", "put_rows", "put_rows_local", "row_axes_of", "rows_from_end"]

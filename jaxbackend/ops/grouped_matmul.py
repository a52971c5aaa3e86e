"""A mixture-of-experts grouped matmul whose work grows with the rows, not with the number of experts.

``jax.lax.ragged_dot(x, w, sizes)`` multiplies rows ``start_e … start_e + n_e`` of ``x [S, K]`` by ``w[e] [K, N]``.
XLA's CPU backend expands it densely — every expert's product over all ``S`` rows, then a select — so its cost is
``E·S·K·N``: a 32-expert Mixtral step ran 12× slower than PyTorch eager. :func:`blocked_ragged_dot` computes the same
product in blocks of ``B`` rows that each belong to one expert:

    group e holds c_e = ⌈n_e / B⌉ blocks;  Σ_e c_e ≤ Σ_e (n_e / B + 1) ≤ ⌈S / B⌉ + E =: n_b   (a static bound)
    block b of group e = rows start_e + j·B … start_e + j·B + B − 1 (j = b − first block of e), rows past n_e masked
    y_block[b] = x_block[b] @ w[e(b)]     — one batched matmul of n_b × [B, K] × [K, N]
    y[s] = y_block[block of s][s's place in it];   rows past Σ n_e are zero (PyTorch leaves them unwritten)

so the work is ``(S + E·B)·K·N`` with ``B`` the power of two nearest below ``S / E`` (at most twice the rows' own
work once ``B`` is above its floor). Measured on 2 CPU cores (forward and backward of ``[4096, 256] × [E, 256, 1024]``):
smaller blocks pay more in gathering each block's weights (``n_b·K·N`` values) than they save in padding. Nothing is dropped or capacity-limited: every row is computed exactly once, like PyTorch's
``_grouped_mm``. ``jax.grad`` flows through the gathers (their transposes are scatter-adds into ``x`` and ``w``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

MIN_BLOCK_ROWS = 16
MAX_BLOCK_ROWS = 128


def block_rows_for(rows: int, groups: int) -> int:
    """The block size: the power of two nearest below ``rows / groups``, within [16, 128]."""
    target = max(rows // max(groups, 1), 1)
    size = 1 << (target.bit_length() - 1)
    return max(MIN_BLOCK_ROWS, min(MAX_BLOCK_ROWS, size))


def blocked_ragged_dot(x: jax.Array, weight: jax.Array, sizes: jax.Array, *, block_rows: int | None = None,
                       starts: jax.Array | None = None, weight_index: jax.Array | None = None,
                       run_blocks: int | None = None,
                       precision=None, preferred_element_type=None) -> jax.Array:
    """``jax.lax.ragged_dot(x, weight, sizes)`` for ``x [S, K]``, ``weight [E, K, N]``, ``sizes [E]`` (rows per
    group, in order; ``Σ sizes ≤ S``), computed in blocks (module docstring). Returns ``[S, N]``.

    ``starts [G]`` / ``weight_index [G]`` generalize the grouping to ``G`` groups of rows ``starts[g] …
    starts[g] + sizes[g] − 1`` (non-overlapping, in increasing order, gaps allowed) each multiplied by
    ``weight[weight_index[g]]``; rows in no group come out zero. The default is ``G = E`` contiguous groups
    from row 0, group ``e`` by ``weight[e]`` (``ragged_dot``'s contract).

    ``run_blocks``: the blocks are multiplied in consecutive runs of that many, every run after the first only if
    it holds a used block (``lax.cond``): for a buffer sized for more rows than it usually holds (an
    expert-parallel exchange's receive slots), the work follows the rows it holds at that granularity."""
    rows, _ = x.shape
    sizes = sizes.astype(jnp.int32)
    groups = sizes.shape[0]
    block = block_rows or block_rows_for(rows, groups)
    num_blocks = -(-rows // block) + groups
    if starts is None:
        starts = jnp.cumsum(sizes) - sizes
    starts = starts.astype(jnp.int32)
    ends = starts + sizes
    if weight_index is None:
        weight_index = jnp.arange(groups, dtype=jnp.int32)
    blocks = (sizes + block - 1) // block
    block_ends = jnp.cumsum(blocks)
    block_starts = block_ends - blocks

    index = jnp.arange(num_blocks, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(block_ends, index, side="right"), groups - 1).astype(jnp.int32)
    first = starts[group] + (index - block_starts[group]) * block
    row = first[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :]  # [n_b, B]
    used = (row < ends[group][:, None]) & (index < block_ends[-1])[:, None]
    x_blocks = jnp.where(used[..., None], x[jnp.clip(row, 0, rows - 1)], jnp.zeros((), x.dtype))
    block_weight = weight_index[group]
    if run_blocks is None or run_blocks >= num_blocks:
        y_blocks = _block_products(x_blocks, weight, block_weight, precision, preferred_element_type)
    else:
        y_blocks = _runs_of_block_products(x_blocks, weight, block_weight, block_ends[-1], run_blocks, precision,
                                           preferred_element_type)

    position = jnp.arange(rows, dtype=jnp.int32)
    # the last group starting at or before the row (an empty group sharing a start with the next is skipped)
    owner = jnp.clip(jnp.searchsorted(starts, position, side="right") - 1, 0, groups - 1).astype(jnp.int32)
    local = position - starts[owner]
    place = (block_starts[owner] + local // block) * block + local % block
    flat = y_blocks.reshape(num_blocks * block, -1)
    picked = flat[jnp.clip(place, 0, num_blocks * block - 1)]
    inside = (local >= 0) & (position < ends[owner])
    return jnp.where(inside[:, None], picked, jnp.zeros((), picked.dtype))


@functools.partial(jax.checkpoint, static_argnums=(3, 4), policy=jax.checkpoint_policies.nothing_saveable)
def _block_products(x_blocks: jax.Array, weight: jax.Array, block_weight: jax.Array, precision=None,
                    preferred_element_type=None) -> jax.Array:
    """``x_blocks [n_b, B, K] @ weight[block_weight] [n_b, K, N]``. The gathered weights (``n_b ≈ S/B + E`` copies
    of ``[K, N]``: about twice the experts' weights) are gathered again in the backward rather than kept from the
    forward: only the operands stay live."""
    return jnp.einsum("bik,bkn->bin", x_blocks, weight[block_weight], precision=precision,
                      preferred_element_type=preferred_element_type)


def _runs_of_block_products(x_blocks: jax.Array, weight: jax.Array, block_weight: jax.Array, used: jax.Array,
                            run_blocks: int, precision=None, preferred_element_type=None) -> jax.Array:
    """:func:`_block_products` in consecutive runs of ``run_blocks`` blocks, a run past the first ``used`` blocks
    (a prefix: groups' blocks are packed from block 0) skipped with zeros."""
    num_blocks = x_blocks.shape[0]
    bounds = [*range(0, num_blocks, max(run_blocks, 1)), num_blocks]
    # typed varying like the rows before the branches, so the cotangent's reduction over mesh axes the rows vary
    # along (data parallelism beside the experts) happens once, outside them: a collective inside a branch that
    # only some devices take never completes
    weight = varying_like(weight, x_blocks, block_weight, used)
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        if hi <= lo:
            continue
        run = lambda lo=lo, hi=hi: _block_products(x_blocks[lo:hi], weight, block_weight[lo:hi], precision,  # noqa: E731
                                                   preferred_element_type)
        if lo == 0:
            parts.append(run())
            continue
        shape = jax.eval_shape(run)
        parts.append(jax.lax.cond(lo < used, run, lambda shape=shape: varying_like(
            jnp.zeros(shape.shape, shape.dtype), x_blocks, block_weight, used, weight)))
    return jnp.concatenate(parts)


def varying_like(value: jax.Array, *sources: jax.Array) -> jax.Array:
    """``value`` typed as varying along every mesh axis any of ``sources`` varies along (inside ``shard_map``: both
    branches of a ``lax.cond`` must agree on it). Outside ``shard_map``, ``value``."""
    axes = set().union(*(_varying_axes(s) for s in sources)) - _varying_axes(value)
    return jax.lax.pcast(value, tuple(sorted(axes)), to="varying") if axes else value


def _varying_axes(value: jax.Array) -> frozenset:
    return frozenset(getattr(jax.typeof(value).manual_axis_type, "varying", frozenset()))

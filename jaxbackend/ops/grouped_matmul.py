"""A mixture-of-experts grouped matmul whose work grows with the rows, not with the number of experts.

``jax.lax.ragged_dot(x, w, sizes)`` multiplies rows ``start_e … start_e + n_e`` of ``x [S, K]`` by ``w[e] [K, N]``.
XLA's CPU backend expands it densely — every expert's product over all ``S`` rows, then a select — so its cost is
``E·S·K·N``: a 32-expert Mixtral step ran 12× slower than PyTorch eager. :func:`blocked_ragged_dot` computes the same
product in blocks of ``B`` rows that each belong to one group:

    group g holds c_g = ⌈n_g / B⌉ blocks;  U = Σ_g c_g ≤ ⌈S / B⌉ + G =: n_b   (U is data; n_b a static bound)
    block j of group g = rows start_g + j·B … start_g + j·B + B − 1, the rows past n_g masked
    y[block] = x[block] @ w[g]

so the work is ``U·B·K·N ≤ (S + G·B)·K·N`` — the rows' own work plus at most one partial block per group. ``B`` is
the power of two nearest below ``S / G`` within [16, 128] (:func:`block_rows_for`). Three ways to run them:

- ``"loop"`` (the CPU default): a ``fori_loop`` over the ``U`` blocks holding rows, one ``[B, K] × [K, N]`` matmul
  each, written in place in ``y``; a block's weights are read in place (``dynamic_slice``), never copied. The trip
  count is data, so the product has its own VJP (a ``while`` loop has no reverse-mode rule): one backward loop over
  the same blocks, ``dx[block] = dy[block] @ w[g]ᵀ`` and ``dw[g] += x[block]ᵀ @ dy[block]`` (fp32 accumulation for
  16-bit weights). On 2 CPU cores the forward and backward of ``[4096, 256] × [8, 256, 1024]`` take 35 ms against
  a dense ``[4096, 256] × [256, 1024]``'s 25 (the gathered path: 70).
- ``"gathered"`` (the default elsewhere: TPUs, GPUs for other dtypes): every one of the ``n_b`` blocks at once, as
  one batched matmul of ``n_b × [B, K] × [n_b, K, N]`` with each block's weights gathered (``n_b·K·N`` values, about
  twice the experts' weights; gathered again in the backward rather than kept). One kernel launch instead of ``U``
  small ones: on an H200 the whole Mixtral step of ``benchmarks/moe.py`` took 12.7 ms this way; the loop is
  unmeasured on a GPU.
- ``"pallas"`` (the default on GPUs for 16- and 32-bit floats, :func:`.grouped_gemm.chosen`):
  :mod:`jaxbackend.kernels.grouped_gemm`, a Pallas (Triton) grouped GEMM (one launch; its backward two) that
  reads the experts' weights tile by tile in place (nothing gathered or copied); a program writes one ``[B, b_N]``
  output tile, summing the products of the groups with rows in it — the same ``(S + G·B)·K·N`` bound on the work.
  Its values and gradients are checked in Pallas's interpret mode (``"pallas-interpret"``, on the CPU) and its CUDA
  lowering is checked to hold the Triton custom call, but it is **not timed on a GPU yet**: whether it beats the
  gathered path or reaches ``torch._grouped_mm`` is for ``benchmarks/grouped_matmul.py`` to say.

Nothing is dropped or capacity-limited: every row is computed exactly once, like PyTorch's ``_grouped_mm``; rows in
no group come out zero (PyTorch leaves them unwritten).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxbackend.kernels import grouped_gemm

MIN_BLOCK_ROWS = 16
MAX_BLOCK_ROWS = 128
METHOD: str | None = None
"""The method of :func:`blocked_ragged_dot` when its caller names none: ``"loop"``, ``"gathered"``, ``"pallas"``,
``"pallas-interpret"`` (the Pallas kernel interpreted: runs on the CPU, slowly; for tests), or ``None`` (the Pallas
kernel on a GPU where :func:`.grouped_gemm.chosen` says so, the loop on the CPU, gathered elsewhere)."""
METHODS = ("loop", "gathered", "pallas", "pallas-interpret")


def block_rows_for(rows: int, groups: int) -> int:
    """The block size: the power of two nearest below ``rows / groups``, within [16, 128]."""
    target = max(rows // max(groups, 1), 1)
    size = 1 << (target.bit_length() - 1)
    return max(MIN_BLOCK_ROWS, min(MAX_BLOCK_ROWS, size))


def block_count(sizes: jax.Array, block_rows: int) -> jax.Array:
    """``U = Σ_g ⌈sizes[g] / B⌉``: the blocks :func:`blocked_ragged_dot` multiplies (a scalar array)."""
    return ((sizes.astype(jnp.int32) + block_rows - 1) // block_rows).sum()


def blocked_ragged_dot(
    x: jax.Array,
    weight: jax.Array,
    sizes: jax.Array,
    *,
    block_rows: int | None = None,
    starts: jax.Array | None = None,
    weight_index: jax.Array | None = None,
    run_blocks: int | None = None,
    method: str | None = None,
    weight_transposed: bool = False,
    precision=None,
    preferred_element_type=None,
) -> jax.Array:
    """``jax.lax.ragged_dot(x, weight, sizes)`` for ``x [S, K]``, ``weight [E, K, N]``, ``sizes [E]`` (rows per
    group, in order; ``Σ sizes ≤ S``), computed block by block (module docstring). Returns ``[S, N]``.

    ``starts [G]`` / ``weight_index [G]`` generalize the grouping to ``G`` groups of rows ``starts[g] …
    starts[g] + sizes[g] − 1`` (non-overlapping, in increasing order, gaps allowed) each multiplied by
    ``weight[weight_index[g]]``; rows in no group come out zero. The default is ``G = E`` contiguous groups
    from row 0, group ``e`` by ``weight[e]`` (``ragged_dot``'s contract).

    ``weight_transposed``: ``weight`` is ``[E, N, K]`` and multiplies as its transpose (HF stores experts like
    ``nn.Linear``, ``[E, out, in]``, and transposes them for ``_grouped_mm``): the blocks read it in place, where
    transposing it first would copy every expert's weights before the loop and their gradient back after it.

    ``method``: ``"loop"``, ``"gathered"``, ``"pallas"`` or ``"pallas-interpret"`` (module docstring); ``None``:
    :data:`METHOD`, else the backend's default (:func:`default_method`).
    The loop runs only the blocks holding rows, so for a buffer sized for more rows than it usually holds (an
    expert-parallel exchange's receive slots) the work follows the rows it holds; the gathered path does so at the
    granularity of ``run_blocks`` (runs of that many blocks, every run after the first only if it holds a used
    block, ``lax.cond``). The Pallas kernel ignores ``run_blocks``: its programs for row tiles no group reaches only
    write zeros.

    Inside ``shard_map`` the rows and the weight are typed varying along the same mesh axes before the loops, so
    a cotangent's reduction over axes only the other operand varies along — the weight's over data parallelism
    beside the experts, the rows' over tensor parallelism inside them — happens outside, by ``pcast``'s
    transpose."""
    rows = x.shape[0]
    sizes = sizes.astype(jnp.int32)
    if starts is None:
        starts = jnp.cumsum(sizes) - sizes
    if weight_index is None:
        weight_index = jnp.arange(sizes.shape[0], dtype=jnp.int32)
    block = min(block_rows or block_rows_for(rows, sizes.shape[0]), rows)
    method = method or METHOD or default_method(x, weight)
    if method not in METHODS:
        raise ValueError(f"blocked_ragged_dot: method {method!r}; expected one of {', '.join(map(repr, METHODS))}")
    grouping = (sizes, starts.astype(jnp.int32), weight_index.astype(jnp.int32))
    x, weight = varying_like(x, weight, *grouping), varying_like(weight, x, *grouping)
    if method.startswith("pallas"):
        return grouped_gemm.grouped_gemm(
            x,
            weight,
            sizes,
            starts=grouping[1],
            weight_index=grouping[2],
            block_rows=block,
            weight_transposed=weight_transposed,
            precision=precision,
            out_dtype=preferred_element_type,
            interpret=method == "pallas-interpret",
        )
    if method == "gathered":
        return _gathered_product(
            x, weight, *grouping, block, run_blocks, weight_transposed, precision, preferred_element_type
        )
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(x, weight))
    return _grouped_product(x, weight, *grouping, block, weight_transposed, precision, out_dtype)


def default_method(x: jax.Array, weight: jax.Array) -> str:
    """The method when none is named: ``"pallas"`` on a GPU for the kernel's dtypes, ``"loop"`` on the CPU,
    ``"gathered"`` elsewhere."""
    if grouped_gemm.chosen(x, weight):
        return "pallas"
    return "loop" if jax.default_backend() == "cpu" else "gathered"


class _Blocks(NamedTuple):
    """The blocks (``n_b = ⌈S / B⌉ + G`` slots, the first ``used`` of them real): block ``b`` covers rows
    ``row_lo[b] … row_lo[b] + B − 1`` (clamped to fit in ``S``: ``slice_start[b]``), of which those below
    ``row_hi[b]`` are its group's, multiplied by ``weight[expert[b]]``; group ``g``'s blocks start at
    ``group_first_block[g]``."""

    slice_start: jax.Array
    row_lo: jax.Array
    row_hi: jax.Array
    expert: jax.Array
    used: jax.Array
    group_first_block: jax.Array


def _blocks(rows: int, sizes: jax.Array, starts: jax.Array, weight_index: jax.Array, block: int) -> _Blocks:
    groups = sizes.shape[0]
    count = (sizes + block - 1) // block
    block_ends = jnp.cumsum(count)
    block_starts = block_ends - count
    index = jnp.arange(-(-rows // block) + groups, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(block_ends, index, side="right"), groups - 1).astype(jnp.int32)
    first = starts[group] + (index - block_starts[group]) * block
    return _Blocks(
        slice_start=jnp.clip(first, 0, rows - block),
        row_lo=first,
        row_hi=jnp.minimum(starts[group] + sizes[group], first + block),
        expert=weight_index[group],
        used=block_ends[-1],
        group_first_block=block_starts,
    )


def _block_mask(blocks: _Blocks, b: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    start = blocks.slice_start[b]
    row = start + jnp.arange(block, dtype=jnp.int32)
    return start, (row >= blocks.row_lo[b]) & (row < blocks.row_hi[b])


def _dot(a: jax.Array, b: jax.Array, contract: tuple[int, int], precision, dtype) -> jax.Array:
    """``a`` and ``b`` (2-D) contracted over ``a``'s dim ``contract[0]`` and ``b``'s ``contract[1]``."""
    return jax.lax.dot_general(
        a, b, (((contract[0],), (contract[1],)), ((), ())), precision=precision, preferred_element_type=dtype
    ).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _grouped_product(x, weight, sizes, starts, weight_index, block, transposed, precision, out_dtype):
    blocks = _blocks(x.shape[0], sizes, starts, weight_index, block)

    def body(b, y):
        start, mask = _block_mask(blocks, b, block)
        # y = x @ w[e] ([K, N]: contract x's dim 1 with w's dim 0) or x @ w[e]ᵀ ([N, K]: with its dim 1)
        y_block = _dot(
            jax.lax.dynamic_slice_in_dim(x, start, block),
            weight[blocks.expert[b]],
            (1, 1 if transposed else 0),
            precision,
            out_dtype,
        )
        return jax.lax.dynamic_update_slice_in_dim(
            y, jnp.where(mask[:, None], y_block, jax.lax.dynamic_slice_in_dim(y, start, block)), start, 0
        )

    columns = weight.shape[1] if transposed else weight.shape[2]
    y = varying_like(jnp.zeros((x.shape[0], columns), out_dtype), x, weight, blocks.used)
    return jax.lax.fori_loop(0, blocks.used, body, y)


def _grouped_product_forward(x, weight, sizes, starts, weight_index, block, transposed, precision, out_dtype):
    return (
        _grouped_product(x, weight, sizes, starts, weight_index, block, transposed, precision, out_dtype),
        (x, weight, sizes, starts, weight_index),
    )


def _grouped_product_backward(block, transposed, precision, out_dtype, residuals, dy):
    x, weight, sizes, starts, weight_index = residuals
    blocks = _blocks(x.shape[0], sizes, starts, weight_index, block)
    accumulate = jnp.float32 if jnp.dtype(weight.dtype).itemsize < 4 else weight.dtype

    def body(b, carry):
        dx, dw = carry
        start, mask = _block_mask(blocks, b, block)
        expert = blocks.expert[b]
        dy_block = jnp.where(mask[:, None], jax.lax.dynamic_slice_in_dim(dy, start, block), 0)
        x_block = jax.lax.dynamic_slice_in_dim(x, start, block)
        # dx = dy @ w[e]ᵀ (w[e] [K, N]: contract dy's dim 1 with its dim 1) or dy @ w[e] ([N, K]: with its dim 0)
        dx_block = _dot(dy_block, weight[expert], (1, 0 if transposed else 1), precision, x.dtype)
        dx = jax.lax.dynamic_update_slice_in_dim(
            dx, jnp.where(mask[:, None], dx_block, jax.lax.dynamic_slice_in_dim(dx, start, block)), start, 0
        )
        # dw[e] += xᵀ @ dy ([K, N]) or dyᵀ @ x ([N, K]): the rows contracted
        dw_block = (
            _dot(dy_block, x_block, (0, 0), precision, accumulate)
            if transposed
            else _dot(x_block, dy_block, (0, 0), precision, accumulate)
        )
        return dx, dw.at[expert].add(dw_block)

    carry = (
        varying_like(jnp.zeros_like(x), x, weight, dy, blocks.used),
        varying_like(jnp.zeros(weight.shape, accumulate), x, weight, dy, blocks.used),
    )
    dx, dw = jax.lax.fori_loop(0, blocks.used, body, carry)
    return dx, dw.astype(weight.dtype), None, None, None


_grouped_product.defvjp(_grouped_product_forward, _grouped_product_backward)


def _gathered_product(
    x, weight, sizes, starts, weight_index, block, run_blocks, transposed, precision, preferred_element_type
) -> jax.Array:
    """The ``"gathered"`` path: every block's product in one batched matmul (module docstring)."""
    rows = x.shape[0]
    groups = sizes.shape[0]
    num_blocks = -(-rows // block) + groups
    blocks = _blocks(rows, sizes, starts, weight_index, block)
    row = blocks.row_lo[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :]  # [n_b, B]
    used = (row < blocks.row_hi[:, None]) & (jnp.arange(num_blocks) < blocks.used)[:, None]
    x_blocks = jnp.where(used[..., None], x[jnp.clip(row, 0, rows - 1)], jnp.zeros((), x.dtype))
    block_weight = blocks.expert
    if run_blocks is None or run_blocks >= num_blocks:
        y_blocks = _block_products(x_blocks, weight, block_weight, transposed, precision, preferred_element_type)
    else:
        y_blocks = _runs_of_block_products(
            x_blocks, weight, block_weight, blocks.used, run_blocks, transposed, precision, preferred_element_type
        )

    position = jnp.arange(rows, dtype=jnp.int32)
    # the last group starting at or before the row (an empty group sharing a start with the next is skipped)
    owner = jnp.clip(jnp.searchsorted(starts, position, side="right") - 1, 0, groups - 1).astype(jnp.int32)
    local = position - starts[owner]
    place = (blocks.group_first_block[owner] + local // block) * block + local % block
    flat = y_blocks.reshape(num_blocks * block, -1)
    picked = flat[jnp.clip(place, 0, num_blocks * block - 1)]
    inside = (local >= 0) & (local < sizes[owner])
    return jnp.where(inside[:, None], picked, jnp.zeros((), picked.dtype))


@functools.partial(jax.checkpoint, static_argnums=(3, 4, 5), policy=jax.checkpoint_policies.nothing_saveable)
def _block_products(
    x_blocks: jax.Array,
    weight: jax.Array,
    block_weight: jax.Array,
    transposed: bool = False,
    precision=None,
    preferred_element_type=None,
) -> jax.Array:
    """``x_blocks [n_b, B, K] @ weight[block_weight] [n_b, K, N]``. The gathered weights (``n_b ≈ S/B + E`` copies
    of ``[K, N]``: about twice the experts' weights) are gathered again in the backward rather than kept from the
    forward: only the operands stay live."""
    return jnp.einsum(
        "bik,bnk->bin" if transposed else "bik,bkn->bin",
        x_blocks,
        weight[block_weight],
        precision=precision,
        preferred_element_type=preferred_element_type,
    )


def _runs_of_block_products(
    x_blocks: jax.Array,
    weight: jax.Array,
    block_weight: jax.Array,
    used: jax.Array,
    run_blocks: int,
    transposed: bool = False,
    precision=None,
    preferred_element_type=None,
) -> jax.Array:
    """:func:`_block_products` in consecutive runs of ``run_blocks`` blocks, a run past the first ``used`` blocks
    (a prefix: groups' blocks are packed from block 0) skipped with zeros."""
    num_blocks = x_blocks.shape[0]
    bounds = [*range(0, num_blocks, max(run_blocks, 1)), num_blocks]
    # the weight is typed varying like the rows before this (blocked_ragged_dot), so the cotangent's reduction over
    # mesh axes the rows vary along happens once, outside the branches: a collective inside a branch that only
    # some devices take never completes
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        if hi <= lo:
            continue
        run = lambda lo=lo, hi=hi: _block_products(
            x_blocks[lo:hi],
            weight,
            block_weight[lo:hi],
            transposed,
            precision,
            preferred_element_type,
        )
        if lo == 0:
            parts.append(run())
            continue
        shape = jax.eval_shape(run)
        parts.append(
            jax.lax.cond(
                lo < used,
                run,
                lambda shape=shape: varying_like(
                    jnp.zeros(shape.shape, shape.dtype), x_blocks, block_weight, used, weight
                ),
            )
        )
    return jnp.concatenate(parts)


def varying_like(value: jax.Array, *sources: jax.Array) -> jax.Array:
    """``value`` typed as varying along every mesh axis any of ``sources`` varies along (inside ``shard_map``: a
    loop's carry and both branches of a ``lax.cond`` must agree on it). Outside ``shard_map``, ``value``."""
    axes = set().union(*(_varying_axes(s) for s in sources)) - _varying_axes(value)
    return jax.lax.pcast(value, tuple(sorted(axes)), to="varying") if axes else value


def _varying_axes(value: jax.Array) -> frozenset:
    return frozenset(getattr(jax.typeof(value).manual_axis_type, "varying", frozenset()))

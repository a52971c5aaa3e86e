"""A grouped GEMM for mixture-of-experts in Pallas (Triton on GPUs): each expert's weight read in place, tile by tile.

The product, for ``x [S, K]``, ``w [E, K, N]`` (or stored ``[E, N, K]``, HF's ``[E, out, in]``: ``transposed``) and
``G`` groups of rows ``a_g … b_g − 1`` (``b_g = a_g + n_g``; in increasing order, not overlapping, gaps allowed), group
``g`` multiplied by ``w[e_g]`` (``e_g = weight_index[g]``, by default ``g``)::

    y[r] = x[r] @ w[e_g]   for a_g ≤ r < b_g;   y[r] = 0 for a row in no group          (fp32 accumulation)

Forward (:func:`_forward_call`): the rows are cut into ``T = ⌈S / B⌉`` row tiles of ``B`` rows; program ``(t, j)``
writes ``y[t·B … t·B + B − 1, j·b_N …]`` exactly once, summing over the *visits* of tile ``t`` — one per group with rows
in it (:func:`_tile_visits`: ``Σ_g (tiles g touches) ≤ T + G`` visits in all, so the work is at most
``(S + G·B)·K·N``, the blocked loop's bound)::

    y_tile = Σ_{visits v of t} mask_v ⊙ Σ_k x[tile, k-tile] @ w[e_v][k-tile, j-tile],   mask_v: rows in [a_v, b_v)

The visits of a tile are a contiguous run of a sorted list (the groups are in row order), so the schedule is three
``[T + G]`` arrays (row range, weight) and a ``[T + 1]`` array of where each tile's run starts, computed from ``sizes``
by ``searchsorted`` (``method="sort"``: no ``while`` loop, which XLA:GPU steps from the host) and read by the
programs as scalars. Every output tile is written by one program: no masked
stores, no races, no zero-filling pass; a tile no group touches is written zero.

Backward (``jax.custom_vjp``), for the cotangent ``dy [S, N]``:

- ``dx = dy @ w[e_g]ᵀ`` row by row: the forward kernel again, the weight read with the other layout (``[E, K, N]`` is
  ``dy``'s ``[E, out, in]``), so no transposed copy;
- ``dw[e] = Σ_{g: e_g = e} x[a_g … b_g − 1]ᵀ @ dy[a_g … b_g − 1]`` (:func:`_weight_grad_call`): program
  ``(e, i, j)`` writes the ``[b_K, b_N]`` tile ``(i, j)`` of ``dw[e]``, looping over ``e``'s *blocks* of ``B`` rows
  of one group (:func:`_expert_blocks`: ``⌈n_g / B⌉`` per group, sorted by weight; at most ``T + G``), rows outside
  the block's group masked to zero in both operands. An expert with no rows gets zero.

Tiles: ``B`` a power of two in [16, 128] (the caller's block rows, rounded down), ``b_K = 64`` and ``b_N = 128`` (less
for a smaller dim; Triton's blocks are powers of two). ``S``, ``K`` and ``N`` are padded to multiples of their tiles
when they are not (a copy; MoE widths are multiples of 128), so no program reads past an array: Triton's loads are
unchecked. The kernels are untimed on a GPU (``benchmarks/grouped_matmul.py`` times them against
``torch._grouped_mm``); on the CPU they run only in Pallas's interpret mode, which is how the tests check them.
Inside a ``shard_map`` they lower for CUDA, but JAX 0.10's interpreter rejects them there (it slices the varying
operands with invariant program ids), so interpret mode is for unsplit products.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from jax.lax import PrecisionLike
from jax.typing import DTypeLike

DEPTH_TILE = 64
"""``b_K``: the contracted dim's tile."""
COLUMN_TILE = 128
"""``b_N``: the output columns' tile (and ``dw``'s second tile)."""
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _compiler_params(dtype: DTypeLike) -> pl_triton.CompilerParams:
    """Triton's launch: 3 pipeline stages for 16-bit operands, 2 for 32-bit ones (the weight gradient's stages of
    ``[B, b_K]`` and ``[B, b_N]`` fp32 tiles, 96 KiB each at ``B = 128``, must fit a H100/H200's 227 KiB of shared
    memory). A guess until timed on a GPU."""
    return pl_triton.CompilerParams(num_warps=4, num_stages=3 if jnp.dtype(dtype).itemsize <= 2 else 2)


def chosen(x: jax.Array, weight: jax.Array, platform: str | None = None) -> bool:
    """Whether the grouped matmul runs this kernel by default: on a GPU (Triton), for 16- and 32-bit floats."""
    platform = platform or jax.default_backend()
    return platform == "gpu" and {jnp.dtype(x.dtype), jnp.dtype(weight.dtype)} <= set(KERNEL_DTYPES)


@dataclasses.dataclass(frozen=True)
class _Config:
    """The static part of one product: the row tile ``B``, the weight's layout, the dot's precision, the output
    dtype and whether Pallas interprets the kernels (the CPU)."""

    block: int
    transposed: bool
    precision: PrecisionLike
    out_dtype: jnp.dtype
    interpret: bool


def grouped_gemm(
    x: jax.Array,
    weight: jax.Array,
    sizes: jax.Array,
    *,
    starts: jax.Array | None = None,
    weight_index: jax.Array | None = None,
    block_rows: int = 64,
    weight_transposed: bool = False,
    precision: PrecisionLike = None,
    out_dtype: DTypeLike | None = None,
    interpret: bool = False,
) -> jax.Array:
    """``y [S, N]``: rows ``starts[g] … starts[g] + sizes[g] − 1`` of ``x [S, K]`` times ``weight[weight_index[g]]``
    (``[K, N]``, or ``[N, K]`` read as its transpose with ``weight_transposed``), other rows zero (module
    docstring). ``starts`` defaults to the groups packed from row 0, ``weight_index`` to ``g``."""
    sizes = sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes if starts is None else starts.astype(jnp.int32)
    if weight_index is None:
        weight_index = jnp.arange(sizes.shape[0], dtype=jnp.int32)
    rows, columns = x.shape[0], weight.shape[1 if weight_transposed else 2]
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(x, weight))
    if 0 in (rows, columns, x.shape[1], sizes.shape[0]):
        return jnp.zeros((rows, columns), out_dtype)
    block = max(16, min(128, 1 << (max(block_rows, 1).bit_length() - 1)))
    config = _Config(block, weight_transposed, precision, out_dtype, interpret)
    return _product(x, weight, sizes, starts, weight_index.astype(jnp.int32), config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _product(x, weight, sizes, starts, weight_index, config: _Config):
    return _forward_call(x, weight, _grouping(sizes, starts, weight_index), config)


def _product_forward(x, weight, sizes, starts, weight_index, config: _Config):
    y = _product(x, weight, sizes, starts, weight_index, config)
    return y, (x, weight, sizes, starts, weight_index)


def _product_backward(config: _Config, residuals, dy):
    x, weight, sizes, starts, weight_index = residuals
    grouping = _grouping(sizes, starts, weight_index)
    dx_config = dataclasses.replace(config, transposed=not config.transposed, out_dtype=jnp.dtype(x.dtype))
    dx = _forward_call(dy, weight, grouping, dx_config)
    dw = _weight_grad_call(x, dy, weight, grouping, config)
    return dx, dw, None, None, None


_product.defvjp(_product_forward, _product_backward)


class _Grouping(NamedTuple):
    sizes: jax.Array
    starts: jax.Array
    weight_index: jax.Array


def _grouping(sizes: jax.Array, starts: jax.Array, weight_index: jax.Array) -> _Grouping:
    return _Grouping(sizes.astype(jnp.int32), starts.astype(jnp.int32), weight_index.astype(jnp.int32))


def _tile_visits(grouping: _Grouping, tiles: int, block: int) -> tuple[jax.Array, ...]:
    """The forward's schedule: ``first [T + 1]`` (tile ``t``'s visits are ``first[t] … first[t + 1] − 1``) and, per
    visit (``T + G`` slots, the used ones first), the group's rows ``[row_lo, row_hi)`` and its weight."""
    sizes, starts, weight_index = grouping
    ends = starts + sizes
    first_tile = starts // block
    count = jnp.where(sizes > 0, (ends - 1) // block - first_tile + 1, 0)
    visit_end = jnp.cumsum(count)
    visit = jnp.arange(tiles + sizes.shape[0], dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(visit_end, visit, side="right", method="sort"), sizes.shape[0] - 1)
    tile = jnp.where(visit < visit_end[-1], first_tile[group] + visit - (visit_end - count)[group], tiles)
    first = jnp.searchsorted(tile, jnp.arange(tiles + 1, dtype=jnp.int32), side="left", method="sort").astype(jnp.int32)
    return first, starts[group], ends[group], weight_index[group]


def _expert_blocks(grouping: _Grouping, experts: int, rows: int, block: int) -> tuple[jax.Array, ...]:
    """The weight gradient's schedule: ``first [E + 1]`` (expert ``e``'s blocks are ``first[e] … first[e + 1] − 1``)
    and, per block (``⌈rows / B⌉ + G`` slots sorted by weight, unused ones last), where its ``B`` rows start (clamped
    into the array) and the rows ``[row_lo, row_hi)`` of its group among them."""
    sizes, starts, weight_index = grouping
    count = (sizes + block - 1) // block
    block_end = jnp.cumsum(count)
    index = jnp.arange(-(-rows // block) + sizes.shape[0], dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(block_end, index, side="right", method="sort"), sizes.shape[0] - 1)
    row_lo = starts[group] + (index - (block_end - count)[group]) * block
    row_hi = jnp.minimum(starts[group] + sizes[group], row_lo + block)
    key = jnp.where(index < block_end[-1], weight_index[group], experts)
    order = jnp.argsort(key, stable=True)
    first = jnp.searchsorted(key[order], jnp.arange(experts + 1, dtype=jnp.int32), side="left", method="sort").astype(
        jnp.int32
    )
    return first, jnp.clip(row_lo, 0, rows - block)[order], row_lo[order], row_hi[order]


def _tile(dim: int, cap: int) -> int:
    """A power-of-two tile for a dim of ``dim``: ``cap``, or the dim rounded up to a power of two (at least 16)."""
    return min(cap, max(16, 1 << (dim - 1).bit_length()))


def _pad(a: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if a.shape == shape:
        return a
    return jnp.pad(a, [(0, want - have) for have, want in zip(a.shape, shape)])


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _out_struct(shape: tuple[int, ...], dtype: DTypeLike, *operands: jax.Array) -> jax.ShapeDtypeStruct:
    """A kernel's output type: inside ``shard_map``, varying along every mesh axis an operand varies along."""
    types = [jax.typeof(a).manual_axis_type for a in operands]
    varying = frozenset().union(*(t.varying for t in types))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=types[0].update(varying=varying))


def tile_dot(a: jax.Array, b: jax.Array, contract: tuple[int, int], precision: PrecisionLike) -> jax.Array:
    """The product of two 2-D tiles inside a Pallas kernel contracting dim ``contract[0]`` of ``a`` with
    ``contract[1]`` of ``b``, accumulated in float32 (``pl.dot`` is deprecated since JAX 0.11 and gone in 0.12)."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _forward_call(x: jax.Array, weight: jax.Array, grouping: _Grouping, config: _Config) -> jax.Array:
    """``y`` (module docstring): grid ``T × N / b_N``, program ``(t, j)`` summing tile ``t``'s visits."""
    rows, depth = x.shape
    columns = weight.shape[1 if config.transposed else 2]
    block, b_k, b_n = config.block, _tile(depth, DEPTH_TILE), _tile(columns, COLUMN_TILE)
    rows_p, depth_p, columns_p = _round_up(rows, block), _round_up(depth, b_k), _round_up(columns, b_n)
    x = _pad(x, (rows_p, depth_p))
    weight = _pad(weight, (weight.shape[0], *((columns_p, depth_p) if config.transposed else (depth_p, columns_p))))
    compute = jnp.result_type(x, weight)
    schedule = _tile_visits(grouping, rows_p // block, block)

    def kernel(first_ref, lo_ref, hi_ref, expert_ref, x_ref, w_ref, y_ref):
        t, j = pl.program_id(0), pl.program_id(1)
        row = t * block + jax.lax.broadcasted_iota(jnp.int32, (block, b_n), 0)

        def visit(v, acc):
            expert = expert_ref[v]

            def depth_step(k, part):
                x_tile = x_ref[pl.ds(t * block, block), pl.ds(k * b_k, b_k)].astype(compute)
                if config.transposed:  # w[e] [N, K]: its tile (j, k), contracted over its dim 1
                    w_tile = w_ref[expert, pl.ds(j * b_n, b_n), pl.ds(k * b_k, b_k)].astype(compute)
                    return part + tile_dot(x_tile, w_tile, (1, 1), config.precision)
                w_tile = w_ref[expert, pl.ds(k * b_k, b_k), pl.ds(j * b_n, b_n)].astype(compute)
                return part + tile_dot(x_tile, w_tile, (1, 0), config.precision)

            part = jax.lax.fori_loop(0, depth_p // b_k, depth_step, jnp.zeros((block, b_n), jnp.float32))
            return acc + jnp.where((row >= lo_ref[v]) & (row < hi_ref[v]), part, 0.0)

        acc = jax.lax.fori_loop(first_ref[t], first_ref[t + 1], visit, jnp.zeros((block, b_n), jnp.float32))
        y_ref[...] = acc.astype(y_ref.dtype)

    whole = pl.BlockSpec(memory_space=pl.ANY)
    y = pl.pallas_call(
        kernel,
        out_shape=_out_struct((rows_p, columns_p), config.out_dtype, *schedule, x, weight),
        grid=(rows_p // block, columns_p // b_n),
        in_specs=[whole] * 6,
        out_specs=pl.BlockSpec((block, b_n), lambda t, j: (t, j)),
        compiler_params=_compiler_params(compute),
        interpret=config.interpret,
        name="grouped_gemm",
    )(*schedule, x, weight)
    return y[:rows, :columns]


def _weight_grad_call(
    x: jax.Array, dy: jax.Array, weight: jax.Array, grouping: _Grouping, config: _Config
) -> jax.Array:
    """``dw`` (module docstring): grid ``E × K / b_K × N / b_N``, program ``(e, i, j)`` summing ``e``'s blocks."""
    (rows, depth), columns, experts = x.shape, dy.shape[1], weight.shape[0]
    block, b_k, b_n = config.block, _tile(depth, DEPTH_TILE), _tile(columns, COLUMN_TILE)
    rows_p, depth_p, columns_p = _round_up(rows, block), _round_up(depth, b_k), _round_up(columns, b_n)
    x, dy = _pad(x, (rows_p, depth_p)), _pad(dy, (rows_p, columns_p))
    compute = jnp.result_type(x, dy)
    schedule = _expert_blocks(grouping, experts, rows_p, block)

    def kernel(first_ref, start_ref, lo_ref, hi_ref, x_ref, dy_ref, dw_ref):
        e, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)

        def accumulate(b, acc):
            start = start_ref[b]
            row = start + jax.lax.broadcasted_iota(jnp.int32, (block, 1), 0)
            inside = (row >= lo_ref[b]) & (row < hi_ref[b])
            x_tile = jnp.where(inside, x_ref[pl.ds(start, block), pl.ds(i * b_k, b_k)].astype(compute), 0)
            dy_tile = jnp.where(inside, dy_ref[pl.ds(start, block), pl.ds(j * b_n, b_n)].astype(compute), 0)
            if config.transposed:  # dw[e] [N, K]: dyᵀ @ x
                return acc + tile_dot(dy_tile, x_tile, (0, 0), config.precision)
            return acc + tile_dot(x_tile, dy_tile, (0, 0), config.precision)

        shape = (b_n, b_k) if config.transposed else (b_k, b_n)
        acc = jax.lax.fori_loop(first_ref[e], first_ref[e + 1], accumulate, jnp.zeros(shape, jnp.float32))
        dw_ref[...] = acc.astype(dw_ref.dtype)

    whole = pl.BlockSpec(memory_space=pl.ANY)
    if config.transposed:
        out_shape, out_spec = (experts, columns_p, depth_p), pl.BlockSpec((None, b_n, b_k), lambda e, i, j: (e, j, i))
    else:
        out_shape, out_spec = (experts, depth_p, columns_p), pl.BlockSpec((None, b_k, b_n), lambda e, i, j: (e, i, j))
    dw = pl.pallas_call(
        kernel,
        out_shape=_out_struct(out_shape, weight.dtype, *schedule, x, dy),
        grid=(experts, depth_p // b_k, columns_p // b_n),
        in_specs=[whole] * 6,
        out_specs=out_spec,
        compiler_params=_compiler_params(compute),
        interpret=config.interpret,
        name="grouped_gemm_weight_grad",
    )(*schedule, x, dy)
    return dw[:, : weight.shape[1], : weight.shape[2]]

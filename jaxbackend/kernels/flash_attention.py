"""Flash attention for one block, in Pallas: the block's output and its log-sum-exp, and their VJP.

The contract is the block of :mod:`jaxbackend.ops.context_attention`: ``q [B, H, L, E]``, ``k [B, Hk, S, E]``,
``v [B, Hk, S, F]`` with ``H = G·Hk`` (query head ``n`` reads key head ``n // G``), scores ``S = Q Kᵀ·scale``
and, per query row ``r``, the keys ``c`` it may see: all of them (``offset=None``) or ``c ≤ r + δ``
(``offset=δ``, causal within the block). It returns

    lse_r = log Σ_c exp(S_rc)                (float32; −inf for a row that sees no key)
    out_r = Σ_c exp(S_rc − lse_r) V_c        (``out_dtype``, the inputs' dtype unless asked; 0 for such a row)

**Forward** (:func:`_forward_kernel`, one program per batch, query head and tile of ``block_q`` rows): the online
softmax over tiles of ``block_k`` keys, with running max ``m``, sum ``ℓ`` and unnormalized output ``A``::

    m' = max(m, rowmax S_j)    ℓ' = e^{m−m'} ℓ + rowsum e^{S_j − m'}    A' = e^{m−m'} A + e^{S_j − m'} V_j

then ``out = A/ℓ`` and ``lse = m + log ℓ``. A causal tile stops at the last key tile its last row sees.

**Backward.** With ``P = exp(S − lse)`` recomputed from the saved statistics, the cotangents ``dO`` of ``out`` and
``dlse`` of ``lse``, and ``δ_r = rowsum(dO ∘ O)_r − dlse_r``::

    dV = Pᵀ dO     dP = dO Vᵀ     dS = P ∘ (dP − δ)     dQ = dS K·scale     dK = dSᵀ Q·scale

(``∂lse_r/∂S_rc = P_rc``, so the ``dlse`` cotangent adds ``P ∘ dlse`` to ``dS``.) Two kernels compute them:
:func:`_dq_kernel` (one program per query tile, a loop over key tiles) and :func:`_dkv_kernel` (one program per
key/value head and tile of ``block_k`` keys, a loop over the ``G`` query heads that read it and their query tiles
— the sum over the group happens inside). :func:`flash_block_grads` takes ``δ`` as an operand, so the
context-parallel ring's own VJP, whose ``lse`` and ``rowsum(dO ∘ O)`` are the whole sequence's, calls the same
kernels; :func:`flash_block` is a ``custom_vjp`` whose cotangents flow through both outputs.

**Shapes.** Tiles are powers of two (Triton's loads need them): ``block_q``/``block_k`` (default
:data:`BLOCK_Q`, :data:`BLOCK_K`, shrunk to the next power of two ≥ 16 of a short sequence). ``L`` and ``S`` are
zero-padded up to a multiple of the tile (padded keys are masked, padded query rows carry ``lse = −inf`` and are
dropped), the head dims ``E`` and ``F`` (``E ≠ F`` allowed) up to a power of two ≥ 16; nothing is copied when
they already are. Scores, statistics and accumulators are float32; products take the inputs' dtype (``P`` and
``dS`` are cast to it) with :func:`jaxbackend.precision.dot_precision`'s algorithm.

**Where it runs.** On GPUs through the Triton backend (``pltriton.CompilerParams``; the Mosaic GPU default does not
take this kernel's loads); elsewhere only in Pallas's interpret mode (``interpret=True``), which is how the tests
check it on the CPU. :func:`supported` is the predicate the ops check before choosing it. The tile sizes and warps
are untuned: the kernel has not been timed on a GPU yet (``benchmarks/attention_gpu.py`` times it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxbackend import precision
from jaxbackend.kernels.grouped_gemm import tile_dot

BLOCK_Q = 64
"""Query rows per tile (a power of two)."""
BLOCK_K = 64
"""Keys per tile (a power of two)."""
MAX_HEAD_DIM = 256
"""The largest head dim (``E`` or ``F``) the kernel takes: its tiles live in registers and shared memory."""
GPU_PLATFORMS = ("gpu", "cuda")
"""Platforms the kernel is compiled for (Triton on NVIDIA GPUs); elsewhere it only runs interpreted."""
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """The static facts of one call (hashable: the ``custom_vjp``'s non-differentiable argument)."""

    scale: float
    offset: int | None
    block_q: int
    block_k: int
    interpret: bool
    out_dtype: jnp.dtype | None
    dot: jax.lax.Precision | jax.lax.DotAlgorithmPreset
    preload: bool = False
    """Interpreted inside a ``shard_map`` that checks varying types: the kernels read the operands their loops
    slice up front, as values (the interpreter evaluates a loop traced on untyped refs with typed blocks, and
    ``while_loop`` rejects the mismatch); compiled, they slice the refs."""

    def compiler_params(self, width: int) -> pltriton.CompilerParams:
        return pltriton.CompilerParams(num_warps=4 if width <= 64 else 8, num_stages=2)


def supported(
    q: jax.Array | jax.ShapeDtypeStruct, k: jax.Array | jax.ShapeDtypeStruct, v: jax.Array | jax.ShapeDtypeStruct
) -> bool:
    """Whether the kernel takes these operands: 4-d, one float dtype of :data:`DTYPES`, ``k`` and ``v`` alike
    but for their head dim, query heads a multiple of key heads, head dims ≤ :data:`MAX_HEAD_DIM`."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or not q.dtype == k.dtype == v.dtype:
        return False
    if q.dtype not in DTYPES or k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        return False
    return q.shape[1] % k.shape[1] == 0 and max(q.shape[-1], v.shape[-1]) <= MAX_HEAD_DIM


def compiled_for(platform: str) -> bool:
    """Whether the kernel compiles for ``platform`` (else it can only be interpreted)."""
    return platform in GPU_PLATFORMS


def flash_block(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    scale: float,
    offset: int | None = None,
    out_dtype: jnp.dtype | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``(out [B, H, L, F], lse [B, H, L] float32)`` of one block (module docstring), differentiable in both."""
    _check(q, k, v, block_q, block_k)
    return _flash(q, k, v, _tiling(q, k, scale, offset, out_dtype, block_q, block_k, interpret))


def flash_block_grads(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    d_out: jax.Array,
    lse: jax.Array,
    delta: jax.Array,
    *,
    scale: float,
    offset: int | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(dq, dk, dv)`` in float32 from the cotangent ``d_out [B, H, L, F]`` and the row statistics ``lse`` and
    ``delta`` ``[B, H, L]`` (``δ`` of the module docstring: ``rowsum(dO ∘ O) − dlse``)."""
    _check(q, k, v, block_q, block_k)
    tiling = _tiling(q, k, scale, offset, None, block_q, block_k, interpret)
    return _backward(q, k, v, d_out, lse, delta, tiling)


def _check(q: jax.Array, k: jax.Array, v: jax.Array, block_q: int, block_k: int) -> None:
    if not supported(q, k, v):
        raise ValueError(
            f"flash_block takes q [B, H, L, E], k [B, Hk, S, E], v [B, Hk, S, F] of one dtype of {DTYPES}, "
            f"H a multiple of Hk, head dims ≤ {MAX_HEAD_DIM}; got {q.shape} {q.dtype}, {k.shape} {k.dtype}, "
            f"{v.shape} {v.dtype}"
        )
    for name, block in (("block_q", block_q), ("block_k", block_k)):
        if block < 16 or block & (block - 1):
            raise ValueError(f"{name} must be a power of two ≥ 16; got {block}")


def _tiling(q, k, scale, offset, out_dtype, block_q, block_k, interpret) -> _Tiling:
    tile = lambda block, length: min(block, _pow2(length))
    return _Tiling(
        scale=float(scale),
        offset=None if offset is None else int(offset),
        block_q=tile(block_q, q.shape[2]),
        block_k=tile(block_k, k.shape[2]),
        interpret=interpret,
        out_dtype=None if out_dtype is None else jnp.dtype(out_dtype),
        dot=precision.dot_precision(q, k),
    )


def _pow2(n: int) -> int:
    """The next power of two ≥ ``max(n, 16)`` (Triton's smallest product tile)."""
    return max(16, 1 << (n - 1).bit_length())


def _pad(x: jax.Array, sizes: dict[int, int], value: float = 0.0) -> jax.Array:
    """``x`` padded at the end of each dim in ``sizes`` up to that size (``x`` itself when nothing grows)."""
    widths = [(0, sizes.get(dim, n) - n) for dim, n in enumerate(x.shape)]
    return x if not any(w for _, w in widths) else jnp.pad(x, widths, constant_values=value)


def _rounded(n: int, tile: int) -> int:
    return -(-n // tile) * tile


def _alike(*operands: jax.Array) -> tuple[list[jax.Array], object]:
    """The operands typed as varying along every mesh axis any of them varies along (inside a ``shard_map``
    checking it, ``pallas_call`` needs its outputs' type spelled out), and that type, for the outputs."""
    varying = [frozenset(getattr(jax.typeof(x).manual_axis_type, "varying", ())) for x in operands]
    axes = frozenset().union(*varying)
    alike = [
        jax.lax.pcast(x, tuple(sorted(axes - v)), to="varying") if axes - v else x for x, v in zip(operands, varying)
    ]
    return alike, jax.typeof(alike[0]).manual_axis_type


def _preloading(t: _Tiling, operand: jax.Array) -> _Tiling:
    varying = getattr(jax.typeof(operand).manual_axis_type, "varying", ())
    return dataclasses.replace(t, preload=True) if t.interpret and varying else t


def _rows(source, start, size: int, t: _Tiling):
    """Rows ``[start, start + size)`` of a ref, or of its value read up front (:attr:`_Tiling.preload`)."""
    if t.preload:
        return jax.lax.dynamic_slice_in_dim(source, start, size, axis=0)
    return source[pl.ds(start, size)]


def _source(ref, t: _Tiling):
    """What a kernel's loop slices: the ref, or its value (:attr:`_Tiling.preload`)."""
    return ref[...] if t.preload else ref


# --- the custom VJP ------------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q: jax.Array, k: jax.Array, v: jax.Array, tiling: _Tiling) -> tuple[jax.Array, jax.Array]:
    return _forward(q, k, v, tiling)


def _flash_fwd(q, k, v, tiling):
    out, lse = _forward(q, k, v, tiling)
    return (out, lse), (q, k, v, out, lse)


def _flash_bwd(tiling, residuals, cotangents):
    q, k, v, out, lse = residuals
    d_out, d_lse = cotangents
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse
    dq, dk, dv = _backward(q, k, v, d_out, lse, delta, tiling)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_flash.defvjp(_flash_fwd, _flash_bwd)


# --- the wrappers: padding, grids, block specs ---------------------------------------------------------------------


def _forward(q, k, v, t: _Tiling):
    (b, h, length, e), (hk, n_keys, f) = q.shape, (k.shape[1], k.shape[2], v.shape[-1])
    lp, sp, ep, fp = _rounded(length, t.block_q), _rounded(n_keys, t.block_k), _pow2(e), _pow2(f)
    q = _pad(q, {2: lp, 3: ep})
    k, v = _pad(k, {2: sp, 3: ep}), _pad(v, {2: sp, 3: fp})
    group = h // hk
    (q, k, v), manual = _alike(q, k, v)
    t = _preloading(t, q)
    kernel = functools.partial(_forward_kernel, t=t, n_keys=n_keys)
    out, lse = pl.pallas_call(
        kernel,
        grid=(b, h, lp // t.block_q),
        in_specs=[
            pl.BlockSpec((None, None, t.block_q, ep), lambda i, n, j: (i, n, j, 0)),
            pl.BlockSpec((None, None, sp, ep), lambda i, n, j: (i, n // group, 0, 0)),
            pl.BlockSpec((None, None, sp, fp), lambda i, n, j: (i, n // group, 0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, t.block_q, fp), lambda i, n, j: (i, n, j, 0)),
            pl.BlockSpec((None, None, t.block_q), lambda i, n, j: (i, n, j)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, h, lp, fp), t.out_dtype or q.dtype, manual_axis_type=manual),
            jax.ShapeDtypeStruct((b, h, lp), jnp.float32, manual_axis_type=manual),
        ],
        compiler_params=t.compiler_params(max(ep, fp)),
        interpret=t.interpret,
        name="flash_block_forward",
    )(q, k, v)
    return out[:, :, :length, :f], lse[:, :, :length]


def _backward(q, k, v, d_out, lse, delta, t: _Tiling):
    (b, h, length, e), (hk, n_keys, f) = q.shape, (k.shape[1], k.shape[2], v.shape[-1])
    lp, sp, ep, fp = _rounded(length, t.block_q), _rounded(n_keys, t.block_k), _pow2(e), _pow2(f)
    q, d_out = _pad(q, {2: lp, 3: ep}), _pad(d_out.astype(v.dtype), {2: lp, 3: fp})
    k, v = _pad(k, {2: sp, 3: ep}), _pad(v, {2: sp, 3: fp})
    lse = _pad(lse.astype(jnp.float32), {2: lp}, -jnp.inf)  # padded rows see no key
    delta = _pad(delta.astype(jnp.float32), {2: lp})
    group, nq = h // hk, lp // t.block_q
    (q, k, v, d_out, lse, delta), manual = _alike(q, k, v, d_out, lse, delta)
    t = _preloading(t, q)
    params = t.compiler_params(max(ep, fp))

    rows = lambda width: pl.BlockSpec((None, None, t.block_q, width), lambda i, n, j: (i, n, j, 0))
    whole_kv = lambda width: pl.BlockSpec((None, None, sp, width), lambda i, n, j: (i, n // group, 0, 0))
    row_stats = pl.BlockSpec((None, None, t.block_q), lambda i, n, j: (i, n, j))
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, t=t, n_keys=n_keys),
        grid=(b, h, nq),
        in_specs=[rows(ep), whole_kv(ep), whole_kv(fp), rows(fp), row_stats, row_stats],
        out_specs=rows(ep),
        out_shape=jax.ShapeDtypeStruct((b, h, lp, ep), jnp.float32, manual_axis_type=manual),
        name="flash_block_dq",
        compiler_params=params,
        interpret=t.interpret,
    )(q, k, v, d_out, lse, delta)

    # the key head's group of query heads as one run of rows: [B, Hk, G·Lp, …]
    grouped = lambda x: x.reshape((b, hk, group * lp) + x.shape[3:])
    group_rows = lambda width: pl.BlockSpec((None, None, group * lp, width), lambda i, n, j: (i, n, 0, 0))
    group_stats = pl.BlockSpec((None, None, group * lp), lambda i, n, j: (i, n, 0))
    key_tile = lambda width: pl.BlockSpec((None, None, t.block_k, width), lambda i, n, j: (i, n, j, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, t=t, n_keys=n_keys, group=group, rows=lp),
        grid=(b, hk, sp // t.block_k),
        in_specs=[group_rows(ep), key_tile(ep), key_tile(fp), group_rows(fp), group_stats, group_stats],
        out_specs=[key_tile(ep), key_tile(fp)],
        out_shape=[
            jax.ShapeDtypeStruct((b, hk, sp, ep), jnp.float32, manual_axis_type=manual),
            jax.ShapeDtypeStruct((b, hk, sp, fp), jnp.float32, manual_axis_type=manual),
        ],
        name="flash_block_dkv",
        compiler_params=params,
        interpret=t.interpret,
    )(grouped(q), k, v, grouped(d_out), grouped(lse), grouped(delta))
    return dq[:, :, :length, :e], dk[:, :, :n_keys, :e], dv[:, :, :n_keys, :f]


# --- the kernels ---------------------------------------------------------------------------------------------------


def _allowed(first_row, first_key, shape: tuple[int, int], t: _Tiling, n_keys: int):
    """Which of a tile's ``(row, key)`` pairs are allowed: the key is real (not padding) and, causally,
    ``key ≤ row + δ``; ``None`` when all are, as far as the static shapes tell."""
    key = first_key + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    allowed = key < n_keys if _rounded(n_keys, t.block_k) != n_keys else None
    if t.offset is not None:
        causal = key <= first_row + jax.lax.broadcasted_iota(jnp.int32, shape, 0) + t.offset
        allowed = causal if allowed is None else allowed & causal
    return allowed


def _scores(q, k, first_row, first_key, t: _Tiling, n_keys: int):
    """float32 ``Q Kᵀ·scale`` of one tile pair, the disallowed pairs at ``−inf``."""
    s = tile_dot(q, k, (1, 1), t.dot) * t.scale
    allowed = _allowed(first_row, first_key, (s.shape[0], s.shape[1]), t, n_keys)
    return s if allowed is None else jnp.where(allowed, s, -jnp.inf)


def _key_tiles(first_row, t: _Tiling, n_keys: int):
    """How many key tiles the query tile starting at ``first_row`` sees (all, or up to its last row's last key)."""
    count = _rounded(n_keys, t.block_k) // t.block_k
    if t.offset is None:
        return count
    seen = jnp.maximum(first_row + t.block_q + t.offset, 0)  # keys [0, seen) are seen by some row
    return jnp.minimum(jax.lax.div(seen + t.block_k - 1, t.block_k), count)


def _forward_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, t: _Tiling, n_keys: int):
    first_row = pl.program_id(2) * t.block_q
    q, k_all, v_all = q_ref[...], _source(k_ref, t), _source(v_ref, t)

    def body(j, carry):
        acc, peak, total = carry
        k, v = _rows(k_all, j * t.block_k, t.block_k, t), _rows(v_all, j * t.block_k, t.block_k, t)
        s = _scores(q, k, first_row, j * t.block_k, t, n_keys)
        new_peak = jnp.maximum(peak, jnp.max(s, axis=1))
        safe = jnp.where(new_peak == -jnp.inf, 0.0, new_peak)  # a row with no key yet: nothing to rescale
        p = jnp.exp(s - safe[:, None])
        rescale = jnp.exp(peak - safe)
        acc = acc * rescale[:, None] + tile_dot(p.astype(v.dtype), v, (1, 0), t.dot)
        return acc, new_peak, total * rescale + jnp.sum(p, axis=1)

    init = (
        jnp.zeros((t.block_q, o_ref.shape[-1]), jnp.float32),
        jnp.full((t.block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((t.block_q,), jnp.float32),
    )
    acc, peak, total = jax.lax.fori_loop(0, _key_tiles(first_row, t, n_keys), body, init)
    live = total > 0
    safe_total = jnp.where(live, total, 1.0)
    o_ref[...] = (acc / safe_total[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(live, peak + jnp.log(safe_total), -jnp.inf)


def _probabilities(s, lse):
    """``exp(S − lse)``, 0 on rows with ``lse = −inf`` (no key; padding)."""
    return jnp.exp(s - jnp.where(lse == -jnp.inf, jnp.inf, lse)[:, None])


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, t: _Tiling, n_keys: int):
    first_row = pl.program_id(2) * t.block_q
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    k_all, v_all = _source(k_ref, t), _source(v_ref, t)

    def body(j, dq):
        k, v = _rows(k_all, j * t.block_k, t.block_k, t), _rows(v_all, j * t.block_k, t.block_k, t)
        p = _probabilities(_scores(q, k, first_row, j * t.block_k, t, n_keys), lse)
        dp = tile_dot(do, v, (1, 1), t.dot)
        ds = p * (dp - delta[:, None])
        return dq + tile_dot(ds.astype(k.dtype), k, (1, 0), t.dot)

    dq = jnp.zeros(dq_ref.shape, jnp.float32)
    dq_ref[...] = jax.lax.fori_loop(0, _key_tiles(first_row, t, n_keys), body, dq) * t.scale


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *, t, n_keys, group, rows):
    first_key = pl.program_id(2) * t.block_k
    k, v = k_ref[...], v_ref[...]
    queries, d_outs, lses, deltas = (_source(ref, t) for ref in (q_ref, do_ref, lse_ref, delta_ref))
    tiles = rows // t.block_q
    first_tile = 0  # causal: the first query tile with a row r ≥ first_key − δ
    if t.offset is not None:
        first_tile = jnp.minimum(jax.lax.div(jnp.maximum(first_key - t.offset, 0), t.block_q), tiles)

    def tile(g, i, carry):
        dk, dv = carry
        at = g * rows + i * t.block_q
        q, do, lse, delta = (_rows(x, at, t.block_q, t) for x in (queries, d_outs, lses, deltas))
        p = _probabilities(_scores(q, k, i * t.block_q, first_key, t, n_keys), lse)
        dv = dv + tile_dot(p.astype(do.dtype), do, (0, 0), t.dot)
        ds = p * (tile_dot(do, v, (1, 1), t.dot) - delta[:, None])
        return dk + tile_dot(ds.astype(q.dtype), q, (0, 0), t.dot), dv

    def head(g, carry):
        return jax.lax.fori_loop(first_tile, tiles, functools.partial(tile, g), carry)

    init = (jnp.zeros(dk_ref.shape, jnp.float32), jnp.zeros(dv_ref.shape, jnp.float32))
    dk, dv = jax.lax.fori_loop(0, group, head, init)
    dk_ref[...] = dk * t.scale
    dv_ref[...] = dv

"""Attention with its sequence split over mesh devices (context parallelism), one device's part inside ``shard_map``.

The contract is :func:`jaxbackend.ops.attention.scaled_dot_product_attention`'s, without a mask operand or
dropout: ``out = softmax(Q Kᵀ·scale [causal]) V`` for ``q [B, H, L, E]``, ``k [B, Hk, S, E]``, ``v [B, Hk, S, F]``
with ``H = G·Hk`` (query head ``n`` reads key head ``n // G``). The sequence dims ``L`` and ``S`` are split
alike over ``P`` devices along the mesh axes ``axes``: device ``d`` holds the contiguous chunk
``[d·L/P, (d+1)·L/P)`` of the queries and of the keys/values (the layout GSPMD gives every other op), and
returns its chunk of the output. Batch and heads may be split over other axes; nothing here depends on them.

Two ways to bring every key to every query (:class:`ContextSplit` ``variant``):

* ``"allgather"``: the keys and values are all-gathered (``[P, …]``), each device attends its queries to all
  of them; the backward re-gathers them and returns their gradient by reduce-scatter (the all-gather's
  transpose). Memory: the gathered ``K, V`` (``S·(E+F)`` per head) while the op runs.
* ``"ring"``: the ``K|V`` block travels around the ring with ``ppermute`` (device ``d`` → ``d+1``) for ``P−1``
  steps; at step ``t`` device ``d`` holds the block of device ``j = d − t``. The backward (a ring-level
  ``custom_vjp``) passes the block again and its gradient accumulator with it (``P`` moves, the last one
  home). Only two blocks are alive per device.

Both compute block by block with flash-attention's merge: a block gives ``(o, lse)`` per query row (output
normalized within the block, log-sum-exp of its scores); two merge as ``lse = logaddexp(lse₁, lse₂)``,
``o = o₁·e^{lse₁−lse} + o₂·e^{lse₂−lse}``. The steps after a device's own block run in a ``fori_loop`` (one step's
buffers at a time), and a block's query rows in tiles of :data:`ROW_TILE`: no ``L × S`` score matrix exists, not
even one device's share; the temporaries are ``ROW_TILE`` rows by one device's keys, so the memory per device falls as
``1/P`` with the chunk. The backward recomputes scores from the saved ``(q, k, v, out, lse)``:
``P = exp(S − lse)``, ``dV = Pᵀ dO``, ``dS = P ∘ (dO Vᵀ − rowsum(dO ∘ O))``, ``dQ = dS K·scale``, ``dK = dSᵀ Q·scale``.

**Zig-zag (causal).** With a causal mask the contiguous layout is unbalanced (device ``P−1`` attends to every
key, device 0 to its own): the sequence is cut into ``2P`` chunks of ``C = L/(2P)`` and device ``d`` works on
chunks ``d`` and ``2P−1−d`` (two ``ppermute`` moves of the packed ``q|k|v`` halves in, two of the output back;
their transposes move the gradients). Then at every ring step every device computes two ``C × C`` blocks:
``j = d``: ``(d, d)`` and ``(2P−1−d, 2P−1−d)`` causally, ``(2P−1−d, d)`` whole; ``j < d``: both its query chunks
against key chunk ``j``; ``j > d``: query chunk ``2P−1−d`` against both of ``j``'s key chunks — the same two
products with their operands selected, so no branch (and no second set of buffers) exists. Causal attention
needs ``L = S``. Without the mask there is no zig-zag (every block is whole).

Precision as the composition (:func:`jaxbackend.precision.dot_precision`): scores, softmax statistics and
accumulators in float32, the output in the inputs' dtype.

**Block kernel** (:data:`BLOCK_KERNEL`). A block's ``(o, lse)`` (:func:`_block`) and its gradients
(:func:`_block_grads`) are computed by the XLA code below (tiles of :data:`ROW_TILE` query rows) or by the Pallas
flash-attention kernel :mod:`jaxbackend.kernels.flash_attention` (its own tiles; the same formulas). By default the
kernel on the GPU platforms it compiles for, where it takes the operands, and the XLA code elsewhere; the tests force
the kernel in Pallas's interpret mode on the CPU (``"pallas-interpret"``) and compare the two.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxbackend import precision
from jaxbackend.collectives import reduce_scatter
from jaxbackend.kernels import flash_attention
from jaxbackend.ops.grouped_matmul import varying_like
from jaxbackend.sharding import AXIS_NAMES, axes_of, shard_map

VARIANTS = ("allgather", "ring")
BLOCK_KERNELS = ("xla", "pallas", "pallas-interpret")
BLOCK_KERNEL: str | None = None
"""How blocks are computed: ``None`` (the default) — the Pallas kernel on a GPU platform it compiles for where it
takes the operands (:func:`jaxbackend.kernels.flash_attention.supported`), the XLA code elsewhere; ``"xla"``;
``"pallas"`` (compiled: a GPU only); ``"pallas-interpret"`` (Pallas's interpret mode, any platform: for tests, slow).
Read when a program is traced."""


@dataclasses.dataclass(frozen=True)
class ContextSplit:
    """How one attention's sequence is split: the mesh ``axes`` names splitting ``L`` and ``S`` (major first),
    ``devices`` (``P``, their product), the ``variant`` (``"allgather"`` or ``"ring"``), ``causal`` and the
    softmax ``scale``."""

    axes: tuple[str, ...]
    devices: int
    variant: str
    causal: bool
    scale: float

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"context attention variant {self.variant!r}: one of {VARIANTS}")


def context_attention(q: jax.Array, k: jax.Array, v: jax.Array, split: ContextSplit) -> jax.Array:
    """This device's output chunk ``[B, H, L/P, F]`` (module docstring); call inside a ``shard_map`` whose mesh
    has ``split.axes``. ``q, k, v``: this device's contiguous chunks (batch dims of ``k, v`` may be 1)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"context attention takes 4-d q, k, v; got {q.shape}, {k.shape}, {v.shape}")
    batch = max(q.shape[0], k.shape[0], v.shape[0])
    q, k, v = (jnp.broadcast_to(x, (batch,) + x.shape[1:]) for x in (q, k, v))
    if q.shape[1] % k.shape[1] or v.shape[1] != k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of key/value heads {k.shape[1]}, {v.shape[1]}")
    if split.causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"causal context attention needs as many queries as keys; got {q.shape[2]}, {k.shape[2]}")
    if split.causal and q.shape[2] % 2:
        raise ValueError(f"zig-zag chunks: a device's {q.shape[2]} queries do not halve")
    # every value the custom_vjp reads varies along the same axes (its cotangents must: pcast's transpose sums)
    q = varying_like(q, k, v)
    k, v = varying_like(k, q), varying_like(v, q)
    if not split.causal or split.devices == 1:  # one device: its two halves are chunks 0 and 1 already
        return _context_core(q, k, v, split)
    q, k, v = _zigzag_in((q, k, v), split)
    return _zigzag_out(_context_core(q, k, v, split), split)


# --- zig-zag layout ------------------------------------------------------------------------------------------------


def _owner(chunk: int, devices: int) -> int:
    return chunk if chunk < devices else 2 * devices - 1 - chunk


def _zigzag_in(tensors: Sequence[jax.Array], split: ContextSplit) -> list[jax.Array]:
    """Contiguous chunks → zig-zag chunks (dim 2): device ``i``'s halves are chunks ``2i`` and ``2i+1``; device
    ``d`` ends with chunks ``d`` and ``2P−1−d``. The tensors travel packed: one ``ppermute`` per half."""
    half = tensors[0].shape[2] // 2
    flat = [jnp.moveaxis(t, 2, 0).reshape(2, half, -1) for t in tensors]  # [2 halves, C, rest]
    widths = [f.shape[-1] for f in flat]
    packed = jnp.concatenate([f.astype(tensors[0].dtype) for f in flat], axis=-1)
    even, odd = _zigzag_exchange(packed[0], packed[1], split)
    d = jax.lax.axis_index(split.axes)
    first = jnp.where(d % 2 == 0, even, odd)  # chunk d: even chunks came through the first exchange
    second = jnp.where(d % 2 == 0, odd, even)
    both = jnp.stack([first, second])  # [2, C, Σ widths]
    out, start = [], 0
    for t, width in zip(tensors, widths):
        part = both[..., start : start + width].reshape((2 * half,) + t.shape[:2] + t.shape[3:])
        out.append(jnp.moveaxis(part, 0, 2).astype(t.dtype))
        start += width
    return out


def _zigzag_exchange(first_half: jax.Array, second_half: jax.Array, split: ContextSplit):
    """Send half 0 (chunk ``2i``) and half 1 (chunk ``2i+1``) of device ``i`` to their zig-zag owners; returns what
    arrived through each exchange (an even chunk, an odd chunk)."""
    p = split.devices
    to_even = [(i, _owner(2 * i, p)) for i in range(p)]
    to_odd = [(i, _owner(2 * i + 1, p)) for i in range(p)]
    return (jax.lax.ppermute(first_half, split.axes, to_even), jax.lax.ppermute(second_half, split.axes, to_odd))


def _zigzag_out(out: jax.Array, split: ContextSplit) -> jax.Array:
    """Zig-zag chunks → contiguous chunks (the inverse of :func:`_zigzag_in` for one tensor)."""
    p, half = split.devices, out.shape[2] // 2
    d = jax.lax.axis_index(split.axes)
    slots = jnp.moveaxis(out, 2, 0).reshape((2, half) + out.shape[:2] + out.shape[3:])
    even = jnp.where(d % 2 == 0, slots[0], slots[1])
    odd = jnp.where(d % 2 == 0, slots[1], slots[0])
    back_even = [(_owner(2 * i, p), i) for i in range(p)]
    back_odd = [(_owner(2 * i + 1, p), i) for i in range(p)]
    halves = jnp.stack([jax.lax.ppermute(even, split.axes, back_even), jax.lax.ppermute(odd, split.axes, back_odd)])
    return jnp.moveaxis(halves.reshape((2 * half,) + out.shape[:2] + out.shape[3:]), 0, 2)


# --- blocks ---------------------------------------------------------------------------------------------------------


def _scores(q, k, scale):
    """``q [B, Hk, G, Lq, E] · k [B, Hk, Sk, E]`` → float32 scores ``[B, Hk, G, Lq, Sk]``."""
    s = jnp.einsum(
        "bkgle,bkse->bkgls", q, k, precision=precision.dot_precision(q, k), preferred_element_type=jnp.float32
    )
    return s * scale


ROW_TILE = 256
"""Query rows per tile inside a block: a block of ``Lq`` rows runs as ``Lq / ROW_TILE`` tiles (``lax.map`` forward,
``lax.scan`` backward; a block of at most ``ROW_TILE`` rows as two, :func:`_tile_rows`), so its temporaries are
``ROW_TILE × Sk`` scores, linear in the sequence, whatever the chunk."""
MIN_TILE = 64
"""Fewer query rows than this are one tile."""


def _block_kernel(q, k, v) -> str:
    """``"xla"``, ``"pallas"`` or ``"pallas-interpret"``: how blocks of these grouped operands are computed
    (:data:`BLOCK_KERNEL`)."""
    if BLOCK_KERNEL is not None and BLOCK_KERNEL not in BLOCK_KERNELS:
        raise ValueError(f"context_attention.BLOCK_KERNEL = {BLOCK_KERNEL!r}: None or one of {BLOCK_KERNELS}")
    if BLOCK_KERNEL == "xla":
        return "xla"
    ungrouped = jax.ShapeDtypeStruct(q.shape[:1] + (q.shape[1] * q.shape[2],) + q.shape[3:], q.dtype)
    taken = flash_attention.supported(ungrouped, k, v)
    if BLOCK_KERNEL is None:
        on_gpu = flash_attention.compiled_for(precision.current().platform or jax.default_backend())
        return "pallas" if on_gpu and taken else "xla"
    if not taken:
        raise ValueError(
            f"context_attention.BLOCK_KERNEL = {BLOCK_KERNEL!r}, but the flash-attention kernel does not take "
            f"q {ungrouped.shape} {q.dtype}, k {k.shape} {k.dtype}, v {v.shape} {v.dtype}"
        )
    return BLOCK_KERNEL


def _ungrouped(x):
    """``[B, Hk, G, L, …]`` → ``[B, Hk·G, L, …]`` (query head ``n`` of key head ``n // G``: the kernel's layout)."""
    return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])


def _block(q, k, v, scale, offset):
    """One block: its output normalized within the block (float32) and its rows' log-sum-exp (``−inf`` for a row
    with no allowed key). ``offset``: ``None`` (every key allowed) or ``δ``: key ``c`` allowed for row ``r`` when
    ``c ≤ r + δ`` (causal within the block)."""
    kernel = _block_kernel(q, k, v)
    if kernel != "xla":
        o, lse = flash_attention.flash_block(
            _ungrouped(q), k, v, scale=scale, offset=offset, out_dtype=jnp.float32, interpret=kernel != "pallas"
        )
        return o.reshape(q.shape[:4] + o.shape[3:]), lse.reshape(q.shape[:4])

    def tile(args):
        q_tile, first = args
        return _block_rows(q_tile, k, v, scale, offset, first)

    tiles, firsts = _row_tiles(q)
    if tiles is None:
        return _block_rows(q, k, v, scale, offset, 0)
    o, lse = jax.lax.map(tile, (tiles, firsts))
    return _untile(o), _untile(lse[..., None])[..., 0]


def _block_rows(q, k, v, scale, offset, first):
    s = _masked(_scores(q, k, scale), offset, first)
    peak = jnp.max(s, axis=-1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    e = jnp.exp(s - peak)
    total = jnp.sum(e, axis=-1, keepdims=True)
    lse = jnp.where(total > 0, jnp.log(jnp.where(total > 0, total, 1.0)) + peak, -jnp.inf)[..., 0]
    p = e / jnp.where(total > 0, total, 1.0)
    o = jnp.einsum(
        "bkgls,bksf->bkglf",
        p.astype(v.dtype),
        v,
        precision=precision.dot_precision(v),
        preferred_element_type=jnp.float32,
    )
    return o, lse


def _masked(s, offset, first):
    """Scores ``[..., rows, keys]`` of rows ``first …`` with the keys ``offset`` does not allow at ``−inf``."""
    if offset is None:
        return s
    rows = jax.lax.broadcasted_iota(jnp.int32, s.shape[-2:], 0) + first
    keys = jax.lax.broadcasted_iota(jnp.int32, s.shape[-2:], 1)
    return jnp.where(keys <= rows + offset, s, -jnp.inf)


def _tile_rows(rows: int) -> int | None:
    """Query rows per tile of a block of ``rows``: :data:`ROW_TILE`, or half the block when it is one tile or less (a
    loop of two: XLA runs a loop's trips one after another, where a block computed straight through had its buffers
    interleaved with the next block's — the ring attention's temporaries at 512 tokens per device were 45 MB on 2
    devices, 21 MB in two tiles); ``None`` (one tile) below :data:`MIN_TILE` rows or where the rows do not divide."""
    tile = ROW_TILE if rows > ROW_TILE else rows // 2
    return tile if tile >= MIN_TILE and rows % tile == 0 else None


def _row_tiles(x):
    """``x [B, Hk, G, L, …]`` as ``[L / t, B, Hk, G, t, …]`` (``t`` = :func:`_tile_rows`) and each tile's first row,
    or ``(None, None)`` when ``L`` is one tile."""
    rows = x.shape[3]
    tile = _tile_rows(rows)
    if tile is None:
        return None, None
    count = rows // tile
    tiles = jnp.moveaxis(x.reshape(x.shape[:3] + (count, tile) + x.shape[4:]), 3, 0)
    return tiles, jnp.arange(count, dtype=jnp.int32) * tile


def _untile(x):
    """The inverse of :func:`_row_tiles`."""
    x = jnp.moveaxis(x, 0, 3)
    return x.reshape(x.shape[:3] + (x.shape[3] * x.shape[4],) + x.shape[5:])


def _merge(o1, lse1, o2, lse2):
    """Two partial results of the same rows over disjoint keys → their union (module docstring)."""
    peak = jnp.maximum(lse1, lse2)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    w1, w2 = jnp.exp(lse1 - peak), jnp.exp(lse2 - peak)
    total = w1 + w2
    safe = jnp.where(total > 0, total, 1.0)
    o = (o1 * w1[..., None] + o2 * w2[..., None]) / safe[..., None]
    return o, jnp.where(total > 0, jnp.log(safe) + peak, -jnp.inf)


def _block_grads(q, k, v, do, lse, rowdot, scale, offset):
    """Gradients of one block's contribution: ``(dq, dk, dv)`` in float32 (module docstring's formulas), tile by
    tile of query rows (``dk, dv`` summed over the tiles), or by the Pallas kernel (its ``δ`` is ``rowdot``)."""
    kernel = _block_kernel(q, k, v)
    if kernel != "xla":
        dq, dk, dv = flash_attention.flash_block_grads(
            _ungrouped(q),
            k,
            v,
            _ungrouped(do),
            _ungrouped(lse),
            _ungrouped(rowdot),
            scale=scale,
            offset=offset,
            interpret=kernel != "pallas",
        )
        return dq.reshape(q.shape), dk, dv
    tiles, firsts = _row_tiles(q)
    if tiles is None:
        return _block_grads_rows(q, k, v, do, lse, rowdot, scale, offset, 0)
    stats = [_row_tiles(x[..., None])[0][..., 0] for x in (lse, rowdot)]
    zeros = [varying_like(jnp.zeros(x.shape, jnp.float32), q, k, v, do) for x in (k, v)]

    def tile(carry, args):
        q_tile, do_tile, lse_tile, rowdot_tile, first = args
        dq, dk, dv = _block_grads_rows(q_tile, k, v, do_tile, lse_tile, rowdot_tile, scale, offset, first)
        return (carry[0] + dk, carry[1] + dv), dq

    (dk, dv), dq = jax.lax.scan(tile, tuple(zeros), (tiles, _row_tiles(do)[0], *stats, firsts))
    return _untile(dq), dk, dv


def _block_grads_rows(q, k, v, do, lse, rowdot, scale, offset, first):
    s = _scores(q, k, scale)
    live = jnp.isfinite(lse)[..., None]
    p = jnp.exp(_masked(s, offset, first) - jnp.where(live, lse[..., None], 0.0))
    p = jnp.where(live, p, 0.0)
    hi = precision.dot_precision(q, k)
    dv = jnp.einsum("bkgls,bkglf->bksf", p, do, precision=hi, preferred_element_type=jnp.float32)
    dp = jnp.einsum("bkglf,bksf->bkgls", do, v, precision=hi, preferred_element_type=jnp.float32)
    ds = p * (dp - rowdot[..., None]) * scale
    dq = jnp.einsum("bkgls,bkse->bkgle", ds, k, precision=hi, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgls,bkgle->bkse", ds, q, precision=hi, preferred_element_type=jnp.float32)
    return dq, dk, dv


# --- the step schedule -------------------------------------------------------------------------------------------


def _step_forward(qg, k, v, own: bool, source, d, split: ContextSplit):
    """One step's ``(o, lse)`` for all of this device's query rows against the key/value block of device ``source``
    (``own``: this device's, the first step); rows a block does not reach get ``lse = −inf``."""
    scale = split.scale
    if not split.causal:
        return _block(qg, k, v, scale, None)
    c = qg.shape[3] // 2
    q_a, q_b = qg[..., :c, :], qg[..., c:, :]
    if own:  # own chunks: (d, d) and (2P−1−d, ·) causally within the pair
        o_a, lse_a = _block(q_a, k[..., :c, :], v[..., :c, :], scale, 0)
        o_b, lse_b = _block(q_b, k, v, scale, c)  # key chunk d whole, 2P−1−d causally
        return jnp.concatenate([o_a, o_b], axis=3), jnp.concatenate([lse_a, lse_b], axis=3)

    # j < d: both query chunks against key chunk j (2P−1−j is after both); j > d: query chunk 2P−1−d against both
    # of j's chunks. The same two C × C products either way, their operands selected (no branch: one set of buffers)
    earlier = source < d
    k_a, k_b, v_a, v_b = k[..., :c, :], k[..., c:, :], v[..., :c, :], v[..., c:, :]
    o0, lse0 = _block(jnp.where(earlier, q_a, q_b), k_a, v_a, scale, None)
    o1, lse1 = _block(q_b, jnp.where(earlier, k_a, k_b), jnp.where(earlier, v_a, v_b), scale, None)
    o_both, lse_both = _merge(o0, lse0, o1, lse1)
    o = jnp.concatenate([jnp.where(earlier, o0, 0.0), jnp.where(earlier, o1, o_both)], axis=3)
    return o, jnp.concatenate([jnp.where(earlier, lse0, -jnp.inf), jnp.where(earlier, lse1, lse_both)], axis=3)


def _step_grads(qg, k, v, do, lse, rowdot, own: bool, source, d, split: ContextSplit):
    """Gradients of one step's blocks (as :func:`_step_forward` chose them): ``(dq [all rows], dk, dv)``."""
    scale = split.scale
    if not split.causal:
        return _block_grads(qg, k, v, do, lse, rowdot, scale, None)
    c = qg.shape[3] // 2
    rows = lambda x, part: x[..., :c, :] if part == 0 else x[..., c:, :]
    row_stats = lambda x, part: x[..., :c] if part == 0 else x[..., c:]
    if own:
        dq_a, dk_a, dv_a = _block_grads(
            rows(qg, 0), k[..., :c, :], v[..., :c, :], rows(do, 0), row_stats(lse, 0), row_stats(rowdot, 0), scale, 0
        )
        dq_b, dk_b, dv_b = _block_grads(
            rows(qg, 1), k, v, rows(do, 1), row_stats(lse, 1), row_stats(rowdot, 1), scale, c
        )
        pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=2)
        return jnp.concatenate([dq_a, dq_b], axis=3), pad(dk_a) + dk_b, pad(dv_a) + dv_b

    earlier = source < d  # the two products of :func:`_step_forward`
    k_a, k_b, v_a, v_b = k[..., :c, :], k[..., c:, :], v[..., :c, :], v[..., c:, :]
    pick = lambda x, stats: jnp.where(
        earlier,
        (row_stats if stats else rows)(x, 0),
        (row_stats if stats else rows)(x, 1),
    )
    dq0, dk0, dv0 = _block_grads(
        pick(qg, False), k_a, v_a, pick(do, False), pick(lse, True), pick(rowdot, True), scale, None
    )
    dq1, dk1, dv1 = _block_grads(
        rows(qg, 1),
        jnp.where(earlier, k_a, k_b),
        jnp.where(earlier, v_a, v_b),
        rows(do, 1),
        row_stats(lse, 1),
        row_stats(rowdot, 1),
        scale,
        None,
    )
    dq = jnp.concatenate([jnp.where(earlier, dq0, 0.0), jnp.where(earlier, dq1, dq0 + dq1)], axis=3)
    dk = jnp.concatenate([jnp.where(earlier, dk0 + dk1, dk0), jnp.where(earlier, 0.0, dk1)], axis=2)
    dv = jnp.concatenate([jnp.where(earlier, dv0 + dv1, dv0), jnp.where(earlier, 0.0, dv1)], axis=2)
    return dq, dk, dv


# --- the ring / all-gather loop (custom_vjp) -----------------------------------------------------------------------


def _grouped(q, kv_heads):
    b, h, length, e = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, length, e)


def _pack(k, v):
    return jnp.concatenate([k, v.astype(k.dtype)], axis=-1)


def _ring_shift(x, split: ContextSplit):
    p = split.devices
    return jax.lax.ppermute(x, split.axes, [(i, (i + 1) % p) for i in range(p)])


def _forward(q, k, v, split: ContextSplit):
    """``(out, lse)``: the first step on this device's own block, then ``P − 1`` steps in a loop (one step's buffers
    at a time), each on the block that arrives from the ring or is read from the gathered ones."""
    kv_heads, width = k.shape[1], k.shape[-1]
    qg = _grouped(q, kv_heads)
    p = split.devices
    d = jax.lax.axis_index(split.axes) if p > 1 else 0
    kv = _pack(k, v)
    gathered = jax.lax.all_gather(kv, split.axes) if split.variant == "allgather" and p > 1 else None

    def step(kv, own, source):
        return _step_forward(qg, kv[..., :width], kv[..., width:].astype(v.dtype), own, source, d, split)

    o, lse = step(kv, True, d)
    if p > 1:

        def body(index, carry):
            o, lse, kv = carry
            source = (d - index) % p
            kv = _ring_shift(kv, split) if gathered is None else _block_of(gathered, source)
            return (*_merge(o, lse, *step(kv, False, source)), kv)

        o, lse, _ = jax.lax.fori_loop(1, p, body, (o, lse, kv))
    out = o.astype(q.dtype).reshape(q.shape[:3] + (v.shape[-1],))
    return out, lse


def _block_of(gathered, source):
    return jax.lax.dynamic_index_in_dim(gathered, source, axis=0, keepdims=False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _context_core(q, k, v, split):
    return _forward(q, k, v, split)[0]


def _core_fwd(q, k, v, split):
    out, lse = _forward(q, k, v, split)
    return out, (q, k, v, out, lse)


def _core_bwd(split, residuals, d_out):
    q, k, v, out, lse = residuals
    kv_heads, width, p = k.shape[1], k.shape[-1], split.devices
    qg, dog = _grouped(q, kv_heads), _grouped(d_out, kv_heads)
    rowdot = jnp.sum(dog.astype(jnp.float32) * _grouped(out, kv_heads).astype(jnp.float32), axis=-1)
    d = jax.lax.axis_index(split.axes) if p > 1 else 0
    kv = _pack(k, v)

    def step(kv, own, source):
        dq, dk, dv = _step_grads(
            qg, kv[..., :width], kv[..., width:].astype(v.dtype), dog, lse, rowdot, own, source, d, split
        )
        return dq, jnp.concatenate([dk, dv], axis=-1)

    dq, d_kv = step(kv, True, d)
    if p > 1 and split.variant == "ring":

        def ring_body(index, carry):  # the block's gradient travels with the block
            dq, d_kv, kv = carry
            kv, d_kv = _ring_shift(kv, split), _ring_shift(d_kv, split)
            dq_t, d_block = step(kv, False, (d - index) % p)
            return dq + dq_t, d_kv + d_block, kv

        dq, d_kv, _ = jax.lax.fori_loop(1, p, ring_body, (dq, d_kv, kv))
        d_kv = _ring_shift(d_kv, split)  # home
    elif p > 1:
        gathered = jax.lax.all_gather(kv, split.axes)
        d_gathered = jax.lax.dynamic_update_index_in_dim(
            varying_like(jnp.zeros(gathered.shape, jnp.float32), d_kv), d_kv, d, axis=0
        )

        def gather_body(index, carry):
            dq, d_gathered = carry
            source = (d - index) % p
            dq_t, d_block = step(_block_of(gathered, source), False, source)
            current = _block_of(d_gathered, source)
            return dq + dq_t, jax.lax.dynamic_update_index_in_dim(d_gathered, current + d_block, source, axis=0)

        dq, d_gathered = jax.lax.fori_loop(1, p, gather_body, (dq, d_gathered))
        d_kv = reduce_scatter(d_gathered, split.axes, dim=0, tiled=False)
    dq = dq.reshape(q.shape).astype(q.dtype)
    return (
        varying_like(dq, q),
        varying_like(d_kv[..., :width].astype(k.dtype), k),
        varying_like(d_kv[..., width:].astype(v.dtype), v),
    )


_context_core.defvjp(_core_fwd, _core_bwd)


# --- under GSPMD ----------------------------------------------------------------------------------------------------


def pinned_context_split(shardings, variant: str | None, causal: bool, scale: float) -> ContextSplit | None:
    """The split that an attention's pinned operand shardings (``q, k, v`` as the plan reads them) and its
    ``variant`` describe: ``q``'s and ``k``'s and ``v``'s sequence dims (2) split over the same mesh axes.
    ``None`` when there is no variant or the sequence is whole; a mismatch is an error naming the layouts."""
    if variant is None or not shardings or len(shardings) < 3 or any(s is None for s in shardings[:3]):
        return None
    specs = [axes_of(s.spec, 4) for s in shardings[:3]]
    axes = specs[0][2]
    if axes is None:
        return None
    if specs[1][2] != axes or specs[2][2] != axes or any(spec[3] for spec in specs):
        raise ValueError(
            f"context attention ({variant}) needs q, k, v split alike along the sequence and whole "
            f"along the head dim; the plan reads them as {specs}"
        )
    mesh = shardings[0].mesh
    names = tuple(AXIS_NAMES[a] for a in axes)
    return ContextSplit(names, math.prod(mesh.shape[n] for n in names), variant, causal, scale)


def split_attention(q: jax.Array, k: jax.Array, v: jax.Array, shardings, split: ContextSplit) -> jax.Array:
    """Context-parallel attention of global arrays under ``jit``/GSPMD: a ``shard_map`` over the pinned shardings'
    mesh, each device running :func:`context_attention` on its chunks; the output laid out as ``q``."""
    specs = [s.spec for s in shardings[:3]]
    out_spec = PartitionSpec(*(tuple(specs[0]) + (None,) * 4)[:3], None)
    body = functools.partial(context_attention, split=split)
    return shard_map(body, shardings[0].mesh, in_specs=tuple(specs), out_specs=out_spec)(q, k, v)

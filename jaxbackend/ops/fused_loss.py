"""The language-model head and the cross-entropy's log-probabilities in chunks of rows: the ``[rows, vocab]`` logits
never exist whole, in the forward or the backward.

A causal LM's loss reads, per row ``i`` of ``a [N, D]`` (the last hidden states) and its label ``t_i``:

    z_i = a_i · b  (+ bias)                      b [D, V]: the head's weight as the matmul reads it (``Wᵀ``)
    out_i = log_softmax(z_i)[t_i] = z_i[t_i] − logsumexp(z_i)

:func:`linear_log_softmax_gather` computes ``out [N, 1]`` by a ``lax.scan`` over ``⌈N / C⌉`` chunks of ``C`` rows
(the last one padded; padded rows are dropped). Each chunk runs the very lowerings the unfused graph runs (``mm`` or
``addmm``, the dtype casts between them, ``_log_softmax``, ``gather``), so the values are the unfused ones row for
row. The chunk function is under ``jax.checkpoint``: the scan keeps only each chunk's inputs (``a``'s rows and their
labels), and the backward recomputes one chunk's logits at a time, so

    temporaries:  forward and backward O(C·V) instead of the unfused O(N·V) (the logits, their log-softmax and
                  its gradient, each ``N·V`` values in the softmax's dtype)
    work:         one more ``2·N·D·V`` matmul (the recomputed logits): 8·N·D·V instead of 6·N·D·V for the head.

The head's gradient ``db = Σ_chunks a_cᵀ · dz_c`` is accumulated by the scan's transpose; with a 16-bit ``b`` the
chunks' partial sums are added in float32 and rounded once (one matmul over all rows accumulates in float32 too).

:func:`jaxbackend.rewrites.fuse_linear_cross_entropy` puts this op in a graph, in place of the ``gather`` that picks
the labels' log-probabilities, where the logits have no other reader.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxbackend import dtypes
from jaxbackend.ops.registry import LoweringFn, lowers, registered

FUSED_LOSS_TARGET = "torchpar.linear_log_softmax_gather"
"""The IR target of the fused op (never in a captured graph; only the lowering's rewrite makes it)."""


@lowers(FUSED_LOSS_TARGET)
def linear_log_softmax_gather(
    a: jax.Array,
    b: jax.Array,
    bias: jax.Array | None,
    index: jax.Array,
    *,
    logits_dtype: str,
    casts: tuple[str, ...],
    log_softmax_dtype: str,
    half_to_float: bool,
    rows_per_chunk: int,
    beta: float = 1,
    alpha: float = 1,
) -> jax.Array:
    """``log_softmax(cast(a @ b [+ bias]))[i, index[i]]`` as ``[N, 1]`` (module docstring).

    ``a [N, D]``, ``b [D, V]``, ``bias [V]`` or ``None`` (``addmm``'s ``beta·bias + alpha·a@b`` with it),
    ``index [N, 1]`` (labels already in ``[0, V)``). ``logits_dtype``: the matmul's torch result dtype; ``casts``: the
    dtypes the logits are converted to on their way to the softmax, in order; ``log_softmax_dtype``: its result
    dtype; ``rows_per_chunk``: ``C``."""
    rows = a.shape[0]
    if index.shape != (rows, 1):
        raise ValueError(f"fused cross-entropy: {rows} rows of hidden states but labels of shape {index.shape}")
    chunk = max(1, min(rows_per_chunk, rows))
    chunks = -(-rows // chunk)
    padded = chunks * chunk - rows
    a_chunks = jnp.pad(a, ((0, padded), (0, 0))).reshape(chunks, chunk, a.shape[1])
    index_chunks = jnp.pad(index, ((0, padded), (0, 0))).reshape(chunks, chunk, 1)
    steps = _ChunkSteps(logits_dtype, casts, log_softmax_dtype, half_to_float, beta, alpha)
    b_sum, bias_sum = _accumulating(b), (None if bias is None else _accumulating(bias))

    @jax.checkpoint
    def chunk_rows(a_c, index_c, b_acc, bias_acc):
        return steps(a_c, index_c, b_acc.astype(b.dtype), None if bias_acc is None else bias_acc.astype(bias.dtype))

    def scan_step(carry, xs):
        return carry, chunk_rows(xs[0], xs[1], b_sum, bias_sum)

    _, out = jax.lax.scan(scan_step, None, (a_chunks, index_chunks))
    return out.reshape(chunks * chunk, 1)[:rows]


def _accumulating(value: jax.Array) -> jax.Array:
    """``value`` in float32 when it is a 16-bit float: the scan's transpose then sums the chunks' gradients in
    float32 (the cast back inside the chunk rounds each use exactly as the unfused op reads it)."""
    return value.astype(jnp.float32) if value.dtype in (jnp.bfloat16, jnp.float16) else value


class _ChunkSteps:
    """One chunk of the unfused ops, each by its own lowering and cast to the dtype PyTorch gave its result."""

    def __init__(self, logits_dtype, casts, log_softmax_dtype, half_to_float, beta, alpha):
        self.logits_dtype = dtypes.to_jax(logits_dtype)
        self.casts = tuple(dtypes.to_jax(name) for name in casts)
        self.log_softmax_dtype = dtypes.to_jax(log_softmax_dtype)
        self.half_to_float, self.beta, self.alpha = half_to_float, beta, alpha

    def __call__(self, a_c, index_c, b, bias):
        if bias is None:
            logits = _lowering("aten.mm.default")(a_c, b)
        else:
            logits = _lowering("aten.addmm.default")(bias, a_c, b, self.beta, self.alpha)
        logits = logits.astype(self.logits_dtype)
        for dtype in self.casts:
            logits = logits.astype(dtype)
        log_probs = _lowering("aten._log_softmax.default")(logits, 1, self.half_to_float)
        return _lowering("aten.gather.default")(log_probs.astype(self.log_softmax_dtype), 1, index_c)


def _lowering(target: str) -> LoweringFn:
    lowering = registered(target)
    assert lowering is not None, f"{target} has a lowering (every op family is imported with jaxbackend.ops)"
    return lowering.fn

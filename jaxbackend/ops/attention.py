"""Scaled dot-product attention: ``aten.scaled_dot_product_attention`` → cuDNN's flash kernel or XLA.

The contract is PyTorch's. With ``...`` batch dims that broadcast against each other (and the mask's)::

    query [..., N, L, E],  key [..., K, S, E],  value [..., K, S, Ev]  →  out [..., N, L, Ev]

    out = P V,   P = softmax_s(Q Kᵀ · scale + A),   scale = 1/√E unless given

where ``A[l, s]`` is ``−inf`` where key ``s`` is masked for query ``l`` and 0 elsewhere, plus the float mask
if one is given. Key ``s`` is masked by a boolean mask that is False there (True = attend), by a float mask
that is ``−inf`` there, and by ``is_causal`` when ``s > l`` (top-left aligned, ``tril(ones(L, S))``, also
when ``L ≠ S``). Masks broadcast against ``[..., N, L, S]``. With ``enable_gqa`` (or ``K == 1``) the ``K``
key/value heads serve ``N = G·K`` query heads, query head ``n`` reading key head ``n // G`` (torch's
``repeat_interleave``). Rank-3 inputs are ``[N, L, E]``, rank-2 ``[L, E]`` (one head).
A query row whose every key is masked gives zeros and zero gradients, not NaN (PyTorch's safe softmax).
``dropout_p > 0`` drops entries of ``P`` with probability ``dropout_p`` and scales the rest by
``1/(1 − dropout_p)``.

Two paths; :func:`_path` chooses while tracing:

* **cudnn**: ``jax.nn.dot_product_attention(..., implementation="cudnn")``, cuDNN's flash-attention kernel,
  through :func:`_fused`, which moves ``[..., N, L, E]`` to JAX's ``[B, T, N, H]`` (batch dims broadcast and
  flattened) and back. Taken on a CUDA GPU for bf16/fp16 q, k, v with ``dropout_p == 0``, no mask,
  ``is_causal`` only with ``L == S``, ``Ev == E``, and equal heads or GQA/MQA. A case cuDNN refuses while
  tracing (head dim not a multiple of 8 or over 128/256, no cuDNN, a ROCm GPU) takes the composition.
* **composition**: matmul, :func:`jaxbackend.ops.nn._masked_softmax`, dropout, matmul. Everything else,
  among it what ``jax.nn.dot_product_attention`` cannot express: ``dropout_p > 0`` (its API has no dropout),
  ``Ev ≠ E``, q/k/v of different dtypes or float64, heads that only broadcast, inputs of different ranks.

Why not ``jax.nn.dot_product_attention`` wherever dropout is 0. In JAX 0.10 ``implementation=None`` does not
pick cuDNN: it always runs JAX's XLA implementation (``jax/_src/nn/functions.py``: "defaults to XLA for
now"), itself a composition, which forward + backward is 1.3–1.5× slower than ours on CPU (8×4×128×64,
causal or padding mask, with or without the YNNPACK fusions of :mod:`jaxbackend.compiler`). So cuDNN is
asked for by name where it applies. :func:`_fused` covers the whole contract (boolean masks → ``mask``,
float masks → ``bias`` with ``−inf`` replaced by the dtype's lowest value, broadcast masks, GQA, and rows
with no key zeroed, where JAX would average V (boolean mask) or give NaN (all ``−inf`` bias)); the tests
check it against torch through JAX's XLA implementation (``implementation="xla"``, never chosen here).
Masks stay off cuDNN until checked on a GPU (its bias path: the mask becomes a bf16 bias whose gradient
the backward always computes, and its output on fully masked rows). HF models build a materialized
``[B, 1, L, S]`` boolean mask in ``forward`` (causal for GPT-2 and Llama, all True for ViT and an unpadded
BERT); the capture folds such constant masks into ``is_causal`` (:mod:`torchpar.capture.semantics.attention_masks`), so
they arrive here without a mask and reach cuDNN; a padding mask from the batch keeps the composition.

Precision. The composition's two products take :func:`jaxbackend.precision.dot_precision`: float32 follows
``torch.get_float32_matmul_precision()`` (fp32 / TF32 / bf16 passes on a GPU, fp32 on CPU), bf16/fp16 run
natively with fp32 accumulation, and for bf16/fp16 the scores are upcast so that the softmax runs in
float32 (``P`` is rounded back before ``P V``). ``jax.nn.dot_product_attention`` takes no ``precision``: its XLA
implementation computes ``Q Kᵀ`` into float32 with ``precision=BF16_BF16_F32`` (bf16), ``F16_F16_F32``
(fp16) or ``None`` (float32: ``Precision.DEFAULT``, TF32 on Ampere and later NVIDIA GPUs unless
``jax_default_matmul_precision`` says otherwise, so ``"highest"`` could not be honoured), the softmax in
float32, ``P V`` with ``precision=None`` in the input dtype; cuDNN takes only fp16/bf16 (fp32 accumulation,
fp32 softmax statistics). The cuDNN path therefore sees only bf16/fp16 inputs, for which it computes what
``dot_precision`` asks anyway; float32 always takes the composition.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxbackend import precision
from jaxbackend.ops.context_attention import pinned_context_split, split_attention
from jaxbackend.ops.nn import _masked_softmax
from jaxbackend.ops.registry import lowers

_FUSED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_HALF_DTYPES = (jnp.bfloat16, jnp.float16)
_CUDNN_PLATFORMS = ("gpu", "cuda")
_CUDNN_REFUSALS = (NotImplementedError, ValueError, RuntimeError)


@lowers("aten.scaled_dot_product_attention.default", random=True, sharded=True)
def scaled_dot_product_attention(
    query,
    key_,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    key,
    shardings=None,
    context=None,
):
    """``softmax(Q Kᵀ·scale + mask) V``; see the module docstring for shapes and paths. With ``context`` (the plan's
    ``"allgather"``/``"ring"``) and pinned ``shardings`` splitting the sequence: context parallelism
    (:mod:`.context_attention`)."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    split = pinned_context_split(shardings, context, bool(is_causal), scale)
    if split is not None:
        if attn_mask is not None or dropout_p > 0.0:
            raise NotImplementedError(
                "context-parallel attention with a mask operand or dropout: plan it with ShardParallel(context='off')"
            )
        return split_attention(query, key_, value, shardings, split)
    path = _path(query, key_, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if path == "cudnn":
        try:
            return _fused(query, key_, value, attn_mask, is_causal, scale, "cudnn")
        except _CUDNN_REFUSALS:
            pass  # refused while tracing: a head dim, GPU or cuDNN version the kernel does not take
    elif path == "xla":
        return _fused(query, key_, value, attn_mask, is_causal, scale, "xla")
    return _composed(query, key_, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key)


def _path(query, key_, value, attn_mask, dropout_p, is_causal, enable_gqa) -> str:
    """``"cudnn"`` or ``"composition"`` (module docstring). ``"xla"``, JAX's XLA implementation through
    :func:`_fused`, is never chosen here (slower than the composition); the tests select it."""
    if not _fused_applies(query, key_, value, attn_mask, dropout_p, enable_gqa):
        return "composition"
    aligned = not is_causal or query.shape[-2] == key_.shape[-2]
    if (
        query.dtype in _HALF_DTYPES
        and attn_mask is None
        and aligned
        and precision.current().platform in _CUDNN_PLATFORMS
    ):
        return "cudnn"
    return "composition"


def _fused_applies(query, key_, value, attn_mask, dropout_p, enable_gqa) -> bool:
    """Whether ``jax.nn.dot_product_attention`` (through :func:`_fused`) computes this call as PyTorch does."""
    dtype = query.dtype
    if dropout_p > 0.0 or dtype not in _FUSED_DTYPES or key_.dtype != dtype or value.dtype != dtype:
        return False
    rank = query.ndim
    if rank < 2 or key_.ndim != rank or value.ndim != rank:
        return False
    if attn_mask is not None and (attn_mask.ndim > rank or not _is_mask_dtype(attn_mask.dtype)):
        return False
    if key_.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1] or key_.shape[-2] != value.shape[-2]:
        return False
    if rank == 2:
        return True
    heads, kv_heads = query.shape[-3], key_.shape[-3]
    if value.shape[-3] != kv_heads:
        return False
    return kv_heads == heads or (heads % kv_heads == 0 and (enable_gqa or kv_heads == 1))


def _is_mask_dtype(dtype) -> bool:
    return dtype == jnp.bool_ or jnp.issubdtype(dtype, jnp.floating)


def _fused(query, key_, value, attn_mask, is_causal, scale, implementation):
    """``jax.nn.dot_product_attention(..., implementation=implementation)`` on torch-layout inputs, rows
    with no key zeroed."""
    if query.ndim == 2:  # [L, E]: one head
        out = _fused(query[None], key_[None], value[None], attn_mask, is_causal, scale, implementation)
        return out[0]
    rank, q_len, k_len = query.ndim, query.shape[-2], key_.shape[-2]
    mask_NLS = None if attn_mask is None else attn_mask.reshape((1,) * (rank - attn_mask.ndim) + attn_mask.shape)
    batch_shape = jnp.broadcast_shapes(
        query.shape[:-3], key_.shape[:-3], value.shape[:-3], () if mask_NLS is None else mask_NLS.shape[:-3]
    )

    def to_btnh(x):  # [..., N, T, H] → [B, T, N, H]
        x = jnp.broadcast_to(x, batch_shape + x.shape[-3:])
        return jnp.swapaxes(x.reshape((-1,) + x.shape[-3:]), 1, 2)

    q_BTNH, k_BSKH, v_BSKH = to_btnh(query), to_btnh(key_), to_btnh(value)
    bias = mask = live_BNTS = None
    if mask_NLS is not None:
        if any(d != 1 for d in mask_NLS.shape[:-3]):
            mask_NLS = jnp.broadcast_to(mask_NLS, batch_shape + mask_NLS.shape[-3:])
        mask_BNTS = mask_NLS.reshape((-1,) + mask_NLS.shape[-3:])  # B is 1 where the mask has no batch dims
        if mask_BNTS.dtype == jnp.bool_:
            mask = live_BNTS = mask_BNTS
        else:
            live_BNTS = mask_BNTS != -jnp.inf
            bias = jnp.where(live_BNTS, mask_BNTS, jnp.finfo(mask_BNTS.dtype).min)
        if is_causal:
            live_BNTS = live_BNTS & jnp.tril(jnp.ones((q_len, k_len), jnp.bool_))

    out_BTNH = jax.nn.dot_product_attention(
        q_BTNH, k_BSKH, v_BSKH, bias, mask, scale=scale, is_causal=is_causal, implementation=implementation
    )
    if live_BNTS is not None:  # rows with no key left: zeros, as PyTorch's safe softmax gives
        dead_BTN1 = jnp.swapaxes(~jnp.any(live_BNTS, axis=-1), 1, 2)[..., None]
        out_BTNH = jnp.where(dead_BTN1, jnp.zeros((), out_BTNH.dtype), out_BTNH)
    out_BNTH = jnp.swapaxes(out_BTNH, 1, 2)
    return out_BNTH.reshape(batch_shape + out_BNTH.shape[1:])


def _composed(query, key_, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, key):
    """Matmul, safe softmax (in float32 for bf16/fp16), dropout, matmul, at
    :func:`jaxbackend.precision.dot_precision`; on the CPU, in tiles of query rows where the scores are large
    (:func:`_row_tile`)."""
    if enable_gqa and query.ndim >= 3 and key_.shape[-3] != query.shape[-3]:
        repeats = query.shape[-3] // key_.shape[-3]
        key_ = jnp.repeat(key_, repeats, axis=-3)
        value = jnp.repeat(value, repeats, axis=-3)
    tile = _row_tile(query, key_)
    if tile is None:
        return _attend_rows(query, key_, value, attn_mask, dropout_p, is_causal, scale, key, 0)
    return _attend_in_row_tiles(query, key_, value, attn_mask, dropout_p, is_causal, scale, key, tile)


def _attend_rows(query, key_, value, attn_mask, dropout_p, is_causal, scale, key, first_row):
    """The composition for query rows ``first_row … first_row + L − 1`` of the sequence (the causal mask's offset)."""
    q_len, k_len = query.shape[-2], key_.shape[-2]
    scores = jnp.matmul(query, jnp.swapaxes(key_, -1, -2), precision=precision.dot_precision(query, key_))
    if scores.dtype in _HALF_DTYPES:  # softmax in float32, as PyTorch's kernels, cuDNN and JAX's XLA path
        scores = scores.astype(jnp.float32)
    scores = scores * scale
    allowed = None
    if is_causal:
        if isinstance(first_row, int) and first_row == 0:
            allowed = jnp.tril(jnp.ones((q_len, k_len), jnp.bool_))
        else:
            allowed = jnp.arange(k_len)[None, :] <= (first_row + jnp.arange(q_len))[:, None]
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            allowed = attn_mask if allowed is None else (allowed & attn_mask)
        else:
            scores = scores + attn_mask
    if allowed is not None:
        scores = jnp.where(allowed, scores, -jnp.inf)
    weights = _masked_softmax(scores, -1)
    if dropout_p > 0.0:
        keep = jax.random.bernoulli(key, 1.0 - dropout_p, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - dropout_p), 0.0)
    return jnp.matmul(weights.astype(value.dtype), value, precision=precision.dot_precision(value))


ROW_TILED_MIN_BYTES = 1 << 30
"""On the CPU, attention whose float32 scores (``[..., N, L, S]``) hold at least this many bytes (1 GiB: e.g. batch 8
× 12 heads at 1,900 tokens) is computed in tiles of query rows (:func:`_attend_in_row_tiles`); smaller ones whole.
Tiles recompute the scores in the backward: ``[8, 4, 1024, 64]`` causal took 1.31 s forward and backward in tiles
against 0.85 s whole on 2 CPU cores, for ``O(tile · S)`` temporaries instead of the scores, weights and dropout mask
of every layer (GPT-2 124M at batch 8 × 1024: 33.9 → 15.1 GB of XLA temporaries)."""
ROW_TILE_BYTES = 16 << 20
"""About how many bytes of scores one tile of query rows holds."""


def _row_tile(query, key_) -> int | None:
    """The query rows per tile (a divisor of ``L``, at least 8), or ``None``: whole (small scores, another platform,
    or no such divisor). GPUs take cuDNN's flash kernel for bf16/fp16; their float32 composition stays whole
    (untimed there)."""
    if query.ndim < 2 or precision.current().platform != "cpu":
        return None
    rows, keys = query.shape[-2], key_.shape[-2]
    batch = math.prod(jnp.broadcast_shapes(query.shape[:-2], key_.shape[:-2]))
    row_bytes = batch * keys * 4
    if rows * row_bytes < ROW_TILED_MIN_BYTES:
        return None
    target = max(8, ROW_TILE_BYTES // row_bytes)
    return next((t for t in range(min(target, rows // 2), 7, -1) if rows % t == 0), None)


def _attend_in_row_tiles(query, key_, value, attn_mask, dropout_p, is_causal, scale, key, tile):
    """:func:`_attend_rows` over ``L / tile`` tiles of query rows in a ``lax.scan``, each under ``jax.checkpoint``:

        out[rows of tile i] = softmax(Q_i Kᵀ·scale + A_i) V       (dropout keyed by ``fold_in(key, i)``)

    Rows are independent, so the values are the whole composition's (the dropout draws its own masks, with the
    same probability). The scan keeps each tile's inputs only; the backward recomputes one tile's scores at a
    time: temporaries ``O(tile · S)`` per head instead of ``O(L · S)`` (the scores, the weights, the dropout mask,
    kept per layer for the backward), for one more ``Q Kᵀ`` and ``P V`` per tile."""
    rows = query.shape[-2]
    count = rows // tile

    def tiles(x):  # [..., L, C] → [count, ..., tile, C]
        return jnp.moveaxis(x.reshape(x.shape[:-2] + (count, tile, x.shape[-1])), -3, 0)

    mask_has_rows = attn_mask is not None and attn_mask.ndim >= 2 and attn_mask.shape[-2] == rows
    whole_mask = None if mask_has_rows else attn_mask

    @jax.checkpoint
    def one_tile(q_tile, mask_tile, index, key_, value):
        tile_key = None if dropout_p <= 0.0 else jax.random.fold_in(key, index)
        mask = mask_tile if mask_has_rows else whole_mask
        return _attend_rows(q_tile, key_, value, mask, dropout_p, is_causal, scale, tile_key, index * tile)

    def step(carry, xs):
        return carry, one_tile(*xs, key_, value)

    xs = (tiles(query), tiles(attn_mask) if mask_has_rows else None, jnp.arange(count))
    _, out = jax.lax.scan(step, None, xs)
    out = jnp.moveaxis(out, 0, -3)
    return out.reshape(out.shape[:-3] + (rows, out.shape[-1]))

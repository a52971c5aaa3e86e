"""Neural-network ops: softmax, normalization, embedding, pooling, attention."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxbackend.ops.registry import lowers

_PRECISION = jax.lax.Precision.HIGHEST


@lowers("aten._softmax.default")
def softmax(x, dim, half_to_float=False):
    return jax.nn.softmax(x.astype(jnp.float32) if half_to_float else x, axis=dim)


@lowers("aten._log_softmax.default")
def log_softmax(x, dim, half_to_float=False):
    return jax.nn.log_softmax(x.astype(jnp.float32) if half_to_float else x, axis=dim)


@lowers("aten._safe_softmax.default")
def safe_softmax(x, dim, dtype=None):
    x = x if dtype is None else x.astype(dtype)
    out = jax.nn.softmax(x, axis=dim)
    return jnp.where(jnp.all(x == -jnp.inf, axis=dim, keepdims=True), 0.0, out)


@lowers("aten.native_layer_norm.default")
def native_layer_norm(x, normalized_shape, weight, bias, eps):
    axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
    mean = jnp.mean(x, axis=axes, keepdims=True)
    centered = x - mean
    var = jnp.mean(centered * centered, axis=axes, keepdims=True)
    rstd = jax.lax.rsqrt(var + eps)
    out = centered * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    return out, mean, rstd


@lowers("aten.native_group_norm.default")
def native_group_norm(x, weight, bias, n, c, hw, group, eps):
    grouped = x.reshape(n, group, -1)
    mean = jnp.mean(grouped, axis=-1, keepdims=True)
    centered = grouped - mean
    var = jnp.mean(centered * centered, axis=-1, keepdims=True)
    rstd = jax.lax.rsqrt(var + eps)
    out = (centered * rstd).reshape(x.shape)
    channel_shape = (1, c) + (1,) * (x.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(channel_shape)
    if bias is not None:
        out = out + bias.reshape(channel_shape)
    return out, mean.reshape(n, group), rstd.reshape(n, group)


def _batch_norm_train(x, weight, bias, eps):
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (1, -1) + (1,) * (x.ndim - 2)
    mean = jnp.mean(x, axis=axes)
    centered = x - mean.reshape(shape)
    var = jnp.mean(centered * centered, axis=axes)
    rstd = jax.lax.rsqrt(var + eps)
    out = centered * rstd.reshape(shape)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out, mean, var, rstd


@lowers("aten._native_batch_norm_legit_functional.default")
def batch_norm_functional(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """Returns ``(out, save_mean, save_rstd, new_running_mean, new_running_var)``; running stats
    update with the unbiased batch variance, as PyTorch does."""
    if not training:
        out, _, _ = batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps)
        return out, jnp.zeros((0,), x.dtype), jnp.zeros((0,), x.dtype), running_mean, running_var
    out, mean, var, rstd = _batch_norm_train(x, weight, bias, eps)
    n = x.size // x.shape[1]
    unbiased = var * (n / max(n - 1, 1))
    new_mean = (1 - momentum) * running_mean + momentum * mean
    new_var = (1 - momentum) * running_var + momentum * unbiased
    return out, mean, rstd, new_mean.astype(running_mean.dtype), new_var.astype(running_var.dtype)


@lowers("aten._native_batch_norm_legit.no_stats")
def batch_norm_no_stats(x, weight, bias, training, momentum, eps):
    out, mean, _, rstd = _batch_norm_train(x, weight, bias, eps)
    return out, mean, rstd


@lowers("aten._native_batch_norm_legit_no_training.default")
def batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    out = (x - running_mean.reshape(shape)) * jax.lax.rsqrt(running_var.reshape(shape) + eps)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out, jnp.zeros((0,), x.dtype), jnp.zeros((0,), x.dtype)


@lowers("aten.embedding.default")
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """Row lookup. The ``padding_idx`` row gets no gradient, as in PyTorch."""
    if scale_grad_by_freq:
        raise NotImplementedError("embedding(scale_grad_by_freq=True) is not supported")
    out = jnp.take(weight, indices, axis=0)
    if padding_idx is not None and padding_idx >= 0:
        is_pad = (indices == padding_idx)[..., None]
        out = jnp.where(is_pad, jax.lax.stop_gradient(out), out)
    return out


# --- pooling -----------------------------------------------------------------------------------------

def _pool_geometry(in_sizes, kernel, stride, padding, dilation, ceil_mode):
    """Per spatial dim ``(low_pad, high_pad)`` giving PyTorch's output size."""
    pads = []
    for size, k, s, p, d in zip(in_sizes, kernel, stride, padding, dilation):
        span = d * (k - 1) + 1
        numerator = size + 2 * p - span + ((s - 1) if ceil_mode else 0)
        out = numerator // s + 1
        if ceil_mode and (out - 1) * s >= size + p:
            out -= 1
        pads.append((p, max((out - 1) * s + span - size - p, 0)))
    return pads


def _tuple(value, n, default=None):
    if value is None or (isinstance(value, (list, tuple)) and len(value) == 0):
        return default
    value = list(value) if isinstance(value, (list, tuple)) else [value]
    return tuple(value * n if len(value) == 1 else value)


@lowers("aten.max_pool2d_with_indices.default", "aten.max_pool3d_with_indices.default")
def max_pool_with_indices(x, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    """Returns ``(values, indices)``; indices are flat positions within each input plane."""
    spatial = len(kernel_size) if isinstance(kernel_size, (list, tuple)) and len(kernel_size) > 1 else x.ndim - 2
    kernel = _tuple(kernel_size, spatial)
    stride = _tuple(stride, spatial, kernel)
    padding = _tuple(padding, spatial)
    dilation = _tuple(dilation, spatial)
    pads = _pool_geometry(x.shape[-spatial:], kernel, stride, padding, dilation, ceil_mode)
    lead = x.ndim - spatial
    window = (1,) * lead + kernel
    strides = (1,) * lead + stride
    dil = (1,) * lead + dilation
    full_pads = [(0, 0)] * lead + pads
    neg_inf = _lowest(x.dtype)
    values = jax.lax.reduce_window(x, neg_inf, jax.lax.max, window, strides, full_pads, window_dilation=dil)
    indices = _window_argmax(jax.lax.stop_gradient(x), kernel, stride, dilation, pads, values.shape[-spatial:])
    return values, indices


def _lowest(dtype) -> np.ndarray:
    """The identity of max as a concrete numpy scalar (so JAX picks its differentiable max-pool)."""
    if jnp.issubdtype(dtype, jnp.floating):
        return np.array(-np.inf, dtype)
    return np.array(jnp.iinfo(dtype).min, dtype)


def _window_argmax(x, kernel, stride, dilation, pads, out_sizes):
    """Flat in-plane index of the first maximum of each pooling window (PyTorch's ``indices``).

    Walks the kernel offsets with strided slices of the padded input — no autodiff involved.
    """
    spatial = len(kernel)
    in_sizes = x.shape[-spatial:]
    lead = x.ndim - spatial
    low = _lowest(x.dtype)
    padded = jax.lax.pad(x, low, [(0, 0, 0)] * lead + [(lo, hi, 0) for lo, hi in pads])
    best_val = best_idx = None
    for offset in np.ndindex(*kernel):
        starts = [o * d for o, d in zip(offset, dilation)]
        window = padded
        coords = []
        for axis, (start, s, n, (lo, _)) in enumerate(zip(starts, stride, out_sizes, pads)):
            window = jax.lax.slice_in_dim(window, start, start + (n - 1) * s + 1, s, axis=lead + axis)
            coords.append(start - lo + s * np.arange(n))
        flat = np.zeros(out_sizes, np.int64)
        for axis, c in enumerate(coords):
            shape = [1] * spatial
            shape[axis] = -1
            flat = flat * in_sizes[axis] + c.reshape(shape)
        flat = jnp.asarray(flat, jnp.int32)
        if best_val is None:
            best_val, best_idx = window, jnp.broadcast_to(flat, window.shape)
        else:
            better = (window > best_val) | (jnp.isnan(window) & ~jnp.isnan(best_val))
            best_val = jnp.where(better, window, best_val)
            best_idx = jnp.where(better, flat, best_idx)
    return best_idx


@lowers("aten.avg_pool2d.default", "aten.avg_pool3d.default", "aten.avg_pool1d.default")
def avg_pool(x, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    spatial = len(kernel_size)
    kernel = _tuple(kernel_size, spatial)
    stride = _tuple(stride, spatial, kernel)
    padding = _tuple(padding, spatial)
    pads = _pool_geometry(x.shape[-spatial:], kernel, stride, padding, (1,) * spatial, ceil_mode)
    lead = x.ndim - spatial
    window = (1,) * lead + kernel
    strides = (1,) * lead + stride
    full_pads = [(0, 0)] * lead + pads
    total = jax.lax.reduce_window(x, np.zeros((), x.dtype), jax.lax.add, window, strides, full_pads)
    if divisor_override:
        return total / divisor_override
    # Count window cells inside the input (count_include_pad=False) or inside input + explicit padding.
    ones = jnp.ones(x.shape[-spatial:], x.dtype)
    if count_include_pad:
        ones = jax.lax.pad(ones, jnp.array(1, x.dtype), [(p, p, 0) for p in padding])
        count_pads = [(0, hi - lo) for (lo, hi) in pads]
    else:
        count_pads = pads
    counts = jax.lax.reduce_window(ones, np.zeros((), x.dtype), jax.lax.add, kernel, stride, count_pads)
    return total / counts


@lowers("aten._adaptive_avg_pool2d.default", "aten.adaptive_avg_pool2d.default",
        "aten._adaptive_avg_pool3d.default", "aten.adaptive_avg_pool1d.default")
def adaptive_avg_pool(x, output_size):
    spatial = len(output_size)
    out = x
    for axis_offset, out_size in enumerate(output_size):
        axis = x.ndim - spatial + axis_offset
        size = x.shape[axis]
        pieces = []
        for i in range(out_size):
            start = (i * size) // out_size
            end = -((-(i + 1) * size) // out_size)
            pieces.append(jnp.mean(jax.lax.slice_in_dim(out, start, end, axis=axis), axis=axis, keepdims=True))
        out = jnp.concatenate(pieces, axis=axis)
    return out


# --- attention ---------------------------------------------------------------------------------------

@lowers("aten.scaled_dot_product_attention.default", random=True)
def scaled_dot_product_attention(query, key_, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                 scale=None, enable_gqa=False, *, key):
    """softmax(Q Kᵀ·scale + mask) V over ``[..., L, E]`` × ``[..., S, E]`` × ``[..., S, Ev]``.

    Rows whose every key is masked give zeros (PyTorch's safe softmax), not NaN.
    """
    q_len, k_len = query.shape[-2], key_.shape[-2]
    if enable_gqa and query.ndim >= 3 and key_.shape[-3] != query.shape[-3]:
        repeats = query.shape[-3] // key_.shape[-3]
        key_ = jnp.repeat(key_, repeats, axis=-3)
        value = jnp.repeat(value, repeats, axis=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = jnp.matmul(query, jnp.swapaxes(key_, -1, -2), precision=_PRECISION) * scale
    allowed = None
    if is_causal:
        allowed = jnp.tril(jnp.ones((q_len, k_len), jnp.bool_))
    if attn_mask is not None:
        if attn_mask.dtype == jnp.bool_:
            allowed = attn_mask if allowed is None else (allowed & attn_mask)
        else:
            scores = scores + attn_mask
    if allowed is not None:
        scores = jnp.where(allowed, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = jnp.where(jnp.isneginf(jnp.max(scores, axis=-1, keepdims=True)), 0.0, weights)
    if dropout_p > 0.0:
        keep = jax.random.bernoulli(key, 1.0 - dropout_p, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - dropout_p), 0.0)
    return jnp.matmul(weights.astype(value.dtype), value, precision=_PRECISION)

"""Neural-network ops: softmax, normalization, embedding (attention is in ``attention.py``, pooling in
``pooling.py``)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxbackend.ops.registry import lowers

_HALF = (jnp.float16, jnp.bfloat16)


def _opmath(x):
    """``x`` in the dtype PyTorch's CPU kernels compute it in: float32 for fp16/bf16 (their ``opmath_type``),
    else unchanged. ``None`` stays ``None``."""
    return x.astype(jnp.float32) if x is not None and x.dtype in _HALF else x


def _in_opmath(fn):
    """Run a normalization lowering on float32 copies of fp16/bf16 operands, as PyTorch's kernels do.

    PyTorch computes the statistics, the normalized output and the backward of layer/group/batch norm in float32
    for half-precision tensors and rounds only the results. Left in fp16, the derivative JAX takes of
    ``rsqrt(var + eps)`` is ``-rstd / (2 (var + eps)) = -rstd³/2``, which overflows fp16 (max 65504) as soon
    as ``var + eps < 6.1e-4``: GPT-2's initial residual stream (std 0.02) is below that, and the backward turns
    the inf into NaN gradients. Results are cast back to the dtype torch reports by the caller (``lower``).
    """

    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        return fn(_opmath(x), *(_opmath(a) if isinstance(a, jax.Array) else a for a in args), **kwargs)

    return wrapper


# Softmax over rows that may be entirely -inf (a fully masked attention row). Such a "dead" row is
# shifted by the most negative float instead of its max (-inf), so its exponentials are 0, not NaN;
# clamping its sum to the smallest normal float then gives a zero softmax. The clamps are no-ops on live
# rows (their sum is at least 1) and, unlike ``where``, keep XLA's reduce + exp fusion intact.


def _exp_and_sum(x, axis):
    shift = jnp.maximum(jnp.max(x, axis=axis, keepdims=True), jnp.finfo(x.dtype).min)
    shifted = x - jax.lax.stop_gradient(shift)
    exp = jnp.exp(shifted)
    return shifted, exp, jnp.sum(exp, axis=axis, keepdims=True)


def _live(total):
    return jnp.maximum(total, jnp.finfo(total.dtype).tiny)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2))
def _softmax(x, axis, nan_dead_rows):
    """Softmax along ``axis``; dead rows are NaN (``nan_dead_rows``, PyTorch's ``_softmax``) or 0.

    The JVP is ``y·(t − Σ y·t)`` with the zero-filled ``y``, so a dead row's gradient is 0 even when
    its value is NaN: torch's ``_safe_softmax`` decomposes to ``where(dead, 0, _softmax)``, and a NaN
    gradient there would poison the whole backward pass.
    """
    _, exp, total = _exp_and_sum(x, axis)
    return exp / (total if nan_dead_rows else _live(total))


@_softmax.defjvp
def _softmax_jvp(axis, nan_dead_rows, primals, tangents):
    (x,), (t,) = primals, tangents
    _, exp, total = _exp_and_sum(x, axis)
    y = exp / _live(total)
    return (exp / total if nan_dead_rows else y), y * (t - jnp.sum(y * t, axis=axis, keepdims=True))


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _log_softmax(x, axis):
    """Log-softmax along ``axis``; a dead row is NaN, as in PyTorch, with a finite gradient."""
    shifted, _, total = _exp_and_sum(x, axis)
    return shifted - jnp.log(total)


@_log_softmax.defjvp
def _log_softmax_jvp(axis, primals, tangents):
    (x,), (t,) = primals, tangents
    shifted, exp, total = _exp_and_sum(x, axis)
    y = exp / _live(total)
    return shifted - jnp.log(total), t - jnp.sum(y * t, axis=axis, keepdims=True)


@lowers("aten._softmax.default")
def softmax(x, dim, half_to_float=False):
    """PyTorch's kernels compute an fp16/bf16 softmax (and its backward) in float32 and round the result,
    to float32 with ``half_to_float``, else to the input's dtype (the caller's cast)."""
    x = _opmath(x)
    return _softmax(x, dim, True) if x.ndim else jnp.ones_like(x)


@lowers("aten._log_softmax.default")
def log_softmax(x, dim, half_to_float=False):
    """In float32 for fp16/bf16 inputs, as :func:`softmax`."""
    x = _opmath(x)
    return _log_softmax(x, dim) if x.ndim else x - x


def _masked_softmax(x, axis):
    """Softmax that gives zeros (and zero gradients) for rows whose every entry is ``-inf``."""
    if x.ndim == 0:
        return jnp.where(x == -jnp.inf, 0.0, 1.0).astype(x.dtype)
    return _softmax(x, axis, False)


@lowers("aten._safe_softmax.default")
def safe_softmax(x, dim, dtype=None):
    return _masked_softmax(x if dtype is None else x.astype(dtype), dim)


@lowers("aten.native_layer_norm.default")
@_in_opmath
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
@_in_opmath
def native_group_norm(x, weight, bias, n, c, hw, group, eps):
    grouped = x.reshape(n, group, (c // group) * hw)
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


def _batch_norm_train(x, weight, bias, eps, across: tuple[str, ...] = ()):
    """Normalize over every dim but the channel dim 1. ``across``: inside ``shard_map``, the mesh axes the
    batch is split over; the statistics are then those of the whole batch (equal shards: mean of means)."""
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (1, -1) + (1,) * (x.ndim - 2)

    def mean_of(v):
        local = jnp.mean(v, axis=axes)
        return jax.lax.pmean(local, across) if across else local

    mean = mean_of(x)
    centered = x - mean.reshape(shape)
    var = mean_of(centered * centered)
    rstd = jax.lax.rsqrt(var + eps)
    out = centered * rstd.reshape(shape)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out, mean, var, rstd


@lowers("aten._native_batch_norm_legit_functional.default")
@_in_opmath
def batch_norm_functional(
    x, weight, bias, running_mean, running_var, training, momentum, eps, across: tuple[str, ...] = ()
):
    """Returns ``(out, save_mean, save_rstd, new_running_mean, new_running_var)``; running stats
    update with the unbiased batch variance, as PyTorch does. ``across``: see :func:`_batch_norm_train`."""
    if not training:
        out, _, _ = batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps)
        return out, jnp.zeros((0,), x.dtype), jnp.zeros((0,), x.dtype), running_mean, running_var
    out, mean, var, rstd = _batch_norm_train(x, weight, bias, eps, across)
    n = x.size // x.shape[1] * (jax.lax.axis_size(across) if across else 1)
    unbiased = var * (n / max(n - 1, 1))
    new_mean = (1 - momentum) * running_mean + momentum * mean
    new_var = (1 - momentum) * running_var + momentum * unbiased
    return out, mean, rstd, new_mean.astype(running_mean.dtype), new_var.astype(running_var.dtype)


@lowers("aten._native_batch_norm_legit.no_stats")
@_in_opmath
def batch_norm_no_stats(x, weight, bias, training, momentum, eps, across: tuple[str, ...] = ()):
    out, mean, _, rstd = _batch_norm_train(x, weight, bias, eps, across)
    return out, mean, rstd


@lowers("aten._native_batch_norm_legit_no_training.default")
@_in_opmath
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

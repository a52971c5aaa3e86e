"""Reductions: sum, mean, max/min, var/std, any/all, prod, arg-reductions, cumulative ops."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxbackend.ops.registry import lowers


def _axes(x, dim):
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return None
    dims = [dim] if isinstance(dim, int) else list(dim)
    return tuple(d + x.ndim if d < 0 else d for d in dims) if x.ndim else None


@lowers("aten.sum.dim_IntList", "aten.sum.default")
def sum_(x, dim=None, keepdim=False, dtype=None):
    """An fp16/bf16 sum accumulates in float32 and rounds once, as PyTorch's kernels do (``jnp.sum`` would
    accumulate in the input's dtype wherever XLA does not widen it itself)."""
    if dtype is None and (x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer)):
        dtype = jnp.int32
    result = jnp.dtype(dtype) if dtype is not None else x.dtype
    if result in (jnp.float16, jnp.bfloat16):
        return jnp.sum(x.astype(result), axis=_axes(x, dim), keepdims=keepdim, dtype=jnp.float32).astype(result)
    return jnp.sum(x, axis=_axes(x, dim), keepdims=keepdim, dtype=dtype)


@lowers("aten.mean.dim", "aten.mean.default")
def mean(x, dim=None, keepdim=False, dtype=None):
    return jnp.mean(x, axis=_axes(x, dim), keepdims=keepdim, dtype=dtype)


@lowers("aten.prod.dim_int", "aten.prod.default")
def prod(x, dim=None, keepdim=False, dtype=None):
    return jnp.prod(x, axis=_axes(x, dim), keepdims=keepdim, dtype=dtype)


@lowers("aten.amax.default")
def amax(x, dim=(), keepdim=False):
    return jnp.max(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers("aten.amin.default")
def amin(x, dim=(), keepdim=False):
    return jnp.min(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers("aten.max.default")
def max_all(x):
    return jnp.max(x)


@lowers("aten.min.default")
def min_all(x):
    return jnp.min(x)


@lowers("aten.max.dim")
def max_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    return jnp.max(x, axis=dim, keepdims=keepdim), jnp.argmax(x, axis=dim, keepdims=keepdim)


@lowers("aten.min.dim")
def min_dim(x, dim, keepdim=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    return jnp.min(x, axis=dim, keepdims=keepdim), jnp.argmin(x, axis=dim, keepdims=keepdim)


@lowers("aten.argmax.default")
def argmax(x, dim=None, keepdim=False):
    if dim is None:
        out = jnp.argmax(x.reshape(-1))
        return out.reshape((1,) * x.ndim) if keepdim else out
    return jnp.argmax(x, axis=dim, keepdims=keepdim) if x.ndim else jnp.zeros((), jnp.int32)


@lowers("aten.argmin.default")
def argmin(x, dim=None, keepdim=False):
    if dim is None:
        out = jnp.argmin(x.reshape(-1))
        return out.reshape((1,) * x.ndim) if keepdim else out
    return jnp.argmin(x, axis=dim, keepdims=keepdim) if x.ndim else jnp.zeros((), jnp.int32)


@lowers("aten.var.correction", "aten.var.dim")
def var(x, dim=None, *, correction=None, keepdim=False, unbiased=None):
    ddof = 1 if correction is None and unbiased is not False else (correction or 0)
    return jnp.var(x, axis=_axes(x, dim), ddof=ddof, keepdims=keepdim)


@lowers("aten.std.correction", "aten.std.dim")
def std(x, dim=None, *, correction=None, keepdim=False, unbiased=None):
    ddof = 1 if correction is None and unbiased is not False else (correction or 0)
    return jnp.std(x, axis=_axes(x, dim), ddof=ddof, keepdims=keepdim)


@lowers("aten.var_mean.correction")
def var_mean(x, dim=None, *, correction=None, keepdim=False):
    ddof = 1 if correction is None else correction
    axes = _axes(x, dim)
    return jnp.var(x, axis=axes, ddof=ddof, keepdims=keepdim), jnp.mean(x, axis=axes, keepdims=keepdim)


@lowers("aten.any.dim", "aten.any.dims", "aten.any.default")
def any_(x, dim=None, keepdim=False):
    return jnp.any(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers("aten.all.dim", "aten.all.dims", "aten.all.default")
def all_(x, dim=None, keepdim=False):
    return jnp.all(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers("aten.logsumexp.default")
def logsumexp(x, dim, keepdim=False):
    return jax.nn.logsumexp(x, axis=_axes(x, dim), keepdims=keepdim)


@lowers("aten.cumsum.default")
def cumsum(x, dim, dtype=None):
    if dtype is None and (x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer)):
        dtype = jnp.int32
    return jnp.cumsum(x, axis=dim, dtype=dtype) if x.ndim else x.astype(dtype or x.dtype)


@lowers("aten.cumprod.default")
def cumprod(x, dim, dtype=None):
    return jnp.cumprod(x, axis=dim, dtype=dtype) if x.ndim else x


@lowers("aten.logcumsumexp.default")
def logcumsumexp(x, dim):
    return jax.lax.cumlogsumexp(x, axis=dim % x.ndim) if x.ndim else x


@lowers("aten.histc.default")
def histc(x, bins=100, min=0, max=0):
    """Counts of ``x`` in ``bins`` equal bins over ``[min, max]`` (the data's range when ``min == max``);
    values outside are ignored, ``max`` itself falls in the last bin."""
    if min == max:
        lo, hi = jnp.min(x), jnp.max(x)
        lo, hi = jnp.where(lo == hi, lo - 1, lo), jnp.where(lo == hi, hi + 1, hi)
    else:
        lo, hi = jnp.asarray(min, x.dtype), jnp.asarray(max, x.dtype)
    position = jnp.floor((x - lo) / (hi - lo) * bins).astype(jnp.int32)
    position = jnp.where(x == hi, bins - 1, position)
    inside = (x >= lo) & (x <= hi)
    index = jnp.where(inside, position, bins).reshape(-1)
    return jnp.zeros((bins,), x.dtype).at[index].add(1, mode="drop")


@lowers("aten.linalg_vector_norm.default")
def vector_norm(x, ord=2, dim=None, keepdim=False, dtype=None):
    axes = _axes(x, dim)
    x = jnp.abs(x if dtype is None else x.astype(dtype))
    if ord == float("inf"):
        return jnp.max(x, axis=axes, keepdims=keepdim)
    if ord == float("-inf"):
        return jnp.min(x, axis=axes, keepdims=keepdim)
    if ord == 0:
        return jnp.sum(x != 0, axis=axes, keepdims=keepdim).astype(x.dtype)
    if ord == 2:
        return jnp.sqrt(jnp.sum(x * x, axis=axes, keepdims=keepdim))
    return jnp.sum(x**ord, axis=axes, keepdims=keepdim) ** (1.0 / ord)

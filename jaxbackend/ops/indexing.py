"""Gather/scatter and advanced indexing: gather, scatter(_add/_reduce), index, index_put,
index_select, masked ops, sort/topk."""

from __future__ import annotations

import jax
import jax.numpy as jnp


from jaxbackend.ops.registry import lowers


def _dim(dim, rank):
    return dim + rank if dim < 0 else dim


def _along_axis_indices(index, dim):
    """Full coordinate arrays for ``x[..., index, ...]`` along ``dim`` (torch.gather/scatter semantics)."""
    grids = list(jnp.meshgrid(*[jnp.arange(s) for s in index.shape], indexing="ij"))
    grids[dim] = index
    return tuple(grids)


@lowers("aten.gather.default")
def gather(x, dim, index, sparse_grad=False):
    if x.ndim == 0:
        return x
    dim = _dim(dim, x.ndim)
    if index.shape[:dim] == x.shape[:dim] and index.shape[dim + 1:] == x.shape[dim + 1:]:
        return jnp.take_along_axis(x, index, axis=dim)
    return x[_along_axis_indices(index, dim)]


@lowers("aten.scatter.src", "aten.scatter.value")
def scatter(x, dim, index, src):
    if x.ndim == 0:
        return jnp.asarray(src, x.dtype).reshape(()) if not hasattr(src, "shape") else src.reshape(())
    dim = _dim(dim, x.ndim)
    if hasattr(src, "shape"):
        src = src[tuple(slice(0, s) for s in index.shape)]
    return x.at[_along_axis_indices(index, dim)].set(src)


@lowers("aten.scatter_add.default")
def scatter_add(x, dim, index, src):
    if x.ndim == 0:
        return x + src.reshape(())
    dim = _dim(dim, x.ndim)
    src = src[tuple(slice(0, s) for s in index.shape)]
    return x.at[_along_axis_indices(index, dim)].add(src)


@lowers("aten.scatter_reduce.two")
def scatter_reduce(x, dim, index, src, reduce, include_self=True):
    dim = _dim(dim, x.ndim)
    src = src[tuple(slice(0, s) for s in index.shape)]
    where = _along_axis_indices(index, dim)
    if reduce == "sum":
        return (x if include_self else x.at[where].set(0)).at[where].add(src)
    if reduce == "prod":
        return (x if include_self else x.at[where].set(1)).at[where].multiply(src)
    if reduce == "amax":
        base = x if include_self else x.at[where].set(jnp.array(-jnp.inf, x.dtype))
        return base.at[where].max(src)
    if reduce == "amin":
        base = x if include_self else x.at[where].set(jnp.array(jnp.inf, x.dtype))
        return base.at[where].min(src)
    if reduce == "mean":
        total = (x if include_self else x.at[where].set(0)).at[where].add(src)
        count = jnp.ones_like(x) if include_self else jnp.zeros_like(x)
        count = count.at[where].add(jnp.ones_like(src))
        out = total / jnp.maximum(count, 1)
        return out if jnp.issubdtype(x.dtype, jnp.floating) else jnp.floor_divide(total, jnp.maximum(count, 1))
    raise NotImplementedError(f"scatter_reduce reduce={reduce!r}")


@lowers("aten.index_select.default")
def index_select(x, dim, index):
    if x.ndim == 0:
        return x
    return jnp.take(x, index, axis=_dim(dim, x.ndim))


def _index_tuple(indices):
    return tuple(slice(None) if i is None else (i.astype(jnp.int32) if i.dtype != jnp.bool_ else i) for i in indices)


@lowers("aten.index.Tensor")
def index(x, indices):
    if any(i is not None and i.dtype == jnp.bool_ for i in indices):
        raise NotImplementedError("boolean-mask indexing has a data-dependent shape; use torch.where instead")
    return x[_index_tuple(indices)]


@lowers("aten.index_put.default")
def index_put(x, indices, values, accumulate=False):
    where = _index_tuple(indices)
    if any(i is not None and i.dtype == jnp.bool_ for i in indices):
        if len(indices) == 1 and indices[0].shape == x.shape:
            return jnp.where(indices[0], values.astype(x.dtype), x) if not accumulate else x + jnp.where(indices[0], values, 0)
        raise NotImplementedError("index_put with a partial boolean mask")
    return x.at[where].add(values) if accumulate else x.at[where].set(values.astype(x.dtype))


@lowers("aten.index_add.default")
def index_add(x, dim, index, source, alpha=1):
    dim = _dim(dim, x.ndim)
    where = (slice(None),) * dim + (index,)
    return x.at[where].add(source * alpha if alpha != 1 else source)


@lowers("aten.index_copy.default")
def index_copy(x, dim, index, source):
    dim = _dim(dim, x.ndim)
    return x.at[(slice(None),) * dim + (index,)].set(source)


@lowers("aten.index_fill.int_Scalar", "aten.index_fill.int_Tensor")
def index_fill(x, dim, index, value):
    dim = _dim(dim, x.ndim)
    return x.at[(slice(None),) * dim + (index,)].set(value)


@lowers("aten.masked_fill.Scalar", "aten.masked_fill.Tensor")
def masked_fill(x, mask, value):
    return jnp.where(mask, jnp.asarray(value, x.dtype), x)


@lowers("aten.masked_scatter.default")
def masked_scatter(x, mask, source):
    mask = jnp.broadcast_to(mask, x.shape)
    positions = jnp.cumsum(mask.reshape(-1)) - 1
    gathered = source.reshape(-1)[jnp.clip(positions, 0, source.size - 1)]
    return jnp.where(mask, gathered.reshape(x.shape), x)


@lowers("aten.sort.default", "aten.sort.stable")
def sort(x, dim=-1, descending=False, *, stable=False):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    dim = _dim(dim, x.ndim) if isinstance(dim, int) else -1
    keys = -x if descending and not jnp.issubdtype(x.dtype, jnp.bool_) else x
    order = jnp.argsort(keys, axis=dim, stable=True, descending=descending and jnp.issubdtype(x.dtype, jnp.bool_))
    return jnp.take_along_axis(x, order, axis=dim), order


@lowers("aten.topk.default")
def topk(x, k, dim=-1, largest=True, sorted=True):
    dim = _dim(dim, x.ndim) if x.ndim else 0
    moved = jnp.moveaxis(x, dim, -1)
    values, indices = jax.lax.top_k(moved if largest else -moved, k)
    values = values if largest else -values
    return jnp.moveaxis(values, -1, dim), jnp.moveaxis(indices, -1, dim)


@lowers("aten.nonzero.default")
def nonzero(x):
    raise NotImplementedError("nonzero has a data-dependent output shape, which XLA cannot compile")


@lowers("aten.bucketize.Tensor")
def bucketize(x, boundaries, out_int32=False, right=False):
    return jnp.searchsorted(boundaries, x, side="right" if right else "left")


@lowers("aten.one_hot.default")
def one_hot(x, num_classes=-1):
    if num_classes < 0:
        raise NotImplementedError("one_hot without num_classes has a data-dependent shape")
    return jax.nn.one_hot(x, num_classes, dtype=jnp.int32)




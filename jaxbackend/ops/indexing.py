"""Gather/scatter and advanced indexing: gather, scatter(_add/_reduce), index, index_put,
index_select, masked ops, sort/topk."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxbackend.ops.registry import lowers
from jaxbackend.ops.row_exchange import gather_rows, put_rows
from jaxbackend.ops.scalars import fit
from jaxbackend.sharding import in_data_replica


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
    if index.shape[:dim] == x.shape[:dim] and index.shape[dim + 1 :] == x.shape[dim + 1 :]:
        if index.shape[dim] == 1 and in_data_replica():
            return _select_along_axis(x, index, dim)
        if index.shape[dim] == 1 and jnp.issubdtype(x.dtype, jnp.inexact):
            return _take_one_along_axis(x, index, dim, x.shape, x.dtype)
        return jnp.take_along_axis(x, index, axis=dim)
    return x[_along_axis_indices(index, dim)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _take_one_along_axis(x, index, dim, shape, dtype):
    """``take_along_axis(x, index, dim)`` for one index per position (``index.shape[dim] == 1``: the loss's gather of
    each row's label), whose gradient is ``where(iota_dim == index, g, 0)``: one elementwise pass XLA fuses into the
    consumer (the log-softmax's backward), where ``take_along_axis``'s own transpose fills a ``shape`` buffer with
    zeros and scatters into it (on 2 CPU cores 12.7 ms a step for Mixtral's ``[1024, 8192]`` logits). The same values:
    each position receives the one cotangent that selected it (torch's ``scatter_add`` into zeros)."""
    return jnp.take_along_axis(x, index, axis=dim)


def _take_one_forward(x, index, dim, shape, dtype):
    return jnp.take_along_axis(x, index, axis=dim), index


def _take_one_backward(dim, shape, dtype, index, g):
    return jnp.where(_picked(index, shape, dim), g, jnp.zeros((), g.dtype)).astype(dtype), None


_take_one_along_axis.defvjp(_take_one_forward, _take_one_backward)


def _select_along_axis(x, index, dim):
    """``take_along_axis(x, index, dim)`` for one index per position (``index.shape[dim] == 1``, e.g. NLL's target
    gather) as a masked sum over ``dim``: the one selected value plus zeros, so the same number, and elementwise work
    XLA's partitioner splits like any other. Used inside a data replica's step (a ``shard_map`` manual over the data
    axis), where partitioning the batched gather ``take_along_axis`` emits aborts XLA (``spmd_partitioner_util.cc``:
    ``partition_group_list.num_replica_groups() * ... == device_groups.num_devices_per_group()``, jax 0.10.2, 2×2×2
    mesh). An index out of range selects nothing (0), where torch raises."""
    return jnp.sum(jnp.where(_picked(index, x.shape, dim), x, jnp.zeros((), x.dtype)), axis=dim, keepdims=True)


def _picked(index, shape, dim):
    """``[shape]`` booleans: true where the position along ``dim`` is the one ``index`` (size 1 there) names."""
    return jax.lax.broadcasted_iota(index.dtype, shape, dim) == index


def _lift_scalar(fn):
    """Run ``fn(x, dim, index, src, ...)`` on 1-element 1-d views when ``x`` is 0-d (torch allows it)."""

    def lifted(x, dim, index, src, *args, **kwargs):
        if x.ndim:
            return fn(x, dim, index, src, *args, **kwargs)
        src = src.reshape(1) if hasattr(src, "shape") else src
        return fn(x.reshape(1), 0, index.reshape(1), src, *args, **kwargs).reshape(())

    return lifted


def _src_window(src, index):
    """``src[:index.shape[0], :index.shape[1], ...]``: torch scatters only that corner of ``src``."""
    if not hasattr(src, "shape"):
        return src
    return src[tuple(slice(0, s) for s in index.shape)]


def _as(x, value):
    """``value`` in ``x``'s dtype (a Python float scattered into an int tensor truncates, as in torch)."""
    return jnp.asarray(value).astype(x.dtype)


@lowers("aten.scatter.src", "aten.scatter.value")
@_lift_scalar
def scatter(x, dim, index, src):
    dim = _dim(dim, x.ndim)
    return x.at[_along_axis_indices(index, dim)].set(_as(x, _src_window(src, index)))


@lowers("aten.scatter.reduce", "aten.scatter.value_reduce")
@_lift_scalar
def scatter_reduce_legacy(x, dim, index, src, *, reduce):
    """``scatter(..., reduce="add" | "multiply")`` (the older API)."""
    dim = _dim(dim, x.ndim)
    where, src = _along_axis_indices(index, dim), _as(x, _src_window(src, index))
    if reduce == "add":
        return x.at[where].add(src)
    if reduce == "multiply":
        return x.at[where].multiply(src)
    raise NotImplementedError(f"scatter reduce={reduce!r}")


@lowers("aten.scatter_add.default")
@_lift_scalar
def scatter_add(x, dim, index, src):
    dim = _dim(dim, x.ndim)
    return x.at[_along_axis_indices(index, dim)].add(_as(x, _src_window(src, index)))


def _extreme(dtype, sign):
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.array(sign * jnp.inf, dtype)
    info = jnp.iinfo(dtype)
    return jnp.array(info.max if sign > 0 else info.min, dtype)


@lowers("aten.scatter_reduce.two")
@_lift_scalar
def scatter_reduce(x, dim, index, src, reduce, include_self=True):
    dim = _dim(dim, x.ndim)
    src = _src_window(src, index)
    where = _along_axis_indices(index, dim)
    if reduce == "sum":
        return (x if include_self else x.at[where].set(0)).at[where].add(src)
    if reduce == "prod":
        return _scatter_prod(x, where, src, include_self)
    if reduce == "amax":
        return (x if include_self else x.at[where].set(_extreme(x.dtype, -1))).at[where].max(src)
    if reduce == "amin":
        return (x if include_self else x.at[where].set(_extreme(x.dtype, 1))).at[where].min(src)
    if reduce == "mean":
        total = (x if include_self else x.at[where].set(0)).at[where].add(src)
        count = jnp.ones_like(x) if include_self else jnp.zeros_like(x)
        count = jnp.maximum(count.at[where].add(jnp.ones_like(src)), 1)
        return total / count if jnp.issubdtype(x.dtype, jnp.floating) else jnp.floor_divide(total, count)
    raise NotImplementedError(f"scatter_reduce reduce={reduce!r}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _scatter_prod(x, where, src, include_self):
    base = x if include_self else x.at[where].set(1)
    return base.at[where].multiply(src)


def _scatter_prod_fwd(x, where, src, include_self):
    out = _scatter_prod(x, where, src, include_self)
    return out, (x, where, src, out)


def _scatter_prod_bwd(include_self, residuals, grad):
    """PyTorch's ``scatter_reduce_backward`` for ``prod``: exclusive products, exact with zeros."""
    x, where, src, out = residuals
    masked_x = jnp.where(x == 0, 1, x)
    grad_x = grad * _scatter_prod(masked_x, where, src, include_self) / masked_x
    src_zero = src == 0
    zeros_at_target = jnp.zeros_like(x).at[where].add(src_zero.astype(x.dtype))[where]
    single_zero = src_zero & (zeros_at_target == 1)
    without_zero = _scatter_prod(x, where, jnp.where(single_zero, 1, src), include_self)
    grad_src = jnp.where(single_zero, (grad * without_zero)[where], (grad * out)[where] / jnp.where(src_zero, 1, src))
    if not include_self:
        grad_x = grad_x.at[where].set(0)
    return grad_x, None, grad_src


_scatter_prod.defvjp(_scatter_prod_fwd, _scatter_prod_bwd)


@lowers("aten.index_select.default")
def index_select(x, dim, index):
    if x.ndim == 0:
        return x
    return jnp.take(x, index, axis=_dim(dim, x.ndim))


def _index_tuple(indices):
    return tuple(slice(None) if i is None else (i.astype(jnp.int32) if i.dtype != jnp.bool_ else i) for i in indices)


@lowers("aten.index.Tensor", sharded=True)
def index(x, indices, *, shardings=None, rows=None):
    """``x[indices]``. With ``rows="exchange"`` (a plan keeping ``x``'s rows split, the one index whole:
    ``shardings`` pins them) only the rows other devices need move (:mod:`.row_exchange`)."""
    if any(i is not None and i.dtype == jnp.bool_ for i in indices):
        raise NotImplementedError("boolean-mask indexing has a data-dependent shape; use torch.where instead")
    if rows == "exchange" and shardings and shardings[0] is not None:
        spec = (tuple(shardings[0].spec) + (None,) * x.ndim)[: x.ndim]
        return gather_rows(x, indices[0], shardings[0].mesh, spec)
    return x[_index_tuple(indices)]


@lowers("aten.index_put.default", sharded=True)
def index_put(x, indices, values, accumulate=False, *, shardings=None, rows=None):
    """``x.index_put(indices, values, accumulate)``; ``rows="exchange"`` as for :func:`index`: ``values``' rows go
    to the devices holding their destination rows."""
    if any(i is not None and i.dtype == jnp.bool_ for i in indices):
        return _index_put_mask(x, indices, values, accumulate)
    if rows == "exchange" and shardings and shardings[0] is not None:
        spec = (tuple(shardings[0].spec) + (None,) * x.ndim)[: x.ndim]
        return put_rows(x, indices[0], values, shardings[0].mesh, spec, accumulate)
    where = _index_tuple(indices)
    return x.at[where].add(values.astype(x.dtype)) if accumulate else x.at[where].set(values.astype(x.dtype))


def _index_put_mask(x, indices, values, accumulate):
    """``x[mask] = values`` for a leading boolean mask over ``x``'s first dims, when ``values`` does not
    depend on how many entries are selected (it broadcasts over the trailing dims): a ``where``."""
    mask = indices[0]
    trailing = x.shape[mask.ndim :]
    if (
        len(indices) != 1
        or mask.shape != x.shape[: mask.ndim]
        or (values.ndim > len(trailing) and any(s != 1 for s in values.shape[: values.ndim - len(trailing)]))
    ):
        raise NotImplementedError(
            "index_put with a boolean mask whose values depend on the number of selected entries has a "
            "data-dependent shape; use torch.where(mask, values, x) instead"
        )
    values = values.reshape(
        values.shape[values.ndim - len(trailing) :] if values.ndim > len(trailing) else values.shape
    )
    values = jnp.broadcast_to(values.astype(x.dtype), x.shape)
    mask = mask.reshape(mask.shape + (1,) * len(trailing))
    return jnp.where(mask, x + values if accumulate else values, x)


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
    return x.at[(slice(None),) * dim + (index,)].set(_as(x, fit(value)))


@lowers("aten.masked_fill.Scalar", "aten.masked_fill.Tensor")
def masked_fill(x, mask, value):
    return jnp.where(mask, _as(x, fit(value)), x)


@lowers("aten.masked_scatter.default")
def masked_scatter(x, mask, source):
    shape = jnp.broadcast_shapes(x.shape, mask.shape)
    x, mask = jnp.broadcast_to(x, shape), jnp.broadcast_to(mask, shape)
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
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int32)
    dim = _dim(dim, x.ndim)
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


@lowers("aten.bucketize.Scalar")
def bucketize_scalar(x, boundaries, out_int32=False, right=False):
    return jnp.searchsorted(boundaries, jnp.asarray(x), side="right" if right else "left")


@lowers("aten.searchsorted.Tensor", "aten.searchsorted.Scalar")
def searchsorted(sorted_sequence, values, *, out_int32=False, right=False, side=None, sorter=None):
    """Insertion points of ``values`` into ``sorted_sequence`` (batched over its leading dims)."""
    side = side or ("right" if right else "left")
    if sorter is not None:
        sorted_sequence = jnp.take_along_axis(sorted_sequence, sorter, axis=-1)
    values = jnp.asarray(values)
    if sorted_sequence.ndim <= 1 or values.size == 0:
        if values.size == 0:
            return jnp.zeros(values.shape, jnp.int32)
        return jnp.searchsorted(sorted_sequence, values, side=side)
    lead = sorted_sequence.shape[:-1]
    flat_seq = sorted_sequence.reshape((-1, sorted_sequence.shape[-1]))
    flat_values = values.reshape((flat_seq.shape[0], -1))
    out = jax.vmap(lambda seq, v: jnp.searchsorted(seq, v, side=side))(flat_seq, flat_values)
    return out.reshape(lead + values.shape[len(lead) :])


@lowers("aten.one_hot.default")
def one_hot(x, num_classes=-1):
    if num_classes < 0:
        raise NotImplementedError("one_hot without num_classes has a data-dependent shape")
    return jax.nn.one_hot(x, num_classes, dtype=jnp.int32)

"""Shape, view, creation and copy ops.

Core ATen is functional, so views are values: ``view``/``permute``/``slice`` produce new arrays and
XLA removes the copies. Creation ops ignore ``device``/``layout``/``pin_memory`` arguments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxbackend.ops.registry import lowers
from jaxbackend.ops.scalars import fit


def _dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


@lowers("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.view_copy.default")
def view(x, size):
    return jnp.reshape(x, tuple(size))


@lowers("aten.permute.default", "aten.permute_copy.default")
def permute(x, dims):
    return jnp.transpose(x, tuple(_dim(d, x.ndim) for d in dims))


@lowers("aten.t.default")
def t(x):
    return x.T if x.ndim == 2 else x


@lowers("aten.transpose.int")
def transpose(x, dim0, dim1):
    return jnp.swapaxes(x, dim0, dim1)


@lowers("aten.expand.default", "aten.expand_copy.default")
def expand(x, size, implicit=False):
    lead = len(size) - x.ndim
    shape = tuple(x.shape[i - lead] if s == -1 else s for i, s in enumerate(size))
    return jnp.broadcast_to(x, shape)


@lowers("aten.squeeze.dims", "aten.squeeze.dim", "aten.squeeze.default", "aten.squeeze_copy.dims")
def squeeze(x, dim=None):
    if dim is None:
        return jnp.squeeze(x)
    dims = [dim] if isinstance(dim, int) else list(dim)
    dims = tuple(d for d in (_dim(d, x.ndim) for d in dims) if x.ndim and x.shape[d] == 1)
    return jnp.squeeze(x, dims) if dims else x


@lowers("aten.unsqueeze.default", "aten.unsqueeze_copy.default")
def unsqueeze(x, dim):
    return jnp.expand_dims(x, _dim(dim, x.ndim + 1))


@lowers("aten.slice.Tensor", "aten.slice_copy.Tensor")
def slice_(x, dim=0, start=None, end=None, step=1):
    dim = _dim(dim, x.ndim)
    size = x.shape[dim]
    start, end = _clamp_range(size, start, end)
    return jax.lax.slice_in_dim(x, start, end, step, axis=dim)


def _clamp_range(size: int, start, end) -> tuple[int, int]:
    """Python slice bounds (negative from the end, clamped to ``[0, size]``, ``end >= start``)."""
    start = 0 if start is None else start
    end = size if end is None else end
    start = min(max(start + size if start < 0 else start, 0), size)
    end = min(max(end + size if end < 0 else end, start), size)
    return start, end


@lowers("aten.select.int", "aten.select_copy.int")
def select(x, dim, index):
    dim = _dim(dim, x.ndim)
    index = index + x.shape[dim] if index < 0 else index
    return jax.lax.index_in_dim(x, index, axis=dim, keepdims=False)


@lowers("aten.split_with_sizes.default", "aten.split_with_sizes_copy.default")
def split_with_sizes(x, split_sizes, dim=0):
    dim = _dim(dim, x.ndim)
    offsets = np.cumsum([0, *split_sizes])
    return [jax.lax.slice_in_dim(x, int(a), int(b), axis=dim) for a, b in zip(offsets[:-1], offsets[1:])]


@lowers("aten.split.Tensor", "aten.split_copy.Tensor")
def split(x, split_size, dim=0):
    dim = _dim(dim, x.ndim)
    size = x.shape[dim]
    sizes = [min(split_size, size - start) for start in range(0, size, split_size)] or [0]
    return split_with_sizes(x, sizes, dim)


@lowers("aten.unbind.int")
def unbind(x, dim=0):
    dim = _dim(dim, x.ndim)
    return [jax.lax.index_in_dim(x, i, axis=dim, keepdims=False) for i in range(x.shape[dim])]


@lowers("aten.slice_scatter.default")
def slice_scatter(x, src, dim=0, start=None, end=None, step=1):
    """``x`` with ``x[..., start:end:step, ...] = src`` along ``dim``."""
    dim = _dim(dim, x.ndim)
    start, end = _clamp_range(x.shape[dim], start, end)
    src = src.astype(x.dtype)
    if step == 1:
        return jax.lax.dynamic_update_slice_in_dim(x, src, start, axis=dim)
    return x.at[(slice(None),) * dim + (slice(start, end, step),)].set(src)


@lowers("aten.select_scatter.default")
def select_scatter(x, src, dim, index):
    dim = _dim(dim, x.ndim)
    index = index + x.shape[dim] if index < 0 else index
    return jax.lax.dynamic_update_slice_in_dim(x, jnp.expand_dims(src.astype(x.dtype), dim), index, axis=dim)


@lowers("aten.diagonal.default", "aten.diagonal_copy.default")
def diagonal(x, offset=0, dim1=0, dim2=1):
    return jnp.diagonal(x, offset, _dim(dim1, x.ndim), _dim(dim2, x.ndim))


@lowers("aten.diagonal_scatter.default")
def diagonal_scatter(x, src, offset=0, dim1=0, dim2=1):
    dim1, dim2 = _dim(dim1, x.ndim), _dim(dim2, x.ndim)
    rows = np.arange(src.shape[-1]) + max(-offset, 0)
    cols = np.arange(src.shape[-1]) + max(offset, 0)
    moved = jnp.moveaxis(x, (dim1, dim2), (-2, -1))
    moved = moved.at[..., rows, cols].set(src.astype(x.dtype))
    return jnp.moveaxis(moved, (-2, -1), (dim1, dim2))


@lowers("aten.unfold.default")
def unfold(x, dimension, size, step):
    """Sliding windows of ``size`` every ``step`` along ``dimension``, as a new last dim."""
    if x.ndim == 0:
        return x.reshape(1)
    dim = _dim(dimension, x.ndim)
    count = (x.shape[dim] - size) // step + 1
    windows = np.arange(count)[:, None] * step + np.arange(size)[None, :]
    return jnp.moveaxis(jnp.take(x, jnp.asarray(windows, jnp.int32), axis=dim), dim + 1, -1)


@lowers("aten.repeat_interleave.Tensor")
def repeat_interleave(repeats, output_size=None):
    """``[0]*repeats[0] + [1]*repeats[1] + ...``; the static ``output_size`` must be given."""
    if output_size is None:
        raise NotImplementedError(
            "repeat_interleave with tensor repeats and no output_size has a data-dependent shape; pass output_size="
        )
    return jnp.repeat(jnp.arange(repeats.shape[0]), repeats, total_repeat_length=output_size)


@lowers("aten.cat.default")
def cat(tensors, dim=0):
    tensors = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or list(tensors)[:1]
    dtype = jnp.result_type(*tensors)
    return jnp.concatenate([t.astype(dtype) for t in tensors], axis=_dim(dim, tensors[0].ndim))


@lowers("aten.stack.default")
def stack(tensors, dim=0):
    return jnp.stack(tensors, axis=_dim(dim, tensors[0].ndim + 1))


@lowers("aten.flip.default")
def flip(x, dims):
    return jnp.flip(x, tuple(dims))


@lowers("aten.roll.default")
def roll(x, shifts, dims=()):
    if not dims:
        return jnp.roll(x.reshape(-1), shifts[0]).reshape(x.shape)
    return jnp.roll(x, tuple(shifts), tuple(dims))


@lowers("aten.repeat.default")
def repeat(x, repeats):
    lead = len(repeats) - x.ndim
    return jnp.tile(x.reshape((1,) * lead + x.shape), tuple(repeats))


@lowers("aten.tril.default")
def tril(x, diagonal=0):
    return jnp.tril(x, diagonal)


@lowers("aten.triu.default")
def triu(x, diagonal=0):
    return jnp.triu(x, diagonal)


@lowers("aten.constant_pad_nd.default")
def constant_pad_nd(x, pad, value=0):
    widths = [(0, 0)] * x.ndim
    for i in range(len(pad) // 2):
        widths[x.ndim - 1 - i] = (pad[2 * i], pad[2 * i + 1])
    config = [(lo, hi, 0) for lo, hi in widths]
    return jax.lax.pad(x, jnp.asarray(fit(value), x.dtype), config)


# --- identity-like -----------------------------------------------------------------------------------


@lowers(
    "aten.clone.default",
    "aten.alias.default",
    "aten.lift_fresh_copy.default",
    "aten.alias_copy.default",
    "aten.contiguous.default",
    "torchpar.pipeline_boundary",
)
def identity(x, memory_format=None):
    return x


@lowers("torchpar.autograd_function_input", "torchpar.autograd_function_output")
def autograd_function_marker(x, *marker_args):
    """The markers around a custom ``autograd.Function`` (``torchpar.ir.function_regions``): the identity;
    ``jaxbackend.lower`` gives the region between them the Function's own backward."""
    return x


@lowers("torchpar.stop_gradient", "aten.detach.default")
def stop_gradient(x):
    """Where PyTorch's autograd stops the gradient (``detach``, a ``no_grad`` region's results; see
    ``torchpar.capture.semantics.grad_semantics``): the value passes, its cotangent is zero."""
    return jax.lax.stop_gradient(x)


@lowers("aten._to_copy.default")
def to_copy(x, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    return x if dtype is None else x.astype(dtype)


@lowers("aten.copy.default")
def copy(x, src, non_blocking=False):
    return jnp.broadcast_to(src.astype(x.dtype), x.shape)


@lowers(
    "aten._assert_tensor_metadata.default",
    "aten._assert_scalar.default",
    "aten.sym_constrain_range_for_size.default",
    "aten._assert_async.msg",
    "aten._assert_async.default",
)
def assert_metadata(*args, **kwargs):
    return None


@lowers("getitem")
def getitem(values, index):
    return values[index]


# --- creation -----------------------------------------------------------------------------------------


def _float_default(dtype):
    return jnp.float32 if dtype is None else dtype


@lowers("aten.full.default")
def full(size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    if dtype is None:
        dtype = (
            jnp.bool_ if isinstance(fill_value, bool) else (jnp.int32 if isinstance(fill_value, int) else jnp.float32)
        )
    return jnp.full(tuple(size), fit(fill_value), dtype)


@lowers("aten.full_like.default")
def full_like(x, fill_value, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.full(x.shape, fit(fill_value), x.dtype if dtype is None else dtype)


@lowers("aten.zeros.default")
def zeros(size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), _float_default(dtype))


@lowers("aten.ones.default")
def ones(size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), _float_default(dtype))


@lowers("aten.zeros_like.default")
def zeros_like(x, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(x.shape, x.dtype if dtype is None else dtype)


@lowers("aten.ones_like.default")
def ones_like(x, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.ones(x.shape, x.dtype if dtype is None else dtype)


@lowers("aten.empty.memory_format", "aten.empty_strided.default")
def empty(size, *rest, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(tuple(size), _float_default(dtype))


@lowers("aten.empty_permuted.default")
def empty_permuted(size, physical_layout, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), _float_default(dtype))


@lowers("aten.empty_like.default")
def empty_like(x, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return jnp.zeros(x.shape, x.dtype if dtype is None else dtype)


@lowers("aten.new_zeros.default")
def new_zeros(x, size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), x.dtype if dtype is None else dtype)


@lowers("aten.new_ones.default")
def new_ones(x, size, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.ones(tuple(size), x.dtype if dtype is None else dtype)


@lowers("aten.new_full.default")
def new_full(x, size, fill_value, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.full(tuple(size), fit(fill_value), x.dtype if dtype is None else dtype)


@lowers("aten.new_empty.default", "aten.new_empty_strided.default")
def new_empty(x, size, *rest, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(tuple(size), x.dtype if dtype is None else dtype)


@lowers("aten.scalar_tensor.default")
def scalar_tensor(value, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(fit(value), _float_default(dtype))


def _arange_dtype(values, dtype):
    if dtype is not None:
        return dtype
    return jnp.int32 if all(isinstance(v, int) for v in values) else jnp.float32


@lowers("aten.arange.default")
def arange(end, dtype=None, layout=None, device=None, pin_memory=None):
    return arange_start_step(0, end, 1, dtype)


@lowers("aten.arange.start")
def arange_start(start, end, dtype=None, layout=None, device=None, pin_memory=None):
    return arange_start_step(start, end, 1, dtype)


@lowers("aten.arange.start_step")
def arange_start_step(start, end, step=1, dtype=None, layout=None, device=None, pin_memory=None):
    """PyTorch's ``arange``: ``ceil((end − start) / step)`` elements counted in float64; for an integer dtype the
    values are ``int(start) + i·int(step)`` (start and step truncated first, as ATen's integer accumulator does:
    ``arange(5, 0, -0.5, dtype=int64)`` is ten 5s), for a floating one ``start + i·step``."""
    dtype = _arange_dtype([start, end, step], dtype)
    count = max(int(np.ceil((float(end) - float(start)) / float(step))), 0)
    if jnp.issubdtype(dtype, jnp.floating):
        return (start + step * jnp.arange(count, dtype=jnp.float32)).astype(dtype)
    return (int(start) + int(step) * jnp.arange(count, dtype=dtype)).astype(dtype)


@lowers("aten.tril_indices.default")
def tril_indices(row, col, offset=0, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(np.stack(np.tril_indices(row, offset, col)).reshape(2, -1), dtype or jnp.int32)


@lowers("aten.triu_indices.default")
def triu_indices(row, col, offset=0, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.asarray(np.stack(np.triu_indices(row, offset, col)).reshape(2, -1), dtype or jnp.int32)


@lowers("aten.linspace.default")
def linspace(start, end, steps, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.linspace(start, end, steps, dtype=_float_default(dtype))

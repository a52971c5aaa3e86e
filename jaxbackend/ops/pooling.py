"""Pooling: max (with PyTorch's flat in-plane indices), average, and adaptive average/max.

Window geometry follows ATen's ``pooling_output_shape``: with ``ceil_mode`` the last window may start
inside the right padding only if it starts inside the input or left padding; padded cells never win a
max and count toward an average only with ``count_include_pad``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxbackend import precision
from jaxbackend.ops.registry import lowers


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
    """Returns ``(values, indices)``; indices are flat positions within each input plane. The gradient goes to
    the first maximum of each window, as in PyTorch (:func:`_routed_max_pool`)."""
    spatial = len(kernel_size) if isinstance(kernel_size, (list, tuple)) and len(kernel_size) > 1 else x.ndim - 2
    kernel = _tuple(kernel_size, spatial)
    stride = _tuple(stride, spatial, kernel)
    padding = _tuple(padding, spatial)
    dilation = _tuple(dilation, spatial)
    pads = tuple(_pool_geometry(x.shape[-spatial:], kernel, stride, padding, dilation, ceil_mode))
    return _routed_max_pool(x, kernel, stride, dilation, pads, tuple(x.shape))


def _lowest(dtype) -> np.ndarray:
    """The identity of max as a concrete numpy scalar."""
    if jnp.issubdtype(dtype, jnp.floating):
        return np.array(-np.inf, dtype)
    return np.array(jnp.iinfo(dtype).min, dtype)


def _out_sizes(in_sizes, kernel, stride, dilation, pads) -> list[int]:
    return [
        (size + lo + hi - d * (k - 1) - 1) // s + 1
        for size, (lo, hi), k, s, d in zip(in_sizes, pads, kernel, stride, dilation)
    ]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _routed_max_pool(x, kernel, stride, dilation, pads, shape):
    """Max pooling whose backward routes each window's gradient to its first maximum, as PyTorch does, from the
    winning kernel offset saved per output cell (an int8/int32 of the output's size).

    JAX's own max-pool gradient (``select_and_scatter_add``) is expanded by XLA's CPU compiler into a
    reduce-window over (value, s32 position) pairs of the padded input: four int32 tensors of the padded input's
    size live at once in the backward, which doubled a ResNet's compiled step memory. This backward is ``k``
    strided pads and adds of the output-sized gradient, fused by XLA into one pass over the input — on GPUs.
    XLA:CPU fuses the whole forward window walk (and the norm and activation before it) into that pass and
    evaluates it once per window covering an input cell (about four times for a 3 × 3 / 2 pool): 2.2 ms of a 13 ms
    ResNet step. On the CPU the backward is therefore a scatter-add of each output cell's gradient to its input
    position (PyTorch's ``indices``, saved instead of the offsets), one batched scatter over the planes: 3.1 → 0.6 ms
    for the ResNet stem's norm, ReLU and pool, forward and backward. (GPUs keep the pads: XLA:GPU's float scatter-add
    is atomic, so its sums of colliding windows would vary from run to run.)"""
    values, indices, _ = _window_argmax(
        x, kernel, stride, dilation, pads, _out_sizes(x.shape[-len(kernel) :], kernel, stride, dilation, pads)
    )
    return values, indices


def _routed_max_pool_forward(x, kernel, stride, dilation, pads, shape):
    values, indices, offsets = _window_argmax(
        x, kernel, stride, dilation, pads, _out_sizes(x.shape[-len(kernel) :], kernel, stride, dilation, pads)
    )
    return (values, indices), (indices if _scatters() else offsets)


def _routed_max_pool_backward(kernel, stride, dilation, pads, shape, saved, cotangents):
    if _scatters():
        return (_scattered_to_indices(cotangents[0], saved, shape, len(kernel)),)
    return (_padded_by_offsets(cotangents[0], saved, kernel, stride, dilation, pads, shape),)


def _scatters() -> bool:
    """Whether the backward scatters to the saved indices (the CPU) or pads by the saved offsets (module notes)."""
    return precision.current().platform == "cpu"


def _scattered_to_indices(grad_values, indices, shape, spatial):
    """The input's gradient: each output cell's gradient added at its flat in-plane position ``indices``; one
    scatter batched over the leading (batch, channel) dims, so a plan that shards them shards the scatter."""
    lead = len(shape) - spatial
    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(),
        inserted_window_dims=(lead,),
        scatter_dims_to_operand_dims=(lead,),
        operand_batching_dims=tuple(range(lead)),
        scatter_indices_batching_dims=tuple(range(lead)),
    )
    grad = jax.lax.scatter_add(
        jnp.zeros((*shape[:lead], int(np.prod(shape[lead:]))), grad_values.dtype),
        indices.reshape(*shape[:lead], -1, 1),
        grad_values.reshape(*shape[:lead], -1),
        numbers,
        mode=jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,  # a window's winner is a cell of the input
    )
    return grad.reshape(shape)


def _padded_by_offsets(grad_values, offsets, kernel, stride, dilation, pads, shape):
    """The input's gradient: for each kernel offset, the gradients of the windows it won, placed by a strided pad."""
    spatial = len(kernel)
    lead = len(shape) - spatial
    padded_sizes = [size + lo + hi for size, (lo, hi) in zip(shape[-spatial:], pads)]
    out_sizes = grad_values.shape[-spatial:]
    grad = jnp.zeros((*shape[:lead], *padded_sizes), grad_values.dtype)
    zero = jnp.zeros((), grad_values.dtype)
    for index, offset in enumerate(np.ndindex(*kernel)):
        routed = jnp.where(offsets == index, grad_values, zero)
        placement = [(0, 0, 0)] * lead
        for start, s, n, total in zip((o * d for o, d in zip(offset, dilation)), stride, out_sizes, padded_sizes):
            placement.append((start, total - start - (n - 1) * s - 1, s - 1))
        grad = grad + jax.lax.pad(routed, zero, placement)
    window = tuple(slice(None) for _ in range(lead)) + tuple(
        slice(lo, lo + size) for (lo, _), size in zip(pads, shape[-spatial:])
    )
    return grad[window]


_routed_max_pool.defvjp(_routed_max_pool_forward, _routed_max_pool_backward)


def _window_argmax(x, kernel, stride, dilation, pads, out_sizes):
    """``(max, index, offset)`` of each pooling window: the index is the flat in-plane position of the first
    maximum (PyTorch's ``indices``), the offset the number of its kernel offset in ``np.ndindex(*kernel)`` order
    (int8 when the kernel has ≤ 127 offsets).

    Walks the kernel offsets with strided slices of the padded input (one ``where`` per offset); a NaN wins over
    any number, the first of several maxima wins.
    """
    spatial = len(kernel)
    in_sizes = x.shape[-spatial:]
    lead = x.ndim - spatial
    low = _lowest(x.dtype)
    offset_dtype = jnp.int8 if int(np.prod(kernel)) <= 127 else jnp.int32
    padded = jax.lax.pad(x, low, [(0, 0, 0)] * lead + [(lo, hi, 0) for lo, hi in pads])
    best_val = best_idx = best_offset = None
    for number, offset in enumerate(np.ndindex(*kernel)):
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
            best_offset = jnp.zeros(window.shape, offset_dtype)
        else:
            better = (window > best_val) | (jnp.isnan(window) & ~jnp.isnan(best_val))
            best_val = jnp.where(better, window, best_val)
            best_idx = jnp.where(better, flat, best_idx)
            best_offset = jnp.where(better, jnp.asarray(number, offset_dtype), best_offset)
    return best_val, best_idx, best_offset


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


def _adaptive_windows(size: int, out_size: int) -> np.ndarray:
    """ATen's adaptive windows ``[floor(i·size/out), ceil((i+1)·size/out))`` as an index table
    ``[out, K]`` (K the widest window; shorter windows repeat their last index, harmless for a max)."""
    starts = (np.arange(out_size) * size) // out_size
    ends = -((-(np.arange(out_size) + 1) * size) // out_size)
    width = int((ends - starts).max())
    return np.minimum(starts[:, None] + np.arange(width)[None, :], ends[:, None] - 1)


@lowers("aten.adaptive_max_pool2d.default", "aten.adaptive_max_pool3d.default", "aten.adaptive_max_pool1d.default")
def adaptive_max_pool(x, output_size):
    """Returns ``(values, indices)``: each window gathered into a trailing dim, then max/argmax there
    (the value is read at the argmax, so the gradient goes to the first maximum, as in PyTorch)."""
    spatial = len(output_size)
    lead = x.ndim - spatial
    in_sizes = x.shape[lead:]
    tables = [_adaptive_windows(size, out) for size, out in zip(in_sizes, output_size)]
    windows = x
    for axis, table in enumerate(tables):
        # [..., out_d, K_d, ...]: one gather per spatial dim with a constant index table.
        windows = jnp.take(windows, jnp.asarray(table, jnp.int32), axis=lead + 2 * axis)
    k_axes = tuple(lead + 2 * a + 1 for a in range(spatial))
    windows = jnp.moveaxis(windows, k_axes, tuple(range(x.ndim, x.ndim + spatial)))
    windows = windows.reshape(windows.shape[: x.ndim] + (-1,))
    best = jnp.argmax(jax.lax.stop_gradient(windows), axis=-1)
    values = jnp.take_along_axis(windows, best[..., None], axis=-1)[..., 0]
    # Flat in-plane index of the winner: its coordinate along each spatial dim, row-major.
    k_shape = tuple(t.shape[1] for t in tables)
    flat = jnp.zeros(best.shape, jnp.int32)
    for axis, (table, k_coord) in enumerate(zip(tables, jnp.unravel_index(best, k_shape))):
        out_coord = jax.lax.broadcasted_iota(jnp.int32, best.shape, lead + axis)
        flat = flat * in_sizes[axis] + jnp.asarray(table, jnp.int32)[out_coord, k_coord]
    return values, flat


@lowers(
    "aten._adaptive_avg_pool2d.default",
    "aten.adaptive_avg_pool2d.default",
    "aten._adaptive_avg_pool3d.default",
    "aten.adaptive_avg_pool1d.default",
)
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

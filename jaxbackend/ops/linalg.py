"""Matrix products and convolution.

Products run at full fp32 precision (``Precision.HIGHEST``), which on CPU is XLA's only mode and on
GPU keeps parity with PyTorch's default (TF32 off).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxbackend.ops.registry import lowers

_PRECISION = jax.lax.Precision.HIGHEST


@lowers("aten.mm.default")
def mm(a, b):
    return jnp.matmul(a, b, precision=_PRECISION)


@lowers("aten.bmm.default")
def bmm(a, b):
    return jnp.matmul(a, b, precision=_PRECISION)


@lowers("aten.matmul.default")
def matmul(a, b):
    return jnp.matmul(a, b, precision=_PRECISION)


@lowers("aten.addmm.default")
def addmm(bias, a, b, beta=1, alpha=1):
    product = jnp.matmul(a, b, precision=_PRECISION)
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    return product + (bias if beta == 1 else bias * beta)


@lowers("aten.baddbmm.default")
def baddbmm(bias, a, b, beta=1, alpha=1):
    product = jnp.matmul(a, b, precision=_PRECISION)
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    return product + (bias if beta == 1 else bias * beta)


@lowers("aten.dot.default", "aten.vdot.default")
def dot(a, b):
    return jnp.dot(a, b, precision=_PRECISION)


@lowers("aten.mv.default")
def mv(a, b):
    return jnp.matmul(a, b, precision=_PRECISION)


@lowers("aten.convolution.default")
def convolution(x, weight, bias, stride, padding, dilation, transposed, output_padding, groups):
    spatial = x.ndim - 2
    stride, padding, dilation = (_expand(v, spatial) for v in (stride, padding, dilation))
    letters = "DHW"[-spatial:] if spatial <= 3 else None
    if letters is None:
        raise NotImplementedError(f"convolution over {spatial} spatial dims")
    numbers = ("NC" + letters, "OI" + letters, "NC" + letters)
    if not transposed:
        out = jax.lax.conv_general_dilated(
            x, weight, window_strides=stride, padding=[(p, p) for p in padding], rhs_dilation=dilation,
            dimension_numbers=numbers, feature_group_count=groups, precision=_PRECISION)
    else:
        out = _conv_transpose(x, weight, stride, padding, dilation, _expand(output_padding, spatial), groups, numbers)
    if bias is not None:
        out = out + bias.reshape((1, -1) + (1,) * spatial)
    return out


def _conv_transpose(x, weight, stride, padding, dilation, output_padding, groups, numbers):
    """Transposed convolution as a dilated forward convolution with a flipped kernel.

    torch's transposed weight is ``[C_in, C_out/groups, *k]``; regroup it to ``[C_out, C_in/groups, *k]``.
    """
    c_in, c_out_g = weight.shape[:2]
    kernel = weight.shape[2:]
    w = weight.reshape((groups, c_in // groups, c_out_g) + kernel)
    w = jnp.swapaxes(w, 1, 2).reshape((groups * c_out_g, c_in // groups) + kernel)
    w = jnp.flip(w, axis=tuple(range(2, w.ndim)))
    pads = [(d * (k - 1) - p, d * (k - 1) - p + op) for k, p, d, op in zip(kernel, padding, dilation, output_padding)]
    return jax.lax.conv_general_dilated(
        x, w, window_strides=(1,) * len(kernel), padding=pads, lhs_dilation=stride, rhs_dilation=dilation,
        dimension_numbers=numbers, feature_group_count=groups, precision=_PRECISION)


def _expand(value, n):
    value = list(value) if isinstance(value, (list, tuple)) else [value]
    return tuple(value * n if len(value) == 1 else value)

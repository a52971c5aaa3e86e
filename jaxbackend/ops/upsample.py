"""Upsampling (``F.interpolate``): nearest and (bi/tri)linear over the trailing spatial dims.

Source positions are static, so each spatial dim is one gather with constant indices (plus a lerp for
the linear modes), computed in float32 exactly as ATen's CPU kernels compute them
(``area_pixel_compute_scale`` / ``area_pixel_compute_source_index`` in ``UpSample.h``):

- nearest: ``src = min(floor(dst · scale), in − 1)`` with ``scale = 1/scale_factor`` when a scale factor
  is given, else ``in/out``;
- linear, ``align_corners=False``: ``src = max(scale · (dst + ½) − ½, 0)``; ``align_corners=True``:
  ``src = dst · (in − 1)/(out − 1)``; output = ``x[floor(src)]·(1 − λ) + x[floor(src) + 1]·λ`` with
  ``λ = src − floor(src)`` (the upper index clamped to ``in − 1``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxbackend.ops.registry import lowers


def _output_sizes(x, output_size, scale_factors):
    spatial = len(output_size) if output_size else len(scale_factors)
    in_sizes = x.shape[-spatial:]
    if output_size:
        return in_sizes, list(output_size), [None] * spatial
    return in_sizes, [int(np.floor(s * f)) for s, f in zip(in_sizes, scale_factors)], list(scale_factors)


def _scale(in_size: int, out_size: int, scale_factor, align_corners: bool) -> np.float32:
    if align_corners:
        return np.float32(in_size - 1) / np.float32(out_size - 1) if out_size > 1 else np.float32(0)
    if scale_factor is not None and scale_factor > 0:
        return np.float32(1.0 / scale_factor)
    return np.float32(in_size) / np.float32(out_size)


@lowers("aten.upsample_nearest1d.vec", "aten.upsample_nearest2d.vec", "aten.upsample_nearest3d.vec")
def upsample_nearest(x, output_size, scale_factors):
    in_sizes, out_sizes, factors = _output_sizes(x, output_size, scale_factors)
    for axis_offset, (size, out, factor) in enumerate(zip(in_sizes, out_sizes, factors)):
        scale = _scale(size, out, factor, False)
        src = np.minimum(np.floor(np.arange(out, dtype=np.float32) * scale).astype(np.int64), size - 1)
        x = jnp.take(x, jnp.asarray(src, jnp.int32), axis=x.ndim - len(in_sizes) + axis_offset)
    return x


@lowers("aten.upsample_linear1d.vec", "aten.upsample_bilinear2d.vec", "aten.upsample_trilinear3d.vec")
def upsample_linear(x, output_size, align_corners, scale_factors):
    in_sizes, out_sizes, factors = _output_sizes(x, output_size, scale_factors)
    for axis_offset, (size, out, factor) in enumerate(zip(in_sizes, out_sizes, factors)):
        axis = x.ndim - len(in_sizes) + axis_offset
        scale = _scale(size, out, factor, align_corners)
        dst = np.arange(out, dtype=np.float32)
        src = scale * dst if align_corners else np.maximum(scale * (dst + np.float32(0.5)) - np.float32(0.5), 0)
        low = src.astype(np.int64)
        high = np.minimum(low + 1, size - 1)
        lam = np.clip(src - low, 0, 1).astype(np.float32)
        shape = [1] * x.ndim
        shape[axis] = out
        lam = jnp.asarray(lam.reshape(shape), x.dtype)
        x = (
            jnp.take(x, jnp.asarray(low, jnp.int32), axis=axis) * (1 - lam)
            + jnp.take(x, jnp.asarray(high, jnp.int32), axis=axis) * lam
        )
    return x

"""Matrix products and convolution.

Each product's ``precision=`` comes from :mod:`jaxbackend.precision` (PyTorch's float32 matmul precision for
the platform the program is lowered for: full fp32 on CPU and by default, TF32 or bf16 passes on a GPU when
the user asked for them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxbackend.collectives import reduce_scatter
from jaxbackend.ops.expert_parallel import (
    GroupedMatmulSplit,
    grouped_mm_split_of,
    split_grouped_mm,
    split_grouped_mm_local,
    swap_weight_dims,
)
from jaxbackend.ops.grouped_matmul import blocked_ragged_dot
from jaxbackend.ops.registry import lowers
from jaxbackend.precision import conv_precision, dot_precision
from jaxbackend.sharding import AXIS_NAMES, axes_of, shard_map


@lowers("aten.mm.default", sharded=True)
def mm(a, b, *, shardings=None, scatter=None):
    """``a @ b``; with ``scatter="rows"`` (the plan's Megatron sequence-parallel choice) and pinned shardings
    splitting the contracted dim: the partial products reduce-scattered by rows (:func:`row_scattered_matmul`)."""
    if scatter == "rows":
        return row_scattered_matmul(a, b, shardings[-2:])
    return jnp.matmul(a, b, precision=dot_precision(a, b))


@lowers("aten.linalg_matrix_exp.default")
def linalg_matrix_exp(x):
    """The matrix exponential of every ``[..., n, n]`` matrix (``torch.linalg.matrix_exp``: what
    ``nn.utils.parametrizations.orthogonal`` maps a skew-symmetric matrix with)."""
    flat = x.reshape(-1, *x.shape[-2:])
    return jax.vmap(jax.scipy.linalg.expm)(flat).reshape(x.shape)


@lowers("aten.bmm.default")
def bmm(a, b):
    return jnp.matmul(a, b, precision=dot_precision(a, b))


@lowers("aten.matmul.default")
def matmul(a, b):
    return jnp.matmul(a, b, precision=dot_precision(a, b))


@lowers("aten.addmm.default", sharded=True)
def addmm(bias, a, b, beta=1, alpha=1, *, shardings=None, scatter=None):
    """``beta·bias + alpha·(a @ b)``; ``scatter`` as for :func:`mm` (the bias added to the scattered rows)."""
    if scatter == "rows":
        return _axpby(bias, row_scattered_matmul(a, b, shardings[-2:]), beta, alpha)
    return _axpby(bias, jnp.matmul(a, b, precision=dot_precision(a, b)), beta, alpha)


def row_scattered_matmul(a, b, shardings):
    """``a [M, K] @ b [K, N]`` with ``K`` split over mesh axes ``A`` (``a`` read as ``(m, A)``, ``b`` as ``(A, n)``, the
    pinned ``shardings``): each device's partial product reduce-scattered over ``A`` by rows, so the output is laid
    out ``(m + A, n)`` — Megatron's sequence parallelism after a row-split layer, one reduce-scatter where GSPMD on
    the CPU would all-reduce and slice. Its transpose gathers the output's gradient (an all-gather)."""
    if len(shardings) < 2 or any(s is None for s in shardings):
        raise ValueError("a row-scattered matmul needs both operands' pinned shardings")
    rows, contracted = axes_of(shardings[0].spec, 2)
    contracted_b, columns = axes_of(shardings[1].spec, 2)
    if not contracted or contracted != contracted_b:
        raise ValueError(
            f"a row-scattered matmul splits its contracted dim alike in both operands; the plan reads "
            f"them as {shardings[0].spec} and {shardings[1].spec}"
        )
    names = lambda axes: tuple(AXIS_NAMES[x] for x in axes) or None
    scattered = names(contracted)

    def body(a_local, b_local):
        partial = jnp.matmul(a_local, b_local, precision=dot_precision(a_local, b_local))
        return reduce_scatter(partial, scattered, dim=0)

    out_spec = PartitionSpec(names((rows or ()) + contracted), names(columns or ()))
    return shard_map(body, shardings[0].mesh, in_specs=(shardings[0].spec, shardings[1].spec), out_specs=out_spec)(a, b)


@lowers("aten.baddbmm.default")
def baddbmm(bias, a, b, beta=1, alpha=1):
    return _axpby(bias, jnp.matmul(a, b, precision=dot_precision(a, b)), beta, alpha)


@lowers("aten.addbmm.default")
def addbmm(bias, a, b, beta=1, alpha=1):
    """``beta·bias + alpha·Σ_b a[b] @ b[b]``."""
    return _axpby(bias, jnp.einsum("bij,bjk->ik", a, b, precision=dot_precision(a, b)), beta, alpha)


@lowers("aten.addmv.default")
def addmv(bias, mat, vec, beta=1, alpha=1):
    return _axpby(bias, jnp.matmul(mat, vec, precision=dot_precision(mat, vec)), beta, alpha)


def _axpby(bias, product, beta, alpha):
    """``beta·bias + alpha·product``; ``beta = 0`` ignores ``bias`` (even NaN in it), as torch does.
    On integer tensors torch truncates float ``alpha``/``beta`` to integers first."""
    if not jnp.issubdtype(product.dtype, jnp.inexact):
        alpha, beta = int(alpha), int(beta)
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    return product + (bias if beta == 1 else bias * beta)


@lowers("aten._trilinear.default")
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    """``Σ_sumdim i1·i2·i3`` after unsqueezing each input at its ``expand`` dims (``F.bilinear``)."""
    rank = i1.ndim + len(expand1)
    letters = "abcdefghijklmnopqrstuvwxyz"[:rank]

    def spec(expand):
        return "".join(letters[d] for d in range(rank) if d not in expand)

    out = "".join(letters[d] for d in range(rank) if d not in sumdim)
    return jnp.einsum(
        f"{spec(expand1)},{spec(expand2)},{spec(expand3)}->{out}", i1, i2, i3, precision=dot_precision(i1, i2, i3)
    )


@lowers("aten.dot.default", "aten.vdot.default")
def dot(a, b):
    return jnp.dot(a, b, precision=dot_precision(a, b))


@lowers("aten.mv.default")
def mv(a, b):
    return jnp.matmul(a, b, precision=dot_precision(a, b))


GROUPED_MM = "blocked"
"""How ``_grouped_mm`` with offsets lowers: ``"blocked"`` (:func:`.grouped_matmul.blocked_ragged_dot`) or
``"ragged_dot"`` (``jax.lax.ragged_dot``, as XLA expands it; ``benchmarks/moe.py`` compares the two)."""


@lowers("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default", sharded=True)
def grouped_mm(
    x, weight, offs=None, bias=None, out_dtype=None, *, weight_transposed=False, shardings=None, local_split=None
):
    """Mixture-of-experts matmul: rows ``offs[e-1]:offs[e]`` of ``x [S, K]`` times ``weight[e] [K, N]``.

    ``offs`` holds cumulative row counts, so the shape is static and only the grouping is data: a ragged
    matmul, computed in blocks of one expert's rows (:func:`.grouped_matmul.blocked_ragged_dot`: work in
    proportion to the rows, where XLA's CPU expansion of ``jax.lax.ragged_dot`` computes every expert on every
    row; :data:`GROUPED_MM` selects ``"ragged_dot"`` instead). Rows past ``offs[-1]`` come out zero (PyTorch
    leaves them unwritten). Also lowers HF transformers' CPU fallback op of the same signature (its default
    ``grouped_mm`` experts path).

    Split over devices (:mod:`.expert_parallel`): under GSPMD, ``shardings`` (of ``x``, ``weight``, ``offs``, as the
    plan reads them) with the rows or the experts split run the op as a ``shard_map`` — experts split: tokens
    exchanged by all-to-all with their experts' devices; rows split: each device its own rows' groups. Inside a
    per-device program, ``local_split`` (a :class:`.expert_parallel.GroupedMatmulSplit`) is this device's part.

    ``weight_transposed`` (set by :func:`jaxbackend.rewrites.fold_transposed_weights`, never by PyTorch): ``weight``
    is the ``[E, N, K]`` value the graph transposed for this op (its sharding, if pinned, permuted alike); the
    blocked product, split or not, reads it in place.
    """
    if weight_transposed and not (x.ndim == 2 and offs is not None and GROUPED_MM == "blocked" and local_split is None):
        weight, weight_transposed = jnp.swapaxes(weight, 1, 2), False
    if x.ndim == 2 and weight.ndim == 3 and offs is not None:
        dot = dict(precision=dot_precision(x, weight))
        split = local_split or _gspmd_split(shardings, weight_transposed)
        if split is not None and bias is not None:
            raise NotImplementedError("a split _grouped_mm with a bias: run it replicated (no expert or row split)")
        if local_split is not None:
            out = split_grouped_mm_local(x, weight, offs, local_split, **dot)
        elif split is not None:
            out = split_grouped_mm(
                x, weight, offs, shardings[0].mesh, split, weight_transposed=weight_transposed, **dot
            )
        elif GROUPED_MM == "blocked":
            out = blocked_ragged_dot(
                x, weight, jnp.diff(offs.astype(jnp.int32), prepend=0), weight_transposed=weight_transposed, **dot
            )
        else:
            out = jax.lax.ragged_dot(x, weight, jnp.diff(offs.astype(jnp.int32), prepend=0), **dot)
    elif x.ndim == 3 and weight.ndim == 3 and offs is None:
        out = jnp.matmul(x, weight, precision=dot_precision(x, weight))
    else:
        raise NotImplementedError(
            f"_grouped_mm of a {x.ndim}-d by a {weight.ndim}-d operand"
            f"{' with' if offs is not None else ' without'} offsets"
        )
    if bias is not None:
        out = out + bias
    return out if out_dtype is None else out.astype(out_dtype)


def _gspmd_split(shardings, weight_transposed: bool = False) -> GroupedMatmulSplit | None:
    """The split that the pinned operand shardings of a grouped matmul describe (``None``: not split, or not
    pinned); the weight's read as ``[E, N, K]`` with ``weight_transposed``."""
    if not shardings or len(shardings) < 2 or shardings[0] is None or shardings[1] is None:
        return None
    mesh = shardings[0].mesh
    weight = axes_of(shardings[1].spec, 3)
    if weight_transposed:
        weight = swap_weight_dims(weight)
    return grouped_mm_split_of(axes_of(shardings[0].spec, 2), weight, tuple(mesh.shape[name] for name in AXIS_NAMES))


@lowers("aten._cdist_forward.default")
def cdist(x1, x2, p, compute_mode=None):
    """p-norm distance between each row of ``x1 [..., P, M]`` and of ``x2 [..., R, M]``.

    Computed from the differences (not ``|x|² + |y|² − 2xy``), with a zero gradient at zero distance,
    as PyTorch's backward gives.
    """
    diff = jnp.abs(x1[..., :, None, :] - x2[..., None, :, :])
    if p == 0:
        return jnp.sum(diff != 0, axis=-1).astype(x1.dtype)
    if p == float("inf"):
        return jnp.max(diff, axis=-1)
    if p == 1:
        return jnp.sum(diff, axis=-1)
    powered = jnp.sum(diff**p, axis=-1)
    positive = powered > 0
    return jnp.where(positive, jnp.where(positive, powered, 1.0) ** (1.0 / p), 0.0)


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
            x,
            weight,
            window_strides=stride,
            padding=[(p, p) for p in padding],
            rhs_dilation=dilation,
            dimension_numbers=numbers,
            feature_group_count=groups,
            precision=conv_precision(x, weight),
        )
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
        x,
        w,
        window_strides=(1,) * len(kernel),
        padding=pads,
        lhs_dilation=stride,
        rhs_dilation=dilation,
        dimension_numbers=numbers,
        feature_group_count=groups,
        precision=conv_precision(x, w),
    )


def _expand(value, n):
    value = list(value) if isinstance(value, (list, tuple)) else [value]
    return tuple(value * n if len(value) == 1 else value)

"""The op-family table: which ATen overloads belong together, for every pass that treats a family alike.

One place for the sets the cost model, the planner's follower rules and layout replay, the stage cost
model and the per-device lowering each need; plain data (overload names as the IR stores them), no
torch, no JAX.
"""

from __future__ import annotations

RESHAPES = frozenset({"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"})
"""Reshapes: same elements, new shape."""

VIEWS = RESHAPES | frozenset(
    {
        "aten.permute.default",
        "aten.expand.default",
        "aten.t.default",
        "aten.transpose.int",
        "aten.unsqueeze.default",
        "aten.squeeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.alias.default",
        "aten.slice.Tensor",
        "aten.select.int",
        "aten.split.Tensor",
        "aten.split_with_sizes.default",
        "aten.detach.default",
        "getitem",
        "aten._assert_tensor_metadata.default",
        "torchpar.stop_gradient",
        "torchpar.autograd_function_input",
        "torchpar.autograd_function_output",  # torchpar.ir.function_regions
    }
)
"""Ops whose result aliases an operand (or a tuple element of one): no arithmetic, no new activation memory."""

SLICES = frozenset({"aten.slice.Tensor", "aten.select.int", "aten.split.Tensor", "aten.split_with_sizes.default"})
"""Views that take part of a dim: along a dim split unevenly by the cut they read the operand gathered."""

CREATIONS = frozenset(
    {
        "aten.lift_fresh_copy.default",
        "aten.clone.default",
        "aten.full.default",
        "aten.arange.start_step",
        "aten.arange.default",
        "aten.arange.start",
        "aten.scalar_tensor.default",
        "aten.zeros.default",
        "aten.ones.default",
        "aten.empty.memory_format",
        "aten.full_like.default",
    }
)
"""Ops that make or copy a tensor without arithmetic."""

FREE = VIEWS | CREATIONS
"""Ops that cost no FLOPs."""

ASSERTS = frozenset({"aten._assert_tensor_metadata.default", "aten._assert_scalar.default"})
"""Checks export leaves in the graph; they compute nothing."""

REDUCTIONS = frozenset(
    {
        "aten.sum.dim_IntList",
        "aten.sum.default",
        "aten.mean.dim",
        "aten.mean.default",
        "aten.amax.default",
        "aten.amin.default",
        "aten.any.dim",
        "aten.any.dims",
        "aten.any.default",
        "aten.all.dim",
        "aten.prod.dim_int",
        "aten.var.correction",
        "aten.std.correction",
        "aten.logsumexp.default",
        "aten.argmax.default",
        "aten.argmin.default",
        "aten.max.dim",
        "aten.min.dim",
        "aten.linalg_vector_norm.default",
    }
)
"""Reductions over some dims (their ``dim`` argument, all dims when absent: :func:`reduction_dims`)."""

DIM_POSITION = {"aten.linalg_vector_norm.default": 2, "aten.norm.ScalarOpt_dim": 2}
"""Reductions whose ``dim`` argument is not their second (it follows the norm's order ``ord`` / ``p``): its position.
``keepdim`` comes right after it."""


def reduction_dims(target: str, args: tuple, kwargs: dict) -> tuple[object, bool]:
    """``(dim argument, keepdim)`` of a reduction's call (:data:`DIM_POSITION`); the dim argument is ``None`` (or an
    empty list) when it reduces every dim."""
    position = DIM_POSITION.get(target, 1)
    dims = args[position] if len(args) > position else kwargs.get("dim")
    keepdim = args[position + 1] if len(args) > position + 1 else kwargs.get("keepdim", False)
    return dims, keepdim is True


PARTIAL_SUM_REDUCTIONS = {
    "aten.sum.dim_IntList": "sum",
    "aten.sum.default": "sum",
    "aten.mean.dim": "mean",
    "aten.mean.default": "mean",
}
"""Reductions a per-device program finishes with one collective: ``sum`` → psum, ``mean`` → pmean (the
shards of a split dim are equal-sized, so the mean of local means is the global mean)."""

ALONG_DIM = {
    "aten._softmax.default": 1,
    "aten._log_softmax.default": 1,
    "aten.cumsum.default": 1,
    "aten.cumprod.default": 1,
    "aten.sort.default": 1,
    "aten.sort.stable": None,
    "aten.topk.default": 2,
    "aten.slice.Tensor": 1,
    "aten.split_with_sizes.default": 2,
    "aten.split.Tensor": 2,
    "aten.index_select.default": 1,
    "aten.gather.default": 1,
    "aten._safe_softmax.default": 1,
}
"""Ops working along one dim, and the position of their ``dim`` argument (``None``: keyword-only, ``dim=``)."""

ALONG_DIM_DEFAULT = {"aten.sort.default": -1, "aten.sort.stable": -1, "aten.topk.default": -1}
"""The dim an :data:`ALONG_DIM` op works along when its ``dim`` argument is left out (0 for the others)."""

BATCH_NORMS = frozenset(
    {
        "aten._native_batch_norm_legit_functional.default",
        "aten._native_batch_norm_legit.no_stats",
        "aten._native_batch_norm_legit_no_training.default",
    }
)
"""Batch norm in training (statistics over the batch) and eval (running statistics) forms."""

SIZE_ARGUMENT = {
    "aten.view.default": 1,
    "aten._unsafe_view.default": 1,
    "aten.reshape.default": 1,
    "aten.expand.default": 1,
    "aten.new_zeros.default": 1,
    "aten.new_ones.default": 1,
    "aten.new_empty.default": 1,
    "aten.new_full.default": 1,
}
"""Ops with a size argument, and its position (a per-device program rewrites it to the local shape)."""

GROUPED_MATMULS = frozenset({"aten._grouped_mm.default", "transformers.grouped_mm_fallback.default"})
"""Mixture-of-experts grouped matmuls ``(x [S, K], w [E, K, N], offs [E])``: HF transformers' fallback op has
PyTorch's signature."""

BIAS_ARGUMENT = {"aten.addmm.default": 0, "aten.baddbmm.default": 0, "aten.convolution.default": 2}
"""Matmuls and convolutions with a bias operand, and its position."""

POINTWISE = frozenset(
    {
        "aten.add.Tensor",
        "aten.add.Scalar",
        "aten.sub.Tensor",
        "aten.sub.Scalar",
        "aten.rsub.Scalar",
        "aten.mul.Tensor",
        "aten.mul.Scalar",
        "aten.div.Tensor",
        "aten.div.Scalar",
        "aten.div.Tensor_mode",
        "aten.neg.default",
        "aten.abs.default",
        "aten.pow.Tensor_Scalar",
        "aten.pow.Tensor_Tensor",
        "aten.pow.Scalar",
        "aten.sqrt.default",
        "aten.rsqrt.default",
        "aten.reciprocal.default",
        "aten.exp.default",
        "aten.log.default",
        "aten.log1p.default",
        "aten.expm1.default",
        "aten.tanh.default",
        "aten.sigmoid.default",
        "aten.gelu.default",
        "aten.relu.default",
        "aten.silu.default",
        "aten.erf.default",
        "aten.sin.default",
        "aten.cos.default",
        "aten.where.self",
        "aten.clamp.default",
        "aten.clamp_min.default",
        "aten.clamp_max.default",
        "aten.minimum.default",
        "aten.maximum.default",
        "aten.eq.Scalar",
        "aten.eq.Tensor",
        "aten.ne.Scalar",
        "aten.ne.Tensor",
        "aten.ge.Scalar",
        "aten.ge.Tensor",
        "aten.gt.Scalar",
        "aten.gt.Tensor",
        "aten.le.Scalar",
        "aten.le.Tensor",
        "aten.lt.Scalar",
        "aten.lt.Tensor",
        "aten.bitwise_and.Tensor",
        "aten.bitwise_or.Tensor",
        "aten.bitwise_not.default",
        "aten.logical_and.default",
        "aten.logical_or.default",
        "aten.logical_not.default",
        "aten._to_copy.default",
        "aten.clone.default",
        "aten.masked_fill.Scalar",
        "aten.masked_fill.Tensor",
        "aten.sign.default",
        "aten.floor.default",
        "aten.ceil.default",
        "aten.round.default",
        "aten.trunc.default",
        "aten.fmod.Scalar",
        "aten.remainder.Scalar",
        "aten.hardtanh.default",
        "aten.leaky_relu.default",
        "aten.elu.default",
        "aten.softplus.default",
        "aten.lerp.Scalar",
        "aten.addcmul.default",
        "aten.addcdiv.default",
    }
)
"""Elementwise ops a compiler fuses into their consumers: a chain of them materializes only the value that leaves
the chain (the activation memory model, ``torchpar.planner.remat.remat_memory``)."""

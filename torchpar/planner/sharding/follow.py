"""How an op that is not a root lays out its output, given the layout of the operand it follows.

``follow(node, operand_metas, main, main_spec, mesh)`` returns the output spec (a tuple of specs for
multi-output ops), the spec each tensor operand must have, and the communication the op causes by
itself (e.g. a sum over a split dim is a partial result and needs an all-reduce). Rules:

- elementwise (output shape = broadcast of the operands): output takes the main operand's layout;
  other operands are aligned from the right; broadcast operands that need gradients pay a backward
  all-reduce over the axes splitting dims they are broadcast along;
- reductions drop (or keep as size 1) the reduced dims, all-reducing over axes that split them;
- ops working *along* dims (softmax, layer norm, cumsum, slicing, concatenation, pooling windows, …)
  need those dims unsplit; the others follow;
- view/permute/expand/squeeze/unsqueeze move the split with its dim (a reshape keeps a split only on the
  major dim of a merged or split group, and only if the new dim divides evenly);
- anything else runs replicated (correct, and priced as such).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from torchpar.ir.function_regions import MARKERS as FUNCTION_MARKERS
from torchpar.ir.graph import Node, OutMeta, TensorMeta
from torchpar.ir.layout import Multi, Spec, is_valid
from torchpar.ir.op_families import ALONG_DIM, ALONG_DIM_DEFAULT, BATCH_NORMS, REDUCTIONS, RESHAPES, reduction_dims
from torchpar.planner.sharding.cost_model import LogicalMesh

OutSpec = Spec | Multi | None


@dataclass(frozen=True)
class Follow:
    """The layout an op takes when its main operand has a given layout."""

    out: OutSpec
    required: tuple[Spec | None, ...]
    comm_s: float = 0.0
    """Seconds of collectives per run of the op (per micro-batch)."""
    weight_grad_comm_s: float = 0.0
    """Seconds of the all-reduces of weight gradients (operands that do not depend on the batch): once per step
    under gradient accumulation, not per micro-batch."""


def follow(
    node: Node,
    operands: Sequence[OutMeta],
    main: int,
    main_spec: OutSpec,
    mesh: LogicalMesh,
    needs_grad: Sequence[bool],
    weights: Sequence[bool] = (),
) -> Follow:
    """Layout of ``node`` when its ``main``-th tensor operand (metas ``operands``) is laid out as ``main_spec``;
    ``weights`` flags the operands that do not depend on the batch (see :attr:`Follow.weight_grad_comm_s`)."""
    target = node.target
    out = node.out
    if target == "getitem":
        assert isinstance(main_spec, Multi), "getitem reads a multi-output value"
        return Follow(main_spec[node.args[1]], (None,) * len(operands))
    if target in FUNCTION_MARKERS:  # identity on operand 0; an output marker's saved tensors are read as they are
        return _function_marker(operands, main, main_spec)
    main_meta = operands[main]
    if not isinstance(main_meta, TensorMeta) or main_spec is None:
        return _replicated(node, operands)
    first_out = out if isinstance(out, TensorMeta) else next((m for m in (out or ()) if m is not None), None)
    if first_out is None:
        return Follow(None, tuple(None for _ in operands))
    if target in RESHAPES:
        return _view(main_meta, first_out, main_spec, mesh, len(operands))
    if target in ("aten.permute.default",):
        dims = [d % len(main_meta.shape) for d in node.args[1]]
        return Follow(tuple(main_spec[d] for d in dims), (main_spec,))
    if target in ("aten.t.default", "aten.transpose.int"):
        rank = len(main_meta.shape)
        d0, d1 = (0, 1) if target == "aten.t.default" else (node.args[1] % rank, node.args[2] % rank)
        swapped = list(main_spec)
        swapped[d0], swapped[d1] = swapped[d1], swapped[d0]
        return Follow(tuple(swapped), (main_spec,))
    if target == "aten.unsqueeze.default":
        dim = node.args[1] % (len(main_meta.shape) + 1)
        return Follow(tuple(main_spec[:dim]) + (None,) + tuple(main_spec[dim:]), (main_spec,))
    if target in ("aten.squeeze.dims", "aten.squeeze.dim", "aten.squeeze.default"):
        kept = _squeeze_kept(main_meta.shape, first_out.shape)
        return Follow(tuple(main_spec[d] for d in kept), (main_spec,))
    if target == "aten.expand.default":
        return _broadcast_like(first_out, operands, main, main_spec, mesh, needs_grad)
    if target in REDUCTIONS:
        return _reduce(node, main_meta, first_out, main_spec, mesh, len(operands))
    if target == "aten.native_layer_norm.default":
        count = len(node.args[1])
        return _normalize(
            node, operands, main_meta, main_spec, range(len(main_meta.shape) - count, len(main_meta.shape))
        )
    if target == "aten.native_group_norm.default":
        return _replicated(node, operands)
    if target in BATCH_NORMS:
        return _batch_norm(node, operands, main_meta, main_spec, mesh)
    if target in (
        "aten.max_pool2d_with_indices.default",
        "aten.avg_pool2d.default",
        "aten._adaptive_avg_pool2d.default",
        "aten.constant_pad_nd.default",
    ):
        spatial = 2 if target != "aten.constant_pad_nd.default" else len(node.args[1]) // 2
        keep = tuple(main_spec[:-spatial]) + (None,) * spatial
        return _same_out(node, keep, (keep,) + (None,) * (len(operands) - 1))
    if target in ("aten.cat.default", "aten.stack.default"):
        dim = node.args[1] if len(node.args) > 1 else 0
        rank = len(main_meta.shape)
        dim = dim % (rank + (target == "aten.stack.default"))
        spec = tuple(None if d == dim else e for d, e in enumerate(main_spec))
        out_spec = spec if target == "aten.cat.default" else tuple(spec[:dim]) + (None,) + tuple(spec[dim:])
        required = tuple(spec if isinstance(m, TensorMeta) and len(m.shape) == rank else None for m in operands)
        return Follow(out_spec, required)
    if target == "aten.select.int":
        dim = node.args[1] % len(main_meta.shape)
        keep = tuple(None if d == dim else e for d, e in enumerate(main_spec))
        return Follow(tuple(e for d, e in enumerate(keep) if d != dim), (keep,))
    if target in ALONG_DIM:
        dim = along_dim(node)
        dims = [dim] if isinstance(dim, int) else list(dim)
        keep = tuple(None if d in [x % len(main_meta.shape) for x in dims] else e for d, e in enumerate(main_spec))
        operand_specs: list[Spec | None] = [None] * len(operands)
        operand_specs[main] = keep
        if target == "aten.gather.default" and len(operands) > 1:
            operand_specs[1] = (
                keep if isinstance(operands[1], TensorMeta) and len(operands[1].shape) == len(keep) else None
            )
        if target == "aten.index_select.default" and len(operands) > 1:
            operand_specs[1] = (None,) * len(cast(TensorMeta, operands[1]).shape)  # the index tensor
        along: OutSpec = keep
        if isinstance(out, tuple):
            along = Multi(keep if isinstance(m, TensorMeta) and len(m.shape) == len(keep) else None for m in out)
        elif len(first_out.shape) != len(keep):
            return _replicated(node, operands)
        return Follow(along, tuple(operand_specs))
    if _is_elementwise(first_out, operands):
        result = _broadcast_like(first_out, operands, main, main_spec, mesh, needs_grad, weights)
        if isinstance(out, tuple):
            return Follow(
                Multi(result.out if isinstance(m, TensorMeta) and m.shape == first_out.shape else None for m in out),
                result.required,
                result.comm_s,
                result.weight_grad_comm_s,
            )
        return result
    return _replicated(node, operands)


def along_dim(node: Node) -> int | Sequence[int]:
    """The ``dim`` argument of an :data:`~torchpar.ir.op_families.ALONG_DIM` op (positional, or the keyword of
    ``sort.stable``), or its default when left out (``sort``, ``topk``: the last dim)."""
    position = ALONG_DIM[node.target]
    if position is not None and len(node.args) > position:
        return node.args[position]
    return node.kwargs.get("dim", ALONG_DIM_DEFAULT.get(node.target, 0))


def _function_marker(operands: Sequence[OutMeta], main: int, main_spec: OutSpec) -> Follow:
    """A custom autograd.Function's marker (:mod:`torchpar.ir.function_regions`): its value takes operand 0's
    layout; when a saved tensor is the operand followed, the value is whole."""
    rest = (None,) * (len(operands) - 1)
    if main == 0 and main_spec is not None:
        return Follow(main_spec, (main_spec,) + rest)
    whole = (None,) * len(cast(TensorMeta, operands[0]).shape)  # the marked tensor
    return Follow(whole, (whole,) + rest)


def _replicated(node: Node, operands: Sequence[OutMeta]) -> Follow:
    required = tuple((None,) * len(m.shape) if isinstance(m, TensorMeta) else None for m in operands)
    out = node.out
    if isinstance(out, TensorMeta):
        return Follow((None,) * len(out.shape), required)
    if isinstance(out, tuple):
        return Follow(Multi((None,) * len(m.shape) if m is not None else None for m in out), required)
    return Follow(None, required)


def _same_out(node: Node, spec: Spec, required: tuple) -> Follow:
    out = node.out
    if isinstance(out, tuple):
        return Follow(Multi(spec if m is not None and len(m.shape) == len(spec) else None for m in out), required)
    return Follow(spec, required)


def _is_elementwise(out: TensorMeta, operands: Sequence[OutMeta]) -> bool:
    tensors = [m for m in operands if isinstance(m, TensorMeta)]
    if not tensors:
        return False
    rank = len(out.shape)
    for meta in tensors:
        if len(meta.shape) > rank:
            return False
        for size, out_size in zip(reversed(meta.shape), reversed(out.shape)):
            if size not in (1, out_size):
                return False
    return True


def _broadcast_like(
    out: TensorMeta,
    operands: Sequence[OutMeta],
    main: int,
    main_spec: Spec,
    mesh: LogicalMesh,
    needs_grad: Sequence[bool],
    weights: Sequence[bool] = (),
) -> Follow:
    """Right-aligned broadcasting: the output takes the main operand's splits; every operand gets the
    output's splits on its non-broadcast dims."""
    rank = len(out.shape)
    main_shape = cast(TensorMeta, operands[main]).shape  # the operand followed is a tensor
    offset = rank - len(main_shape)
    out_spec: list[tuple[int, ...] | None] = [None] * rank
    for d, entry in enumerate(main_spec):
        if main_shape[d] == out.shape[d + offset]:
            out_spec[d + offset] = entry
    out_spec_t = tuple(out_spec)
    if not is_valid(out_spec_t, out.shape, mesh.shape):
        out_spec_t = (None,) * rank
    required: list[Spec | None] = []
    comm = weight_comm = 0.0
    for position, (meta, grad) in enumerate(zip(operands, needs_grad)):
        if not isinstance(meta, TensorMeta):
            required.append(None)
            continue
        shift = rank - len(meta.shape)
        spec = tuple(
            out_spec_t[d + shift] if meta.shape[d] == out.shape[d + shift] else None for d in range(len(meta.shape))
        )
        required.append(spec)
        if grad:  # ∂operand sums over the dims it is broadcast along
            reduced_axes = [
                a
                for d, entry in enumerate(out_spec_t)
                if entry
                for a in entry
                if d < shift or meta.shape[d - shift] != out.shape[d]
            ]
            if reduced_axes:
                local = meta.nbytes / math.prod(mesh.shape[a] for e in spec if e for a in e)
                if position < len(weights) and weights[position]:
                    weight_comm += mesh.all_reduce(local, reduced_axes)
                else:
                    comm += mesh.all_reduce(local, reduced_axes)
    return Follow(out_spec_t, tuple(required), comm, weight_comm)


def reduced_dims(node: Node, rank: int) -> set[int]:
    """The dims of its rank-``rank`` operand that the reduction ``node`` reduces over."""
    dims_arg, _ = reduction_dims(node.target, node.args, node.kwargs)
    if (
        node.target in ("aten.sum.default", "aten.mean.default", "aten.any.default")
        or dims_arg is None
        or dims_arg == []
    ):
        return set(range(rank))
    dims = cast(int | Sequence[int], dims_arg)  # a reduction's dim argument: one dim or a list of them
    return {d % rank for d in ([dims] if isinstance(dims, int) else dims)}


def _reduce(
    node: Node, main_meta: TensorMeta, out: TensorMeta, spec: Spec, mesh: LogicalMesh, n_operands: int
) -> Follow:
    rank = len(main_meta.shape)
    dims = reduced_dims(node, rank)
    keepdim = len(out.shape) == rank
    out_spec = (
        tuple((None if d in dims else e) for d, e in enumerate(spec))
        if keepdim
        else tuple(e for d, e in enumerate(spec) if d not in dims)
    )
    axes = [a for d, e in enumerate(spec) if e and d in dims for a in e]
    comm = 0.0
    if axes:
        local = out.nbytes / math.prod(mesh.shape[a] for e in out_spec if e for a in e)
        comm = mesh.all_reduce(local, axes)
    out_value: OutSpec = out_spec
    if isinstance(node.out, tuple):  # max.dim → (values, indices)
        out_value = Multi(out_spec for _ in node.out)
    return Follow(out_value, (spec,) + (None,) * (n_operands - 1), comm)


def _normalize(node: Node, operands: Sequence[OutMeta], main_meta: TensorMeta, spec: Spec, dims: range) -> Follow:
    keep = tuple(None if d in dims else e for d, e in enumerate(spec))
    rank = len(main_meta.shape)
    required = [keep] + [
        tuple(keep[rank - len(m.shape) + d] for d in range(len(m.shape))) if isinstance(m, TensorMeta) else None
        for m in operands[1:]
    ]
    out = (
        Multi(
            (keep if len(m.shape) == rank else tuple(keep[: len(m.shape)])) if m is not None else None for m in node.out
        )
        if isinstance(node.out, tuple)
        else keep
    )
    return Follow(out, tuple(required))


def _batch_norm(
    node: Node, operands: Sequence[OutMeta], main_meta: TensorMeta, spec: Spec, mesh: LogicalMesh
) -> Follow:
    channel = spec[1] if len(spec) > 1 else None
    required = tuple(
        spec if i == 0 else ((channel,) if isinstance(m, TensorMeta) else None) for i, m in enumerate(operands)
    )
    axes = [a for d, e in enumerate(spec) if e and d != 1 for a in e]
    comm = 0.0
    if axes:  # batch statistics (and their gradients) are all-reduced across the split batch/spatial dims
        channels = main_meta.shape[1] if len(main_meta.shape) > 1 else 1
        comm = 2 * mesh.all_reduce(2 * channels * 4, axes)
    outs = node.out if isinstance(node.out, tuple) else (node.out,)
    out = Multi(
        spec if i == 0 else ((channel,) if m is not None and len(m.shape) == 1 else None) for i, m in enumerate(outs)
    )
    return Follow(out, required, comm)


def _squeeze_kept(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[int]:
    kept, j = [], 0
    for d, size in enumerate(in_shape):
        if j < len(out_shape) and out_shape[j] == size and (size != 1 or len(in_shape) - d - 1 < len(out_shape) - j):
            kept.append(d)
            j += 1
    return kept if len(kept) == len(out_shape) else [d for d, s in enumerate(in_shape) if s != 1][: len(out_shape)]


def _view(in_meta: TensorMeta, out_meta: TensorMeta, spec: Spec, mesh: LogicalMesh, n_operands: int) -> Follow:
    """A split survives a reshape only on the major dim of each merged/split group."""
    in_shape, out_shape = list(in_meta.shape), list(out_meta.shape)
    required = list(spec)
    out_spec: list[tuple[int, ...] | None] = [None] * len(out_shape)
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        group_in: list[int] = []
        group_out: list[int] = []
        prod_in = prod_out = 1
        while True:
            if prod_in == prod_out and group_in and group_out:
                break
            if (prod_in <= prod_out and i < len(in_shape)) or j >= len(out_shape):
                if i >= len(in_shape):
                    break
                group_in.append(i)
                prod_in *= in_shape[i]
                i += 1
            else:
                group_out.append(j)
                prod_out *= out_shape[j]
                j += 1
        while i < len(in_shape) and in_shape[i] == 1 and prod_in == prod_out:  # trailing size-1 dims
            group_in.append(i)
            i += 1
        while j < len(out_shape) and out_shape[j] == 1 and prod_in == prod_out:
            group_out.append(j)
            j += 1
        major_in = next((d for d in group_in if in_shape[d] != 1), None)
        major_out = next((d for d in group_out if out_shape[d] != 1), None)
        for d in group_in:
            entry = spec[d] if d < len(spec) else None
            if not entry:
                continue
            pieces = math.prod(mesh.shape[a] for a in entry)
            if d == major_in and major_out is not None and out_shape[major_out] % pieces == 0:
                out_spec[major_out] = entry
            else:
                required[d] = None
        if not group_in and not group_out:
            break
    return Follow(tuple(out_spec), (tuple(required),) + (None,) * (n_operands - 1))

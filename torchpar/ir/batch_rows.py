"""Which dims of each value index the batch's rows, and which floating-point values mix rows.

A loss that is a sum (or mean, or a sum over a count) of per-row terms combines from the losses of any split of the
batch's rows (:mod:`torchpar.ir.loss_parts`); one that reduces over the rows before its last reduction — a penalty on
the batch's mean activation, a router's load-balancing loss (a product of batch means) — does not. This pass follows
the rows from the batch inputs (dim 0 of every leaf, as micro-batches and data replicas cut them) through the ops it
knows and marks a floating-point value **mixed** when an op reduces, normalizes or contracts over a dim that holds
rows, and every floating-point value computed from a mixed one. It never guesses: after an op it does not know (or a
reshape it cannot follow) a value's rows are untracked (``None``), and no op on an untracked value is called mixing
— so a missed mixing is possible, a false one is not meant to be. Integer values (indices, counts, offsets) carry no
mixing: a permutation of the rows (sorting tokens by expert and putting them back) or a grouping by counts keeps each
row's value its own.

**Permuted rows.** A sort along the rows puts them in a batch-dependent order: each split of the batch would sort
only its own rows. That is harmless while every row stays with itself — a mixture-of-experts layer sorts its tokens
by expert, runs each through its expert, and puts them back — and not when a row in the sorted order meets a row in
the batch's order (``mse(h[argsort(h[:, 0])], y)`` pairs each sorted row with another row's target). So a value's
rows carry their *order* (``""``: the batch's; else the sort that made it), and an index its *target* (the order of
the rows its values number): ``sort`` gives indices in its own order numbering the input's rows; ``table[idx]`` with
``idx`` numbering the table's order has ``idx``'s order; ``base.index_put([idx], values)`` puts the values' rows back
into the order ``idx`` numbers (with ``values = arange``: the inverse permutation, an index numbering ``idx``'s
order). An elementwise op whose operands' rows are in different orders mixes rows.

Plain data in, plain data out: no torch, no JAX.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import SupportsInt, cast

from torchpar.ir.graph import Graph, Node, OutMeta, Ref, TensorMeta, one_row_index
from torchpar.ir.op_families import reduction_dims

Rows = frozenset[int] | None
"""The dims of a value that index batch rows (empty: none; ``None``: not tracked)."""


@dataclass(frozen=True)
class RowState:
    rows: Rows
    mixed: str | None = None
    """For a floating-point value computed from a reduction over rows (or a pairing of rows in two orders): the op
    that mixed them (its target, node name and source line) and how, else ``None``."""
    order: str = ""
    """The order its row dims are in: ``""`` the batch's, else the name of the sort that permuted them."""
    target: str | None = None
    """For an index into rows: the order of the rows its values number (``""``: the batch's), else ``None``."""


_SAME = frozenset(
    {
        "aten.clone.default",
        "aten.alias.default",
        "aten._to_copy.default",
        "aten.detach.default",
        "torchpar.stop_gradient",
        "aten.contiguous.default",
        "aten.convert_element_type.default",
        "aten.native_dropout.default",
        "aten.dropout.default",
        "aten.slice.Tensor",
        "aten.constant_pad_nd.default",
        "aten.expand.default",
        "aten.split_with_sizes.default",
        "aten.split.Tensor",
    }
)
_REDUCE_DIMS = frozenset(
    {
        "aten.sum.dim_IntList",
        "aten.mean.dim",
        "aten.amax.default",
        "aten.amin.default",
        "aten.var.correction",
        "aten.var.dim",
        "aten.std.correction",
        "aten.std.dim",
        "aten.logsumexp.default",
        "aten.prod.dim_int",
        "aten.max.dim",
        "aten.min.dim",
        "aten.argmax.default",
        "aten.argmin.default",
        "aten.any.dim",
        "aten.all.dim",
        "aten.norm.ScalarOpt_dim",
        "aten.linalg_vector_norm.default",
    }
)
_REDUCE_ALL = frozenset(
    {
        "aten.sum.default",
        "aten.mean.default",
        "aten.max.default",
        "aten.min.default",
        "aten.prod.default",
        "aten.var.default",
        "aten.std.default",
        "aten.histc.default",
        "aten.bincount.default",
    }
)
_ALONG_DIM = frozenset(
    {  # (x, dim, ...): the result keeps x's dims; rows mix when dim holds them
        "aten._softmax.default",
        "aten._log_softmax.default",
        "aten.softmax.int",
        "aten.log_softmax.int",
        "aten.cumsum.default",
        "aten.cumprod.default",
        "aten.logcumsumexp.default",
    }
)
_VIEWS = frozenset({"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"})
_GROUPED = frozenset({"aten._grouped_mm.default", "transformers.grouped_mm_fallback.default"})


def row_states(graph: Graph, *, integers: bool = False) -> dict[str, RowState]:
    """The :class:`RowState` of every input and node of ``graph`` (module docstring). ``integers``: integer and bool
    values carry mixing too, as floating-point ones do — for values returned as they are (a ``step_fn``'s aux
    outputs, :mod:`torchpar.ir.aux_parts`), where ``(x > x.mean(0))`` or an index shifted by the batch's largest one
    is no row's own; a grouping by counts over the batch (a mixture of experts) then mixes too."""
    carries = (lambda meta: True) if integers else _floating
    metas = graph.metas()
    states: dict[str, RowState] = {}
    for inp in graph.inputs:
        batch = inp.kind == "input" and isinstance(inp.meta, TensorMeta) and len(inp.meta.shape) >= 1
        states[inp.name] = RowState(frozenset({0}) if batch else frozenset())
    positions: set[str] = set()  # values of arange: row positions, an index numbering whatever order it is used in
    for node in graph.nodes:
        states[node.name] = _state(node, states, metas, positions, carries)
        if node.target.startswith("aten.arange."):
            positions.add(node.name)
    return states


def _state(
    node: Node,
    states: dict[str, RowState],
    metas: dict[str, OutMeta],
    positions: set[str],
    carries: Callable[[OutMeta], bool],
) -> RowState:
    """``node``'s state from its operands'; ``carries(meta)``: whether a value of that meta carries mixing."""
    refs = list(node.refs())
    operands = [states.get(r, RowState(None)) for r in refs]
    inherited = next((s.mixed for s, r in zip(operands, refs) if s.mixed and carries(metas.get(r))), None)
    if all(s.rows == frozenset() for s in operands):  # nothing from the batch
        return RowState(frozenset(), inherited if carries(node.out) else None)
    rows, reducing = _rows(node, operands, metas)
    order, target, paired = _order(node, operands, metas, positions, rows)
    if order is None:
        rows, order = None, ""
    what = "reduces over them" if reducing else "pairs rows sorted over the batch with rows in another order"
    mixed = inherited or (f"{node.target} ({node.name}{_where(node)}) {what}" if reducing or paired else None)
    return RowState(rows, mixed if carries(node.out) else None, order, target)


def _order(
    node: Node, operands: list[RowState], metas: dict[str, OutMeta], positions: set[str], rows: Rows
) -> tuple[str | None, str | None, bool]:
    """``(the order of the output's rows (None: not followed), what it indexes (an index's target), whether the op
    pairs rows of two orders)`` (module docstring: permuted rows)."""
    target, args = node.target, node.args
    first = operands[0] if operands else RowState(None)
    if not rows:
        return "", None, False
    if target == "getitem":
        return first.order, first.target, False
    if target in ("aten.sort.default", "aten.sort.stable"):
        if _sort_dim(node, metas) in rows:  # values and indices in the sort's order, the indices numbering x's rows
            return node.name, first.order, False
        return first.order, None, False
    if target == "aten.index.Tensor" and one_row_index(args):
        table, index = operands[0], operands[1]
        if table.rows:  # rows of the table picked by the index: in the index's order, if it numbers the table's
            return (index.order if index.target == table.order else None), None, False
        return index.order, None, False
    if target == "aten.index_put.default" and one_row_index(args) and len(operands) > 2:
        index, values = operands[1], operands[2]
        if index.target is None or (values.rows and values.order != index.order):
            return None, None, False
        arange = isinstance(args[2], Ref) and args[2].name in positions
        return index.target, (index.order if arange else None), False
    carrying = [s for s in operands if s.rows]
    orders = {s.order for s in carrying}
    if len(orders) > 1:  # an elementwise op pairs rows of two orders; anything else: not followed
        return (carrying[0].order, None, True) if _elementwise(node, metas) else (None, None, False)
    order = orders.pop() if orders else ""
    if (
        order
        and target in _VIEWS
        and isinstance(node.out, TensorMeta)
        and args
        and isinstance(args[0], Ref)
        and isinstance(metas.get(args[0].name), TensorMeta)
        and cast(TensorMeta, metas[args[0].name]).shape[:1] != node.out.shape[:1]
    ):
        return None, None, False  # permuted rows merged or split: not followed
    tensors = [s for s, r in zip(operands, node.refs()) if isinstance(metas.get(r), TensorMeta)]
    index_target = tensors[0].target if len(tensors) == 1 else None  # perm // k numbers the tokens of the pairs
    return order, index_target, False


def _sort_dim(node: Node, metas: dict[str, OutMeta]) -> int:
    """The dim a ``sort`` works along (``sort.stable`` takes it as a keyword; both default to the last)."""
    args = node.args
    meta = metas.get(args[0].name) if args and isinstance(args[0], Ref) else None
    rank = len(meta.shape) if isinstance(meta, TensorMeta) else 1
    dim = args[1] if len(args) > 1 and not isinstance(args[1], bool) else node.kwargs.get("dim", -1)
    return _norm(dim, max(rank, 1))


def _elementwise(node: Node, metas: dict[str, OutMeta]) -> bool:
    out = node.out
    tensors = [metas.get(r) for r in node.refs()]
    return isinstance(out, TensorMeta) and all(
        isinstance(m, TensorMeta) and _broadcasts(m.shape, out.shape) for m in tensors
    )


def _rows(node: Node, operands: list[RowState], metas: dict[str, OutMeta]) -> tuple[Rows, bool]:
    """``(the output's rows, whether the op reduces over rows)``; an operand that is not tracked leaves the output
    untracked and the op not called reducing."""
    target, args = node.target, node.args
    first = operands[0] if operands else RowState(None)
    x_meta = metas.get(args[0].name) if args and isinstance(args[0], Ref) else None
    rank = len(x_meta.shape) if isinstance(x_meta, TensorMeta) else None
    if target == "getitem":
        return first.rows, False
    if target == "aten.cat.default":
        return _cat_rows(node, operands, metas), False
    if first.rows is None or rank is None:
        return None, False
    assert isinstance(x_meta, TensorMeta)  # rank was read from it
    rows = first.rows
    if target in _SAME:
        return rows, False
    if target in _ALONG_DIM:
        dim = _norm(args[1], rank)
        return rows, dim in rows
    if target == "aten.topk.default":  # (x, k, dim=-1): which values are kept depends on the others along dim
        dim = _norm(args[2] if len(args) > 2 else -1, rank)
        return rows, dim in rows
    if target in ("aten.sort.default", "aten.sort.stable"):  # a permutation along its dim: of rows too, which then
        # come in the sort's order (:func:`_order`)
        return rows, False
    if target in _REDUCE_ALL:
        return frozenset(), bool(rows)
    if target in _REDUCE_DIMS:
        dims, keep = reduction_dims(target, args, node.kwargs)
        if dims is None or (isinstance(dims, (list, tuple)) and not dims):  # no dims: every dim
            dims = tuple(range(rank))
        dims = dims if isinstance(dims, (list, tuple)) else (dims,)
        dims = {_norm(d, rank) for d in dims}
        kept = rows - dims if keep else frozenset(d - sum(1 for r in dims if r < d) for d in rows - dims)
        return kept, bool(rows & dims)
    if target == "aten.native_layer_norm.default":
        normalized = len(args[1])
        return rows, any(d >= rank - normalized for d in rows)
    if target == "aten.unsqueeze.default":
        dim = _norm(args[1], rank + 1)
        return frozenset(d + 1 if d >= dim else d for d in rows), False
    if target in ("aten.squeeze.dims", "aten.squeeze.dim"):
        dims = args[1] if isinstance(args[1], (list, tuple)) else (args[1],)
        gone = {_norm(d, rank) for d in dims if x_meta.shape[_norm(d, rank)] == 1}
        return frozenset(d - sum(1 for g in gone if g < d) for d in rows - gone), False
    if target == "aten.permute.default":
        order = [_norm(d, rank) for d in args[1]]
        return frozenset(i for i, d in enumerate(order) if d in rows), False
    if target in ("aten.t.default", "aten.transpose.int"):
        a, b = (0, 1) if target == "aten.t.default" else (_norm(args[1], rank), _norm(args[2], rank))
        return frozenset(b if d == a else a if d == b else d for d in rows), False
    if target == "aten.select.int":
        dim = _norm(args[1], rank)
        return frozenset(d - 1 if d > dim else d for d in rows if d != dim), False
    if target in _VIEWS:
        return _view_rows(rows, x_meta.shape, node.out), False
    if target == "aten.convolution.default":  # (x [N, C, …], w, b): each sample's output from its own input
        return (rows, False) if rows == {0} and all(s.rows == frozenset() for s in operands[1:]) else (None, False)
    if target in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default"):
        return _matmul_rows(target, operands)
    if target == "aten.embedding.default":  # (weight, indices): the indices' dims, then the embedding's
        return (operands[1].rows, False) if len(operands) > 1 else (None, False)
    if target == "aten.gather.default":
        dim = _norm(args[1], rank)
        return (rows, False) if dim not in rows else (None, False)
    if target == "aten.index.Tensor" and one_row_index(args) and len(operands) > 1:
        # table[idx]: the index's dims, then the table's others; the table's rows picked by an index numbering them
        table, index = operands
        if index.rows is None or (rows and (rows != {0} or index.target is None)):
            return None, False
        return frozenset(index.rows) | frozenset(
            d - 1 + len(cast(TensorMeta, metas[args[1][0].name]).shape) for d in rows - {0}
        ) if isinstance(metas.get(args[1][0].name), TensorMeta) else None, False
    if target == "aten.index_put.default" and one_row_index(args) and len(operands) > 2:
        index, values = operands[1], operands[2]
        if index.target is None or index.rows != {0} or values.rows not in (frozenset(), frozenset({0})):
            return None, False
        return frozenset({0}), False
    if target in _GROUPED:  # rows grouped by expert: each row's product is its own
        return (frozenset({0}) if rows == frozenset({0}) else None), False
    if target == "aten.scaled_dot_product_attention.default":
        tracked = [s.rows for s in operands[:3]]
        if any(r is None or r - {0, 1} for r in tracked):
            return None, False
        return rows, False
    return _elementwise_rows(node, operands, metas)


def _cat_rows(node: Node, operands: list[RowState], metas: dict[str, OutMeta]) -> Rows:
    """``cat(tensors, dim)`` along a dim that holds no rows: the operands' rows (an empty operand — a cache's initial
    ``[0]`` tensor — adds nothing); of one operand (an RNN's layers, one of them): its rows; along rows, or with an
    untracked operand: not followed."""
    sizes = [metas.get(r) for r in node.refs()]
    kept = [s for s, meta in zip(operands, sizes) if not (isinstance(meta, TensorMeta) and 0 in meta.shape)]
    if not kept or any(s.rows is None for s in kept) or not isinstance(node.out, TensorMeta):
        return None
    if len(sizes) == 1:
        return kept[0].rows
    rows = frozenset[int]().union(*(cast(frozenset[int], s.rows) for s in kept))  # none is None: checked above
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return None if _norm(dim, len(node.out.shape)) in rows else rows


def _matmul_rows(target: str, operands: list[RowState]) -> tuple[Rows, bool]:
    """``[M, K] @ [K, N]`` (``addmm``: after the bias) and ``[G, M, K] @ [G, K, N]``: rows stay on ``M``, ``N``
    and ``G``; a contraction over rows (``K``) mixes them."""
    a, b = (operands[1], operands[2]) if target == "aten.addmm.default" else (operands[0], operands[1])
    if a.rows is None or b.rows is None:
        return None, False
    if target == "aten.bmm.default":
        out = (
            ({0} if 0 in a.rows | b.rows else set()) | ({1} if 1 in a.rows else set()) | ({2} if 2 in b.rows else set())
        )
        return frozenset(out), 2 in a.rows or 1 in b.rows
    out = ({0} if 0 in a.rows else set()) | ({1} if 1 in b.rows else set())
    return frozenset(out), 1 in a.rows or 0 in b.rows


def _elementwise_rows(node: Node, operands: list[RowState], metas: dict[str, OutMeta]) -> tuple[Rows, bool]:
    """An op whose tensor operands all broadcast to its output's shape (right-aligned): each output element reads
    the elements at its own position, so the rows stay where they are. Anything else is not followed."""
    out = node.out
    if not isinstance(out, TensorMeta):
        return None, False
    rows: set[int] = set()
    for state, ref in zip(operands, node.refs()):
        meta = metas.get(ref)
        if not isinstance(meta, TensorMeta) or not _broadcasts(meta.shape, out.shape) or state.rows is None:
            return None, False
        offset = len(out.shape) - len(meta.shape)
        rows |= {d + offset for d in state.rows if meta.shape[d] == out.shape[d + offset]}
    return frozenset(rows), False


def _view_rows(rows: frozenset[int], old: tuple[int, ...], out: OutMeta) -> Rows:
    """A reshape keeps rows at dim 0 when it merges dim 0 with the dims after it or splits it into a leading dim of
    more than one (``[B, T, C] ↔ [B·T, C]``); a dim of rows it leaves whole moves to the dim of the result that has
    its size and as many elements before it (``[1, B, H] → [B, H]``, ``[T, B, H] → [T, B, H]``); otherwise they are
    not followed."""
    if not isinstance(out, TensorMeta) or not rows or not old or not out.shape:
        return frozenset() if not rows else None
    new0, old0 = out.shape[0], old[0]
    if rows == {0} and new0 > 1 and (new0 % old0 == 0 or old0 % new0 == 0):
        return frozenset({0})
    kept = [_kept_dim(d, old, out.shape) for d in rows]
    return None if None in kept else frozenset(cast("list[int]", kept))


def _kept_dim(dim: int, old: tuple[int, ...], new: tuple[int, ...]) -> int | None:
    """The dim of a reshape's result ``new`` that dim ``dim`` of ``old`` becomes when the reshape leaves it whole (the
    same size, the same number of elements before it), else ``None``."""
    before = math.prod(old[:dim])
    for d, size in enumerate(new):
        if size == old[dim] and math.prod(new[:d]) == before:
            return d
    return None


def _broadcasts(shape: tuple[int, ...], out: tuple[int, ...]) -> bool:
    if len(shape) > len(out):
        return False
    return all(s in (1, o) for s, o in zip(shape, out[len(out) - len(shape) :]))


def _floating(meta: OutMeta) -> bool:
    if isinstance(meta, tuple):
        return any(_floating(m) for m in meta)
    return isinstance(meta, TensorMeta) and ("float" in meta.dtype or "bfloat" in meta.dtype)


def _norm(dim: SupportsInt, rank: int) -> int:
    return int(dim) + rank if int(dim) < 0 else int(dim)


def _where(node: Node) -> str:
    return f" at {node.source}" if node.source else ""


__all__ = ["RowState", "Rows", "row_states"]

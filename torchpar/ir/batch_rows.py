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

Plain data in, plain data out: no torch, no JAX.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchpar.ir.graph import Graph, Node, Ref, TensorMeta

Rows = frozenset[int] | None
"""The dims of a value that index batch rows (empty: none; ``None``: not tracked)."""


@dataclass(frozen=True)
class RowState:
    rows: Rows
    mixed: str | None = None
    """For a floating-point value computed from a reduction over rows: the op that reduced them (its node name,
    target and source line), else ``None``."""


_SAME = frozenset({
    "aten.clone.default", "aten.alias.default", "aten._to_copy.default", "aten.detach.default", "torchpar.stop_gradient",
    "aten.contiguous.default", "aten.convert_element_type.default", "aten.native_dropout.default",
    "aten.dropout.default", "aten.slice.Tensor", "aten.constant_pad_nd.default", "aten.expand.default",
    "aten.split_with_sizes.default", "aten.split.Tensor",
})
_REDUCE_DIMS = frozenset({
    "aten.sum.dim_IntList", "aten.mean.dim", "aten.amax.default", "aten.amin.default", "aten.var.correction",
    "aten.var.dim", "aten.std.correction", "aten.std.dim", "aten.logsumexp.default", "aten.prod.dim_int",
    "aten.max.dim", "aten.min.dim", "aten.argmax.default", "aten.argmin.default", "aten.any.dim", "aten.all.dim",
    "aten.norm.ScalarOpt_dim", "aten.linalg_vector_norm.default",
})
_REDUCE_ALL = frozenset({
    "aten.sum.default", "aten.mean.default", "aten.max.default", "aten.min.default",
    "aten.prod.default", "aten.var.default", "aten.std.default", "aten.histc.default", "aten.bincount.default",
})
_ALONG_DIM = frozenset({  # (x, dim, ...): the result keeps x's dims; rows mix when dim holds them
    "aten._softmax.default", "aten._log_softmax.default", "aten.softmax.int", "aten.log_softmax.int",
    "aten.cumsum.default", "aten.cumprod.default", "aten.logcumsumexp.default",
})
_VIEWS = frozenset({"aten.view.default", "aten._unsafe_view.default", "aten.reshape.default"})
_GROUPED = frozenset({"aten._grouped_mm.default", "transformers.grouped_mm_fallback.default"})


def row_states(graph: Graph) -> dict[str, RowState]:
    """The :class:`RowState` of every input and node of ``graph`` (module docstring)."""
    metas = graph.metas()
    states: dict[str, RowState] = {}
    for inp in graph.inputs:
        batch = inp.kind == "input" and isinstance(inp.meta, TensorMeta) and len(inp.meta.shape) >= 1
        states[inp.name] = RowState(frozenset({0}) if batch else frozenset())
    for node in graph.nodes:
        states[node.name] = _state(node, states, metas)
    return states


def _state(node: Node, states: dict[str, RowState], metas: dict[str, Any]) -> RowState:
    refs = list(node.refs())
    operands = [states.get(r, RowState(None)) for r in refs]
    inherited = next((s.mixed for s, r in zip(operands, refs) if s.mixed and _floating(metas.get(r))), None)
    if all(s.rows == frozenset() for s in operands):  # nothing from the batch
        return RowState(frozenset(), inherited if _floating(node.out) else None)
    rows, reducing = _rows(node, operands, metas)
    mixed = inherited or (f"{node.target} ({node.name}{_where(node)})" if reducing else None)
    return RowState(rows, mixed if _floating(node.out) else None)


def _rows(node: Node, operands: list[RowState], metas: dict[str, Any]) -> tuple[Rows, bool]:
    """``(the output's rows, whether the op reduces over rows)``; an operand that is not tracked leaves the output
    untracked and the op not called reducing."""
    target, args = node.target, node.args
    first = operands[0] if operands else RowState(None)
    x_meta = metas.get(args[0].name) if args and isinstance(args[0], Ref) else None
    rank = len(x_meta.shape) if isinstance(x_meta, TensorMeta) else None
    if target == "getitem":
        return first.rows, False
    if first.rows is None or rank is None:
        return None, False
    rows = first.rows
    if target in _SAME:
        return rows, False
    if target in _ALONG_DIM:
        dim = _norm(args[1], rank)
        return rows, dim in rows
    if target == "aten.topk.default":  # (x, k, dim=-1): which values are kept depends on the others along dim
        dim = _norm(args[2] if len(args) > 2 else -1, rank)
        return rows, dim in rows
    if target in ("aten.sort.default", "aten.sort.stable"):  # (x, dim=-1) / (x, *, dim=-1): a permutation along
        # dim, of rows too: not followed there
        dim = _norm(args[1] if len(args) > 1 and not isinstance(args[1], bool) else node.kwargs.get("dim", -1), rank)
        return (rows, False) if dim not in rows else (None, False)
    if target in _REDUCE_ALL:
        return frozenset(), bool(rows)
    if target in _REDUCE_DIMS:
        dims = args[1] if len(args) > 1 else None
        if dims is None or (isinstance(dims, (list, tuple)) and not dims):  # no dims: every dim
            dims = tuple(range(rank))
        dims = dims if isinstance(dims, (list, tuple)) else (dims,)
        dims = {_norm(d, rank) for d in dims}
        keep = len(args) > 2 and args[2] is True or node.kwargs.get("keepdim", False)
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
    if target == "aten.cat.default":
        if any(s.rows is None for s in operands):
            return None, False
        return frozenset().union(*(s.rows for s in operands)), False
    if target in ("aten.mm.default", "aten.addmm.default", "aten.bmm.default"):
        return _matmul_rows(target, operands)
    if target == "aten.embedding.default":  # (weight, indices): the indices' dims, then the embedding's
        return (operands[1].rows, False) if len(operands) > 1 else (None, False)
    if target == "aten.gather.default":
        dim = _norm(args[1], rank)
        return (rows, False) if dim not in rows else (None, False)
    if target in _GROUPED:  # rows grouped by expert: each row's product is its own
        return (frozenset({0}) if rows == frozenset({0}) else None), False
    if target == "aten.scaled_dot_product_attention.default":
        tracked = [s.rows for s in operands[:3]]
        if any(r is None or r - {0, 1} for r in tracked):
            return None, False
        return rows, False
    return _elementwise_rows(node, operands, metas)


def _matmul_rows(target: str, operands: list[RowState]) -> tuple[Rows, bool]:
    """``[M, K] @ [K, N]`` (``addmm``: after the bias) and ``[G, M, K] @ [G, K, N]``: rows stay on ``M``, ``N``
    and ``G``; a contraction over rows (``K``) mixes them."""
    a, b = (operands[1], operands[2]) if target == "aten.addmm.default" else (operands[0], operands[1])
    if a.rows is None or b.rows is None:
        return None, False
    if target == "aten.bmm.default":
        out = ({0} if 0 in a.rows | b.rows else set()) | ({1} if 1 in a.rows else set()) | \
            ({2} if 2 in b.rows else set())
        return frozenset(out), 2 in a.rows or 1 in b.rows
    out = ({0} if 0 in a.rows else set()) | ({1} if 1 in b.rows else set())
    return frozenset(out), 1 in a.rows or 0 in b.rows


def _elementwise_rows(node: Node, operands: list[RowState], metas: dict[str, Any]) -> tuple[Rows, bool]:
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


def _view_rows(rows: frozenset[int], old: tuple[int, ...], out: Any) -> Rows:
    """A reshape keeps rows at dim 0 when it merges dim 0 with the dims after it or splits it into a leading dim of
    more than one (``[B, T, C] ↔ [B·T, C]``); otherwise they are not followed."""
    if not isinstance(out, TensorMeta) or not rows or rows != {0} or not old or not out.shape:
        return frozenset() if not rows else None
    new0, old0 = out.shape[0], old[0]
    if new0 > 1 and (new0 % old0 == 0 or old0 % new0 == 0):
        return frozenset({0})
    return None


def _broadcasts(shape: tuple[int, ...], out: tuple[int, ...]) -> bool:
    if len(shape) > len(out):
        return False
    return all(s in (1, o) for s, o in zip(shape, out[len(out) - len(shape):]))


def _floating(meta: Any) -> bool:
    if isinstance(meta, tuple):
        return any(_floating(m) for m in meta)
    return isinstance(meta, TensorMeta) and ("float" in meta.dtype or "bfloat" in meta.dtype)


def _norm(dim: Any, rank: int) -> int:
    return int(dim) + rank if int(dim) < 0 else int(dim)


def _where(node: Node) -> str:
    return f" at {node.source}" if node.source else ""


__all__ = ["RowState", "Rows", "row_states"]

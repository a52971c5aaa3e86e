"""Strategies of the ops that move rows by a whole index: ``table[idx]`` and ``base.index_put([idx], values)``.

Both are roots of the sharding ILP (anchors) when the index is one 1-D tensor on dim 0 — a mixture-of-experts
layer's token dispatch (``hidden[perm // k]``, ``out[inv_perm]``, ``index_put((perm,), y)``). Besides the layouts
the plain op runs in (for the gather, the embedding-like einsum ``V…, i → i…``: index rows split with the table
whole, table rows split with a partial sum, or the trailing dims split; for the put, everything whole), they can
keep their rows split: the **exchange** (``jaxbackend.ops.row_exchange``) moves only the rows whose source and
destination devices differ, by one all-to-all over the row axes ``R``. The index must be whole (an ``int`` tensor
of ``S`` entries: ``4·S`` bytes, against ``S`` rows of the table for an all-gather of the data). **Priced for a
uniform permutation** (the index is data; the plan cannot know it): with ``P = |R|``, a destination chunk of
``L`` rows, and ``T = expert_slot_rows(L, P)`` rows per peer's slot (``2·L/P``):

- all-to-all of the send buffer ``[P·T, row]`` over ``R`` forward, and again backward when the moved rows need a
  gradient (the exact path, ``T = L``, runs only when a device pair has more than ``T`` rows: a skewed router);
- memory: the output's ``1/P``; transient: send and receive buffers of both paths (``2·P·(T + L)·row``, the two
  branches of a ``lax.cond``, as the expert exchange).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

from torchpar.ir.costs import expert_slot_rows
from torchpar.ir.graph import Node, OutMeta, TensorMeta, one_row_index
from torchpar.ir.layout import Spec
from torchpar.planner.sharding.cost_model import LogicalMesh
from torchpar.planner.sharding.strategies import Einsum, Strategy, anchor_einsum

ROW_GATHER = "aten.index.Tensor"
ROW_PUT = "aten.index_put.default"
EXCHANGE = (("rows", "exchange"),)
"""The lowering option of an exchange strategy (``Strategy.lowering``)."""


def row_exchange_form(
    target: str, args: tuple, operand_shapes: Sequence[Sequence[int]], out_shape: Sequence[int]
) -> str | None:
    """``"gather"`` for ``table[idx]`` and ``"put"`` for ``base.index_put([idx], values)`` with one 1-D index on
    dim 0 (and, for the put, ``values`` of shape ``[len(idx), *base.shape[1:]]``: no broadcasting); else ``None``.
    ``operand_shapes``: the tensor operands' shapes in ``Node.refs()`` order."""
    if target not in (ROW_GATHER, ROW_PUT) or not one_row_index(args):
        return None
    shapes = [tuple(s) for s in operand_shapes]
    if target == ROW_GATHER and len(shapes) == 2:
        table, idx = shapes
        if len(table) >= 1 and len(idx) == 1 and tuple(out_shape) == idx + table[1:]:
            return "gather"
    if target == ROW_PUT and len(shapes) == 3:
        base, idx, values = shapes
        if len(base) >= 1 and len(idx) == 1 and values == idx + base[1:] and tuple(out_shape) == base:
            return "put"
    return None


def anchor_of(node: Node, operand_metas: Sequence[OutMeta]) -> tuple[Einsum | None, str | None] | None:
    """How ``node`` is a root (anchor) of the sharding ILP — ``(its einsum view, its row-exchange form)``, either
    possibly ``None`` — or ``None`` when it follows an operand instead. ``operand_metas``: its tensor operands' metas
    in ``Node.refs()`` order (the solver graph and the layouts replayed from a plan both decide by this)."""
    out = node.out
    if (
        not operand_metas
        or not isinstance(out, TensorMeta)
        or not all(isinstance(m, TensorMeta) for m in operand_metas)
    ):
        return None
    tensors = cast(Sequence[TensorMeta], operand_metas)  # every operand is a tensor, as just checked
    einsum = anchor_einsum(node.target, node.args, [len(m.shape) for m in tensors], len(out.shape))
    if einsum is not None and len(einsum.operands) != len(tensors):
        einsum = None
    form = row_exchange_form(node.target, node.args, [m.shape for m in tensors], out.shape)
    return (einsum, form) if einsum is not None or form is not None else None


def replicated_put(operand_shapes: Sequence[Sequence[int]], out_bytes: float) -> Strategy:
    """A put run whole on every device (what GSPMD does with it unless told otherwise)."""
    whole = tuple((None,) * len(s) for s in operand_shapes)
    return Strategy(name="replicated", out_spec=whole[0], in_specs=whole, memory_bytes=out_bytes)


def exchange_strategies(
    form: str,
    operand_shapes: Sequence[Sequence[int]],
    itemsize: int,
    needs_grad: Sequence[bool],
    mesh: LogicalMesh,
    *,
    num_micro_batches: int = 1,
) -> list[Strategy]:
    """The exchange strategies of a ``form`` (:func:`row_exchange_form`) op: rows split over one live axis or both
    (either major: a grouped matmul's rows split ``(experts' axis, other)`` read them without a reshuffle), and
    with one axis for the rows, the dim after them optionally split over the other (columns: each row moves in
    pieces). Module docstring: costs."""
    data = operand_shapes[0] if form == "gather" else operand_shapes[2]  # the rows that move
    dest_rows = operand_shapes[1][0] if form == "gather" else operand_shapes[0][0]
    source_rows = operand_shapes[0][0] if form == "gather" else operand_shapes[1][0]
    moved_rows = operand_shapes[1][0]  # the pairs: one per index entry
    out_shape = (moved_rows,) + tuple(data[1:]) if form == "gather" else tuple(operand_shapes[0])
    live = [a for a in (0, 1) if mesh.shape[a] > 1]
    choices: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((a,), ()) for a in live]
    if len(data) >= 2:
        choices += [((a,), (b,)) for a in live for b in live if b != a]
    if len(live) == 2:  # either major: the expert strategies' rows run (experts' axis, the other)
        choices += [((0, 1), ()), ((1, 0), ())]
    size = lambda axes: math.prod(mesh.shape[x] for x in axes)
    grad = bool(needs_grad[0] if form == "gather" else len(needs_grad) > 2 and needs_grad[2])
    strategies = []
    for rows, columns in choices:
        peers, pieces = size(rows), size(columns)
        if dest_rows % peers or source_rows % peers or moved_rows % peers or (columns and data[1] % pieces):
            continue
        row_bytes = math.prod(data[1:]) * itemsize / pieces
        chunk = (moved_rows if form == "gather" else source_rows) // peers  # the most rows one pair can move
        slot = expert_slot_rows(chunk, peers)
        sent = peers * slot * row_bytes
        comm = num_micro_batches * mesh.all_to_all(sent, rows) * (2.0 if grad else 1.0)
        spec = lambda rank, rows=rows, columns=columns: (
            (rows,) + ((columns,) if columns else (None,)) * (rank > 1) + (None,) * max(rank - 2, 0)
        )
        whole_index = (None,)
        in_specs: tuple[Spec | None, ...]
        if form == "gather":
            in_specs = (spec(len(data)), whole_index)
        else:
            in_specs = (spec(len(out_shape)), whole_index, spec(len(data)))
        out_bytes = math.prod(out_shape) * itemsize / peers / pieces
        buffers = 2.0 * peers * (slot + (chunk if slot < chunk else 0)) * row_bytes
        name = (
            f"rows@{''.join(map(str, rows))}" + (f",cols@{''.join(map(str, columns))}" if columns else "") + ",exchange"
        )
        strategies.append(
            Strategy(
                name=name,
                out_spec=spec(len(out_shape)),
                in_specs=in_specs,
                comm_s=comm,
                memory_bytes=out_bytes,
                transient_bytes=buffers,
                lowering=EXCHANGE,
                collectives=(f"all-to-all {sent:.0f}B over {rows}" + (", again backward" if grad else ""),),
            )
        )
    return strategies


def is_exchange(strategy: Strategy) -> bool:
    return tuple(getattr(strategy, "lowering", ()) or ()) == EXCHANGE


__all__ = [
    "EXCHANGE",
    "ROW_GATHER",
    "ROW_PUT",
    "anchor_of",
    "exchange_strategies",
    "is_exchange",
    "replicated_put",
    "row_exchange_form",
]

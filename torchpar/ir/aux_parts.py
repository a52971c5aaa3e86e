"""How a ``step_fn``'s auxiliary outputs over the parts of a batch make the whole batch's, found in the IR.

A ``step_fn`` may return ``(loss, aux)`` with ``aux`` a dict of tensors; each value is a graph output of kind ``"aux"``
whose ``target`` is its key (:mod:`torchpar.capture.export`). When a step cuts the batch into ``P > 1`` equal parts
along dim 0 (micro-batches × data replicas), the captured graph computes one part's value ``a_p``, and PyTorch's
truth is the value ``A`` the whole batch gives. :func:`with_aux_parts` marks each aux output with the rule that
makes ``A`` of the ``a_p`` (``Output.combine``), or refuses it:

- ``"rows"`` — dim 0 holds the batch's rows, in the batch's order, and no row's value depends on another row
  (:mod:`torchpar.ir.batch_rows`: tracked, not mixed — through integer values too — not permuted): ``A`` is the
  parts' rows concatenated in batch order (a per-row loss, a prediction, an RNN's batch-first hidden state);
- ``"mean"`` / ``"sum"`` — a scalar that is a mean / sum of per-row terms, by the loss's own analysis
  (:class:`torchpar.ir.loss_parts.Reductions`: through casts, scalar multiples and sums of like terms): equal parts
  have equal counts, so ``A = (1/P) Σ_p a_p`` / ``A = Σ_p a_p`` (an accuracy, a count of correct predictions);
- ``"same"`` — a value that reads no batch input (a parameter norm): every part computes it alike, ``A = a_1``.

Anything else — a scalar that is a ratio, a maximum or a product of batch statistics; a tensor whose rows mix or sit
in another dim — has no exact rule, so it raises ``ValueError`` naming the key and why, before anything compiles.
With one part nothing is marked (``combine == ""``): the value is returned as it is.

Plain data in, plain data out: no torch, no JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Final

from torchpar.ir.graph import Graph, Node, OutMeta, Output, TensorMeta
from torchpar.ir.loss_parts import NotDecomposable, Reductions

AUX: Final = "aux"
"""The output kind of a ``step_fn``'s auxiliary values."""


def aux_outputs(graph: Graph) -> list[Output]:
    """``graph``'s auxiliary outputs, in the order the ``step_fn`` returned them."""
    return [o for o in graph.outputs if o.kind == AUX]


def with_aux_parts(graph: Graph, parts: str) -> Graph:
    """``graph`` with each aux output marked with its combination rule (module docstring); raises ``ValueError``
    naming the first aux value that has none. ``parts`` says how the batch is cut, for that message (``"4
    micro-batches"``). ``graph`` itself when it has no aux output."""
    if not aux_outputs(graph):
        return graph
    analysis = Reductions(graph, what="the value", integers=True)
    metas = graph.metas()
    return dataclasses.replace(
        graph,
        outputs=[
            dataclasses.replace(o, combine=_rule(analysis, o, metas, parts)) if o.kind == AUX else o
            for o in graph.outputs
        ],
    )


def _rule(analysis: Reductions, output: Output, metas: dict[str, OutMeta], parts: str) -> str:
    """The combination rule of ``output`` (module docstring), or the ``ValueError`` saying why it has none."""
    assert output.value is not None  # an aux output names its value
    name = output.value.name
    meta = metas[name]
    assert isinstance(meta, TensorMeta)  # a step_fn's aux values are tensors
    if name not in analysis.on_batch:
        return "same"
    state = analysis.rows.get(name)
    if state is not None and state.rows == frozenset({0}) and not state.mixed and not state.order:
        return "rows"
    if meta.numel == 1 and (state is None or not state.rows):
        try:
            reduction = analysis.reduction(name)
        except NotDecomposable as error:
            why = f"it is a scalar, but not a mean or a sum of per-row terms ({error})"
            raise _refusal(output, meta, parts, why) from None
        if reduction.kind == "ratio":
            raise _refusal(
                output,
                meta,
                parts,
                f"it is a sum divided by a count ({reduction.den}), which needs every "
                "part's count; return the numerator and the count as two aux sums and divide them after "
                "the step",
            )
        return reduction.kind
    raise _refusal(output, meta, parts, _why_not_rows(analysis, name))


def _why_not_rows(analysis: Reductions, name: str) -> str:
    state = analysis.rows.get(name)
    if state is None or state.rows is None:
        lost = _rows_lost_at(analysis, name)
        where = f" ({lost.target} {lost.name}{' at ' + lost.source if lost.source else ''})" if lost else ""
        return (
            f"the batch-rows analysis cannot follow the batch's rows to it through an op it does not know{where}, "
            "so neither its rows nor a reduction can be told"
        )
    if state.mixed:
        return f"its values mix the batch's rows: {state.mixed}"
    if state.order:
        return f"its rows are in the order of a sort over the batch ({state.order}), not the batch's"
    if not state.rows:
        return "it holds no dim of the batch's rows, yet depends on the batch"
    if 0 not in state.rows:
        return (
            f"the batch's rows are in dim(s) {sorted(state.rows)}, not dim 0: return it with the rows first "
            "(e.g. an LSTM's h_n.transpose(0, 1))"
        )
    return f"dims {sorted(state.rows)} all hold the batch's rows; a per-row value holds them in dim 0 only"


def _rows_lost_at(analysis: Reductions, name: str) -> Node | None:
    """The first op above ``name`` whose result's rows are untracked while its operands' are: where they were lost."""
    seen, stack, found = set(), [name], []
    while stack:
        value = stack.pop()
        node = analysis.producers.get(value)
        if node is None or value in seen or analysis.rows[value].rows is not None:
            continue
        seen.add(value)
        operands = list(node.refs())
        if all(analysis.rows[r].rows is not None for r in operands):
            found.append(node)
        stack.extend(operands)
    order = {n: i for i, n in enumerate(analysis.producers)}
    return min(found, key=lambda n: order[n.name], default=None)


def _refusal(output: Output, meta: TensorMeta, parts: str, why: str) -> ValueError:
    return ValueError(
        f"step_fn's aux[{output.target!r}] ({meta}) cannot be combined over the {parts} each batch is cut into: {why}. "
        "torchpar returns an aux value for the whole batch when its dim 0 holds the batch's rows (concatenated), "
        "when it is a scalar mean or sum over rows, or when it does not read the batch; return such a value instead, "
        "or train with one part per batch (num_micro_batches=1, no data replicas)."
    )


__all__ = ["AUX", "aux_outputs", "with_aux_parts"]

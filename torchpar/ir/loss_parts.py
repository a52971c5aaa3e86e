"""How micro-batch losses make the whole batch's loss: the loss's final reduction, found in the IR.

Gradient accumulation and pipelines run the captured step on ``M`` micro-batches of one batch. PyTorch's
truth is the step on the whole batch, so the micro-batch losses ``ℓ_m`` must be combined the way the loss's
last reduction combines rows. Write the loss as ``ℓ = num / den`` with ``den`` independent of the parameters;
the whole batch's loss and gradient are then

    L = Σ_m num_m / Σ_m den_m,        ∇L = Σ_m ∇num_m / Σ_m den_m.

:func:`with_loss_parts` recognizes three forms (:class:`LossReduction`), through scalar multiples and dtype
casts of the loss (``0.5 * loss``, ``loss.float()``) and sums of like terms:

A mean or sum qualifies only if what it adds are per-row terms: where an earlier op reduced over the batch's rows
(``x.mean(0)``, a router's load-balancing loss; :mod:`torchpar.ir.batch_rows`) the loss is not decomposable.

- ``"mean"`` — ``mean.default`` / ``mean.dim`` to a scalar (``num = Σ x``, ``den = numel``): every micro-batch
  has the same shapes, so ``den_m`` is the same for all and ``L = (1/M) Σ_m ℓ_m``. A loss that does not depend
  on the batch at all is the same on every micro-batch, and also combines this way.
- ``"sum"`` — ``sum`` to a scalar (``den = 1`` for the whole batch): ``L = Σ_m ℓ_m``.
- ``"ratio"`` — ``div.Tensor(a, b)`` with ``a`` a sum and ``b`` a sum over the batch that reads no parameter
  (cross-entropy with ``ignore_index``: the summed nll over the count of non-ignored tokens; HF-style
  ``loss.sum() / num_items``): ``num_m = a_m = ℓ_m · b_m`` and ``den_m = b_m``, so
  ``L = Σ_m ℓ_m b_m / Σ_m b_m``.

The pass marks the form with one extra graph output of kind ``"loss_den"``: its value is the denominator ``b``
(``"ratio"``), or ``None`` (``"sum"``); no mark means ``"mean"``. It adds no node, so plans made for the graph
(node → layer maps) still fit it, and pipeline slicing carries the mark to the last stage
(:mod:`torchpar.planner.pipeline.slicing`). :func:`loss_reduction` reads the mark back. A loss of another form keeps
the mean of micro-batch losses, with a ``warnings.warn`` saying so and how to write it.

Plain data in, plain data out: no torch, no JAX.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Final, Literal

from torchpar.ir.batch_rows import row_states
from torchpar.ir.graph import Graph, Node, Output, Ref, TensorMeta

LOSS_DEN: Final = "loss_den"
"""The output kind that marks how micro-batch losses combine."""

ReductionKind = Literal["mean", "sum", "ratio"]

_MEANS = frozenset({"aten.mean.default", "aten.mean.dim"})
_SUMS = frozenset({"aten.sum.default", "aten.sum.dim_IntList"})
_SAME_VALUE = frozenset(
    {  # a scalar passed through: cast, copy, view, negation
        "aten._to_copy.default",
        "aten.clone.default",
        "aten.alias.default",
        "aten.view.default",
        "aten._unsafe_view.default",
        "aten.reshape.default",
        "aten.squeeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.unsqueeze.default",
        "aten.neg.default",
        "aten.expand.default",
        "aten.convert_element_type.default",
    }
)
_MULTIPLIES = frozenset({"aten.mul.Tensor", "aten.mul.Scalar"})
_DIVIDES = frozenset({"aten.div.Tensor", "aten.div.Scalar"})
_ADDS = frozenset({"aten.add.Tensor", "aten.sub.Tensor"})
_STOP_GRADIENT = frozenset({"aten.detach.default", "torchpar.stop_gradient"})
_MAX_DEPTH = 32


@dataclass(frozen=True)
class LossReduction:
    """How the whole batch's loss is made of the micro-batches' (module docstring)."""

    kind: ReductionKind
    den: str | None = None
    """``"ratio"``: the value holding a micro-batch's denominator (a node or input of the graph)."""

    def describe(self) -> str:
        return {
            "mean": "the mean of the micro-batch losses",
            "sum": "the sum of the micro-batch losses",
            "ratio": f"Σ numerator / Σ denominator over the micro-batches (denominator {self.den})",
        }[self.kind]


MEAN = LossReduction("mean")
SUM = LossReduction("sum")


class NotDecomposable(ValueError):
    """The loss is not of a form :func:`decompose_loss` knows; the message says which op stopped it."""


def loss_reduction(graph: Graph) -> LossReduction:
    """The reduction :func:`with_loss_parts` marked in ``graph`` (``MEAN`` where it marked none)."""
    mark = next((o for o in graph.outputs if o.kind == LOSS_DEN), None)
    if mark is None:
        return MEAN
    return SUM if mark.value is None else LossReduction("ratio", mark.value.name)


def decompose_loss(graph: Graph) -> LossReduction:
    """The form of ``graph``'s loss (module docstring); raises :class:`NotDecomposable` naming what is not."""
    loss = next((o.value.name for o in graph.outputs if o.kind == "loss" and o.value is not None), None)
    if loss is None:
        raise NotDecomposable("the graph has no loss output")
    return Reductions(graph).whole(loss)


def with_loss_parts(graph: Graph) -> Graph:
    """``graph`` with its loss's reduction marked as an output (module docstring); ``graph`` itself for a mean (or
    if already marked). A loss of unknown form warns and is left unmarked: its micro-batch losses are averaged."""
    if any(o.kind == LOSS_DEN for o in graph.outputs):
        return graph
    try:
        reduction = decompose_loss(graph)
    except NotDecomposable as error:
        warnings.warn(
            f"torchpar: the loss cannot be split into a numerator and a parameter-free denominator ({error}); with "
            "num_micro_batches > 1 each micro-batch's loss is weighted 1/num_micro_batches (the mean of the "
            "micro-batch losses), which equals the whole batch's loss only for a mean over equal-size micro-batches. "
            "End the loss with a mean, a sum, or `.sum() / count` where `count` does not depend on the parameters "
            "(e.g. `(labels != -100).sum()`) to train exactly as on the whole batch.",
            stacklevel=2,
        )
        return graph
    if reduction.kind == "mean":
        return graph
    mark = Output(LOSS_DEN, Ref(reduction.den) if reduction.den is not None else None)
    return dataclasses.replace(graph, outputs=[*graph.outputs, mark])


class Reductions:
    """Which values depend on the batch (``on_batch``) and on the parameters, each value's rows (``rows``:
    :func:`torchpar.ir.batch_rows.row_states`, ``integers`` as there), and the reduction of a scalar value
    (:meth:`reduction`; also read by :mod:`torchpar.ir.aux_parts` for a ``step_fn``'s aux outputs)."""

    def __init__(self, graph: Graph, what: str = "the loss", *, integers: bool = False):
        self.what = what
        """What the analysed value is, in :class:`NotDecomposable` messages."""
        self.producers: dict[str, Node] = {n.name: n for n in graph.nodes}
        self.metas = graph.metas()
        self.rows = row_states(graph, integers=integers)
        self.on_batch = {i.name for i in graph.inputs if i.kind == "input"}
        self.on_params = {i.name for i in graph.inputs if i.kind == "param"}
        for node in graph.nodes:
            refs = set(node.refs())
            if refs & self.on_batch:
                self.on_batch.add(node.name)
            if refs & self.on_params and node.target not in _STOP_GRADIENT:
                self.on_params.add(node.name)

    def whole(self, loss: str) -> LossReduction:
        """The reduction of the loss; a loss that does not read the batch is the same on every micro-batch."""
        if loss not in self.on_batch:
            return MEAN
        return self.reduction(loss, 0)

    def reduction(self, name: str, depth: int = 0) -> LossReduction:
        """How the scalar value ``name`` combines over parts of the batch; :class:`NotDecomposable` says why not."""
        node = self.producers.get(name)
        if node is None:
            raise NotDecomposable(f"{self.what} is the input {name}")
        if depth > _MAX_DEPTH:
            raise NotDecomposable(f"the reduction chain above {node.target} is longer than {_MAX_DEPTH} ops")
        if not _is_scalar(node.out):
            raise NotDecomposable(f"{node.target} ({node.name}) makes {node.out}, not a scalar")
        target, operands = node.target, node.args
        if target in _MEANS or target in _SUMS:
            summed = operands[0] if operands and isinstance(operands[0], Ref) else None
            mixed = self.rows[summed.name].mixed if summed is not None and summed.name in self.rows else None
            if mixed:
                raise NotDecomposable(
                    f"the {target} ({node.name}) adds terms that already mix the batch's rows: "
                    f"{mixed}, so {self.what} is not a sum of per-row terms{_where(node)}"
                )
            return MEAN if target in _MEANS else SUM
        if target in _SAME_VALUE and operands and isinstance(operands[0], Ref):
            return self.reduction(operands[0].name, depth + 1)
        if target in _MULTIPLIES and len(operands) == 2:
            factor, other = self._split_factor(operands)
            if factor is not None:
                assert other is not None  # found with its factor
                return self.reduction(other.name, depth + 1)
        if target in _DIVIDES and len(operands) == 2 and isinstance(operands[0], Ref):
            num, den = operands
            if not isinstance(den, Ref) or den.name not in self.on_batch:  # a constant divisor: a scalar multiple
                return self.reduction(num.name, depth + 1)
            return self._ratio(node, num.name, den.name, depth)
        if target in _ADDS and len(operands) >= 2 and all(isinstance(o, Ref) for o in operands[:2]):
            return self._sum_of_terms(node, operands[0].name, operands[1].name, depth)
        raise NotDecomposable(
            f"{self.what} ends in {target} ({node.name}), not a mean, a sum or a sum divided by a count{_where(node)}"
        )

    def _split_factor(self, operands: tuple) -> tuple[object, Ref | None]:
        """``(factor, other operand)`` of a product with one operand that does not read the batch (a python number
        or a batch-independent tensor); ``(None, None)`` if both read it."""
        a, b = operands
        for factor, other in ((b, a), (a, b)):
            if isinstance(other, Ref) and (not isinstance(factor, Ref) or factor.name not in self.on_batch):
                return factor, other
        return None, None

    def _ratio(self, node: Node, num: str, den: str, depth: int) -> LossReduction:
        if den in self.on_params:
            raise NotDecomposable(f"the divisor {den} of {node.name} depends on the parameters{_where(node)}")
        if self.reduction(num, depth + 1).kind != "sum":
            raise NotDecomposable(f"the numerator {num} of {node.name} is not a sum{_where(node)}")
        try:
            den_kind = self.reduction(den, depth + 1).kind
        except NotDecomposable as error:
            raise NotDecomposable(f"the divisor {den} of {node.name} is not a sum over the batch ({error})") from None
        if den_kind != "sum":
            raise NotDecomposable(f"the divisor {den} of {node.name} is a {den_kind}, not a sum over the batch")
        return LossReduction("ratio", den)

    def _sum_of_terms(self, node: Node, a: str, b: str, depth: int) -> LossReduction:
        """``a ± b``: terms of one form add up (a ratio's over the same denominator); a term that does not read the
        batch adds to a mean or a ratio alike (``Σ_m (ℓ_m + c)·den_m / Σ den_m = L + c``), not to a sum."""
        terms = [self.reduction(t, depth + 1) if t in self.on_batch else None for t in (a, b)]
        batch_terms = [t for t in terms if t is not None]
        if len(batch_terms) == 1 and batch_terms[0].kind != "sum":
            return batch_terms[0]
        if len(batch_terms) == 2 and batch_terms[0] == batch_terms[1]:
            return batch_terms[0]
        kinds = " and ".join(t.describe() if t is not None else "a batch-independent term" for t in terms)
        raise NotDecomposable(
            f"{node.target} ({node.name}) adds terms that combine differently over micro-batches "
            f"({kinds}){_where(node)}"
        )


def _is_scalar(meta: object) -> bool:
    return isinstance(meta, TensorMeta) and meta.numel == 1


def _where(node: Node) -> str:
    return f" at {node.source}" if node.source else ""


__all__ = [
    "LOSS_DEN",
    "LossReduction",
    "MEAN",
    "NotDecomposable",
    "Reductions",
    "SUM",
    "decompose_loss",
    "loss_reduction",
    "with_loss_parts",
]

"""Which batch values index a tensor, and the range PyTorch accepts for them.

PyTorch checks every index at run time (``IndexError: index out of range in self``); XLA clamps an
out-of-range gather to the nearest row, so a token id of 9999 for a vocabulary of 512 would silently read
row 511. :func:`index_bounds` finds, from the IR alone, every integer batch input whose values reach an
index operand unchanged, and :func:`check_index_inputs` checks a batch against them on the host before
the step runs (a min/max per checked input: microseconds next to a training step).

Value flow. A batch input *reaches* an op's index operand when the operand is the input passed through
value-preserving ops only (views, slices, padding, concatenation, copies, integer casts; see
``VALUE_PRESERVING``). ``where(ne(x, k), x, c)`` passes ``x`` on with ``k`` replaced (HF's loss replaces
``ignore_index`` so); then ``k`` is an allowed value of ``x``. Any other op (arithmetic, clamp, a ``where``
with another condition) ends the flow, so a model that maps its ids itself is never checked against a
range it does not use: the check has false negatives, never false positives.

Ranges (PyTorch's rules, ``n`` the size of the indexed dim): ``embedding``, ``index_select``, ``gather``,
``scatter*``, ``index_add`` take ``0 ≤ v < n``; advanced indexing (``index.Tensor``, ``index_put``) takes
``−n ≤ v < n``; ``nll_loss`` targets take ``0 ≤ v < C`` or ``ignore_index``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from torchpar.ir.graph import Graph, Node, OutMeta, Ref, TensorMeta

_INT_DTYPES = frozenset({"int8", "uint8", "int16", "int32", "int64"})

VALUE_PRESERVING = frozenset(
    {
        "aten.view.default",
        "aten._unsafe_view.default",
        "aten.reshape.default",
        "aten.expand.default",
        "aten.slice.Tensor",
        "aten.select.int",
        "aten.unsqueeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.squeeze.default",
        "aten.permute.default",
        "aten.transpose.int",
        "aten.t.default",
        "aten.clone.default",
        "aten.alias.default",
        "torchpar.stop_gradient",
        "aten.lift_fresh_copy.default",
        "aten._to_copy.default",
        "aten.constant_pad_nd.default",
        "aten.repeat.default",
        "aten.flip.default",
        "aten.roll.default",
        "aten.cat.default",
        "aten.split.Tensor",
        "aten.split_with_sizes.default",
        "aten.unbind.int",
        "aten.index.Tensor",
        "getitem",
        "aten.narrow.default",
        "aten.view_copy.default",
        "aten.slice_copy.Tensor",
        "aten.expand_copy.default",
        "aten.contiguous.default",
    }
)
"""Ops whose (first, data) operand's values reach their result unchanged."""

_ZERO_BASED = {  # op → (position of the indexed tensor, position of dim (None: dim 0), position of the index)
    "aten.embedding.default": (0, None, 1),
    "aten.index_select.default": (0, 1, 2),
    "aten.gather.default": (0, 1, 2),
    "aten.scatter.src": (0, 1, 2),
    "aten.scatter.value": (0, 1, 2),
    "aten.scatter_add.default": (0, 1, 2),
    "aten.scatter_reduce.two": (0, 1, 2),
    "aten.index_add.default": (0, 1, 2),
}
_ADVANCED = (
    "aten.index.Tensor",
    "aten.index_put.default",
    "aten._unsafe_index.Tensor",
    "aten._unsafe_index_put.default",
)
_NLL = ("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default")


@dataclass(frozen=True)
class IndexBound:
    """Batch input ``input_index`` (its position in the flattened batch) indexes ``node`` (an ATen ``op``):
    each of its values ``v`` must satisfy ``low ≤ v < high`` or be one of ``allowed`` (an ignore index)."""

    input_index: int
    low: int
    high: int
    allowed: frozenset[int]
    op: str
    node: str
    indexed: str
    """What the values index, in words (``"the 512 rows of transformer.wte.weight"``)."""
    source: str
    module_path: str

    def describe_range(self) -> str:
        extra = "".join(f" or {v} (ignore_index)" for v in sorted(self.allowed))
        return f"{self.low} … {self.high - 1}{extra}"


class InputRangeError(IndexError):
    """A batch value indexes a tensor outside the range PyTorch accepts (PyTorch raises ``IndexError``; XLA
    would clamp it and train on the wrong rows)."""


def index_bounds(graph: Graph) -> list[IndexBound]:
    """Every (batch input, index op) pair of ``graph`` where the input's values reach the op's index operand
    unchanged (module docstring), with the range PyTorch accepts; deduplicated, in graph order."""
    metas = graph.metas()
    params = {i.name: i.target for i in graph.inputs if i.kind in ("param", "buffer")}
    # flow[value name] = (batch input position, values allowed outside the range on the way)
    flow: dict[str, tuple[int, frozenset[int]]] = {
        i.name: (int(i.target), frozenset())
        for i in graph.inputs
        if i.kind == "input" and isinstance(i.meta, TensorMeta) and i.meta.dtype in _INT_DTYPES
    }
    producers = {n.name: n for n in graph.nodes}
    bounds: list[IndexBound] = []
    seen: set[tuple] = set()
    for node in graph.nodes:
        for position, ref in _index_operands(node):
            if ref not in flow:
                continue
            bound = _bound(node, position, flow[ref], metas, params, producers)
            key = (bound.input_index, bound.low, bound.high, bound.allowed, bound.op)
            if bound.high > bound.low and key not in seen:
                seen.add(key)
                bounds.append(bound)
        passed = _passed_value(node, flow, producers)
        if passed is not None and _is_int(node.out):
            flow[node.name] = passed
    return bounds


def check_index_inputs(bounds: Sequence[IndexBound], leaves: Sequence[np.ndarray | None], names: Sequence[str]) -> None:
    """Raise :class:`InputRangeError` for the first batch value outside its bound. ``leaves`` are the batch's
    arrays in flattened order (the values the user passed, before any narrowing cast; ``None`` for a bfloat16
    leaf, which indexes nothing), ``names`` how to call each (``"batch['input_ids']"``)."""
    for bound in bounds:
        values = leaves[bound.input_index]
        assert values is not None  # an index is an integer leaf
        if values.size == 0:
            continue
        low, high = values.min(), values.max()
        if low >= bound.low and high < bound.high:
            continue
        bad = (values < bound.low) | (values >= bound.high)
        for allowed in bound.allowed:
            bad &= values != allowed
        if bad.any():
            raise InputRangeError(_message(bound, values, bad, names[bound.input_index]))


def _index_operands(node: Node) -> Iterable[tuple[int | tuple[int, int], str]]:
    """(position, value name) of each index operand of ``node``; a position ``(p, k)`` is entry ``k`` of the
    list argument ``p`` (advanced indexing)."""
    if node.target in _ZERO_BASED:
        position = _ZERO_BASED[node.target][2]
        if len(node.args) > position and isinstance(node.args[position], Ref):
            yield position, node.args[position].name
    elif node.target in _ADVANCED and len(node.args) > 1:
        for k, entry in enumerate(node.args[1]):
            if isinstance(entry, Ref):
                yield (1, k), entry.name
    elif node.target in _NLL and len(node.args) > 1 and isinstance(node.args[1], Ref):
        yield 1, node.args[1].name


def _bound(
    node: Node,
    position: int | tuple[int, int],
    flowing: tuple[int, frozenset[int]],
    metas: dict[str, OutMeta],
    params: dict[str, str],
    producers: dict[str, Node],
) -> IndexBound:
    input_index, allowed = flowing
    indexed_ref = node.args[0]
    shape = cast(TensorMeta, metas[indexed_ref.name]).shape  # the indexed operand: a tensor
    named = params.get(indexed_ref.name)
    if node.target in _ZERO_BASED:
        _, dim_position, _ = _ZERO_BASED[node.target]
        dim = 0 if dim_position is None else node.args[dim_position] % max(len(shape), 1)
        low, high = 0, shape[dim]
        source = producers.get(indexed_ref.name)
        if node.target == "aten.embedding.default":
            indexed = f"the {high} rows of {named or 'the embedding table'}"
        elif node.target == "aten.gather.default" and source is not None and "log_softmax" in source.target:
            indexed = f"the {high} classes of a cross-entropy loss"
        else:
            indexed = f"dim {dim} (size {high}) of {named or 'a ' + str(metas[indexed_ref.name])}"
    elif node.target in _ADVANCED:
        dim = cast("tuple[int, int]", position)[1]  # an advanced index's (operand, dim)
        low, high = -shape[dim], shape[dim]
        indexed = f"dim {dim} (size {high}) of {named or 'a ' + str(metas[indexed_ref.name])}"
    else:  # nll_loss: classes are dim 1 of the input (dim 0 when it is one sample)
        classes = shape[1] if len(shape) > 1 else shape[0]
        low, high = 0, classes
        ignore = node.args[4] if len(node.args) > 4 else -100
        allowed = allowed | {int(ignore)}
        indexed = f"the {classes} classes of the loss"
    allowed = frozenset(v for v in allowed if not low <= v < high)
    return IndexBound(
        input_index=input_index,
        low=int(low),
        high=int(high),
        allowed=allowed,
        op=node.target,
        node=node.name,
        indexed=indexed,
        source=node.source,
        module_path=node.module_path,
    )


def _passed_value(
    node: Node, flow: dict[str, tuple[int, frozenset[int]]], producers: dict[str, Node]
) -> tuple[int, frozenset[int]] | None:
    """The flowing batch value ``node``'s result carries unchanged, if any."""
    if node.target in VALUE_PRESERVING:
        data = node.args[0] if node.args else None
        candidates = data if isinstance(data, (list, tuple)) and node.target == "aten.cat.default" else [data]
        flowing = [flow[c.name] for c in candidates if isinstance(c, Ref) and c.name in flow]
        if len({f[0] for f in flowing}) == 1:  # one batch input (cat of several: not followed)
            return flowing[0][0], frozenset().union(*(f[1] for f in flowing))
        return None
    if node.target == "aten.where.self" and len(node.args) == 3:
        cond, a, b = node.args
        for kept, test_op in ((a, "aten.ne.Scalar"), (b, "aten.eq.Scalar")):
            if isinstance(kept, Ref) and kept.name in flow:
                input_index, allowed = flow[kept.name]
                tested = producers.get(cond.name) if isinstance(cond, Ref) else None
                if (
                    tested is not None
                    and tested.target == test_op
                    and isinstance(tested.args[0], Ref)
                    and flow.get(tested.args[0].name, (None,))[0] == input_index
                    and isinstance(tested.args[1], (int, float))
                ):
                    return input_index, allowed | {int(tested.args[1])}
    return None


def _is_int(out: OutMeta) -> bool:
    return (
        isinstance(out, TensorMeta)
        and out.dtype in _INT_DTYPES
        or (isinstance(out, tuple) and any(isinstance(o, TensorMeta) and o.dtype in _INT_DTYPES for o in out))
    )


def _message(bound: IndexBound, values: np.ndarray, bad: np.ndarray, name: str) -> str:
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    value = int(values[where])
    count = int(bad.sum())
    at = f" ({bound.module_path})" if bound.module_path else ""
    line = f"\n  at {bound.source}" if bound.source else ""
    return (
        f"{name} holds {value} at index {list(where)}, outside the valid range {bound.describe_range()}: it "
        f"indexes {bound.indexed} in {bound.op}{at}{line}\n"
        f"  {count} of {values.size} value(s) of {name} are out of range. PyTorch raises "
        "'IndexError: index out of range' here; XLA would silently clamp the index and train on the wrong "
        "row. Fix the data (or the size the model was built with); torchpar.compile(..., check_inputs=False) "
        "turns this check off."
    )

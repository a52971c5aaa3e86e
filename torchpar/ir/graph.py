"""The one IR in the middle: a functional graph of core ATen ops, free of torch objects.

Capture (``torchpar.capture``) produces a :class:`Graph`; planner passes read it; ``jaxbackend.lower``
turns it into a JAX function. Everything here is plain data (numpy arrays for constants), so a graph
can be inspected, sliced into stages and serialized without importing torch or jax.

Vocabulary:
- An *input* is a graph placeholder: a parameter, a buffer, a lifted constant or a user (batch) input.
- A *node* is one ATen call. Its ``args``/``kwargs`` hold python scalars, lists, ``None``, strings,
  :class:`Ref` (the value of another node or input) and :class:`DType` (a tensor dtype).
- A node's ``out`` is a :class:`TensorMeta`, a tuple of them (multi-output ops; ``None`` for a
  non-tensor slot), or ``None`` for ops with no tensor result.
- An *output* is the loss, an auxiliary output of a ``step_fn`` (kind ``"aux"``), a user output, or the new value
  of a mutated buffer.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, overload

import numpy as np

DTYPE_BYTES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


@dataclass(frozen=True)
class Ref:
    """The value of the input or node called ``name``."""

    name: str


@dataclass(frozen=True)
class DType:
    """A tensor dtype argument, by its torch name without the ``torch.`` prefix (``"float32"``)."""

    name: str


@dataclass(frozen=True)
class TensorMeta:
    """Static shape and dtype of one tensor value."""

    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)  # exact Python ints (the planner calls this a million times: not numpy's)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


InputKind = Literal["param", "buffer", "constant", "input", "activation"]
OutputKind = Literal["loss", "aux", "user", "buffer", "activation", "loss_den"]
OutMeta = TensorMeta | tuple[TensorMeta | None, ...] | None


@dataclass(frozen=True)
class Input:
    """A graph placeholder.

    ``target`` is the parameter or buffer name as in ``model.named_parameters()`` /
    ``named_buffers()`` (tied parameters: the first name, so two placeholders may share a target),
    the constant's key in :attr:`Graph.constants`, for a user input its position in the
    flattened batch (``"0"``, ``"1"``, ...), and for an activation (a pipeline stage's input computed by
    an earlier stage) the name of that value in the whole graph.
    """

    name: str
    kind: InputKind
    target: str
    meta: TensorMeta


@dataclass(frozen=True)
class Node:
    """One ATen call. ``target`` is the overload name, e.g. ``"aten.addmm.default"``."""

    name: str
    target: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: OutMeta
    flops: float = 0.0
    source: str = ""
    module_path: str = ""

    def refs(self) -> Iterator[str]:
        """Names of the values this node reads, in argument order (with repeats)."""
        yield from _iter_refs(self.args)
        yield from _iter_refs(tuple(self.kwargs.values()))

    @property
    def out_bytes(self) -> int:
        if isinstance(self.out, TensorMeta):
            return self.out.nbytes
        if isinstance(self.out, tuple):
            return sum(m.nbytes for m in self.out if m is not None)
        return 0

    def describe_inputs(self, metas: dict[str, OutMeta]) -> str:
        """``"float32[8, 16], int64[8]"`` for the tensor operands, for error messages."""
        return ", ".join(str(metas.get(r)) for r in self.refs())


@dataclass(frozen=True)
class Output:
    """A graph result: the loss, an auxiliary output ``target`` (a key of the dict a ``step_fn`` returns beside the
    loss; outputs only, never differentiated), a user output, the new value of buffer ``target``, (in a pipeline
    stage) an activation ``target`` that later stages read, or ``loss_den``: how micro-batch losses combine into
    the whole batch's (the loss's denominator, or ``None`` for a sum: :mod:`torchpar.ir.loss_parts`)."""

    kind: OutputKind
    value: Ref | None
    target: str = ""
    combine: str = ""
    """``"aux"``: how the values of the batch's parts make the whole batch's (:mod:`torchpar.ir.aux_parts`);
    ``""`` where the batch is one part (returned as is)."""


@dataclass
class Graph:
    """A functional graph: inputs → nodes (topologically ordered) → outputs.

    Invariants: node and input names are unique; every :class:`Ref` names an input or an earlier node.
    """

    inputs: list[Input]
    nodes: list[Node]
    outputs: list[Output]
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    custom_backwards: dict[int, Graph] = field(default_factory=dict)
    """The backward of each custom ``torch.autograd.Function`` call in this graph, by call id (see
    :mod:`torchpar.ir.function_regions`); empty for most models."""

    def metas(self) -> dict[str, OutMeta]:
        """Static meta of every value by name."""
        metas: dict[str, OutMeta] = {i.name: i.meta for i in self.inputs}
        metas.update({n.name: n.out for n in self.nodes})
        return metas

    @property
    def total_flops(self) -> float:
        return float(sum(n.flops for n in self.nodes))

    def op_counts(self) -> collections.Counter[str]:
        return collections.Counter(n.target for n in self.nodes)

    def validate(self) -> None:
        """Assert the structural invariants (internal consistency, not user error)."""
        seen = {i.name for i in self.inputs}
        assert len(seen) == len(self.inputs), "duplicate input names"
        for node in self.nodes:
            for ref in node.refs():
                assert ref in seen, f"{node.name} reads {ref} before it is defined"
            assert node.name not in seen, f"duplicate node name {node.name}"
            seen.add(node.name)
        for out in self.outputs:
            assert out.value is None or out.value.name in seen
        for call, backward in self.custom_backwards.items():
            assert isinstance(call, int), f"Function call id {call!r} is not an int"
            assert all(i.kind in ("input", "constant") for i in backward.inputs), (
                f"Function call {call}: backward reads state"
            )
            backward.validate()

    def summary(self, top: int = 12) -> str:
        """A few lines: sizes, FLOPs and the most frequent ops."""
        kinds = collections.Counter(i.kind for i in self.inputs)
        lines = [
            f"Graph: {len(self.nodes)} ops, inputs {dict(kinds)}, outputs "
            f"{[o.kind for o in self.outputs]}, {self.total_flops / 1e9:.3f} GFLOP",
        ]
        for target, count in self.op_counts().most_common(top):
            lines.append(f"  {count:5d}  {target}")
        return "\n".join(lines)

    def replace(self, **changes: Any) -> Graph:
        return dataclasses.replace(self, **changes)


def one_row_index(args: tuple) -> bool:
    """Whether an ``aten.index.Tensor`` / ``aten.index_put`` indexes with one tensor, on dim 0 (``args[1]`` is
    ``[Ref]``)."""
    indices = args[1] if len(args) > 1 else None
    return isinstance(indices, (list, tuple)) and len(indices) == 1 and isinstance(indices[0], Ref)


_V = TypeVar("_V")


@overload
def map_refs(value: _V, fn: Callable[[Ref], Ref]) -> _V: ...
@overload
def map_refs(value: object, fn: Callable[[Ref], object]) -> object: ...
def map_refs(value: object, fn: Callable[[Ref], object]) -> object:
    """``value`` (a node argument: scalars, ``Ref``, lists, tuples, dicts of them) with every :class:`Ref` replaced by
    ``fn(ref)``; containers keep their type."""
    if isinstance(value, Ref):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(map_refs(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_refs(v, fn) for k, v in value.items()}
    return value


def _iter_refs(values: tuple[object, ...]) -> Iterator[str]:

    for value in values:
        if isinstance(value, Ref):
            yield value.name
        elif isinstance(value, (list, tuple)):
            yield from _iter_refs(tuple(value))

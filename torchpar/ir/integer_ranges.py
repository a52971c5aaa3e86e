"""Whether a step's 64-bit integer arithmetic stays inside int32, checked on the host before the step runs.

JAX runs with 64-bit types off, so an ``int64`` tensor of the model is held as ``int32`` and its arithmetic wraps at
2³¹ where PyTorch's does not: the hashing trick ``(ids * 1000003 + 12345) % 97`` with ids up to 10⁵ would look up
other rows. :func:`integer_ranges` keeps, from the IR, the graph's integer-valued nodes; :meth:`IntegerRanges.check`
propagates intervals through them from a batch's integer leaves (their min and max) and raises
:class:`IntegerOverflowError` at the first ``int64`` op whose result *can* leave int32's range for that batch,
naming the op, its source line and the leaves' ranges. Cost: a min/max per integer leaf and a few interval
operations per integer node, only for graphs with ``int64`` arithmetic.

Intervals ``[lo, hi]`` (exact Python ints) follow PyTorch's integer rules: ``a + αb``, ``a·b`` and ``a**k`` from
the corners; floor/trunc division, ``remainder`` (the divisor's sign) and ``fmod`` (the dividend's); a sum of
``n`` elements in ``[n·lo, n·hi]``; ``cumsum`` the same with ``n`` the scanned length; value-preserving ops
(views, copies, concatenation, gathers, ``where``, ``masked_fill``) the union of what they pass; indices
(``argmax``, ``topk``, ``sort``) ``[0, n)``; ``arange``, ``full`` and constants their values; booleans ``[0, 1]``.
A result of a narrower dtype than ``int64`` wraps in PyTorch exactly as in JAX, so it is cut to its dtype's range,
never refused.

Not checked (the interval is unknown, so nothing computed from it is refused): values of ops not listed above
(a float cast to an integer, ``scatter_add`` counts, ``bincount`` weights), and integer *buffers* (their values
change as training runs). The bounds are worst cases: a sum is refused when ``n`` times its largest element could
leave int32, even if this batch's actual sum does not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from torchpar.ir.graph import Graph, Node, OutMeta, Ref, TensorMeta
from torchpar.ir.index_inputs import VALUE_PRESERVING

Interval = tuple[int, int] | None
"""``(lo, hi)`` with ``lo ≤ hi``, or ``None``: unknown (a float value, or one the rules do not bound)."""

Known = Interval | list[Interval]
"""A value's interval, or one per result of a multi-output node."""

INT32 = (-(2**31), 2**31 - 1)
_DTYPE_RANGES = {"bool": (0, 1), "uint8": (0, 255), "int8": (-128, 127), "int16": (-(2**15), 2**15 - 1), "int32": INT32}
_INTEGER_DTYPES = frozenset({"bool", "uint8", "int8", "int16", "int32", "int64"})
_ARITHMETIC = frozenset(
    {
        "aten.add",
        "aten.sub",
        "aten.rsub",
        "aten.mul",
        "aten.pow",
        "aten.sum",
        "aten.cumsum",
        "aten.neg",
        "aten.abs",
        "aten.bitwise_left_shift",
        "aten.__lshift__",
        "aten.prod",
        "aten.arange",
        "aten.div",
        "aten.floor_divide",
    }
)
"""Ops (by overload packet) whose int64 result can leave the range of their operands: a graph without one as an
int64 result has nothing to check."""


class IntegerOverflowError(ValueError):
    """An int64 op of the model can produce a value beyond int32's range for this batch; JAX holds int64 as int32,
    so the step would wrap it where PyTorch does not. Raised before the step runs (the state is untouched)."""


@dataclass(frozen=True)
class IntegerRanges:
    """The integer-valued part of one step's graph, to check batches against (module docstring)."""

    inputs: tuple[tuple[str, int], ...]
    """``(value name, batch leaf position)`` of each integer batch input."""
    constants: tuple[tuple[str, Interval], ...]
    nodes: tuple[Node, ...]
    """The nodes with an integer or boolean result, in graph order."""
    metas: dict[str, OutMeta]
    """Shape and dtype of every value the nodes read (reduction lengths, operand dtypes)."""

    def check(self, leaves: Sequence[np.ndarray | None], names: Sequence[str]) -> None:
        """Raise :class:`IntegerOverflowError` at the first int64 node whose interval leaves int32 for this batch
        (``leaves``: the batch's arrays in flattened order as the user passed them; ``None`` for a bfloat16 leaf)."""
        if self.nodes:
            self.intervals(leaves, names)

    def intervals(self, leaves: Sequence[np.ndarray | None], names: Sequence[str]) -> dict[str, Known]:
        """Every integer value's interval for this batch (a list per multi-output node), raising as :meth:`check`."""
        known: dict[str, Known] = dict(self.constants)
        described = []
        for name, position in self.inputs:
            values = leaves[position] if position < len(leaves) else None
            if values is None or not (np.issubdtype(values.dtype, np.integer) or values.dtype == np.bool_):
                continue
            known[name] = found = (int(values.min()), int(values.max())) if values.size else None
            if found is not None:
                described.append(f"{names[position]} in [{found[0]}, {found[1]}]")
        for node in self.nodes:
            interval = _interval(node, known, self.metas)
            if isinstance(node.out, TensorMeta):
                interval = _fit(cast(Interval, interval), node.out.dtype, node, described)  # one result: no list
            known[node.name] = interval
        return known


def integer_ranges(graph: Graph) -> IntegerRanges:
    """What :meth:`IntegerRanges.check` needs of ``graph``; empty (a no-op check) when no int64 result comes from an
    op that can grow its operands' range."""
    nodes = tuple(n for n in graph.nodes if _integer_valued(n.out))
    if not any(
        isinstance(n.out, TensorMeta) and n.out.dtype == "int64" and _packet(n.target) in _ARITHMETIC for n in nodes
    ):
        return IntegerRanges((), (), (), {})
    inputs = tuple(
        (i.name, int(i.target)) for i in graph.inputs if i.kind == "input" and i.meta.dtype in _INTEGER_DTYPES
    )
    constants = tuple(
        (i.name, _array_interval(graph.constants.get(i.target)))
        for i in graph.inputs
        if i.kind == "constant" and i.meta.dtype in _INTEGER_DTYPES
    )
    metas = graph.metas()
    read = {r for n in nodes for r in n.refs()} | {n.name for n in nodes}
    return IntegerRanges(inputs, constants, nodes, {k: v for k, v in metas.items() if k in read})


# --- the rules ---------------------------------------------------------------------------------------------------


def _interval(node: Node, known: dict[str, Known], metas: dict[str, OutMeta]) -> Known:
    """The interval of ``node``'s result (a tuple of them for a multi-output op) from its operands' (``known``)."""

    def get(value: object) -> Interval:
        if isinstance(value, Ref):
            found = known.get(value.name)
            return found if isinstance(found, tuple) and len(found) == 2 and isinstance(found[0], int) else None
        if isinstance(value, (bool, int)):
            return int(value), int(value)
        return None

    args, target = node.args, node.target
    if target == "getitem":
        produced = known.get(args[0].name)
        return produced[args[1]] if isinstance(produced, list) and args[1] < len(produced) else None
    if target in VALUE_PRESERVING:
        if target == "aten.cat.default":
            return _union(*(get(a) for a in args[0]))
        passed = get(args[0])
        return [passed] * len(node.out) if isinstance(node.out, tuple) else passed
    rule = _RULES.get(_packet(target))
    if rule is None:
        return [None] * len(node.out) if isinstance(node.out, tuple) else None
    return rule(node, get, metas)


def _fit(interval: Interval, dtype: str, node: Node, described: list[str]) -> Interval:
    """``interval`` as ``node``'s result holds it: refused for int64 beyond int32, cut to a narrower dtype's range."""
    if dtype == "bool":
        return 0, 1
    if dtype not in _INTEGER_DTYPES or interval is None:
        return None if dtype not in _INTEGER_DTYPES else interval
    if dtype == "int64":
        if interval[0] < INT32[0] or interval[1] > INT32[1]:
            raise IntegerOverflowError(_message(node, interval, described))
        return interval
    low, high = _DTYPE_RANGES[dtype]
    return interval if low <= interval[0] and interval[1] <= high else (low, high)


def _message(node: Node, interval: tuple[int, int], described: list[str]) -> str:
    where = f"\n  at {node.source}" if node.source else ""
    inputs = "; ".join(described) or "no integer batch input"
    return (
        f"{node.target} ({node.name}) can produce int64 values in [{interval[0]}, {interval[1]}] for this batch, "
        f"outside int32's range [{INT32[0]}, {INT32[1]}]: JAX runs int64 tensors as int32 (x64 off), so the "
        f"step would wrap them where PyTorch does not.{where}\n  the batch's integer inputs: {inputs}\n"
        "Try: compute it in the data pipeline (in int64, on the host) and pass the result in the batch; bring the "
        "values into range first (e.g. ids modulo the table size before multiplying); or use float arithmetic."
    )


def _packet(target: str) -> str:
    return target.rsplit(".", 1)[0] if target.startswith("aten.") else target


def _integer_valued(out: OutMeta) -> bool:
    if isinstance(out, tuple):
        return any(_integer_valued(o) for o in out)
    return isinstance(out, TensorMeta) and out.dtype in _INTEGER_DTYPES


def _array_interval(array: np.ndarray | None) -> Interval:
    if array is None or not array.size or not (np.issubdtype(array.dtype, np.integer) or array.dtype == np.bool_):
        return None
    return int(array.min()), int(array.max())


def _union(*intervals: Interval) -> Interval:
    if not intervals or any(i is None for i in intervals):
        return None
    known = cast("tuple[tuple[int, int], ...]", intervals)  # none is None: checked above
    return min(i[0] for i in known), max(i[1] for i in known)


def _corners(a: Interval, b: Interval, op: Callable[[int, int], int]) -> Interval:
    if a is None or b is None:
        return None
    values = [op(x, y) for x in a for y in b]
    return min(values), max(values)


def _scale(a: Interval, factor: int) -> Interval:
    return None if a is None else (min(a[0] * factor, a[1] * factor), max(a[0] * factor, a[1] * factor))


def _add(node: Node, get: Callable, metas: dict) -> Interval:
    alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
    if not isinstance(alpha, int):
        return None
    first, second = get(node.args[0]), _scale(get(node.args[1]), alpha)
    if node.target.startswith("aten.sub"):
        second = _scale(second, -1)
    if node.target.startswith("aten.rsub"):
        first, second = _scale(get(node.args[1]), 1), _scale(get(node.args[0]), -alpha)
    return _corners(first, second, lambda x, y: x + y)


def _mul(node: Node, get: Callable, metas: dict) -> Interval:
    return _corners(get(node.args[0]), get(node.args[1]), lambda x, y: x * y)


def _divide(node: Node, get: Callable, metas: dict) -> Interval:
    mode = node.kwargs.get("rounding_mode", "floor" if "floor_divide" in node.target else None)
    a, b = get(node.args[0]), get(node.args[1])
    if a is None or b is None or mode not in ("floor", "trunc"):
        return None
    if b[0] <= 0 <= b[1]:  # a divisor that can be ±1 keeps |a|; 0 raises in PyTorch
        largest = max(abs(a[0]), abs(a[1]))
        return -largest, largest
    if mode == "floor":
        return _corners(a, b, lambda x, y: x // y)
    return _corners(a, b, lambda x, y: abs(x) // abs(y) * (1 if (x < 0) == (y < 0) else -1))


def _remainder(node: Node, get: Callable, metas: dict) -> Interval:
    a, b = get(node.args[0]), get(node.args[1])
    if a is None or b is None:
        return None
    largest = max(abs(b[0]), abs(b[1])) - 1
    if "fmod" in node.target:  # the dividend's sign, |result| < |divisor| and ≤ |dividend|
        bound = min(largest, max(abs(a[0]), abs(a[1])))
        return (-bound if a[0] < 0 else 0), (bound if a[1] > 0 else 0)
    if b[0] > 0:
        return (0, min(largest, a[1])) if a[0] >= 0 else (0, largest)
    return (-largest, 0) if b[1] < 0 else (-largest, largest)


def _pow(node: Node, get: Callable, metas: dict) -> Interval:
    a, k = get(node.args[0]), node.args[1]
    if a is None or not isinstance(k, int) or isinstance(k, bool) or k < 0:
        return None
    values = [a[0] ** k, a[1] ** k] + ([0] if a[0] < 0 < a[1] else [])
    return min(values), max(values)


def _unary(fn: Callable[[Interval], Interval]) -> Callable:
    return lambda node, get, metas: fn(get(node.args[0]))


def _neg(a: Interval) -> Interval:
    return None if a is None else (-a[1], -a[0])


def _abs(a: Interval) -> Interval:
    if a is None:
        return None
    return (0 if a[0] <= 0 <= a[1] else min(abs(a[0]), abs(a[1]))), max(abs(a[0]), abs(a[1]))


def _clamp(node: Node, get: Callable, metas: dict) -> Interval:
    a = get(node.args[0])
    names = {"aten.clamp_min": ("min",), "aten.clamp_max": ("max",)}.get(_packet(node.target), ("min", "max"))
    bounds = dict(zip(names, node.args[1:]))
    bounds.update({k: v for k, v in node.kwargs.items() if k in ("min", "max")})
    if a is None:
        return None
    low, high = a
    if isinstance(bounds.get("min"), int):
        low, high = max(low, bounds["min"]), max(high, bounds["min"])
    if isinstance(bounds.get("max"), int):
        low, high = min(low, bounds["max"]), min(high, bounds["max"])
    return low, high


def _extremum(node: Node, get: Callable, metas: dict) -> Interval:
    a, b = get(node.args[0]), get(node.args[1])
    if a is None or b is None:
        return None
    pick = max if "max" in _packet(node.target) else min
    return pick(a[0], b[0]), pick(a[1], b[1])


def _reduced_count(node: Node, metas: dict) -> int:
    """How many input elements make one output element of a reduction ``node``."""
    source, out = metas.get(node.args[0].name), node.out
    if not isinstance(source, TensorMeta) or not isinstance(out, TensorMeta):
        return 0
    return source.numel // max(out.numel, 1) if out.numel else 0


def _sum(node: Node, get: Callable, metas: dict) -> Interval:
    a, n = get(node.args[0]), _reduced_count(node, metas)
    return None if a is None else (a[0] * n, a[1] * n)


def _cumsum(node: Node, get: Callable, metas: dict) -> Interval:
    a, source = get(node.args[0]), metas.get(node.args[0].name)
    if a is None or not isinstance(source, TensorMeta) or not source.shape:
        return a
    n = source.shape[node.args[1] % len(source.shape)]
    return min(a[0], a[0] * n), max(a[1], a[1] * n)


def _prod(node: Node, get: Callable, metas: dict) -> Interval:
    a, n = get(node.args[0]), _reduced_count(node, metas)
    if a is None:
        return None
    largest = max(abs(a[0]), abs(a[1])) ** n
    return (-largest if a[0] < 0 else min(a[0] ** n, 1)), largest


_DIM_POSITIONS = {"aten.argmax": 1, "aten.argmin": 1, "aten.sort": 1, "aten.topk": 2, "aten.max": 1, "aten.min": 1}


def _indices(node: Node, get: Callable, metas: dict) -> Known:
    """``argmax``/``argmin`` (one index result) and ``sort``/``topk``/``max.dim``/``min.dim`` (values, indices):
    indices in ``[0, n)`` with ``n`` the size of the dim they run over (every element without a dim)."""
    packet, source = _packet(node.target), metas.get(node.args[0].name)
    position = _DIM_POSITIONS[packet]
    default = -1 if packet in ("aten.sort", "aten.topk") else None
    dim = node.kwargs.get("dim", node.args[position] if len(node.args) > position else default)
    index: Interval = None
    if isinstance(source, TensorMeta):
        size = source.numel if dim is None or not source.shape else source.shape[dim % len(source.shape)]
        index = 0, max(size - 1, 0)
    return [get(node.args[0]), index] if isinstance(node.out, tuple) else index


def _reduction_value(node: Node, get: Callable, metas: dict) -> Known:
    """``max``/``min``/``amax``/``amin``: the input's values (with indices for the ``dim`` overloads); the
    elementwise ``max.other``/``min.other`` as ``maximum``/``minimum``."""
    if isinstance(node.out, tuple):
        return _indices(node, get, metas)
    if node.target.endswith(".other"):
        return _extremum(node, get, metas)
    return get(node.args[0])


def _arange(node: Node, get: Callable, metas: dict) -> Interval:
    numbers = [a for a in node.args if isinstance(a, (int, float)) and not isinstance(a, bool)]
    start, end, step = (
        (0, numbers[0], 1) if len(numbers) == 1 else (*numbers[:2], numbers[2] if len(numbers) > 2 else 1)
    )
    length = node.out.numel if isinstance(node.out, TensorMeta) else 0
    if not length:
        return None
    last = start + (length - 1) * step
    return math.floor(min(start, last)), math.ceil(max(start, last))


_FILL_POSITIONS = {"aten.full": 1, "aten.full_like": 1, "aten.new_full": 2, "aten.fill": 1, "aten.scalar_tensor": 0}


def _fill(node: Node, get: Callable, metas: dict) -> Interval:
    position = _FILL_POSITIONS[_packet(node.target)]
    value = node.kwargs.get("fill_value", node.args[position] if len(node.args) > position else None)
    return get(value) if isinstance(value, (int, Ref)) else None


def _constant(value: int) -> Callable:
    return lambda node, get, metas: (value, value)


def _where(node: Node, get: Callable, metas: dict) -> Interval:
    return _union(get(node.args[1]), get(node.args[2]))


def _masked_fill(node: Node, get: Callable, metas: dict) -> Interval:
    return _union(get(node.args[0]), get(node.args[2]))


def _index_put(node: Node, get: Callable, metas: dict) -> Interval:
    return _union(get(node.args[0]), get(node.args[2]))


def _shift(node: Node, get: Callable, metas: dict) -> Interval:
    a, k = get(node.args[0]), get(node.args[1])
    if a is None or k is None or k[0] < 0 or k[1] > 62:
        return None
    if "left" in node.target or "lshift" in node.target:
        return _corners(a, k, lambda x, y: x << y)
    return _corners(a, k, lambda x, y: x >> y)


def _bitwise(node: Node, get: Callable, metas: dict) -> Interval:
    a, b = get(node.args[0]), get(node.args[1])
    if a is None or b is None or a[0] < 0 or b[0] < 0:
        return None
    if node.target.startswith("aten.bitwise_and"):
        return 0, min(a[1], b[1])
    return 0, (1 << max(a[1], b[1]).bit_length()) - 1


_RULES: dict[str, Callable[[Node, Callable, dict], Known]] = {
    "aten.add": _add,
    "aten.sub": _add,
    "aten.rsub": _add,
    "aten.mul": _mul,
    "aten.div": _divide,
    "aten.floor_divide": _divide,
    "aten.remainder": _remainder,
    "aten.fmod": _remainder,
    "aten.pow": _pow,
    "aten.neg": _unary(_neg),
    "aten.abs": _unary(_abs),
    "aten.sign": lambda node, get, metas: (-1, 1),
    "aten.clamp": _clamp,
    "aten.clamp_min": _clamp,
    "aten.clamp_max": _clamp,
    "aten.maximum": _extremum,
    "aten.minimum": _extremum,
    "aten.sum": _sum,
    "aten.cumsum": _cumsum,
    "aten.prod": _prod,
    "aten.argmax": _indices,
    "aten.argmin": _indices,
    "aten.sort": _indices,
    "aten.topk": _indices,
    "aten.max": _reduction_value,
    "aten.min": _reduction_value,
    "aten.amax": _reduction_value,
    "aten.amin": _reduction_value,
    "aten.arange": _arange,
    "aten.full": _fill,
    "aten.full_like": _fill,
    "aten.new_full": _fill,
    "aten.scalar_tensor": _fill,
    "aten.fill": _fill,
    "aten.zeros": _constant(0),
    "aten.zeros_like": _constant(0),
    "aten.new_zeros": _constant(0),
    "aten.ones": _constant(1),
    "aten.ones_like": _constant(1),
    "aten.new_ones": _constant(1),
    "aten.one_hot": lambda node, get, metas: (0, 1),
    "aten.where": _where,
    "aten.masked_fill": _masked_fill,
    "aten.index_put": _index_put,
    "aten._unsafe_index_put": _index_put,
    "aten.gather": lambda node, get, metas: get(node.args[0]),
    "aten.index_select": lambda node, get, metas: get(node.args[0]),
    "aten.bitwise_left_shift": _shift,
    "aten.__lshift__": _shift,
    "aten.bitwise_right_shift": _shift,
    "aten.__rshift__": _shift,
    "aten.bitwise_and": _bitwise,
    "aten.bitwise_or": _bitwise,
    "aten.bitwise_xor": _bitwise,
}
"""Interval rules by overload packet; an op not here gives an unknown interval."""

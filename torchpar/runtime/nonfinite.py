"""Where a non-finite training step came from: the diagnostic re-run behind ``on_nonfinite="raise"``.

When a step's loss or gradients are inf/nan the executable skips the update (``RunOptions.check_finite``), so
the state is still the one the step started from. :func:`locate_nonfinite` re-runs that step's graph on the
driver as one program returning every intermediate value (``jaxbackend.lower(..., observe=...)``), checks them
in graph order, as ``torch.autograd.detect_anomaly`` does, and names the first culprit, in this order:

1. a batch leaf or a parameter/buffer that already holds inf/nan;
2. the first op (graph order) whose result holds a nan while none of its operands does;
3. the first op that turns finite operands into an inf (ops writing an infinite literal, such as an attention
   mask's ``-inf`` fill, are not culprits: they are meant to);
4. if the forward is finite: the parameters whose gradients hold inf/nan (the backward overflowed).

A micro-batch of a ratio loss whose denominator is 0 (:mod:`torchpar.ir.loss_parts`: every token ignored) is no
culprit: its ``0/0`` loss is left out of the step's, as the whole batch's sums leave its tokens out.

The re-run needs the whole state on the driver (it is exported from the workers), so engines run it
automatically only below ``AUTO_DIAGNOSIS_BYTES``; ``engine.locate_nonfinite(batch)`` runs it on demand.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from torchpar.ir.graph import Graph, Node
from torchpar.ir.loss_parts import loss_reduction

if TYPE_CHECKING:
    import jax

AUTO_DIAGNOSIS_BYTES = 1 << 30
"""Largest state (parameters + buffers) re-run on the driver automatically after a non-finite step."""

_INF_WRITERS = (
    "aten.full.default",
    "aten.scalar_tensor.default",
    "aten.fill.Scalar",
    "aten.masked_fill.Scalar",
    "aten.full_like.default",
    "aten.clamp.default",
    "aten.new_full.default",
)


class NonFiniteError(FloatingPointError):
    """A training step produced an inf/nan loss or gradient; the update was skipped (the state is the one before
    the step). The message names the step and, when the diagnostic re-run found it, the first culprit."""

    def __init__(self, message: str, *, step: int, loss: float, culprit: str = ""):
        super().__init__(message)
        self.step = step
        self.loss = loss
        self.culprit = culprit


@dataclass(frozen=True)
class Culprit:
    """What the diagnostic re-run blames, in words, with the op's source line when it is an op."""

    kind: str
    """``"input"``, ``"state"``, ``"op"`` or ``"gradient"``."""
    text: str


def locate_nonfinite(
    graph: Graph,
    trainable: Sequence[str],
    params: Mapping[str, np.ndarray],
    buffers: Mapping[str, np.ndarray],
    leaves: Sequence[np.ndarray],
    leaf_names: Sequence[str],
    key: jax.Array,
) -> Culprit | None:
    """The first source of inf/nan in one training step of ``graph`` (module docstring), or ``None`` if the
    re-run is finite (a nondeterministic or device-specific overflow)."""
    for name, leaf in zip(leaf_names, leaves):
        found = _describe_bad(np.asarray(leaf))
        if found:
            return Culprit("input", f"{name} holds {found}")
    for kind, held in (("parameter", params), ("buffer", buffers)):
        for name, value in held.items():
            found = _describe_bad(np.asarray(value))
            if found:
                return Culprit("state", f"{kind} {name} already holds {found} (an earlier step went unchecked)")
    values, loss, grads = _rerun(graph, trainable, params, buffers, [np.asarray(leaf) for leaf in leaves], key)
    reduction = loss_reduction(graph)
    if reduction.kind == "ratio":
        assert reduction.den is not None  # a ratio loss names its denominator
        if not np.any(np.asarray(values[reduction.den])):
            return None  # a ratio loss's micro-batch with denominator 0 (every token ignored): its 0/0 adds nothing
    first = _first_culprits(graph, values)
    if first:
        return first.get("nan") or first["inf"]
    if not math.isfinite(loss):
        return Culprit("op", f"the loss is {loss} although no op introduced an inf/nan")
    bad = [(n, _describe_bad(np.asarray(g))) for n, g in grads.items()]
    bad = [(n, text) for n, text in bad if text]
    if not bad:
        return None
    listed = "; ".join(f"{n} ({text})" for n, text in bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
    return Culprit(
        "gradient",
        f"the forward is finite on the re-run (loss {loss:.6g}); the backward produced "
        f"non-finite gradients of {len(bad)} parameter(s): {listed}",
    )


def _rerun(
    graph: Graph,
    trainable: Sequence[str],
    params: Mapping[str, np.ndarray],
    buffers: Mapping[str, np.ndarray],
    arrays: list[np.ndarray],
    key: jax.Array,
) -> tuple[dict[str, object], float, dict[str, jax.Array]]:
    """One jitted forward + backward of ``graph`` returning every value it computed (inputs and nodes, as host
    arrays), the loss and the gradients: one compilation, where an eager re-run compiles every op alone."""
    import jax

    from jaxbackend.lower import lower

    def collect(node: Node, value: object, env: Mapping[str, object]) -> None:
        collected[node.name] = value

    collected: dict[str, object] = {}
    run = lower(graph, observe=collect)
    # placed once (what jit would do with the host arrays it closes over): the step function takes device arrays
    frozen = {n: jax.numpy.asarray(v) for n, v in params.items() if n not in trainable}
    held = {n: jax.numpy.asarray(v) for n, v in buffers.items()}
    inputs = [jax.numpy.asarray(a) for a in arrays]

    def step(train: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, object]]:
        collected.clear()
        outputs, _ = run({**frozen, **train}, held, inputs, key)
        return outputs[0], dict(collected)

    (loss, nodes), grads = jax.jit(jax.value_and_grad(step, has_aux=True))({n: params[n] for n in trainable})
    values: dict[str, object] = {}
    for inp in graph.inputs:
        source = {"param": params, "buffer": buffers, "constant": graph.constants}.get(inp.kind)
        values[inp.name] = source[inp.target] if source is not None else arrays[int(inp.target)]
    values.update(jax.tree.map(np.asarray, nodes))
    return values, float(np.asarray(loss)), grads


def _first_culprits(graph: Graph, values: Mapping[str, object]) -> dict[str, Culprit]:
    """The first op (graph order) introducing a nan from nan-free operands (key ``"nan"``), and the first turning
    finite operands into an inf (``"inf"``; ops writing an infinite literal excepted)."""
    first: dict[str, Culprit] = {}
    for node in graph.nodes:
        value = values.get(node.name)
        for out in value if isinstance(value, (tuple, list)) else (value,):
            if out is None or not np.issubdtype(np.asarray(out).dtype, np.inexact):
                continue
            array = _as_float(np.asarray(out))
            has_nan = bool(np.isnan(array).any())
            if not has_nan and ("inf" in first or np.isfinite(array).all()):
                continue
            operands = [np.asarray(values[r]) for r in node.refs() if r in values]
            inexact = [_as_float(o) for o in operands if np.issubdtype(o.dtype, np.inexact)]
            if has_nan and not any(np.isnan(o).any() for o in inexact):
                first["nan"] = Culprit("op", _describe_op(node, "nan", array, operands))
                return first
            if (
                "inf" not in first
                and not has_nan
                and all(np.isfinite(o).all() for o in inexact)
                and not _writes_infinity(node)
            ):
                first["inf"] = Culprit("op", _describe_op(node, "inf", array, operands))
    return first


def _as_float(array: np.ndarray) -> np.ndarray:
    return array.astype(np.float32) if array.dtype.itemsize < 4 else array


def _writes_infinity(node: Node) -> bool:
    """The op writes an infinite literal on purpose (a mask fill)."""
    literals = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, float)]
    return node.target in _INF_WRITERS and any(math.isinf(v) for v in literals)


def _describe_op(node: Node, what: str, array: np.ndarray, operands: list[np.ndarray]) -> str:
    bad = int((np.isnan(array) if what == "nan" else ~np.isfinite(array)).sum())
    ranges = ", ".join(
        f"[{float(np.nanmin(o)):.3g}, {float(np.nanmax(o)):.3g}]"
        for o in operands
        if o.size and np.issubdtype(o.dtype, np.number) and o.dtype != np.bool_
    )
    where = f" in {node.module_path}" if node.module_path else ""
    line = f"\n    at {node.source}" if node.source else ""
    return (
        f"{node.target} ({node.name}){where} produced {bad} {what} value(s) of {array.size} from finite "
        f"operands (ranges {ranges or 'n/a'}){line}{_zero_over_zero(node, what, operands)}"
    )


def _zero_over_zero(node: Node, what: str, operands: list[np.ndarray]) -> str:
    """For a nan made by 0 / 0: what usually divides by a zero count, and that PyTorch gives nan there too."""
    if what != "nan" or not node.target.startswith("aten.div") or len(operands) < 2:
        return ""
    numerator, denominator = operands[0], operands[1]
    if not (np.any(numerator == 0) and np.any(denominator == 0)):
        return ""
    return (
        "\n    0 / 0: a mean over nothing — most often a token-mean loss on a batch that counts no token (every "
        "label is ignore_index, -100, e.g. padding only); PyTorch's loss is nan on such a batch too. Skip such "
        "batches (check (labels != -100).any()), or compile with on_nonfinite='skip' to drop their steps"
    )


def _describe_bad(array: np.ndarray) -> str:
    """``"3 nan / 1 inf of 64 values"`` if ``array`` holds non-finite values, else ``""``."""
    if not np.issubdtype(array.dtype, np.inexact):
        return ""
    as_float = array.astype(np.float32) if array.dtype.itemsize < 4 else array
    nan, inf = int(np.isnan(as_float).sum()), int(np.isinf(as_float).sum())
    if not nan and not inf:
        return ""
    parts = [f"{nan} nan" if nan else "", f"{inf} inf" if inf else ""]
    return f"{' / '.join(p for p in parts if p)} of {array.size} values"

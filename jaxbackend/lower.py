"""IR → one pure JAX function.

``lower(graph)`` returns ``fn(params, buffers, inputs, key) -> (outputs, new_buffers)`` where
``params``/``buffers`` are dicts keyed by the IR inputs' targets, ``inputs`` is the list of user
(batch) arrays in flattened order, ``key`` is a PRNG key (each random op draws from
``fold_in(key, node_index)``, so a seed reproduces a run), ``outputs`` are the graph's non-buffer
outputs in order and ``new_buffers`` maps buffer names to their new values. A pipeline stage's graph
also reads ``activations`` (a mapping from whole-graph value names to arrays). A per-device program (``layouts``)
returns buffers and a ``step_fn``'s aux outputs whole on every device.

Each node's tensor results are cast to the dtype PyTorch reported for it (this is where torch's type
promotion rules are enforced) and checked against its static shape.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxbackend import dtypes, ops, precision
from jaxbackend.precision import Numerics
from jaxbackend.remat import Remat, checkpoint
from jaxbackend.rewrites import fold_transposed_weights
from jaxbackend.sharding import constrain
from torchpar.ir.function_regions import FunctionRegion, function_regions
from torchpar.ir.graph import DType, Graph, Node, OutMeta, Ref, TensorMeta

StepFn = Callable[
    [dict[str, jax.Array], dict[str, jax.Array], Sequence[jax.Array], jax.Array], tuple[list[Any], dict[str, jax.Array]]
]


class UnsupportedOpsError(NotImplementedError):
    """Raised at compile time when some ops of a graph have no lowering; lists every one of them."""


class LoweringError(RuntimeError):
    """A lowering failed or disagreed with PyTorch's static shape; names the op and its source line."""


def unsupported_ops(graph: Graph) -> list[Node]:
    """Nodes of ``graph`` whose target has no lowering, in graph order."""
    return [node for node in graph.nodes if ops.get(node.target) is None]


def check_supported(graph: Graph) -> None:
    """Raise :class:`UnsupportedOpsError` naming every unsupported op, its operands and source line."""
    missing = unsupported_ops(graph)
    if not missing:
        return
    metas = graph.metas()
    lines = [f"{len(missing)} op(s) in the model have no JAX lowering in torchpar:"]
    for node in missing:
        lines.append(f"  - {node.target}({node.describe_inputs(metas)}) -> {_describe_out(node.out)}")
        if node.source:
            lines.append(f"      at {node.source}")
    lines.append(
        "Try: rewrite that line with supported ops, or register a lowering with "
        "@jaxbackend.ops.registry.lowers(<target>) (see docs/debugging.md)."
    )
    raise UnsupportedOpsError("\n".join(lines))


def lower(
    graph: Graph,
    *,
    value_shardings: Mapping[str, Any] | None = None,
    operand_shardings: Mapping[str, Sequence[Any]] | None = None,
    op_options: Mapping[str, Mapping[str, Any]] | None = None,
    layouts: Any = None,
    observe: Callable[[Node, Any, dict[str, Any]], None] | None = None,
    numerics: Numerics | None = None,
    remat: Remat | None = None,
) -> StepFn:
    """The pure JAX function computing ``graph`` (see the module docstring for its signature).

    ``value_shardings`` maps input or node names to a sharding their value is constrained to
    (``with_sharding_constraint``) where it is produced; ``operand_shardings`` maps a node name to one
    sharding (or ``None``) per tensor operand, constrained right before the op reads it. These are how a
    sharding plan is enforced under GSPMD; the backward pass inherits them through ``jax.grad``. A lowering
    registered ``sharded`` receives its node's pinned shardings (``shardings=``) and its ``op_options`` (keyword
    arguments naming how the plan splits it, e.g. ``context="ring"``).

    ``layouts`` (a ``torchpar.planner.sharding.layouts.ValueLayouts``) instead makes a per-device
    function for ``jax.shard_map``: inputs and results are this device's shards, and the collectives the
    plan implies are explicit (:mod:`jaxbackend.spmd`). It excludes the two sharding mappings.

    ``observe(node, value, env)`` is called after each node with its value and every value computed so far
    (for diagnostics run eagerly, outside ``jit``: e.g. finding the first op that produced a nan).

    ``numerics`` sets the precision of float32 products and convolutions (:mod:`jaxbackend.precision`;
    default full fp32). It is read while the function is traced, so the backward pass that ``jax.grad``
    derives from it computes its products the same way.

    ``remat`` computes its groups of nodes under ``jax.checkpoint`` (:mod:`jaxbackend.remat`): the backward
    recomputes what the policy does not keep. Ignored with ``observe`` (an eager diagnostic keeps nothing).
    """
    check_supported(graph)
    local = None
    if layouts is not None:
        from jaxbackend.spmd import LocalProgram

        if value_shardings or operand_shardings:
            raise ValueError("a per-device (layouts=) lowering takes no sharding constraints")
        local = LocalProgram(layouts)
    value_shardings = dict(value_shardings or {})
    operand_shardings = dict(operand_shardings or {})
    op_options = dict(op_options or {})
    if local is None:  # a per-device program reads each operand in its planned layout, by name
        graph, operand_shardings = fold_transposed_weights(graph, operand_shardings)
    constants = {name: jnp.asarray(value) for name, value in graph.constants.items()}
    lowerings = [ops.get(node.target) for node in graph.nodes]
    buffer_outputs = [o for o in graph.outputs if o.kind == "buffer"]
    value_outputs = [o for o in graph.outputs if o.kind != "buffer"]

    def run(
        params: dict[str, jax.Array],
        buffers: dict[str, jax.Array],
        inputs: Sequence[jax.Array],
        key: jax.Array,
        activations: Mapping[str, jax.Array] | None = None,
    ) -> tuple[list[Any], dict[str, jax.Array]]:
        with precision.using(numerics):
            return trace(params, buffers, inputs, key, activations)

    regions = function_regions(graph)
    segments = _segments(graph, remat if observe is None else None, regions)
    region_at = {region.start: region for region in regions}
    backwards = {region.call: lower(graph.custom_backwards[region.call], numerics=numerics) for region in regions}
    read_after = _last_reads(graph) if regions else {}

    def evaluate(index: int, env: dict[str, Any], key: jax.Array) -> None:
        """Compute node ``index`` from the values in ``env`` and store its result there."""
        node, lowering = graph.nodes[index], lowerings[index]
        scope = env
        if node.name in operand_shardings:
            scope = dict(env)
            for ref, sharding in zip(node.refs(), operand_shardings[node.name]):
                scope[ref] = constrain(env[ref], sharding)
        elif local is not None:
            scope = local.read_operands(node, env)
        args = _materialize(node.args, scope)
        kwargs = {k: _materialize(v, scope) for k, v in node.kwargs.items()}
        if lowering.random:
            kwargs["key"] = jax.random.fold_in(key, index)
        if lowering.sharded and node.name in operand_shardings:
            kwargs["shardings"] = tuple(operand_shardings[node.name])
            kwargs.update(op_options.get(node.name, {}))
        fn, finish = lowering.fn, None
        if local is not None:
            fn, args, kwargs, finish = local.prepare(node, fn, args, kwargs)
        try:
            result = fn(*args, **kwargs)
        except OverflowError as error:  # a Python int beyond int32 meeting an int32 array (an int64 tensor's)
            raise LoweringError(
                _context(
                    node,
                    graph,
                    (
                        f"an integer constant is outside int32's range ({error}): JAX runs int64 tensors as int32 "
                        "(x64 off), so this arithmetic cannot be done exactly. Do it in the data pipeline, in 64 bits "
                        "(e.g. hash ids there and pass the hashed ids), or keep its values within int32"
                    ),
                )
            ) from None
        except Exception as error:
            raise LoweringError(_context(node, graph, f"lowering raised {type(error).__name__}: {error}")) from error
        if finish is not None:
            result = finish(result)
        env[node.name] = _conform(result, node, graph, local)
        if node.name in value_shardings:
            env[node.name] = constrain(env[node.name], value_shardings[node.name])
        if observe is not None:
            observe(node, env[node.name], env)

    def evaluate_span(start: int, stop: int, env: dict[str, Any], key: jax.Array) -> None:
        """Nodes ``start:stop``, each autograd.Function region among them as one unit."""
        index = start
        while index < stop:
            if index in region_at:
                evaluate_region(region_at[index], env, key)
                index = region_at[index].stop
            else:
                evaluate(index, env, key)
                index += 1

    def evaluate_region(region: FunctionRegion, env: dict[str, Any], key: jax.Array) -> None:
        """A custom autograd.Function's forward, as one ``jax.custom_vjp`` function whose backward is the
        Function's own (:func:`_function_vjp`)."""
        if local is not None:
            _check_replicated(region, graph, local)

        def forward(scope: dict[str, Any], key: jax.Array) -> None:
            for index in region.node_range():
                evaluate(index, scope, key)

        _function_vjp(region, graph, backwards[region.call], read_after, forward)(env, key)

    def evaluate_checkpointed(segment: _Segment, env: dict[str, Any], key: jax.Array) -> None:
        """Nodes ``segment.start:segment.stop`` under ``jax.checkpoint``; only their later-used results enter
        ``env``."""
        arrays = [name for name in segment.reads if _is_traced_value(env[name])]
        fixed = {name: env[name] for name in segment.reads if name not in arrays}

        def body(values: list[Any], key: jax.Array) -> list[Any]:
            inner = dict(fixed) | dict(zip(arrays, values))
            evaluate_span(segment.start, segment.stop, inner, key)
            return [inner[name] for name in segment.writes]

        results = checkpoint(body, remat.policy)([env[name] for name in arrays], key)
        env.update(zip(segment.writes, results))

    def trace(params, buffers, inputs, key, activations):
        env: dict[str, Any] = {}
        for inp in graph.inputs:
            if inp.kind == "param":
                env[inp.name] = params[inp.target]
            elif inp.kind == "buffer":
                env[inp.name] = buffers[inp.target]
            elif inp.kind == "constant":
                env[inp.name] = constants[inp.target]
            elif inp.kind == "activation":
                env[inp.name] = activations[inp.target]
            else:
                env[inp.name] = inputs[int(inp.target)]
            if inp.name in value_shardings:
                env[inp.name] = constrain(env[inp.name], value_shardings[inp.name])
        for segment in segments:
            if segment.checkpointed:
                evaluate_checkpointed(segment, env, key)
            else:
                evaluate_span(segment.start, segment.stop, env, key)
        outputs = [env[o.value.name] if o.value is not None else None for o in value_outputs]
        new_buffers = {o.target: env[o.value.name] for o in buffer_outputs}
        if local is not None:  # buffers are stored whole on every device; a step_fn's aux values come back whole
            new_buffers = {o.target: local.whole(env[o.value.name], local.spec(o.value.name)) for o in buffer_outputs}
            outputs = [
                local.whole(v, local.spec(o.value.name)) if o.kind == "aux" else v
                for o, v in zip(value_outputs, outputs)
            ]
        return outputs, new_buffers

    return run


@dataclasses.dataclass(frozen=True)
class _Segment:
    """Nodes ``start:stop`` of the graph: one node, one autograd.Function region, or a checkpointed group that
    reads ``reads`` (values made before it) and makes ``writes`` (its values read after it or by the graph's
    outputs)."""

    start: int
    stop: int
    checkpointed: bool = False
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()


def _segments(graph: Graph, remat: Remat | None, regions: Sequence[FunctionRegion] = ()) -> list[_Segment]:
    """The graph's nodes in order, the runs of consecutive nodes of each ``remat`` group (of at least two nodes)
    as checkpointed segments, every other node alone. An autograd.Function region is never split: one that a
    group holds only in part leaves that group (the group's runs before and after it stay checkpointed)."""
    position = {node.name: index for index, node in enumerate(graph.nodes)}
    group_of: dict[int, int] = {}
    for number, group in enumerate(remat.groups if remat is not None else ()):
        for name in group:
            if name in position:
                group_of[position[name]] = number
    for region in regions:
        if len({group_of.get(index) for index in region.node_range()}) > 1:
            for index in region.node_range():
                group_of.pop(index, None)
    region_stop = {region.start: region.stop for region in regions}
    read_after = _last_reads(graph)
    segments: list[_Segment] = []
    index = 0
    while index < len(graph.nodes):
        stop = index + 1
        if index in group_of:
            while stop < len(graph.nodes) and group_of.get(stop) == group_of[index]:
                stop += 1
        if stop - index < 2:
            stop = region_stop.get(index, stop)
            segments.append(_Segment(index, stop))
        else:
            inside = {node.name for node in graph.nodes[index:stop]}
            reads = dict.fromkeys(ref for node in graph.nodes[index:stop] for ref in node.refs() if ref not in inside)
            writes = [name for name in inside if read_after.get(name, -1) >= stop]
            writes.sort(key=position.__getitem__)
            segments.append(_Segment(index, stop, True, tuple(reads), tuple(writes)))
        index = stop
    return segments


def _function_vjp(
    region: FunctionRegion,
    graph: Graph,
    backward: StepFn,
    read_after: dict[str, int],
    forward: Callable[[dict[str, Any], jax.Array], None],
) -> Callable[[dict[str, Any], jax.Array], None]:
    """``run(env, key)``: computes the region's nodes (``forward(scope, key)`` evaluates them into ``scope``)
    and stores its results in ``env``, as a ``jax.custom_vjp`` function of the arrays it reads whose backward
    is the Function's backward graph, lowered as ``backward``.

    The primal arguments are every array the region reads from outside; residuals are the tensors the Function
    saved. The backward graph takes (saved..., one cotangent per tensor result) (a result no longer in the graph,
    or an integer one, gets zeros, as PyTorch materializes them) and returns one gradient per argument of
    ``apply``: summed to the argument's shape and cast to its dtype (PyTorch's ``validate_outputs``) and added
    into the value the argument's input marker reads; ``None`` is zero, and so is the cotangent of every value
    the forward reads other than through its arguments (PyTorch runs the forward without autograd)."""
    inside = [graph.nodes[index].name for index in region.node_range()]
    inside_set = set(inside)
    reads = list(
        dict.fromkeys(
            ref for index in region.node_range() for ref in graph.nodes[index].refs() if ref not in inside_set
        )
    )
    outputs = [name for _, name in region.outputs]
    leaks = [name for name in inside if read_after.get(name, -1) >= region.stop and name not in outputs]
    if leaks:
        node = graph.nodes[region.start]
        raise LoweringError(
            f"the forward of a custom autograd.Function (at {node.source or 'an unknown line'}) "
            f"makes values used outside it other than its results ({', '.join(leaks[:4])}): their "
            "gradient would bypass the Function's backward"
        )
    metas = graph.metas()
    backward_inputs = [i.meta for i in graph.custom_backwards[region.call].inputs if i.kind == "input"]
    cotangent_metas = backward_inputs[len(region.saved) :]
    argument_of: dict[str, list[int]] = {}
    for position, name in region.inputs:
        argument_of.setdefault(name, []).append(position)

    def run(env: dict[str, Any], key: jax.Array) -> None:
        arrays = [name for name in reads if _is_traced_value(env[name])]
        fixed = {name: env[name] for name in reads if name not in arrays}

        def compute(values: list[Any], key: jax.Array) -> tuple[list[Any], list[Any]]:
            scope = dict(fixed) | dict(zip(arrays, values))
            forward(scope, key)
            return [scope[name] for name in outputs], [scope[name] for name in region.saved]

        @jax.custom_vjp
        def function(values: list[Any], key: jax.Array) -> list[Any]:
            return compute(values, key)[0]

        def function_fwd(values: list[Any], key: jax.Array) -> tuple[list[Any], Any]:
            results, saved = compute(values, key)
            return results, (saved, key)

        def function_bwd(residuals: Any, cotangents: list[Any]) -> tuple[list[Any], None]:
            saved, key = residuals
            grads_out = [jnp.zeros(meta.shape, dtypes.to_jax(meta.dtype)) for meta in cotangent_metas]
            for (position, _), cotangent in zip(region.outputs, cotangents):
                meta = cotangent_metas[position]
                if cotangent.dtype != jax.dtypes.float0:
                    grads_out[position] = cotangent.astype(dtypes.to_jax(meta.dtype))
            grads_in, _ = backward({}, {}, [*saved, *grads_out], key)
            result: list[Any] = []
            for name in arrays:
                meta = metas[name]
                total = None
                for position in argument_of.get(name, ()):
                    grad = grads_in[position] if position < len(grads_in) else None
                    if grad is not None and isinstance(meta, TensorMeta):
                        grad = _sum_to(grad, meta)
                        total = grad if total is None else total + grad
                floating = isinstance(meta, TensorMeta) and jnp.issubdtype(dtypes.to_jax(meta.dtype), jnp.inexact)
                result.append(total if total is not None and floating else None)
            return result, None

        function.defvjp(function_fwd, function_bwd)
        env.update(zip(outputs, function([env[name] for name in arrays], key)))

    return run


def _sum_to(grad: jax.Array, meta: TensorMeta) -> jax.Array:
    """A Function's gradient for an argument of shape ``meta.shape``: summed over the dims it broadcasts the
    argument along (PyTorch's ``sum_to``), cast to the argument's dtype."""
    grad = jnp.asarray(grad)
    extra = grad.ndim - len(meta.shape)
    if extra < 0:
        grad = jnp.broadcast_to(grad, meta.shape)
        extra = 0
    if extra:
        grad = grad.sum(axis=tuple(range(extra)))
    dims = tuple(d for d, (g, m) in enumerate(zip(grad.shape, meta.shape)) if g != m and m == 1)
    if dims:
        grad = grad.sum(axis=dims, keepdims=True)
    return grad.reshape(meta.shape).astype(dtypes.to_jax(meta.dtype))


def _check_replicated(region: FunctionRegion, graph: Graph, local: Any) -> None:
    """A per-device program runs a Function region only where all its values are whole on every device: its
    backward graph was traced on whole shapes."""
    from jaxbackend.spmd import LocalModeError

    names = [ref for index in region.node_range() for ref in graph.nodes[index].refs()]
    names += [graph.nodes[index].name for index in region.node_range()]
    if any(_is_split(local.spec(name)) for name in names):
        raise LocalModeError(
            f"a custom autograd.Function (at {graph.nodes[region.start].source or 'an unknown line'}) "
            "reads or makes values split across devices; its backward graph computes whole tensors"
        )


def _is_split(spec: Any) -> bool:
    if spec is None:
        return False
    return any(
        _is_split(entry) if isinstance(entry, tuple) and entry and isinstance(entry[0], tuple) else bool(entry)
        for entry in spec
    )


def _last_reads(graph: Graph) -> dict[str, int]:
    """Each value's last reader: a node index, or ``len(graph.nodes)`` for the graph's outputs."""
    last: dict[str, int] = {}
    for index, node in enumerate(graph.nodes):
        for ref in node.refs():
            last[ref] = index
    for output in graph.outputs:
        if output.value is not None:
            last[output.value.name] = len(graph.nodes)
    return last


def _is_traced_value(value: Any) -> bool:
    """Whether a value can be an argument of ``jax.checkpoint``'s function (arrays, tuples of arrays); Python
    scalars and ``None`` stay static."""
    leaves = jax.tree_util.tree_leaves(value)
    return bool(leaves) and all(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves)


def _materialize(value: Any, env: dict[str, Any]) -> Any:
    if isinstance(value, Ref):
        return env[value.name]
    if isinstance(value, DType):
        return dtypes.to_jax(value.name)
    if isinstance(value, list):
        return [_materialize(v, env) for v in value]
    if isinstance(value, tuple):
        return tuple(_materialize(v, env) for v in value)
    return value


def _conform(result: Any, node: Node, graph: Graph, local: Any = None) -> Any:
    """Cast ``result`` to the node's torch dtype and check its shape against the node's meta (per device:
    its local shape)."""
    meta = node.out
    spec = local.spec(node.name) if local is not None else None
    if isinstance(meta, TensorMeta):
        return _conform_one(result, local.local_meta(meta, spec) if local is not None else meta, node, graph, local)
    if isinstance(meta, tuple):
        if not isinstance(result, (tuple, list)) or len(result) != len(meta):
            raise LoweringError(_context(node, graph, f"expected {len(meta)} results, got {type(result).__name__}"))
        if local is not None:
            specs = spec if isinstance(spec, tuple) and len(spec) == len(meta) else (None,) * len(meta)
            meta = tuple(local.local_meta(m, s) if m is not None else None for m, s in zip(meta, specs))
        return tuple(_conform_one(r, m, node, graph, local) if m is not None else r for r, m in zip(result, meta))
    return result


def _conform_one(value: Any, meta: TensorMeta, node: Node, graph: Graph, local: Any = None) -> jax.Array:
    value = jnp.asarray(value)
    if tuple(value.shape) != meta.shape:
        if local is not None:
            from jaxbackend.spmd import LocalModeError

            raise LocalModeError(
                _context(
                    node,
                    graph,
                    f"per device it produced shape {list(value.shape)}, the plan's layout gives {list(meta.shape)}",
                )
            )
        raise LoweringError(
            _context(node, graph, f"produced shape {list(value.shape)}, PyTorch says {list(meta.shape)}")
        )
    want = dtypes.to_jax(meta.dtype)
    return value if value.dtype == want else value.astype(want)


def _context(node: Node, graph: Graph, problem: str) -> str:
    where = f"\n  at {node.source}" if node.source else ""
    return f"{node.target}({node.describe_inputs(graph.metas())}) -> {_describe_out(node.out)}: {problem}{where}"


def _describe_out(out: OutMeta) -> str:
    if isinstance(out, tuple):
        return "(" + ", ".join(str(m) for m in out) + ")"
    return str(out)


class IntegerRangeError(ValueError):
    """An integer array holds values its 32-bit JAX dtype cannot (JAX runs with x64 off): they would wrap."""


def to_numpy_input(array: np.ndarray, what: str = "an input array") -> np.ndarray:
    """A host array in the dtype JAX will hold it in (int64 → int32 when x64 is off). Raises
    :class:`IntegerRangeError` naming ``what`` when an integer array holds a value the narrower dtype cannot: a cast
    would wrap it silently (a hashed id of 2**33 + 7 would read row 7)."""
    want = jax.dtypes.canonicalize_dtype(array.dtype)
    if array.dtype == want:
        return array
    if np.issubdtype(array.dtype, np.integer) and array.size:
        low, high, limits = array.min(), array.max(), np.iinfo(want)
        if low < limits.min or high > limits.max:
            raise IntegerRangeError(
                f"{what} ({array.dtype}, shape {tuple(array.shape)}) holds values in [{low}, {high}], outside "
                f"{want}'s range [{limits.min}, {limits.max}]: JAX runs 64-bit integers as 32-bit (x64 off), so they "
                "would wrap. Bring them into range before the batch (e.g. hash ids modulo the table size in the "
                "data pipeline), or keep such values as floats."
            )
    return array.astype(want)


__all__ = [
    "IntegerRangeError",
    "LoweringError",
    "StepFn",
    "UnsupportedOpsError",
    "check_supported",
    "lower",
    "unsupported_ops",
    "to_numpy_input",
]

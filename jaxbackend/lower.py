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

One interpreter (:class:`_Interpreter`) computes the nodes in both modes; what a GSPMD program and a per-device one
do differently (constraints vs. explicit reshards and collectives, global vs. local shapes) is one of two operand
strategies chosen once per graph (:class:`_GlobalOperands`, :class:`_LocalOperands`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxbackend import dtypes, ops, precision, threefry_cpu
from jaxbackend.ops.registry import Lowering, LoweringFn
from jaxbackend.precision import Numerics
from jaxbackend.remat import Remat, checkpoint
from jaxbackend.rewrites import fold_transposed_weights, fuse_linear_cross_entropy
from jaxbackend.sharding import constrain
from torchpar.ir.function_regions import FunctionRegion, function_regions
from torchpar.ir.graph import DType, Graph, Node, OutMeta, Output, Ref, TensorMeta
from torchpar.ir.layout import Multi, Spec

if TYPE_CHECKING:
    from jaxbackend.spmd import Layouts, LocalProgram

Results = tuple[list[Any], dict[str, jax.Array]]
"""``(outputs, new_buffers)``: the graph's value outputs in order (``None`` for one without a value) and its
buffers' new values by name."""
StepFn = Callable[[dict[str, jax.Array], dict[str, jax.Array], Sequence[jax.Array], jax.Array], Results]


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
    value_shardings: Mapping[str, NamedSharding | None] | None = None,
    operand_shardings: Mapping[str, Sequence[NamedSharding | None]] | None = None,
    op_options: Mapping[str, Mapping[str, object]] | None = None,
    layouts: Layouts | None = None,
    observe: Callable[[Node, object, Mapping[str, object]], None] | None = None,
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

    Random bits on the CPU are hashed in one fused pass (:mod:`jaxbackend.threefry_cpu`, the same bits).
    """
    threefry_cpu.install()
    check_supported(graph)
    operands = _operands_for(graph, value_shardings, operand_shardings, op_options, layouts)
    graph = operands.graph
    regions = function_regions(graph)
    backwards = {region.call: lower(graph.custom_backwards[region.call], numerics=numerics) for region in regions}
    interpreter = _Interpreter(graph, operands, regions, backwards, observe, remat if observe is None else None)

    def run(
        params: dict[str, jax.Array],
        buffers: dict[str, jax.Array],
        inputs: Sequence[jax.Array],
        key: jax.Array,
        activations: Mapping[str, jax.Array] | None = None,
    ) -> Results:
        with precision.using(numerics):
            return interpreter.trace(params, buffers, inputs, key, activations)

    return run


# --- the two operand strategies --------------------------------------------------------------------------------------

Finish = Callable[[object], object]
"""What completes an op's result after its lowering ran (per device: the collective that sums a partial result)."""


class _Operands(Protocol):
    """Where GSPMD and per-device lowering differ: how a value becomes the operand an op reads, how an op is called,
    which shape its result must have, and how the graph's results leave the function. :class:`_Interpreter` runs
    every node the same way through one of these, chosen once by :func:`_operands_for`."""

    graph: Graph
    """The graph to interpret (GSPMD: after :func:`~jaxbackend.rewrites.fuse_linear_cross_entropy` and
    :func:`~jaxbackend.rewrites.fold_transposed_weights`)."""

    def produced(self, name: str, value: object) -> object:
        """Value ``name`` (an input or a node's result) as the rest of the graph reads it."""
        ...

    def read(self, node: Node, env: dict[str, object]) -> dict[str, object]:
        """``env`` with ``node``'s operands in the layout the op reads them in (``env`` itself if none changes)."""
        ...

    def call(
        self, node: Node, lowering: Lowering, args: Sequence[object], kwargs: dict[str, object]
    ) -> tuple[LoweringFn, Sequence[object], dict[str, object], Finish]:
        """The function computing ``node``, its arguments, and what finishes its result."""
        ...

    def spec(self, name: str) -> Spec | None:
        """The layout of value ``name`` on one device (a ``Multi`` for a multi-output op); ``None``: whole."""
        ...

    def shard_meta(self, meta: TensorMeta, spec: Spec | None) -> TensorMeta:
        """The shape and dtype of one device's piece of a tensor of ``meta`` laid out as ``spec``."""
        ...

    def mismatch(self, node: Node, graph: Graph, shape: list[int], meta: TensorMeta) -> Exception:
        """The error for ``node``'s lowering producing ``shape`` where ``meta`` was expected."""
        ...

    def enter_region(self, region: FunctionRegion, graph: Graph) -> None:
        """Raise if this mode cannot run the custom autograd.Function ``region``."""
        ...

    def returned(self, output: Output, value: object) -> object:
        """What the function returns for ``output`` (a buffer's new value or a value output) of value ``value``."""
        ...


class _GlobalOperands:
    """GSPMD: ops read and make global arrays; the plan's shardings are constraints XLA partitions the program by."""

    def __init__(
        self,
        graph: Graph,
        value_shardings: Mapping[str, NamedSharding | None],
        operand_shardings: Mapping[str, Sequence[NamedSharding | None]],
        op_options: Mapping[str, Mapping[str, object]],
    ):
        graph = fuse_linear_cross_entropy(graph, value_shardings, operand_shardings, op_options)
        self.graph, self.operand_shardings = fold_transposed_weights(graph, operand_shardings)
        self.value_shardings = value_shardings
        self.op_options = op_options

    def produced(self, name: str, value: object) -> object:
        return constrain(value, self.value_shardings[name]) if name in self.value_shardings else value

    def read(self, node: Node, env: dict[str, object]) -> dict[str, object]:
        if node.name not in self.operand_shardings:
            return env
        scope = dict(env)
        for ref, sharding in zip(node.refs(), self.operand_shardings[node.name]):
            scope[ref] = constrain(env[ref], sharding)
        return scope

    def call(
        self, node: Node, lowering: Lowering, args: Sequence[object], kwargs: dict[str, object]
    ) -> tuple[LoweringFn, Sequence[object], dict[str, object], Finish]:
        if lowering.sharded and node.name in self.operand_shardings:
            kwargs["shardings"] = tuple(self.operand_shardings[node.name])
            kwargs.update(self.op_options.get(node.name, {}))
        return lowering.fn, args, kwargs, _unchanged

    def spec(self, name: str) -> Spec | None:
        return None

    def shard_meta(self, meta: TensorMeta, spec: Spec | None) -> TensorMeta:
        return meta

    def mismatch(self, node: Node, graph: Graph, shape: list[int], meta: TensorMeta) -> Exception:
        return LoweringError(_context(node, graph, f"produced shape {shape}, PyTorch says {list(meta.shape)}"))

    def enter_region(self, region: FunctionRegion, graph: Graph) -> None:
        return None

    def returned(self, output: Output, value: object) -> object:
        return value


class _LocalOperands:
    """Per device (inside ``jax.shard_map``): ops read and make this device's shards; :class:`LocalProgram` reshards
    operands, rewrites calls and finishes partial results with explicit collectives. Buffers' new values and a
    ``step_fn``'s aux outputs are gathered whole."""

    def __init__(self, graph: Graph, program: LocalProgram):
        self.graph = graph
        self.program = program

    def produced(self, name: str, value: object) -> object:
        return value

    def read(self, node: Node, env: dict[str, object]) -> dict[str, object]:
        return self.program.read_operands(node, env)

    def call(
        self, node: Node, lowering: Lowering, args: Sequence[object], kwargs: dict[str, object]
    ) -> tuple[LoweringFn, Sequence[object], dict[str, object], Finish]:
        return self.program.prepare(node, lowering.fn, args, kwargs)

    def spec(self, name: str) -> Spec | None:
        return self.program.spec(name)

    def shard_meta(self, meta: TensorMeta, spec: Spec | None) -> TensorMeta:
        return self.program.local_meta(meta, spec)

    def mismatch(self, node: Node, graph: Graph, shape: list[int], meta: TensorMeta) -> Exception:
        from jaxbackend.spmd import LocalModeError

        problem = f"per device it produced shape {shape}, the plan's layout gives {list(meta.shape)}"
        return LocalModeError(_context(node, graph, problem))

    def enter_region(self, region: FunctionRegion, graph: Graph) -> None:
        _check_replicated(region, graph, self.program)

    def returned(self, output: Output, value: object) -> object:
        if output.kind not in ("buffer", "aux"):
            return value
        assert output.value is not None  # buffers' new values and aux outputs are values of the graph
        return self.program.whole(cast(jax.Array, value), self.program.spec(output.value.name))


def _unchanged(result: object) -> object:
    return result


def _operands_for(
    graph: Graph,
    value_shardings: Mapping[str, NamedSharding | None] | None,
    operand_shardings: Mapping[str, Sequence[NamedSharding | None]] | None,
    op_options: Mapping[str, Mapping[str, object]] | None,
    layouts: Layouts | None,
) -> _Operands:
    """GSPMD operands, or per-device ones with ``layouts`` (which excludes the sharding mappings)."""
    if layouts is None:
        return _GlobalOperands(
            graph, dict(value_shardings or {}), dict(operand_shardings or {}), dict(op_options or {})
        )
    from jaxbackend.spmd import LocalProgram

    if value_shardings or operand_shardings:
        raise ValueError("a per-device (layouts=) lowering takes no sharding constraints")
    # the graph is not rewritten (fold_transposed_weights): a per-device program reads each operand in its planned
    # layout, by name
    return _LocalOperands(graph, LocalProgram(layouts))


# --- the interpreter -------------------------------------------------------------------------------------------------


class _Interpreter:
    """Computes ``graph``'s nodes in order, each by its lowering, on the values ``operands`` makes operands of (the
    one place where GSPMD and per-device programs differ); an autograd.Function region as one ``jax.custom_vjp``
    unit whose backward is the lowered ``backwards[region.call]``, a ``remat`` group under ``jax.checkpoint``."""

    def __init__(
        self,
        graph: Graph,
        operands: _Operands,
        regions: Sequence[FunctionRegion],
        backwards: Mapping[int, StepFn],
        observe: Callable[[Node, object, Mapping[str, object]], None] | None,
        remat: Remat | None,
    ):
        self.graph = graph
        self.operands = operands
        self.observe = observe
        self.remat = remat
        self.constants = {name: jnp.asarray(value) for name, value in graph.constants.items()}
        self.lowerings = _lowerings(graph)
        self.buffer_outputs = [o for o in graph.outputs if o.kind == "buffer"]
        self.value_outputs = [o for o in graph.outputs if o.kind != "buffer"]
        self.segments = _segments(graph, remat, regions)
        self.region_at = {region.start: region for region in regions}
        self.backwards = backwards
        self.read_after = _last_reads(graph) if regions else {}

    def trace(
        self,
        params: Mapping[str, jax.Array],
        buffers: Mapping[str, jax.Array],
        inputs: Sequence[jax.Array],
        key: jax.Array,
        activations: Mapping[str, jax.Array] | None,
    ) -> Results:
        """The graph's value outputs and its buffers' new values, computed from its inputs."""
        env: dict[str, object] = {}
        for inp in self.graph.inputs:
            value: jax.Array
            if inp.kind == "param":
                value = params[inp.target]
            elif inp.kind == "buffer":
                value = buffers[inp.target]
            elif inp.kind == "constant":
                value = self.constants[inp.target]
            elif inp.kind == "activation":
                assert activations is not None  # a pipeline stage's graph is run with its activations
                value = activations[inp.target]
            else:
                value = inputs[int(inp.target)]
            env[inp.name] = self.operands.produced(inp.name, value)
        for segment in self.segments:
            if segment.checkpointed:
                self.evaluate_checkpointed(segment, env, key)
            else:
                self.evaluate_span(segment.start, segment.stop, env, key)
        outputs = [env[o.value.name] if o.value is not None else None for o in self.value_outputs]
        new_buffers = {o.target: self._buffer(o, env) for o in self.buffer_outputs}
        return [self.operands.returned(o, v) for o, v in zip(self.value_outputs, outputs)], new_buffers

    def _buffer(self, output: Output, env: Mapping[str, object]) -> jax.Array:
        assert output.value is not None  # a buffer's new value is a value of the graph
        return cast(jax.Array, self.operands.returned(output, env[output.value.name]))

    def evaluate(self, index: int, env: dict[str, object], key: jax.Array) -> None:
        """Compute node ``index`` from the values in ``env`` and store its result there."""
        graph, node, lowering = self.graph, self.graph.nodes[index], self.lowerings[index]
        scope = self.operands.read(node, env)
        args = tuple(_materialize(arg, scope) for arg in node.args)
        kwargs = {k: _materialize(v, scope) for k, v in node.kwargs.items()}
        if lowering.random:
            kwargs["key"] = jax.random.fold_in(key, index)
        fn, call_args, call_kwargs, finish = self.operands.call(node, lowering, args, kwargs)
        try:
            result = fn(*call_args, **call_kwargs)
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
        env[node.name] = self.operands.produced(node.name, _conform(finish(result), node, graph, self.operands))
        if self.observe is not None:
            self.observe(node, env[node.name], env)

    def evaluate_span(self, start: int, stop: int, env: dict[str, object], key: jax.Array) -> None:
        """Nodes ``start:stop``, each autograd.Function region among them as one unit."""
        index = start
        while index < stop:
            if index in self.region_at:
                self.evaluate_region(self.region_at[index], env, key)
                index = self.region_at[index].stop
            else:
                self.evaluate(index, env, key)
                index += 1

    def evaluate_region(self, region: FunctionRegion, env: dict[str, object], key: jax.Array) -> None:
        """A custom autograd.Function's forward, as one ``jax.custom_vjp`` function whose backward is the
        Function's own (:func:`_function_vjp`)."""
        self.operands.enter_region(region, self.graph)

        def forward(scope: dict[str, object], key: jax.Array) -> None:
            for index in region.node_range():
                self.evaluate(index, scope, key)

        _function_vjp(region, self.graph, self.backwards[region.call], self.read_after, forward)(env, key)

    def evaluate_checkpointed(self, segment: _Segment, env: dict[str, object], key: jax.Array) -> None:
        """Nodes ``segment.start:segment.stop`` under ``jax.checkpoint``; only their later-used results enter
        ``env``."""
        assert self.remat is not None  # only a remat makes checkpointed segments
        arrays = [name for name in segment.reads if _is_traced_value(env[name])]
        fixed = {name: env[name] for name in segment.reads if name not in arrays}

        def body(values: list[object], key: jax.Array) -> list[object]:
            inner = dict(fixed) | dict(zip(arrays, values))
            self.evaluate_span(segment.start, segment.stop, inner, key)
            return [inner[name] for name in segment.writes]

        results = checkpoint(body, self.remat.policy)([env[name] for name in arrays], key)
        env.update(zip(segment.writes, results))


def _lowerings(graph: Graph) -> list[Lowering]:
    """Each node's lowering (:func:`check_supported` has found one for every node)."""
    lowerings = []
    for node in graph.nodes:
        lowering = ops.get(node.target)
        assert lowering is not None  # check_supported raised otherwise
        lowerings.append(lowering)
    return lowerings


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
    forward: Callable[[dict[str, object], jax.Array], None],
) -> Callable[[dict[str, object], jax.Array], None]:
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

    def run(env: dict[str, object], key: jax.Array) -> None:
        arrays = [name for name in reads if _is_traced_value(env[name])]
        fixed = {name: env[name] for name in reads if name not in arrays}

        def compute(values: list[object], key: jax.Array) -> tuple[list[object], list[jax.Array]]:
            scope = dict(fixed) | dict(zip(arrays, values))
            forward(scope, key)
            return [scope[name] for name in outputs], [cast(jax.Array, scope[name]) for name in region.saved]

        @jax.custom_vjp
        def function(values: list[object], key: jax.Array) -> list[object]:
            return compute(values, key)[0]

        def function_fwd(
            values: list[object], key: jax.Array
        ) -> tuple[list[object], tuple[list[jax.Array], jax.Array]]:
            results, saved = compute(values, key)
            return results, (saved, key)

        def function_bwd(
            residuals: tuple[list[jax.Array], jax.Array], cotangents: list[jax.Array]
        ) -> tuple[list[jax.Array | None], None]:
            saved, key = residuals
            grads_out = [jnp.zeros(meta.shape, dtypes.to_jax(meta.dtype)) for meta in cotangent_metas]
            for (position, _), cotangent in zip(region.outputs, cotangents):
                meta = cotangent_metas[position]
                if cotangent.dtype != jax.dtypes.float0:
                    grads_out[position] = cotangent.astype(dtypes.to_jax(meta.dtype))
            grads_in, _ = backward({}, {}, [*saved, *grads_out], key)
            result: list[jax.Array | None] = []
            for name in arrays:
                argument = metas[name]
                total = None
                for position in argument_of.get(name, ()):
                    grad = grads_in[position] if position < len(grads_in) else None
                    if grad is not None and isinstance(argument, TensorMeta):
                        grad = _sum_to(grad, argument)
                        total = grad if total is None else total + grad
                floating = isinstance(argument, TensorMeta) and jnp.issubdtype(
                    dtypes.to_jax(argument.dtype), jnp.inexact
                )
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


def _check_replicated(region: FunctionRegion, graph: Graph, local: LocalProgram) -> None:
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


def _is_split(spec: Sequence[object] | None) -> bool:
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


def _is_traced_value(value: object) -> bool:
    """Whether a value can be an argument of ``jax.checkpoint``'s function (arrays, tuples of arrays); Python
    scalars and ``None`` stay static."""
    leaves = jax.tree_util.tree_leaves(value)
    return bool(leaves) and all(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves)


def _materialize(value: object, env: Mapping[str, object]) -> object:
    if isinstance(value, Ref):
        return env[value.name]
    if isinstance(value, DType):
        return dtypes.to_jax(value.name)
    if isinstance(value, list):
        return [_materialize(v, env) for v in value]
    if isinstance(value, tuple):
        return tuple(_materialize(v, env) for v in value)
    return value


def _conform(result: object, node: Node, graph: Graph, operands: _Operands) -> object:
    """Cast ``result`` to the node's torch dtype and check its shape against the node's meta (per device:
    its local shape)."""
    meta = node.out
    spec = operands.spec(node.name)
    if isinstance(meta, TensorMeta):
        return _conform_one(result, operands.shard_meta(meta, spec), node, graph, operands)
    if isinstance(meta, tuple):
        if not isinstance(result, (tuple, list)) or len(result) != len(meta):
            raise LoweringError(_context(node, graph, f"expected {len(meta)} results, got {type(result).__name__}"))
        # a multi-output op's spec is a Multi of its results' specs
        specs = cast(Multi, spec) if isinstance(spec, tuple) and len(spec) == len(meta) else (None,) * len(meta)
        metas = tuple(operands.shard_meta(m, s) if m is not None else None for m, s in zip(meta, specs))
        return tuple(_conform_one(r, m, node, graph, operands) if m is not None else r for r, m in zip(result, metas))
    return result


def _conform_one(value: object, meta: TensorMeta, node: Node, graph: Graph, operands: _Operands) -> jax.Array:
    array = jnp.asarray(value)
    if tuple(array.shape) != meta.shape:
        raise operands.mismatch(node, graph, list(array.shape), meta)
    want = dtypes.to_jax(meta.dtype)
    return array if array.dtype == want else array.astype(want)


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

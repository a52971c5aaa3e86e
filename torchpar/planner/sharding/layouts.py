"""Every value's layout under a solved stage plan, replayed from the plan alone.

A :class:`~torchpar.planner.plan.StagePlan` pins only the ILP's roots: parameters, batch inputs and
anchor ops (with the layout each anchor reads its operands in). Every other op followed an operand
while solving (:mod:`.solver_graph`); :func:`replay_layouts` walks the graph in order and applies the
same follower rules (:func:`.follow.follow`, same choice of followed operand), so a plan loaded from
JSON yields the same layouts as the solver graph it came from.

The result is what an SPMD program written per device needs (``jaxbackend.spmd``): for each value its
spec, for each op the spec each tensor operand must be resharded to before the op reads it, and the
mesh axes over which the op's local result is only a partial sum (a reduction or a contraction over a
split dim). :meth:`ValueLayouts.obstacles` lists what such a program cannot run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

from torchpar.ir.function_regions import MARKERS as FUNCTION_MARKERS
from torchpar.ir.graph import Graph, Input, Node, OutMeta, TensorMeta
from torchpar.ir.layout import MeshShape, Multi, Spec, from_json
from torchpar.ir.op_families import ASSERTS, BATCH_NORMS, PARTIAL_SUM_REDUCTIONS, REDUCTIONS
from torchpar.planner.plan import StagePlan
from torchpar.planner.sharding.cost_model import LogicalMesh
from torchpar.planner.sharding.exchange_strategies import anchor_of
from torchpar.planner.sharding.follow import OutSpec, follow, reduced_dims
from torchpar.planner.sharding.solver_graph import _numel


@dataclass
class ValueLayouts:
    """Layouts of one stage's values on a logical mesh of ``mesh_shape``.

    ``values``: spec of every input and node (a :class:`~torchpar.ir.layout.Multi` for multi-output ops, ``None``
    for non-tensor values). ``operands``: per node, the spec each tensor operand (``Node.refs()`` order)
    must have when the op reads it (``None`` = read as it is). ``partial``: per node, the mesh axes its
    local result must be summed over, and how (``"sum"``/``"mean"``/``"contract"``).
    """

    mesh_shape: tuple[int, int]
    values: dict[str, OutSpec] = field(default_factory=dict)
    operands: dict[str, tuple[Spec | None, ...]] = field(default_factory=dict)
    partial: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    statistics_axes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Per batch-norm node whose batch is split: the mesh axes its statistics are averaged across."""
    options: dict[str, dict[str, str]] = field(default_factory=dict)
    """Per anchor whose strategy names how it runs split (``StagePlan.op_options``): e.g. ``{"rows": "exchange"}``."""
    problems: dict[str, list[str]] = field(default_factory=dict)
    """What a per-device program cannot run: a reason → the values (ops, buffers) it concerns."""

    def add_problem(self, reason: str, name: str) -> None:
        self.problems.setdefault(reason, []).append(name)

    def local_shape(self, shape: tuple[int, ...], spec: Spec | None) -> tuple[int, ...]:
        """The per-device shape of a tensor of global ``shape`` laid out as ``spec``."""
        if not spec:
            return tuple(shape)
        return tuple(
            size // math.prod(self.mesh_shape[a] for a in entry) if entry else size for size, entry in zip(shape, spec)
        )

    def obstacles(self) -> list[str]:
        """Why a per-device (``shard_map``) program cannot run this stage, one line per reason naming up to
        three of the values concerned; empty if it can."""
        return [
            f"{reason}: {', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''}"
            for reason, names in self.problems.items()
        ]


def replay_layouts(graph: Graph, stage: StagePlan) -> ValueLayouts:
    """The layout of every value of ``graph`` under ``stage`` (see the module docstring)."""
    mesh_shape = cast(MeshShape, tuple(stage.logical_mesh_shape))  # a plan's mesh has two axes
    mesh = LogicalMesh(shape=mesh_shape)
    layouts = ValueLayouts(mesh_shape=mesh_shape)
    metas = graph.metas()
    for inp in graph.inputs:
        layouts.values[inp.name] = _input_spec(inp, stage)
    for node in graph.nodes:
        if node.target in ASSERTS or node.out is None:
            continue
        _replay_node(node, metas, stage, mesh, layouts)
    return layouts


def _input_spec(inp: Input, stage: StagePlan) -> Spec:
    rank = len(inp.meta.shape)
    if inp.kind == "param":
        spec = stage.params_at_use.get(inp.target, stage.params.get(inp.target))
    elif inp.kind == "input":
        spec = stage.inputs.get(str(inp.target))
    elif inp.kind == "activation":
        spec = stage.activations.get(inp.name)
    else:
        spec = None
    return from_json(spec) if spec is not None else (None,) * rank


def _replay_node(
    node: Node, metas: dict[str, OutMeta], stage: StagePlan, mesh: LogicalMesh, layouts: ValueLayouts
) -> None:
    refs = list(node.refs())
    operand_metas = [metas.get(r) for r in refs]
    out = node.out
    if anchor_of(node, operand_metas) is not None:
        _replay_anchor(node, stage, layouts)
        options = stage.op_options.get(node.name, {})
        if options:
            layouts.options[node.name] = dict(options)
        if "context" in options:
            layouts.add_problem(
                "an attention splits its sequence (context parallelism runs under GSPMD only)", node.name
            )
        if "scatter" in options:
            layouts.add_problem(
                "a matmul reduce-scatters its rows (sequence parallelism runs under GSPMD only)", node.name
            )
        return
    tracked = [i for i, r in enumerate(refs) if r in layouts.values]
    if not tracked:  # a constant: computed whole on every device
        layouts.values[node.name] = _replicated_out(out)
        layouts.operands[node.name] = (None,) * len(refs)
        return
    main = max(tracked, key=lambda i: (_numel(operand_metas[i]), -i))
    result = follow(node, operand_metas, main, layouts.values[refs[main]], mesh, [False] * len(refs))
    layouts.values[node.name] = result.out
    layouts.operands[node.name] = result.required
    for position, (ref, required) in enumerate(zip(refs, result.required)):
        current = layouts.values.get(ref)
        if (
            required is None
            and isinstance(operand_metas[position], TensorMeta)
            and _is_split(current)
            and node.target != "getitem"
        ):
            layouts.add_problem(
                "a custom torch.autograd.Function saves values split across devices (its backward "
                "graph computes whole tensors)"
                if node.target in FUNCTION_MARKERS
                else f"{node.target} has no layout rule for a split operand",
                node.name,
            )
    if node.target in REDUCTIONS:
        _replay_reduction(node, operand_metas[main], result.required[main], layouts)
    elif node.target in BATCH_NORMS and node.target != "aten._native_batch_norm_legit_no_training.default":
        spec = result.required[0]  # statistics are per channel (dim 1) over the other dims, some of them split
        axes = tuple(sorted(a for d, entry in enumerate(spec or ()) if entry and d != 1 for a in entry))
        if axes:
            layouts.statistics_axes[node.name] = axes


def _replay_anchor(node: Node, stage: StagePlan, layouts: ValueLayouts) -> None:
    out_spec = stage.activations.get(node.name)
    in_specs = stage.operands.get(node.name)
    if out_spec is None or in_specs is None:
        layouts.add_problem(f"the plan pins no layout for {node.target}", node.name)
        layouts.values[node.name] = _replicated_out(node.out)
        layouts.operands[node.name] = (None,) * len(list(node.refs()))
        return
    out = from_json(out_spec)
    required = tuple(from_json(s) if s is not None else None for s in in_specs)
    layouts.values[node.name] = out
    layouts.operands[node.name] = required
    out_axes = {a for entry in out if entry for a in entry}
    contracted = sorted({a for spec in required if spec for entry in spec if entry for a in entry} - out_axes)
    if contracted:
        layouts.partial[node.name] = ("contract", tuple(contracted))


def _replay_reduction(node: Node, main_meta: OutMeta, spec: Spec | None, layouts: ValueLayouts) -> None:
    if not spec:
        return
    dims = reduced_dims(node, len(cast(TensorMeta, main_meta).shape))  # it has a spec to read it in: a tensor
    axes = tuple(sorted(a for d, entry in enumerate(spec) if entry and d in dims for a in entry))
    if not axes:
        return
    kind = PARTIAL_SUM_REDUCTIONS.get(node.target)
    if kind is None:
        layouts.add_problem(
            f"{node.target} reduces over a split dim (only sum and mean are finished with a collective)", node.name
        )
        return
    layouts.partial[node.name] = (kind, axes)


def _replicated_out(out: OutMeta) -> OutSpec:
    if isinstance(out, TensorMeta):
        return (None,) * len(out.shape)
    if isinstance(out, tuple):
        return Multi((None,) * len(m.shape) if m is not None else None for m in out)
    return None


def _is_split(spec: OutSpec) -> bool:
    if isinstance(spec, Multi):
        return any(_is_split(s) for s in spec)
    return spec is not None and any(entry for entry in spec)


__all__ = ["ValueLayouts", "replay_layouts"]

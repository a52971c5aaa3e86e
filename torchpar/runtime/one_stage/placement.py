"""Where a one-stage plan puts things: a device mesh and a JAX sharding for every pinned tensor.

Built from a :class:`~torchpar.planner.plan.StagePlan`; the runtime places parameters, optimizer state
and batches with it, and hands its value/operand shardings to the lowering (which constrains them with
``with_sharding_constraint``). One device is the 1×1 mesh, so every plan runs on one code path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from torchpar.ir.graph import Graph
from torchpar.ir.optimizer import OptimizerSpec
from torchpar.planner.plan import Spec, StagePlan

if TYPE_CHECKING:  # JAX is imported when a placement is built
    import jax
    from jax.sharding import Mesh, NamedSharding


@dataclass
class Placement:
    """Shardings of one stage. ``params``/``grads``/``state`` by parameter name, ``inputs`` by batch
    leaf position (the plan's layouts; :meth:`input` adds the data axis), ``values``/``operands``/``options`` by IR
    value name (see ``jaxbackend.lower.lower``). A stage with data replicas has the 3-D mesh
    ``(data, d0, d1)`` (:func:`jaxbackend.sharding.make_mesh`); its layouts leave the data axis out."""

    mesh: Mesh
    params: dict[str, NamedSharding]
    grads: dict[str, NamedSharding]
    state: dict[str, NamedSharding]
    inputs: dict[int, NamedSharding]
    values: dict[str, NamedSharding]
    operands: dict[str, list[NamedSharding | None]]
    replicated: NamedSharding
    options: dict[str, dict[str, str]] = field(default_factory=dict)

    @classmethod
    def from_stage(
        cls,
        stage: StagePlan,
        graph: Graph | None,
        devices: Sequence[jax.Device] | None = None,
        optimizer: OptimizerSpec | None = None,
    ) -> Placement:
        """Shardings of ``stage`` on a mesh of ``devices`` (default: the first devices JAX has). Without a
        ``graph`` only the stored tensors are placed (parameters, optimizer state, batch leaves), not the
        values inside the step. With an Adafactor ``optimizer``, the state of a parameter of ≥ 2 dims (its row and
        column factors, of size 1 along the last dim and the next-to-last one) keeps those two dims whole."""
        from jaxbackend import sharding as jsh

        shape = cast("tuple[int, int]", tuple(stage.logical_mesh_shape))  # a plan's mesh is 2-D
        mesh = jsh.make_mesh(shape, devices, stage.data_replicas)

        def named(spec: Spec) -> NamedSharding:
            return jsh.named_sharding(mesh, spec)

        params = {n: named(s) for n, s in stage.params.items()}
        grads = {n: named(s) for n, s in stage.grads.items()}
        state = {n: named(_state_spec(stage.optimizer_state.get(n, s), n, optimizer)) for n, s in stage.params.items()}
        inputs = {int(i): named(s) for i, s in stage.inputs.items()}
        values: dict[str, NamedSharding] = {}
        if graph is None:
            return cls(mesh, params, grads, state, inputs, values, {}, jsh.replicated(mesh), {})
        by_target: dict[str, list[str]] = {}
        for inp in graph.inputs:
            if inp.kind == "param":
                by_target.setdefault(inp.target, []).append(inp.name)
        for name, spec in stage.params_at_use.items():
            for placeholder in by_target.get(name, []):
                values[placeholder] = named(spec)
        node_names = {n.name for n in graph.nodes}
        activation_inputs = {i.name for i in graph.inputs if i.kind == "activation"}
        for name, spec in stage.activations.items():
            if name in node_names or name in activation_inputs:
                values[name] = named(spec)
        operands = {
            name: [named(s) if s is not None else None for s in specs]
            for name, specs in stage.operands.items()
            if name in node_names
        }
        options = {name: dict(opts) for name, opts in stage.op_options.items() if name in operands}
        return cls(mesh, params, grads, state, inputs, values, operands, jsh.replicated(mesh), options)

    def param(self, name: str) -> NamedSharding:
        return self.params.get(name, self.replicated)

    def state_of(self, name: str) -> NamedSharding:
        return self.state.get(name, self.param(name))

    def input(self, index: int) -> NamedSharding:
        """Batch leaf ``index`` as it enters the step: the plan's layout, its dim 0 split over the data axis first on
        a mesh of data replicas."""
        return self.with_data_axis(self.inputs.get(index, self.replicated))

    def with_data_axis(self, sharding: NamedSharding) -> NamedSharding:
        """``sharding`` with dim 0 split over the data axis first (the replicas' blocks of rows, each split as the
        plan says within); ``sharding`` itself on a 2-D mesh."""
        from jax.sharding import NamedSharding, PartitionSpec

        from jaxbackend import sharding as jsh

        if jsh.data_replicas_of(self.mesh) == 1:
            return sharding
        spec = tuple(sharding.spec)
        first = spec[0] if spec else None
        rows = (jsh.DATA_AXIS, *((first,) if isinstance(first, str) else (first or ())))
        return NamedSharding(self.mesh, PartitionSpec(rows, *spec[1:]))

    def value(self, name: str) -> NamedSharding:
        """The sharding of an IR value (e.g. an activation entering the stage), replicated if unpinned."""
        return self.values.get(name, self.replicated)


def _state_spec(spec: Spec, name: str, optimizer: OptimizerSpec | None) -> Spec:
    """The layout of parameter ``name``'s optimizer state: the plan's, but whole along Adafactor's factored dims."""
    if optimizer is None or optimizer.kind != "adafactor" or name not in optimizer.param_names or len(spec) < 2:
        return spec
    return [*spec[:-2], None, None]

"""A one-stage plan's compiled programs on its mesh: the fused training step and the eval forward.

One :class:`OneStageProgram` per process that owns devices of the plan's mesh (the whole mesh in the local
runtime; in the Ray runtime every host actor of the mesh builds the same program and runs it as one SPMD
program over all of them). It holds no state: the worker passes parameters, optimizer state and buffers
in and keeps what comes back.

A training step is compiled once per batch signature (a new capture of the same model). It runs as

- ``"shard_map"``: a per-device program with explicit collectives (:mod:`.spmd_step`), for data-parallel
  and ZeRO plans by default, for every plan that accumulates gradients over micro-batches (it reduces them once
  per step), or any plan with ``spmd="shard_map"``;
- ``"gspmd"``: global shapes, XLA's partitioner inserts the collectives
  (:func:`torchpar.runtime.train_step.make_fused_step`).

The per-device step updates each device's piece of a parameter from its pieces of the gradient and the optimizer
state. That is the whole update only for an elementwise optimizer: Adafactor (row/column means, RMS norms) and Muon
(matrix products) read the whole tensor (:data:`torchpar.ir.optimizer.NOT_ELEMENTWISE`), so a plan that splits
such a parameter, its gradient or its state runs under GSPMD, which computes the update on global shapes
(:meth:`OneStageProgram._shard_map_layouts` names the parameters as the obstacle; a replicated parameter, as in
data parallelism, is updated whole on every device and keeps the per-device step). Adafactor's row and column
factors of a matrix (torch's ``row_var`` of shape (…, n, 1), ``col_var`` of shape (…, 1, m)) are kept whole along
those last two dims, where the plan's layout of the parameter would split a dim of size 1
(:meth:`.placement.Placement.from_stage`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxbackend.compiler import compiler_options
from jaxbackend.precision import Numerics
from jaxbackend.sharding import DATA_AXIS
from torchpar.ir.graph import Graph
from torchpar.ir.layout import JsonSpec, from_json, num_shards
from torchpar.ir.optimizer import NOT_ELEMENTWISE, OptimizerSpec
from torchpar.planner.plan import StagePlan
from torchpar.runtime.arrays import fitting
from torchpar.runtime.aux_parts import AuxOutputs
from torchpar.runtime.micro_batch_loss import MicroBatchLoss
from torchpar.runtime.one_stage.placement import Placement
from torchpar.runtime.train_step import Arrays, StepScalars, make_fused_step, over_data_replicas, remat_groups

if TYPE_CHECKING:
    from torchpar.planner.sharding.layouts import ValueLayouts

log = logging.getLogger(__name__)

SHARD_MAP_METHODS = ("data_parallel", "zero2", "zero3")
"""Plan methods whose step runs per device under ``spmd="auto"`` (every method does under gradient accumulation,
where the plan allows: only a per-device program synchronizes the gradients once per step; XLA's partitioner
reduces them in every micro-batch)."""


@dataclass
class CompiledStep:
    """A training step compiled for one batch signature."""

    compiled: jax.stages.Compiled
    spmd: str
    """``"shard_map"`` or ``"gspmd"``; ``"single_device"`` on a one-device mesh (nothing is partitioned)."""
    num_inputs: int
    lower_s: float
    compile_s: float
    input_shardings: list[jax.sharding.Sharding]
    """Each batch leaf's sharding on entry: the plan's, or :func:`torchpar.runtime.arrays.fitting`'s where it does not
    split evenly."""


class OneStageProgram:
    """Compiles steps and forwards of one stage plan on ``devices`` (see the module docstring)."""

    def __init__(
        self,
        stage: StagePlan,
        method: str,
        devices: list[jax.Device],
        *,
        optimizer: OptimizerSpec,
        grad_clip_norm: float | None,
        spmd: str,
        library_fusions: bool,
        check_finite: bool = False,
        numerics: Numerics | None = None,
        loss_scaling: bool = False,
        remat: str = "none",
        num_micro_batches: int = 1,
    ):
        self.stage = stage
        self.method = method
        self.devices = devices
        self.optimizer = optimizer
        self.grad_clip_norm = grad_clip_norm
        self.spmd = spmd
        self.library_fusions = library_fusions
        self.check_finite = check_finite
        self.numerics = numerics
        self.remat = remat
        self.loss_scaling = loss_scaling
        self.num_micro_batches = num_micro_batches
        self.placement = Placement.from_stage(stage, None, devices, optimizer)
        self._options = compiler_options(library_fusions, len(devices))

    def compile_step(
        self,
        graph: Graph,
        trainable: tuple[str, ...],
        leaves: list[tuple[tuple[int, ...], np.dtype]],
        state: tuple[Arrays, dict[str, Arrays], Arrays],
        scalars: StepScalars,
    ) -> CompiledStep:
        """Lower and compile the training step of ``graph`` for batch ``leaves`` (shape and dtype of each, in
        flattened order), the given state (arrays on this program's shardings) and optimizer
        scalars; raises ``ValueError`` if ``spmd="shard_map"`` cannot run it. With ``num_micro_batches`` M > 1,
        ``graph`` is the step of one micro-batch and ``leaves`` the whole batch (M micro-batches along dim 0)."""
        params, opt_state, buffers = state
        placement = Placement.from_stage(self.stage, graph, self.devices, self.optimizer)
        replicas = self.stage.data_replicas
        input_shardings: list[jax.sharding.Sharding]
        if replicas > 1:  # (what replicas cannot train was refused at capture: check_replicable)
            # each replica's rows laid out as the plan says (XLA pads what does not divide), its block of dim 0 its own
            input_shardings = [
                placement.with_data_axis(
                    # a named sharding fitted is a named sharding
                    cast(
                        NamedSharding,
                        fitting(placement.inputs.get(i, placement.replicated), (shape[0] // replicas, *shape[1:])),
                    )
                )
                for i, (shape, _) in enumerate(leaves)
            ]
        else:
            input_shardings = [fitting(placement.input(i), shape) for i, (shape, _) in enumerate(leaves)]
        # a per-device program splits each device's rows into the micro-batches: they must divide by shards × M
        # (data replicas never run one)
        micro = self.num_micro_batches
        uneven = (
            []
            if replicas > 1
            else [
                i
                for i, (shape, _) in enumerate(leaves)
                if fitting(placement.input(i), (shape[0] // micro, *shape[1:]) if shape else shape)
                != placement.input(i)
            ]
        )
        inputs = [
            jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            for (shape, dtype), sharding in zip(leaves, input_shardings)
        ]
        out_shardings = (
            placement.replicated,
            placement.replicated,
            placement.replicated,
            placement.replicated,
            {n: placement.param(n) for n in params},
            {n: {k: placement.state_of(n) for k in entries} for n, entries in opt_state.items()},
            dict.fromkeys(buffers, placement.replicated),
        )
        key_data = np.asarray(jax.random.key_data(jax.random.key(0)))
        args = (params, opt_state, buffers, inputs, scalars, key_data)

        # the PRNG key travels as raw key data: a host array in every process
        def jit_step(fn: Callable) -> jax.stages.Wrapped:
            with_key = lambda p, o, b, i, s, k: fn(p, o, b, i, s, jax.random.wrap_key_data(k))
            return jax.jit(with_key, donate_argnums=(0, 1, 2), out_shardings=out_shardings)

        start = time.perf_counter()
        lowered, spmd = None, "gspmd"
        if uneven:  # e.g. an epoch's last batch: a per-device program needs even shards, XLA's partitioner does not
            log.info(
                "torchpar: batch leaves %s (shapes %s) do not split evenly over the plan's mesh %s; this batch "
                "signature's step runs under GSPMD with those leaves whole on entry (the same training: XLA pads "
                "the uneven shards inside the step)%s",
                uneven,
                [leaves[i][0] for i in uneven],
                tuple(self.stage.logical_mesh_shape),
                self._accumulation_caveat(),
            )
        layouts = None if uneven else self._shard_map_layouts(graph)
        if layouts is not None:
            from jaxbackend.spmd import LocalModeError

            candidates = self._gradient_axes(placement, len(inputs))
            for attempt, gradient_axes in enumerate(candidates):
                try:
                    step_fn = self._spmd_step(
                        graph, layouts, trainable, placement, params, opt_state, buffers, len(inputs), gradient_axes
                    )
                    lowered = jit_step(step_fn).lower(*args)
                    spmd = "shard_map"
                    break
                except LocalModeError as error:
                    if attempt + 1 < len(candidates):
                        log.info(
                            "torchpar: the per-device step cannot take per-device gradients along %s (%s); "
                            "its gradients are reduced where they arise, in every micro-batch",
                            list(gradient_axes),
                            error,
                        )
                        continue
                    if self.spmd == "shard_map":
                        raise ValueError(
                            f"spmd='shard_map' cannot run this plan: {error}\nTry spmd='gspmd'."
                        ) from error
                    log.warning(
                        "torchpar: the per-device (shard_map) step cannot run this plan, using GSPMD%s: %s",
                        self._accumulation_caveat(),
                        error,
                    )
        if lowered is None:
            from jaxbackend.lower import lower

            run = lower(
                graph,
                value_shardings=placement.values,
                operand_shardings=placement.operands,
                op_options=placement.options,
                numerics=self.numerics,
                remat=remat_groups(graph, self.remat),
            )
            data_axis = DATA_AXIS if replicas > 1 else None
            one_count = len(self.devices) > 1 and data_axis is None
            step_fn = make_fused_step(
                run,
                trainable,
                self.optimizer,
                self.grad_clip_norm,
                placement.grads,
                check_finite=self.check_finite,
                loss_scaling=self.loss_scaling,
                count_nonfinite=_one_collective_count(placement) if one_count else None,
                num_micro_batches=self.num_micro_batches,
                loss=MicroBatchLoss.of(graph),
                data_axis=data_axis,
                aux=AuxOutputs.of(graph),
            )
            if data_axis is not None:
                step_fn = over_data_replicas(step_fn, placement.mesh, len(inputs), data_axis)
            lowered = jit_step(step_fn).lower(*args)
        if len(self.devices) == 1:
            spmd = "single_device"
        lowered_at = time.perf_counter()
        compiled = lowered.compile(compiler_options=self._options)
        done = time.perf_counter()
        log.info(
            "torchpar: compiled training step (%d ops, %s) in %.2fs: lower %.2fs, XLA %.2fs",
            len(graph.nodes),
            spmd,
            done - start,
            lowered_at - start,
            done - lowered_at,
        )
        return CompiledStep(
            compiled=compiled,
            spmd=spmd,
            num_inputs=len(inputs),
            lower_s=lowered_at - start,
            compile_s=done - lowered_at,
            input_shardings=input_shardings,
        )

    def compile_forward(self, graph: Graph) -> Callable:
        """The eval forward of ``graph``: ``(params, buffers, inputs) → outputs``; shardings propagate from the
        parameters' layouts."""
        from jaxbackend.lower import lower

        run = lower(graph, numerics=self.numerics)
        key = jax.random.key(0)
        return jax.jit(
            lambda params, buffers, inputs: run(params, buffers, inputs, key)[0], compiler_options=self._options
        )

    def _accumulation_caveat(self) -> str:
        return (
            f" (its gradients are then reduced in each of the {self.num_micro_batches} micro-batches, not once "
            "per step)"
            if self.num_micro_batches > 1
            else ""
        )

    def _shard_map_layouts(self, graph: Graph) -> ValueLayouts | None:
        """The value layouts a per-device step runs with, or ``None`` for the GSPMD step (per ``spmd``)."""
        per_device_by_default = self.method in SHARD_MAP_METHODS or self.num_micro_batches > 1
        if self.spmd == "gspmd" or (self.spmd == "auto" and not per_device_by_default):
            return None
        if self.stage.data_replicas > 1:
            if self.spmd == "shard_map":
                raise ValueError(
                    f"spmd='shard_map' cannot run a plan with {self.stage.data_replicas} data replicas "
                    "(each replica's step is a GSPMD program over its d0 × d1 devices). Try spmd='auto'."
                )
            log.info(
                "torchpar: the plan's %d data replicas each run a GSPMD step over %s devices; the per-device "
                "(shard_map) step is not used",
                self.stage.data_replicas,
                tuple(self.stage.logical_mesh_shape),
            )
            return None
        from torchpar.planner.sharding.layouts import replay_layouts

        layouts = replay_layouts(graph, self.stage)
        for name in self._split_for_optimizer():
            layouts.add_problem(
                f"optimizer {NOT_ELEMENTWISE[self.optimizer.kind]} and these parameters (or their "
                "gradients or optimizer state) are sharded",
                name,
            )
        obstacles = layouts.obstacles()
        if not obstacles:
            return layouts
        reasons = "\n  ".join(obstacles[:10] + ([f"… and {len(obstacles) - 10} more"] if len(obstacles) > 10 else []))
        if self.spmd == "shard_map":
            raise ValueError(f"spmd='shard_map' cannot run this plan:\n  {reasons}\nTry spmd='gspmd'.")
        log.warning(
            "torchpar: %s plan runs under GSPMD%s; a per-device (shard_map) step cannot run it:\n  %s",
            self.method,
            self._accumulation_caveat(),
            reasons,
        )
        return None

    def _split_for_optimizer(self) -> list[str]:
        """Parameters the per-device step would update from pieces while the optimizer needs them whole: for an
        optimizer of `NOT_ELEMENTWISE`, those whose gradient or optimizer-state layout (the pieces the update reads,
        as :func:`.spmd_step.make_spmd_step` lays them out) splits a dim over more than one device."""
        if self.optimizer.kind not in NOT_ELEMENTWISE:
            return []
        mesh_shape = cast("tuple[int, int]", tuple(self.stage.logical_mesh_shape))  # a plan's mesh is 2-D
        out = []
        for name in self.optimizer.param_names:
            stored = self.stage.params.get(name)
            grad = self.stage.grads.get(name, stored)
            state = self.stage.optimizer_state.get(name, grad)
            if any(_splits(spec, mesh_shape) for spec in (grad, state)):
                out.append(name)
        return out

    def _gradient_axes(self, placement: Placement, num_inputs: int) -> list[tuple[str, ...]]:
        """The ``gradient_axes`` of :func:`.spmd_step.make_spmd_step` to try, in order. Data-parallel and ZeRO plans
        split the batch over every axis. Other plans, under gradient accumulation: the axes splitting the batch
        inputs, so their partial gradients are accumulated and reduced once — unless a parameter meets the batch
        gathered along them (the plan replicates some op over a batch axis), which makes the loss vary there: then
        none, and JAX's transposes reduce the gradients where they arise."""
        from torchpar.runtime.one_stage.spmd_step import batch_axes

        if self.method in SHARD_MAP_METHODS:
            return [tuple(placement.mesh.axis_names)]
        if self.num_micro_batches > 1:
            axes = batch_axes(self.stage, num_inputs)
            return [axes, ()] if axes else [()]
        return [()]

    def _spmd_step(
        self,
        graph: Graph,
        layouts: ValueLayouts,
        trainable: tuple[str, ...],
        placement: Placement,
        params: Arrays,
        opt_state: dict[str, Arrays],
        buffers: Arrays,
        num_inputs: int,
        gradient_axes: tuple[str, ...],
    ) -> Callable:
        from jaxbackend.lower import lower
        from torchpar.runtime.one_stage.spmd_step import make_spmd_step

        run = lower(graph, layouts=layouts, numerics=self.numerics, remat=remat_groups(graph, self.remat))
        return make_spmd_step(
            run,
            layouts,
            self.stage,
            mesh=placement.mesh,
            param_names=list(params),
            buffer_names=list(buffers),
            state_keys={n: list(e) for n, e in opt_state.items()},
            num_inputs=num_inputs,
            trainable=trainable,
            spec=self.optimizer,
            grad_clip_norm=self.grad_clip_norm,
            check_finite=self.check_finite,
            loss_scaling=self.loss_scaling,
            num_micro_batches=self.num_micro_batches,
            micro_loss=MicroBatchLoss.of(graph),
            gradient_axes=gradient_axes,
            aux=AuxOutputs.of(graph),
        )


def check_replicable(graph: Graph, replicas: int) -> None:
    """Data replicas train as the whole batch does only if nothing but the loss mixes rows of the batch and the loss
    combines from the replicas' (:mod:`torchpar.ir.loss_parts`: a mean, a sum, or a sum over a parameter-free count).
    Raises ``ValueError`` naming what does not: buffers the step updates (BatchNorm's running statistics, whose
    forward also normalizes by the batch's statistics), or the loss term that is not a sum of per-row terms (a
    router's load-balancing loss, a product of batch means) — each replica would compute them from its rows alone."""
    from torchpar.ir.loss_parts import NotDecomposable, decompose_loss

    updated = [o.target for o in graph.outputs if o.kind == "buffer"]
    if updated:
        shown = ", ".join(map(str, updated[:5])) + (f", … ({len(updated)} in all)" if len(updated) > 5 else "")
        raise ValueError(
            f"a plan with {replicas} data replicas cannot train this model the way PyTorch does: its "
            f"step updates buffers ({shown}), e.g. BatchNorm statistics, which each replica would compute "
            "from its own rows only. Use a 2-D mesh_shape (the planner then splits the batch under XLA's "
            "partitioner, which keeps whole-batch statistics), or put those modules in eval() mode."
        )
    try:
        decompose_loss(graph)
    except NotDecomposable as error:
        raise ValueError(
            f"a plan with {replicas} data replicas cannot train this model the way PyTorch does on the whole batch: "
            f"the whole batch's loss is not made of the replicas' ({error}). A term such as a mixture-of-experts "
            "router's load-balancing loss (a product of batch means) would be each replica's own. Use a 2-D "
            "mesh_shape (its batch split keeps whole-batch statistics), or end the loss with a mean, a sum or "
            "`.sum() / count` where `count` does not depend on the parameters."
        ) from None


def _splits(json_spec: JsonSpec | None, mesh_shape: tuple[int, int]) -> bool:
    """Whether a plan's JSON spec cuts the tensor into more than one piece on a mesh of ``mesh_shape``."""
    return json_spec is not None and num_shards(from_json(json_spec), mesh_shape) > 1


def _one_collective_count(placement: Placement) -> Callable[[Arrays], jax.Array]:
    """``grads → inf/nan element count`` over a sharded GSPMD step's gradients with a single scalar all-reduce
    (XLA's partitioner would all-reduce each gradient's partial count on its own): each device counts its
    pieces in a ``shard_map`` over the gradients' layouts, then one ``psum``. A replicated piece is counted once
    per device holding it; the count is only compared with zero."""
    from jax.sharding import PartitionSpec

    from torchpar.runtime.train_step import nonfinite_count

    mesh = placement.mesh
    axes = tuple(mesh.axis_names)

    def count(grads: Arrays) -> jax.Array:
        specs = {n: (placement.grads.get(n) or placement.param(n)).spec for n in grads}

        def local(pieces: Arrays) -> jax.Array:
            return jax.lax.psum(nonfinite_count(pieces), axes)

        return jax.shard_map(local, mesh=mesh, in_specs=(specs,), out_specs=PartitionSpec(), check_vma=False)(grads)

    return count

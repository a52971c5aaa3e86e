"""Measured profiling on this process's devices: stages compiled and timed, all-reduces timed per mesh axis.

The planner decides with these timings (:mod:`torchpar.planner.profiling`); this module only measures. A stage
is compiled as the runtime compiles it (:class:`~torchpar.runtime.pipeline.stage_program.StageProgram` on the stage's
devices, with its plan's layouts), fed random parameters and a random batch of its micro-batch shapes (integer inputs
are zeros: always valid indices), run once to compile, then timed ``repeats`` times: forward, then backward with its
gradients added into an accumulator, as every micro-batch after the first is run in a step. The timing of one
call is the wall time until its outputs are ready; the result is the median over the repeats. Timings are kept
in the disk cache (:mod:`.profile_cache`), so planning the same model on the same hardware again compiles
nothing.

Only the local runtime is profiled: the devices must belong to this process.
"""

from __future__ import annotations

import hashlib
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypedDict, cast

import jax
import jax.numpy as jnp
import numpy as np

from jaxbackend.dtypes import to_jax
from jaxbackend.precision import Numerics
from torchpar.ir.graph import TensorMeta
from torchpar.ir.optimizer import OptimizerSpec
from torchpar.planner.pipeline.slicing import StageGraph
from torchpar.planner.plan import StagePlan
from torchpar.planner.profiling import LinkFit, StageTiming, fit_alpha_beta
from torchpar.runtime.measure.profile_cache import ProfileCache, hardware_name
from torchpar.runtime.one_stage.placement import Placement
from torchpar.runtime.pipeline.stage_program import LOSS, Residuals, StageProgram
from torchpar.runtime.train_step import Arrays

if TYPE_CHECKING:
    from jax.sharding import Mesh

log = logging.getLogger(__name__)

DEFAULT_REPEATS = 5
"""Timed runs of each stage (after the compiling one); the median is kept."""
COLLECTIVE_BYTES = (1 << 16, 1 << 19, 1 << 22, 1 << 24)
"""All-reduce sizes (bytes of float32 buffers) the link fit is made from: 64 KiB to 16 MiB."""


class StageEntry(TypedDict):
    """A stage's timing as the profile cache keeps it."""

    forward_s: float
    backward_s: float
    compile_s: float


def graph_key(stage: StageGraph) -> dict[str, object]:
    """What of a stage graph its timing depends on: every input, op and output (names, targets, operands,
    shapes, dtypes) and the constants' shapes and bytes' digest."""
    graph = stage.graph
    constants = {
        name: [
            list(np.shape(v)),
            str(np.asarray(v).dtype),
            hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest(),
        ]
        for name, v in sorted(graph.constants.items())
    }
    return {
        "inputs": [repr(i) for i in graph.inputs],
        "nodes": [repr((n.name, n.target, n.args, n.kwargs, n.out)) for n in graph.nodes],
        "outputs": [repr(o) for o in graph.outputs],
        "constants": constants,
        "activation_inputs": list(stage.activation_inputs),
        "activation_outputs": list(stage.activation_outputs),
    }


def plan_key(plan: StagePlan) -> dict[str, object]:
    """The layouts and mesh of ``plan`` a stage's timing depends on."""
    return {
        "logical_mesh_shape": list(plan.logical_mesh_shape),
        "params": plan.params,
        "grads": plan.grads,
        "params_at_use": plan.params_at_use,
        "inputs": plan.inputs,
        "activations": plan.activations,
        "operands": plan.operands,
        "devices": plan.devices(),
    }


class StageProfiler:
    """A :class:`~torchpar.planner.profiling.StageTimer` on this process's devices (module docstring).

    ``spec`` / ``trainable``: the optimizer's parameters and which of them train (the backward computes their
    gradients); ``num_micro_batches`` seeds the loss cotangent as the runtime does; ``numerics`` and
    ``library_fusions`` compile the stage as the engine will (``remat`` comes with each call)."""

    def __init__(
        self,
        *,
        spec: OptimizerSpec,
        trainable: set[str],
        num_micro_batches: int,
        numerics: Numerics | None,
        library_fusions: bool,
        cache: ProfileCache,
        repeats: int = DEFAULT_REPEATS,
        devices: Sequence[jax.Device] | None = None,
        on_stage: Callable[[str], None] | None = None,
    ):
        if repeats < 1:
            raise ValueError(f"repeats must be ≥ 1, got {repeats}")
        self.spec, self.trainable, self.num_micro_batches = spec, trainable, num_micro_batches
        self.numerics, self.library_fusions = numerics, library_fusions
        self.cache, self.repeats = cache, repeats
        self.devices = list(devices if devices is not None else jax.devices())
        self.hardware = hardware_name(self.devices)
        self.on_stage = on_stage

    def __call__(self, stage: StageGraph, plan: StagePlan, remat: str = "none") -> StageTiming:
        key = {
            "kind": "stage",
            "graph": graph_key(stage),
            "plan": plan_key(plan),
            "hardware": self.hardware,
            "jax": jax.__version__,
            "numerics": repr(self.numerics),
            "remat": remat,
            "library_fusions": self.library_fusions,
            "micro_batches": self.num_micro_batches,
            "trainable": sorted(n for n in stage.params if n in self.trainable),
            "repeats": self.repeats,
        }
        stored = cast("StageEntry | None", self.cache.get(key))  # what this profiler put under a stage key
        if stored is not None:
            timing = StageTiming(forward_s=stored["forward_s"], backward_s=stored["backward_s"], cached=True)
        else:
            timing = self._measure(stage, plan, remat)
            entry: StageEntry = {
                "forward_s": timing.forward_s,
                "backward_s": timing.backward_s,
                "compile_s": timing.compile_s,
            }
            self.cache.put(key, entry)
        if self.on_stage is not None:
            self.on_stage(f"stage of {len(stage.graph.nodes)} ops on {tuple(plan.logical_mesh_shape)}")
        return timing

    def _measure(self, stage: StageGraph, plan: StagePlan, remat: str) -> StageTiming:
        ids = plan.devices()
        if max(ids) >= len(self.devices):
            raise ValueError(
                f"profiling a stage on devices {ids}, but this process has {len(self.devices)}: "
                "profile=True measures on the local runtime's devices (torchpar.init(num_devices=...))"
            )
        placement = Placement.from_stage(plan, stage.graph, [self.devices[i] for i in ids], self.spec)
        program = StageProgram(
            stage,
            placement=placement,
            spec=self.spec,
            trainable=self.trainable,
            num_micro_batches=self.num_micro_batches,
            library_fusions=self.library_fusions,
            numerics=self.numerics,
            remat=remat,
        )
        params, buffers, inputs, acts = _random_arguments(program)
        key = jax.random.key(0)

        def forward() -> tuple[Arrays, Arrays, Arrays, Residuals]:
            return program.forward(params, buffers, inputs, acts, key)

        begin = time.perf_counter()
        diff, _, _, residuals = forward()
        cotangents = {n: jnp.zeros_like(v) for n, v in diff.items() if n != LOSS}
        total, _ = program.backward(residuals, cotangents)
        total, _ = program.backward_into(residuals, cotangents, total)
        jax.block_until_ready(total)
        compile_s = time.perf_counter() - begin
        forward_times, backward_times = [], []
        for _ in range(self.repeats):
            begin = time.perf_counter()
            diff, _, _, residuals = forward()
            jax.block_until_ready(diff)
            middle = time.perf_counter()
            total, act_cotangents = program.backward_into(residuals, cotangents, total)
            jax.block_until_ready((total, act_cotangents))
            forward_times.append(middle - begin)
            backward_times.append(time.perf_counter() - middle)
        timing = StageTiming(
            forward_s=statistics.median(forward_times),
            backward_s=statistics.median(backward_times),
            compile_s=compile_s,
        )
        log.info(
            "profiled a stage of %d ops on %s: forward %.4g s, backward %.4g s (compile %.3g s)",
            len(stage.graph.nodes),
            tuple(plan.logical_mesh_shape),
            timing.forward_s,
            timing.backward_s,
            compile_s,
        )
        return timing


def _random_arguments(program: StageProgram) -> tuple[Arrays, Arrays, dict[int, jax.Array], Arrays]:
    """Parameters, buffers, batch inputs and received activations of ``program``'s stage, of its shapes and dtypes,
    placed as its plan lays them out: floats drawn from N(0, 0.02²) (parameters) or N(0, 1), integers zero."""
    rng = np.random.default_rng(0)

    def draw(meta: TensorMeta, scale: float) -> np.ndarray:
        dtype = to_jax(meta.dtype)
        if jnp.issubdtype(dtype, jnp.floating):
            return (rng.standard_normal(meta.shape) * scale).astype(dtype)
        return np.zeros(meta.shape, dtype)

    params: Arrays = {}
    buffers: Arrays = {}
    inputs: dict[int, jax.Array] = {}
    acts: Arrays = {}
    for item in program.stage.graph.inputs:
        if item.kind == "param" and item.target not in params:
            params[item.target] = program.put_param(item.target, draw(item.meta, 0.02))
        elif item.kind == "buffer" and item.target not in buffers:
            buffers[item.target] = program.put(draw(item.meta, 0.0))
        elif item.kind == "input":
            inputs[int(item.target)] = program.put_input(int(item.target), draw(item.meta, 1.0))
        elif item.kind == "activation":
            acts[item.name] = program.put_activation(item.name, draw(item.meta, 1.0))
    return params, buffers, inputs, acts


def time_links(
    cache: ProfileCache,
    devices: Sequence[jax.Device] | None = None,
    *,
    sizes: tuple[int, ...] = COLLECTIVE_BYTES,
    repeats: int = DEFAULT_REPEATS,
) -> list[LinkFit]:
    """All-reduces of ``sizes`` bytes timed over this process's devices, fitted per logical mesh axis: axis 1 on the
    mesh ``(1, n)``, axis 0 on ``(n, 1)`` (one process holds one host, so both axes run over its ``n`` devices).
    Empty with fewer than two devices."""
    devices = list(devices if devices is not None else jax.devices())
    if len(devices) < 2:
        return []
    from jax.sharding import Mesh

    hardware = hardware_name(devices)
    fits = []
    for axis in (0, 1):
        shape = (len(devices), 1) if axis == 0 else (1, len(devices))
        key = {
            "kind": "all_reduce",
            "axis": axis,
            "shape": list(shape),
            "sizes": list(sizes),
            "hardware": hardware,
            "jax": jax.__version__,
            "repeats": repeats,
        }
        points = cast("list[list[float]] | None", cache.get(key))  # what this function put under a link key
        if points is None:
            mesh = Mesh(np.array(devices).reshape(shape), ("d0", "d1"))
            name = mesh.axis_names[axis]
            points = [[float(nbytes), _time_all_reduce(mesh, name, nbytes, repeats)] for nbytes in sizes]
            cache.put(key, points)
        pairs = [cast("tuple[float, float]", tuple(p)) for p in points]  # each point is [bytes, seconds]
        alpha, beta = fit_alpha_beta(pairs, len(devices))
        fits.append(
            LinkFit(
                axis=axis,
                devices=len(devices),
                alpha=alpha,
                beta=beta,
                points=tuple((float(b), float(t)) for b, t in points),
            )
        )
        log.info("link axis %d over %d devices: alpha %.3g s, beta %.3g s/byte", axis, len(devices), alpha, beta)
    return fits


def _time_all_reduce(mesh: Mesh, axis_name: str, nbytes: int, repeats: int) -> float:
    """Median seconds of one all-reduce (``psum``) of a float32 buffer of ``nbytes`` over ``axis_name``."""
    from jax.sharding import NamedSharding, PartitionSpec

    count = mesh.devices.size
    per_device = max(nbytes // 4, 1)
    spec = PartitionSpec(axis_name)
    summed = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, axis_name), mesh=mesh, in_specs=spec, out_specs=spec))
    value = jax.device_put(np.ones((count * per_device,), np.float32), NamedSharding(mesh, spec))
    jax.block_until_ready(summed(value))
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        jax.block_until_ready(summed(value))
        times.append(time.perf_counter() - begin)
    return statistics.median(times)

"""What one process does for a plan: build its programs, hold its share of the state, run its part of a step.

The local runtime has one :class:`Worker`, called directly; the Ray runtime has one per host actor
(:mod:`torchpar.runtime.ray.host_actor`), all joined into one JAX multi-controller system. Every worker of an engine
gets the same :class:`ExecutionSpec` and its process rank, builds the programs of the stages whose devices it
owns, and answers the same calls:

``load(state)`` / ``export(kinds)``; ``save_shards(directory)`` / ``load_checkpoint(directory, tensors)`` (sharded
checkpoints: :mod:`.checkpoint_io`); ``compile(key, graph, trainable, leaves, scalars, stage_graphs)`` (the step
of one batch signature ``key``, for every kind of plan); ``run_step(...) → StepReport``;
``apply_update(clip_scale)``; ``hlo_text()`` / ``memory_stats()`` (by stage, from the stage's lead —
lowest-ranked — process); ``describe()``.

- :class:`OneStageWorker` — a one-stage plan (one device, DataParallel, ZeRO, ShardParallel, Megatron):
  one fused step per batch signature over the plan's mesh (:mod:`.one_stage`), which may span hosts;
- :class:`PipelineWorker` — PipeshardParallel: a :class:`~torchpar.runtime.pipeline.stage_program.StageProgram` per
  stage it takes
  part in, each device group's instruction list (one stage, or v under interleaved 1F1B) run on its own
  thread by the interpreter (:mod:`torchpar.runtime.pipeline.interpreter`); tied gradients and global-norm clipping are
  finished across stages (:mod:`torchpar.runtime.pipeline.gradients`).
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NotRequired, TypeAlias, TypedDict, cast

import jax
import numpy as np

from jaxbackend.precision import FULL_FP32, Numerics
from torchpar.ir.graph import Graph
from torchpar.ir.optimizer import OptimizerSpec, Scalars
from torchpar.planner.pipeline.schedules import SPLIT_BACKWARD, device_groups, make_schedule
from torchpar.planner.pipeline.slicing import StageGraph
from torchpar.planner.plan import Plan
from torchpar.runtime.arrays import Piece, local_copy, local_scalar, put, put_batch
from torchpar.runtime.batch_parts import Ahead, HostRows, Index, LeafPiece, local_box, pieces_from_rows, place
from torchpar.runtime.checkpoint_io import (
    KINDS,
    CheckpointSource,
    ShardReader,
    StateArray,
    TensorEntry,
    tensor_key,
    write_shards,
)
from torchpar.runtime.devices import DeviceMap
from torchpar.runtime.micro_batch_loss import MicroBatchLoss
from torchpar.runtime.pipeline import gradients
from torchpar.runtime.pipeline.transport import Deliver, Mailbox, MessageKey, Transport
from torchpar.runtime.state import Exported, HostState, export_arrays
from torchpar.runtime.train_step import StepScalars, split_scalars

if TYPE_CHECKING:
    from torchpar.runtime.host_loading import DataFactory, HostLoader
    from torchpar.runtime.one_stage.placement import Placement
    from torchpar.runtime.one_stage.programs import CompiledStep
    from torchpar.runtime.pipeline.interpreter import StageRun
    from torchpar.runtime.pipeline.stage_program import StageProgram

log = logging.getLogger(__name__)

LeafSpec: TypeAlias = tuple[tuple[int, ...], np.dtype]
"""A batch leaf's ``(shape, dtype)``."""

OneStagePayload: TypeAlias = Ahead | HostRows | Sequence[jax.Array] | Sequence[LeafPiece] | Sequence[np.ndarray]
"""What a one-stage process receives for a step (:meth:`OneStageWorker.step_inputs`)."""

PipelinePayload: TypeAlias = list[dict[int, np.ndarray]] | HostRows
"""What a pipeline process receives for a step: each micro-batch's leaves its stages read, or the rows to load."""

Payload: TypeAlias = OneStagePayload | PipelinePayload
"""A process's part of a step's batch (:meth:`.executor.Executor.payloads`)."""

HostOutput: TypeAlias = tuple[tuple[int, ...], np.dtype, np.ndarray | list[Piece]]
"""An eval output as a process returns it: ``(shape, dtype, the host array or this process's pieces)``."""


class CompileResult(TypedDict):
    """What :meth:`Worker.compile` returns: phase seconds and, one-stage plans, how the step runs and the boxes of
    the batch leaves this process holds (:func:`~.batch_parts.local_box`)."""

    lower: float
    xla_compile: float
    spmd: NotRequired[str]
    input_boxes: NotRequired[list[Index]]


class ProgramInfo(TypedDict):
    """A stage's program as :meth:`Worker.describe` shows it: its optimized HLO and the process of each device."""

    hlo: str
    device_processes: list[int]


@dataclass(kw_only=True, frozen=True)
class RunOptions:
    """Options of :func:`torchpar.compile` that the programs need."""

    grad_clip_norm: float | None = None
    library_fusions: bool = True
    spmd: str = "auto"
    timeout_s: float = 60.0
    """Longest wait for a message from another stage or process."""
    check_finite: bool = False
    """Skip the optimizer update of a step whose loss or gradients are not finite, and report it."""
    numerics: Numerics = FULL_FP32
    """Precision of float32 products and convolutions (:mod:`jaxbackend.precision`)."""
    loss_scaling: bool = False
    """One-stage steps take a dynamic loss scale with their scalars (:mod:`torchpar.runtime.train_step`)."""
    remat: str = "none"
    """Activation checkpointing of each layer (:mod:`torchpar.planner.remat`): ``none``/``layers``/``selective``."""


@dataclass(kw_only=True)
class ExecutionSpec:
    """Everything a worker builds its programs from (plain data: it travels to Ray actors)."""

    plan: Plan
    optimizer: OptimizerSpec
    devices: DeviceMap
    options: RunOptions
    stage_graphs: list[StageGraph] = field(default_factory=list)
    """Pipeline plans: each stage's sub-graph (one-stage plans get a graph per batch signature instead)."""
    trainable: tuple[str, ...] = ()
    """Pipeline plans: the parameters the optimizer updates."""

    @property
    def is_pipeline(self) -> bool:
        return self.plan.method == "pipeshard"

    def stage_ranks(self) -> dict[int, tuple[int, ...]]:
        """The process ranks running each stage."""
        return {s: self.devices.ranks(stage.devices()) for s, stage in enumerate(self.plan.stages)}


@dataclass
class StepReport:
    """One worker's part of a step, for the driver. Losses are reported by the lead process of the stage
    computing them; squared norms (when clipping) by each stage's lead."""

    losses: list[float] = field(default_factory=list)
    aux: dict[str, list[np.ndarray]] = field(default_factory=dict)
    """A ``step_fn``'s aux values by key, host copies: one-stage steps, the whole batch's (one entry, lead process);
    pipelines, one per micro-batch in order, from the lead process of the stage computing it."""
    loss_dens: list[float] = field(default_factory=list)
    """Pipelines with a ratio loss: each micro-batch's denominator, and the reference ``r`` its seed was divided by
    (:mod:`.micro_batch_loss`), from the last stage's lead process."""
    loss_reference: float = 1.0
    squared_norms: dict[int, float] = field(default_factory=dict)
    """Pipelines: each stage's sum of squares of the gradients it owns
    (:func:`torchpar.runtime.pipeline.gradients.owned_squared_norm`), from its lead process, as computed (before the
    driver's unscaling and clipping)."""
    grad_norm: float | None = None
    """One-stage steps: the gradients' global norm before clipping (lead process)."""
    nonfinite: dict[int, int] = field(default_factory=dict)
    """Pipelines checking finiteness: each stage's count of non-finite gradient elements (its lead reports)."""
    finite: bool = True
    """One-stage steps: the loss and gradients were finite (the update ran); else it was skipped."""
    blocks: dict[int, list[tuple[str, int, float, float]]] = field(default_factory=dict)
    spans: dict[int, list[tuple[str, int, float, float]]] = field(default_factory=dict)
    """Pipelines: each stage's non-compute spans (:class:`~torchpar.runtime.pipeline.timeline.StepTimeline`), from its
    lead process."""
    updated: bool = False
    """The optimizer update ran inside the step (no clipping across stages needed)."""
    input_bytes: int = 0
    """Bytes of batch data this process received for the step (driver-fed batches; 0 for host-loaded ones)."""
    data_wait_s: float = 0.0
    """Seconds the step waited for this process's host-loaded rows (0 when they were prefetched in time)."""


class Worker:
    """The calls every worker answers (see the module docstring)."""

    host_loader: HostLoader | None

    def __init__(self, spec: ExecutionSpec, rank: int):
        self.spec = spec
        self.rank = rank
        self.steps_run = 0

    def describe(self, programs: bool = False) -> dict[str, object]:
        """Where this worker runs and what it ran: process, devices, stages, steps, and which of its devices
        hold a piece of the state. ``programs=True`` adds, per stage, the optimized HLO this process runs and
        its device assignment as process indices (logical id ``i`` of the HLO's replica groups is device
        ``i`` of the stage's mesh), so a caller can see which collectives cross processes."""
        devices = jax.local_devices()
        info: dict[str, object] = {
            "rank": self.rank,
            "pid": os.getpid(),
            "process_index": jax.process_index(),
            "process_count": jax.process_count(),
            "platform": devices[0].platform,
            "local_devices": [str(d) for d in devices],
            "steps_run": self.steps_run,
            "stages": self.stages(),
            "cores": sorted(os.sched_getaffinity(0)),
            "niceness": os.nice(0),
            "gc_threshold": gc.get_threshold(),
            "devices_holding_state": sorted(
                {str(s.device) for array in self.state_arrays() for s in array.addressable_shards}
            ),
        }
        if programs:
            info["programs"] = self.programs_info()
        return info

    def attach_data(self, factory: DataFactory, depth: int) -> None:
        """Host-loaded training: load this process's rows of every step with ``factory`` (``torchpar.HostData``),
        ``depth`` steps ahead (:mod:`.host_loading`)."""
        from torchpar.runtime.host_loading import HostLoader

        self.detach_data()
        host = self.spec.devices.hosts[self.rank] if self.spec.devices.hosts is not None else 0
        self.host_loader = HostLoader(factory, host, depth, self._prepare_rows)

    def detach_data(self) -> None:
        loader, self.host_loader = getattr(self, "host_loader", None), None
        if loader is not None:
            loader.close()

    def _prepare_rows(self, key: Hashable, rows: HostRows, leaves: list[np.ndarray]) -> list[jax.Array] | None:
        """Loaded rows placed for signature ``key`` (on the loader's thread), ``None`` if ``key`` is not compiled."""
        return None

    def stages(self) -> list[int]:
        raise NotImplementedError

    def state_arrays(self) -> list[jax.Array]:
        """Every array of the state this process holds (parameters, buffers, optimizer state)."""
        raise NotImplementedError

    def programs_info(self) -> dict[int, ProgramInfo]:
        raise NotImplementedError

    def load(self, state: HostState | CheckpointSource) -> None:
        """Place the state on this process's devices: ``state`` is a :class:`HostState` or a checkpoint on disk
        (:class:`~.checkpoint_io.CheckpointSource`); both answer ``place(kind, name, sharding)``."""
        raise NotImplementedError

    def checkpoint_arrays(self) -> list[tuple[str, StateArray]]:
        """``(tensor key, array)`` of every state array this process writes into a checkpoint (a parameter that
        several stages hold is written by its first stage only)."""
        raise NotImplementedError

    def update(self, state: HostState) -> None:
        """Replace the entries ``state`` holds (some parameters, buffers or optimizer state, as host arrays) where
        this process holds them, laid out as the plan lays them out; the rest of the state stays as it is."""
        raise NotImplementedError

    def compile(
        self,
        key: Hashable,
        graph: Graph,
        trainable: tuple[str, ...],
        leaves: list[LeafSpec],
        scalars: StepScalars,
        stage_graphs: list[StageGraph] | None = None,
    ) -> CompileResult:
        """Compile the training step for batch signature ``key`` now (not inside its first step): ``graph`` is the
        training graph captured on one micro-batch of such a batch, ``leaves`` the whole batch's ``(shape, dtype)``
        per input, ``scalars`` a step's scalars (their shapes are what matter); ``stage_graphs``: the plan's stages
        cut out of ``graph`` when it is not the graph the plan was made for (pipelines; ``None``: the plan's own).
        Returns phase seconds (``lower``, ``xla_compile``) and, one-stage plans, how the step runs (``spmd``)."""
        raise NotImplementedError

    def export(self, kinds: tuple[str, ...] = KINDS) -> list[Exported]:
        """This process's pieces of the state entries of ``kinds``, for the driver to assemble."""
        raise NotImplementedError

    def place_ahead(self, token: int, key: Hashable, payload: OneStagePayload) -> None:
        """Place a later step's part of the batch on this process's devices now, kept under ``token`` (one-stage
        plans; a prefetch beside the running step)."""
        raise NotImplementedError

    def run_step(
        self, key: Hashable, inputs: Payload, scalars: StepScalars, key_data: np.ndarray, start_time: float
    ) -> StepReport:
        """Run this process's part of one training step of signature ``key`` on ``inputs`` (its part of the batch,
        placed, prefetched or host-loaded); ``start_time``: when the driver started the step (for the timeline)."""
        raise NotImplementedError

    def apply_update(self, clip_scale: float | None) -> None:
        """Pipelines whose gradient clipping needs every stage's norm: the optimizer update, gradients scaled by
        ``clip_scale``."""
        raise NotImplementedError

    def forward(self, key: Hashable, graph: Graph, leaves: list[np.ndarray]) -> list[HostOutput | None]:
        """The eval forward of ``graph`` on ``leaves``."""
        raise NotImplementedError

    def hlo_text(self) -> dict[int, str]:
        """The optimized HLO of each stage this process leads, by stage index."""
        raise NotImplementedError

    def memory_stats(self) -> dict[int, dict[str, int]]:
        """XLA's memory analysis of each stage this process leads, by stage index."""
        raise NotImplementedError

    def save_shards(self, directory: str) -> dict[str, Any]:
        """Write this process's pieces of the state into ``directory``; returns their manifest."""
        return write_shards(directory, self.checkpoint_arrays(), writer=f"rank{self.rank}")

    def load_checkpoint(self, directory: str, tensors: dict[str, TensorEntry]) -> dict[str, int]:
        """Load the state from the checkpoint in ``directory`` (``tensors``: its index's entries), each device's
        shard read from the pieces overlapping it; returns the bytes this process read."""
        with ShardReader(directory, tensors) as reader:
            self.load(CheckpointSource(reader))
            return {"rank": self.rank, "bytes_read": reader.bytes_read}


# --- one-stage plans --------------------------------------------------------------------------------------


class OneStageWorker(Worker):
    """A one-stage plan's share on this process: the state on the plan's mesh and one step per signature."""

    def __init__(self, spec: ExecutionSpec, rank: int):
        super().__init__(spec, rank)
        from torchpar.runtime.one_stage.programs import OneStageProgram

        stage = spec.plan.stages[0]
        options = spec.options
        self.program = OneStageProgram(
            stage,
            spec.plan.method,
            spec.devices.jax_devices(stage.devices()),
            optimizer=spec.optimizer,
            grad_clip_norm=options.grad_clip_norm,
            spmd=options.spmd,
            library_fusions=options.library_fusions,
            check_finite=options.check_finite,
            numerics=options.numerics,
            remat=options.remat,
            loss_scaling=options.loss_scaling,
            num_micro_batches=spec.plan.num_micro_batches,
        )
        self.lead = min(spec.stage_ranks()[0]) == rank
        self.params: dict[str, jax.Array] = {}
        self.buffers: dict[str, jax.Array] = {}
        self.opt_state: dict[str, dict[str, jax.Array]] = {}
        self._steps: dict[Hashable, CompiledStep] = {}
        self._boxes: dict[Hashable, list[Index]] = {}
        self._ahead: dict[int, tuple[list[jax.Array], int, float]] = {}
        self._ahead_ready = threading.Condition()
        self._forwards: dict[Hashable, Callable] = {}
        self._last: CompiledStep | None = None
        self.host_loader = None

    def stages(self) -> list[int]:
        return [0]

    def state_arrays(self) -> list[jax.Array]:
        return [
            *self.params.values(),
            *self.buffers.values(),
            *(v for entries in self.opt_state.values() for v in entries.values()),
        ]

    def programs_info(self) -> dict[int, ProgramInfo]:
        mesh = self.program.placement.mesh
        return {
            0: {
                "hlo": (self._last.compiled.as_text() or "") if self._last else "",
                "device_processes": [d.process_index for d in mesh.devices.flat],
            }
        }

    def load(self, state: HostState | CheckpointSource) -> None:
        placement = self.program.placement
        self.params = {n: state.place("param", n, placement.param(n)) for n in state.params}
        self.buffers = {n: state.place("buffer", n, placement.replicated) for n in state.buffers}
        self.opt_state = {
            n: {k: state.place("state", (n, k), placement.state_of(n)) for k in entries}
            for n, entries in state.opt_state.items()
        }

    def update(self, state: HostState) -> None:
        placement = self.program.placement
        self.params.update({n: state.place("param", n, placement.param(n)) for n in state.params})
        self.buffers.update({n: state.place("buffer", n, placement.replicated) for n in state.buffers})
        for n, entries in state.opt_state.items():
            if n in self.opt_state:
                self.opt_state[n].update({k: state.place("state", (n, k), placement.state_of(n)) for k in entries})

    def export(self, kinds: tuple[str, ...] = KINDS) -> list[Exported]:
        return export_arrays(0, self.params, self.buffers, self.opt_state, kinds)

    def checkpoint_arrays(self) -> list[tuple[str, StateArray]]:
        return [
            *((tensor_key("param", n), v) for n, v in self.params.items()),
            *((tensor_key("buffer", n), v) for n, v in self.buffers.items()),
            *((tensor_key("state", (n, k)), v) for n, entries in self.opt_state.items() for k, v in entries.items()),
        ]

    def compile(
        self,
        key: Hashable,
        graph: Graph,
        trainable: tuple[str, ...],
        leaves: list[LeafSpec],
        scalars: StepScalars,
        stage_graphs: list[StageGraph] | None = None,
    ) -> CompileResult:
        compiled = self.program.compile_step(
            graph, trainable, leaves, (self.params, self.opt_state, self.buffers), scalars
        )
        self._steps[key] = compiled
        self._last = compiled
        self._boxes[key] = [
            local_box(sharding, shape) for (shape, _), sharding in zip(leaves, compiled.input_shardings)
        ]
        return {
            "spmd": compiled.spmd,
            "lower": compiled.lower_s,
            "xla_compile": compiled.compile_s,
            "input_boxes": self._boxes[key],
        }

    def _prepare_rows(self, key: Hashable, rows: HostRows, leaves: list[np.ndarray]) -> list[jax.Array] | None:
        compiled = self._steps.get(key)
        if compiled is None:
            return None
        pieces = pieces_from_rows(leaves, rows.rows, self._boxes[key], rows.batch_rows)
        return [place(piece, sharding) for piece, sharding in zip(pieces, compiled.input_shardings)]

    def place_ahead(self, token: int, key: Hashable, payload: OneStagePayload) -> None:
        """Place a prefetched batch's pieces on this process's devices now (beside the running step); the step that
        trains on it names ``token`` (:class:`~.batch_parts.Ahead`)."""
        placed = self.step_inputs(key, payload)
        with self._ahead_ready:
            self._ahead[token] = placed
            self._ahead_ready.notify_all()

    def step_inputs(self, key: Hashable, batch: Payload) -> tuple[list[jax.Array], int, float]:
        """The step's input arrays from what the driver sent — whole leaves, this process's
        :class:`~.batch_parts.LeafPiece` of each, arrays already placed (a prefetch, here or by :meth:`place_ahead`),
        or :class:`HostRows` to load — with the bytes received and the seconds waited for host-loaded rows."""
        compiled = self._steps[key]
        if isinstance(batch, Ahead):
            with self._ahead_ready:
                if not self._ahead_ready.wait_for(lambda: batch.token in self._ahead, self.spec.options.timeout_s):
                    raise TimeoutError(
                        f"the prefetched batch {batch.token} was not placed within {self.spec.options.timeout_s:.0f}s"
                    )
                return self._ahead.pop(batch.token)
        if isinstance(batch, HostRows):
            if self.host_loader is None:
                raise RuntimeError("a host-loaded step reached a process with no data attached")
            (loaded, leaves, prepared), waited = self.host_loader.take(batch)
            if prepared is None:
                prepared = self._prepare_rows(key, loaded, leaves)
            assert prepared is not None  # key is compiled (self._steps[key] above)
            return prepared, 0, waited
        if all(isinstance(leaf, jax.Array) for leaf in batch):
            return cast("list[jax.Array]", list(batch)), 0, 0.0
        if all(isinstance(leaf, LeafPiece) for leaf in batch):
            pieces = cast("Sequence[LeafPiece]", batch)
            return (
                [place(piece, sharding) for piece, sharding in zip(pieces, compiled.input_shardings)],
                sum(piece.nbytes for piece in pieces),
                0.0,
            )
        arrays = cast("Sequence[np.ndarray]", batch)  # a one-stage process's whole host leaves
        return (
            [put(leaf, sharding) for leaf, sharding in zip(arrays, compiled.input_shardings)],  # fitted at compile
            sum(int(np.asarray(leaf).nbytes) for leaf in arrays),
            0.0,
        )

    def run_step(
        self, key: Hashable, leaves: Payload, scalars: StepScalars, key_data: np.ndarray, start_time: float
    ) -> StepReport:
        compiled = self._steps[key]
        inputs, received, waited = self.step_inputs(key, leaves)
        begin = time.time()
        loss, aux, finite, norm, self.params, self.opt_state, self.buffers = compiled.compiled(
            self.params, self.opt_state, self.buffers, inputs, scalars, key_data
        )
        self._last = compiled
        self.steps_run += 1
        report = StepReport(updated=True, input_bytes=received, data_wait_s=waited)
        if self.lead:
            report.losses = [local_scalar(loss)]
            report.aux = {key: [local_copy(value)] for key, value in aux.items()}
            report.finite = bool(local_scalar(finite))
            report.grad_norm = local_scalar(norm)
            report.blocks = {0: [("step", 0, begin - start_time, time.time() - start_time)]}
        return report

    def apply_update(self, clip_scale: float | None) -> None:
        raise AssertionError("one-stage steps update inside their executable")

    def forward(self, key: Hashable, graph: Graph, leaves: list[np.ndarray]) -> list[HostOutput | None]:
        """The eval forward of ``graph`` on ``leaves``: each output as a host array (lead process) or its pieces."""
        from torchpar.runtime.arrays import to_host

        if key not in self._forwards:
            self._forwards[key] = self.program.compile_forward(graph)
        inputs = [put_batch(leaf, self.program.placement.input(i)) for i, leaf in enumerate(leaves)]
        outputs = self._forwards[key](self.params, self.buffers, inputs)
        return [None if o is None else (tuple(o.shape), o.dtype, to_host(o)) for o in outputs]

    def spmd_mode(self) -> str:
        return (self._last or next(iter(self._steps.values()))).spmd

    def hlo_text(self) -> dict[int, str]:
        assert self._last is not None  # read after a step compiled
        return {0: self._last.compiled.as_text() or ""} if self.lead else {}

    def memory_stats(self) -> dict[int, dict[str, int]]:
        from jaxbackend.compiler import memory_analysis

        assert self._last is not None  # read after a step compiled
        return {0: memory_analysis(self._last.compiled)} if self.lead else {}


# --- pipelines ----------------------------------------------------------------------------------------------


class PipelineWorker(Worker):
    """The stages of a pipeline plan that this process takes part in (see the module docstring)."""

    def __init__(self, spec: ExecutionSpec, rank: int, deliver: Deliver | None):
        super().__init__(spec, rank)
        plan = spec.plan
        self.ranks = spec.stage_ranks()
        trainable = set(spec.trainable)
        # the layouts and programs of the most recent step's batch shapes (at first: the example batch's); those
        # of every compiled batch signature by signature (compile)
        start = time.perf_counter()
        self.placements, self.programs = self._build(spec.stage_graphs)
        self._build_s = time.perf_counter() - start
        self._primary = (self.placements, self.programs)
        self._variants: dict[Hashable, tuple[dict[int, Placement], dict[int, StageProgram]]] = {}
        from torchpar.runtime.pipeline.interpreter import StageState

        self.states = {s: StageState() for s in self.programs}
        # one instruction list per device group: stage s runs on group s mod G (G < stages: interleaved 1F1B)
        self.num_groups = device_groups(plan.schedule, [stage.devices() for stage in plan.stages])
        self.schedule = make_schedule(
            plan.schedule, len(plan.stages), plan.num_micro_batches, virtual_stages=len(plan.stages) // self.num_groups
        )
        self.shared = gradients.shared_parameters(
            {s: [n for n in g.params if n in trainable] for s, g in enumerate(spec.stage_graphs)}
        )
        self.mailbox = Mailbox()
        self.transport = Transport(rank, self.ranks, self.mailbox, deliver, spec.options.timeout_s)
        self.host_loader = None

    def _build(self, stage_graphs: list[StageGraph]) -> tuple[dict[int, Placement], dict[int, StageProgram]]:
        """Every stage's layouts (the neighbours' too: a sender lays values out as the receiver reads them) and
        the programs of the stages this process takes part in, for ``stage_graphs``."""
        from torchpar.runtime.one_stage.placement import Placement
        from torchpar.runtime.pipeline.stage_program import StageProgram

        spec, plan = self.spec, self.spec.plan
        placements = {
            s: Placement.from_stage(
                stage_plan, graph.graph, spec.devices.jax_devices(stage_plan.devices()), spec.optimizer
            )
            for s, (graph, stage_plan) in enumerate(zip(stage_graphs, plan.stages))
        }
        programs = {
            s: StageProgram(
                graph,
                placement=placements[s],
                spec=spec.optimizer,
                trainable=set(spec.trainable),
                num_micro_batches=plan.num_micro_batches,
                library_fusions=spec.options.library_fusions,
                numerics=spec.options.numerics,
                remat=spec.options.remat,
                split_backward=plan.schedule in SPLIT_BACKWARD,
            )
            for s, graph in enumerate(stage_graphs)
            if self.rank in self.ranks[s]
        }
        return placements, programs

    def compile(
        self,
        key: Hashable,
        graph: Graph,
        trainable: tuple[str, ...],
        leaves: list[LeafSpec],
        scalars: StepScalars,
        stage_graphs: list[StageGraph] | None = None,
    ) -> CompileResult:
        """Compile every stage's executables this process takes part in (by running them on zeros), stages one
        after another in rank order so processes sharing a stage compile it together. ``stage_graphs=None``: the
        plan's own stages (built with the worker); else the stages are built again for other batch shapes and
        kept for ``key``; the state stays where it is."""
        start = time.perf_counter()
        if stage_graphs is None:
            placements, programs = self._primary
            lower_s = self._build_s
        else:
            placements, programs = self._build(stage_graphs)
            lower_s = time.perf_counter() - start
        start = time.perf_counter()
        scalars = self._optimizer_scalars(scalars, programs)
        for s, program in sorted(programs.items()):
            stage = self.states[s]
            program.warm_up(stage.params, stage.buffers, stage.opt_state, scalars)
        self._variants[key] = (placements, programs)
        return {"lower": lower_s, "xla_compile": time.perf_counter() - start}

    def _optimizer_scalars(self, scalars: StepScalars, programs: dict[int, StageProgram]) -> Scalars:
        """The optimizer's part of a step's ``scalars``; under loss scaling (``(optimizer scalars, [S, 1/S])``)
        the stages' loss seeds are set to the step's scale first."""
        optimizer_scalars, loss_scale = split_scalars(scalars, self.spec.options.loss_scaling)
        if loss_scale is not None:
            for program in programs.values():
                program.set_loss_scale(float(loss_scale[0]))
        return optimizer_scalars

    def stages(self) -> list[int]:
        return sorted(self.programs)

    def state_arrays(self) -> list[jax.Array]:
        return [
            v
            for stage in self.states.values()
            for v in [
                *stage.params.values(),
                *stage.buffers.values(),
                *(x for entries in stage.opt_state.values() for x in entries.values()),
            ]
        ]

    def programs_info(self) -> dict[int, ProgramInfo]:
        return {
            s: {
                "hlo": p.forward_hlo() + "\n" + p.backward_hlo(),
                "device_processes": [d.process_index for d in p.placement.mesh.devices.flat],
            }
            for s, p in self.programs.items()
        }

    def is_lead(self, stage: int) -> bool:
        return self.ranks[stage][0] == self.rank

    def deliver(self, key: MessageKey, payload: object) -> None:
        """A message from another process (the Ray actor's endpoint)."""
        self.mailbox.put(key, payload)

    def load(self, state: HostState | CheckpointSource) -> None:
        for s, program in self.programs.items():
            stage, placement = self.states[s], program.placement
            stage.params = {n: state.place("param", n, placement.param(n)) for n in program.stage.params}
            stage.buffers = {
                i.target: state.place("buffer", i.target, placement.replicated)
                for i in program.stage.graph.inputs
                if i.kind == "buffer"
            }
            stage.opt_state = {
                n: {k: state.place("state", (n, k), placement.state_of(n)) for k in state.opt_state[n]}
                for n in program.trainable
            }

    def update(self, state: HostState) -> None:
        for s, program in self.programs.items():
            stage, placement = self.states[s], program.placement
            stage.params.update(
                {n: state.place("param", n, placement.param(n)) for n in state.params if n in stage.params}
            )
            stage.buffers.update(
                {n: state.place("buffer", n, placement.replicated) for n in state.buffers if n in stage.buffers}
            )
            for n, entries in state.opt_state.items():
                if n in stage.opt_state:
                    stage.opt_state[n].update({k: state.place("state", (n, k), placement.state_of(n)) for k in entries})

    def export(self, kinds: tuple[str, ...] = KINDS) -> list[Exported]:
        entries = []
        for s, stage in self.states.items():
            entries += export_arrays(s, stage.params, stage.buffers, stage.opt_state, kinds)
        return entries

    def checkpoint_arrays(self) -> list[tuple[str, StateArray]]:
        first = self._first_stage_holding()
        arrays: list[tuple[str, StateArray]] = []
        for s, stage in sorted(self.states.items()):
            arrays += [(tensor_key("param", n), v) for n, v in stage.params.items() if first[n] == s]
            arrays += [(tensor_key("buffer", n), v) for n, v in stage.buffers.items() if first[n] == s]
            arrays += [
                (tensor_key("state", (n, k)), v)
                for n, entries in stage.opt_state.items()
                if first[n] == s
                for k, v in entries.items()
            ]
        return arrays

    def _first_stage_holding(self) -> dict[str, int]:
        """Each parameter's and buffer's first stage (of every process: the stage graphs are the same everywhere)."""
        first: dict[str, int] = {}
        for s, graph in enumerate(self.spec.stage_graphs):
            for name in [*graph.params, *(i.target for i in graph.graph.inputs if i.kind == "buffer")]:
                first.setdefault(name, s)
        return first

    def run_step(
        self,
        key: Hashable,
        micro_inputs: Payload,
        scalars: StepScalars,
        key_data: np.ndarray,
        start_time: float,
    ) -> StepReport:
        """Every local device group's instructions on its own thread (a group runs one stage, or its v stages
        under interleaved 1F1B), then tied gradients; the update too when no clipping needs every stage's norm
        (else the driver calls :meth:`apply_update`)."""
        from torchpar.runtime.pipeline.interpreter import run_instructions

        received, waited = 0, 0.0
        if isinstance(micro_inputs, HostRows):  # load the whole batch's leaves this process's stages read
            assert self.host_loader is not None  # attached before the driver sends rows to load
            (_, leaves, _), waited = self.host_loader.take(micro_inputs)
            needed = {i for s in self.programs for i in self.spec.stage_graphs[s].batch_inputs}
            parts = [np.split(leaf, self.spec.plan.num_micro_batches) for leaf in leaves]
            micro_inputs = [{i: parts[i][m] for i in needed} for m in range(self.spec.plan.num_micro_batches)]
        else:
            micro_inputs = cast("list[dict[int, np.ndarray]]", micro_inputs)  # a pipeline process's payload
            received = sum(int(np.asarray(leaf).nbytes) for micro in micro_inputs for leaf in micro.values())
        self.placements, self.programs = self._variants.get(key, self._primary)
        rng = jax.random.wrap_key_data(key_data)  # type: ignore[arg-type]  # jax stub: Array; takes host uint32
        self._scalars = self._optimizer_scalars(scalars, self.programs)
        self.transport.begin_step(self.steps_run)
        runs: dict[int, StageRun] = {}
        errors: list[BaseException] = []

        groups = sorted({s % self.num_groups for s in self.programs})

        def run(g: int) -> None:
            try:
                mine = [s for s in self.programs if s % self.num_groups == g]
                runs[g] = run_instructions(
                    g,
                    {s: self.programs[s] for s in mine},
                    {s: self.states[s] for s in mine},
                    self.schedule[g],
                    self.transport,
                    micro_inputs,
                    rng,
                    self._layout,
                    start_time,
                )
                if len(mine) == 1:  # else after every group's list: two stages of a group may share a parameter
                    exchange(mine[0])
            except BaseException as error:  # reported to the driver below; wake the other stages
                errors.append(error)
                self.mailbox.abort(error)

        def exchange(s: int) -> None:
            try:
                stage = self.states[s]
                stage.grads = gradients.exchange_tied_gradients(
                    s, stage.grads or {}, self.shared, self.transport, self._grad_layout
                )
            except BaseException as error:
                errors.append(error)
                self.mailbox.abort(error)

        self._run_threads(run, groups, "stage")
        if len(self.programs) > len(groups) and not errors:
            self._run_threads(exchange, sorted(self.programs), "tied")
        if errors:
            raise errors[0]
        self.steps_run += 1
        report = StepReport(input_bytes=received, data_wait_s=waited)
        last = len(self.spec.plan.stages) - 1
        for s, result in runs.items():  # by device group (group g's first stage is stage g)
            if self.is_lead(s):
                report.blocks[s] = result.blocks
                report.spans[s] = result.spans
                for aux_key, values in result.aux.items():
                    report.aux[aux_key] = [local_copy(values[m]) for m in sorted(values)]
                if s == last % self.num_groups:
                    report.losses = [local_scalar(loss) for loss in result.losses]
                    report.loss_dens = [local_scalar(den) for den in result.dens]
                    if result.reference is not None:
                        report.loss_reference = local_scalar(result.reference)
        options = self.spec.options
        # a ratio loss's gradients are finished by the driver: M·r/D needs every micro-batch's denominator
        ratio = MicroBatchLoss.of(self.spec.stage_graphs[-1].graph).is_ratio
        for s, program in self.programs.items():  # the pre-clip norm, reported every step (and clipped by)
            norm = gradients.owned_squared_norm(s, self.states[s].grads or {}, self.shared, program.squared_norm)
            if self.is_lead(s):
                report.squared_norms[s] = norm
        if options.grad_clip_norm is None and not options.check_finite and not ratio:
            self.apply_update(1.0)
            report.updated = True
            return report
        if options.check_finite:
            for s, program in self.programs.items():
                count = gradients.owned_nonfinite_count(
                    s, self.states[s].grads or {}, self.shared, program.nonfinite_count
                )
                if self.is_lead(s):
                    report.nonfinite[s] = count
        return report

    @staticmethod
    def _run_threads(target: Callable[[int], None], items: list[int], name: str) -> None:
        threads = [threading.Thread(target=target, args=(i,), name=f"torchpar-{name}-{i}", daemon=True) for i in items]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def apply_update(self, clip_scale: float | None) -> None:
        """Apply the optimizer once on every local stage with its final gradients times ``clip_scale`` (and the
        optimizer scalars of the step that computed them); ``None`` skips the update (a non-finite step)."""
        for s, program in self.programs.items():
            stage = self.states[s]
            if program.trainable and clip_scale is not None:
                stage.params, stage.opt_state = program.update(
                    stage.params, stage.grads or {}, stage.opt_state, self._scalars, clip_scale
                )
            stage.grads = None

    def _layout(self, stage: int, name: str) -> jax.sharding.Sharding:
        return self.placements[stage].value(name)

    def _grad_layout(self, stage: int, name: str) -> jax.sharding.Sharding:
        return self.placements[stage].param(name)

    def hlo_text(self) -> dict[int, str]:
        return {s: p.forward_hlo() for s, p in self.programs.items() if self.is_lead(s)}

    def memory_stats(self) -> dict[int, dict[str, int]]:
        return {s: p.memory_stats() for s, p in self.programs.items() if self.is_lead(s)}


def make_worker(spec: ExecutionSpec, rank: int, deliver: Deliver | None = None) -> Worker:
    """The worker of process ``rank`` for ``spec``."""
    if spec.is_pipeline:
        return PipelineWorker(spec, rank, deliver)
    return OneStageWorker(spec, rank)

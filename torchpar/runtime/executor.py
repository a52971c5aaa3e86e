"""The executor seam: how a plan runs, behind one interface.

An :class:`Executor` is built from an :class:`~.worker.ExecutionSpec` (the plan, the stage graphs, the
optimizer spec, run options) and answers

- ``load_state(HostState)`` / ``export_state() → HostState``: the training state in and out, as host arrays;
- ``save_shards(directory) → manifest`` / ``load_checkpoint(directory, tensors)``: the state to and from a sharded
  checkpoint on disk, every worker writing and reading its own shards (:mod:`.checkpoint_io`);
- ``compile(key, graph, trainable, leaves, scalars, stage_graphs)``: the step of batch signature ``key``, for
  every kind of plan (a one-stage plan's one fused step; a pipeline's stages, cut again for other batch shapes);
- ``step(key, leaves, scalars, key_data) → StepResult``: one optimizer step on a batch (host arrays): the
  loss, a ``step_fn``'s aux values, and whether the step was finite (with ``RunOptions.check_finite`` a non-finite
  step is skipped);
- ``forward(key, graph, leaves) → outputs``: the eval forward;
- ``hlo_text()`` (in stage order), ``memory_stats()`` (by stage index), ``describe_workers()``, ``spmd_mode``,
  ``last_timeline``;
- ``close()``: free everything it started (also a context manager).

Implementations differ only in where the workers (:mod:`.worker`) live: :class:`LocalExecutor` holds one
in this process, over all its devices; ``RayExecutor`` (:mod:`torchpar.runtime.ray.ray_executor`) one per host actor.
The driver-side logic of a step — splitting micro-batches, clipping across stages, the loss, the timeline
— is here, once.
"""

from __future__ import annotations

import logging
import math
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np

from torchpar.ir.graph import Graph
from torchpar.ir.optimizer import Scalars
from torchpar.planner.pipeline.slicing import StageGraph
from torchpar.runtime.aux_parts import combine_blocks
from torchpar.runtime.batch_parts import HostBatch, HostRows, Index, cut, pipeline_leaves, rows_of
from torchpar.runtime.micro_batch_loss import MicroBatchLoss, gradient_factor, whole_batch_loss
from torchpar.runtime.pipeline import gradients
from torchpar.runtime.pipeline.timeline import StepTimeline
from torchpar.runtime.state import HostState, collect_state
from torchpar.runtime.train_step import LossScale, StepScalars
from torchpar.runtime.worker import (
    ExecutionSpec,
    HostOutput,
    LeafSpec,
    OneStageWorker,
    Payload,
    StepReport,
    Worker,
)

if TYPE_CHECKING:
    from torchpar.runtime.checkpoint_io import TensorEntry
    from torchpar.runtime.host_loading import DataFactory

R = TypeVar("R")
"""What a worker call returns (each worker's answer, in rank order)."""

T = TypeVar("T")
"""A worker's answer for one stage."""

log = logging.getLogger(__name__)

_open_executors: weakref.WeakSet[Executor] = weakref.WeakSet()


def open_executors() -> list[Executor]:
    """Executors of this process not closed yet (what holds Ray actors and CPUs)."""
    return [e for e in list(_open_executors) if not e.closed]


def close_all() -> int:
    """Close every open executor of this process; returns how many were closed."""
    executors = open_executors()
    for executor in executors:
        executor.close()
    return len(executors)


@dataclass(frozen=True)
class StepResult:
    """What one step reports to the driver."""

    loss: float
    """The whole batch's loss (before the update): the micro-batch losses combined as the loss's reduction says
    (:mod:`.micro_batch_loss`)."""
    finite: bool = True
    """The loss and every gradient element were finite. With ``check_finite`` a non-finite step left the
    parameters, optimizer state (and, one-stage plans, buffers) as they were."""
    nonfinite_gradients: int = 0
    """Pipelines: how many gradient elements were inf/nan (one-stage steps do not count them on the host)."""
    grad_norm: float | None = None
    """The global L2 norm of the whole batch's gradients before clipping (``clip_grad_norm_``'s return value)."""
    aux: dict[str, np.ndarray] = field(default_factory=dict)
    """A ``step_fn``'s aux values, the whole batch's, as host arrays (:mod:`.aux_parts`)."""


class ExecutorClosedError(RuntimeError):
    """The executor was closed (by the user, or after a failure stopped its workers)."""


class Executor:
    """One plan's execution (see the module docstring); subclasses provide :meth:`_call`."""

    kind = "abstract"

    def __init__(self, spec: ExecutionSpec, label: str = ""):
        self.spec = spec
        self.label = label or spec.plan.method
        self.created = time.strftime("%H:%M:%S")
        self.closed = False
        self._closed_reason = "it was closed"
        self._state_names: dict[str, list[str]] = {}
        self._unheld = HostState()
        self._spmd = "pipeline" if spec.is_pipeline else "gspmd"
        self._timeline: StepTimeline | None = None
        self._warned_spmd = False
        self.timings: dict[str, float] = {}
        """Seconds of the executor's own set-up phases (e.g. starting and joining Ray host actors)."""
        self._boxes: dict[Hashable, list[list[Index]]] = {}
        self.last_input_bytes: list[int] = []
        """Bytes of batch data each process (by rank) received for the last step (0 for host-loaded data)."""
        self.last_data_wait_s = 0.0
        """Seconds the last step waited for host-loaded rows (the slowest process)."""
        _open_executors.add(self)

    # --- the calls to workers (subclasses) ------------------------------------------------------------------

    def _call(self, method: Callable[..., R], *args: object, what: str, timeout_s: float | None = None) -> list[R]:
        """``worker.method(*args)`` on every worker, results in rank order; raises if any fails. ``method`` is a
        method of :class:`~torchpar.runtime.worker.Worker` (``Worker.load``): referenced, not named by a string, so
        a reader and a type checker cross the seam; each worker runs its own class's override of it."""
        raise NotImplementedError

    def _call_ranks(
        self, method: Callable[..., R], args_by_rank: Sequence[tuple], what: str, timeout_s: float | None = None
    ) -> list[R]:
        """``worker.method(*args_by_rank[r])`` on every worker ``r`` (each its own arguments), results in rank
        order; raises if any fails."""
        raise NotImplementedError

    def _release(self) -> None:
        """Free what the executor started (workers, actors)."""

    # --- state ------------------------------------------------------------------------------------------------

    def load_state(self, state: HostState) -> None:
        """Place ``state`` on the workers. Entries no stage reads (a pipeline's unused buffer, a parameter
        outside the loss's graph) stay here as host arrays and come back unchanged from :meth:`export_state`."""
        self._check_open()
        self._state_names = {n: list(entries) for n, entries in state.opt_state.items()}
        params, buffers = self._held_names()
        self._unheld = HostState(
            params={n: v for n, v in state.params.items() if n not in params},
            buffers={n: v for n, v in state.buffers.items() if n not in buffers},
            opt_state={n: e for n, e in state.opt_state.items() if n not in params},
        )
        self._call(Worker.load, state, what="loading the training state")

    def update_state(self, state: HostState) -> None:
        """Replace the entries ``state`` holds (a subset of the parameters, buffers and optimizer state, as host
        arrays) on the workers that hold them, each laid out as the plan lays it out; nothing else moves."""
        self._check_open()
        self._unheld.params.update({n: v for n, v in state.params.items() if n in self._unheld.params})
        self._unheld.buffers.update({n: v for n, v in state.buffers.items() if n in self._unheld.buffers})
        for n, entries in state.opt_state.items():
            if n in self._unheld.opt_state:
                self._unheld.opt_state[n].update(entries)
        self._call(Worker.update, state, what="updating the training state")

    def export_state(self, kinds: tuple[str, ...] = ("param", "buffer", "state")) -> HostState:
        """The state as host arrays on this process (all of it: for checkpoints of large models see
        :meth:`save_shards`); ``kinds`` picks parameters, buffers and optimizer state (``"state"``)."""
        self._check_open()
        entries = [
            entry for part in self._call(Worker.export, kinds, what="exporting the training state") for entry in part
        ]
        state = collect_state(entries)
        state.params = {**self._unheld.params, **state.params} if "param" in kinds else {}
        state.buffers = {**self._unheld.buffers, **state.buffers} if "buffer" in kinds else {}
        state.opt_state = (
            {n: state.opt_state.get(n, self._unheld.opt_state.get(n, {})) for n in self._state_names}
            if "state" in kinds
            else {}
        )
        return state

    def save_shards(self, directory: str) -> dict[str, Any]:
        """Every worker writes the pieces of the state it holds into ``directory`` (in parallel, one file per
        device), the driver the entries no worker holds; returns the merged manifest (:mod:`.checkpoint_io`)."""
        from torchpar.runtime.checkpoint_io import merge_manifests, tensor_key, write_shards

        self._check_open()
        manifests = self._call(
            Worker.save_shards, directory, what="writing the checkpoint's shards", timeout_s=self.compile_timeout_s
        )
        unheld = [
            *((tensor_key("param", n), v) for n, v in self._unheld.params.items()),
            *((tensor_key("buffer", n), v) for n, v in self._unheld.buffers.items()),
            *((tensor_key("state", (n, k)), v) for n, e in self._unheld.opt_state.items() for k, v in e.items()),
        ]
        if unheld:
            manifests.append(write_shards(directory, [(k, np.asarray(v)) for k, v in unheld], writer="driver"))
        return merge_manifests(manifests)

    def load_checkpoint(self, directory: str, tensors: dict[str, TensorEntry]) -> list[dict[str, int]]:
        """Load the state from a sharded checkpoint: each worker reads the slices its devices hold under this plan
        (``tensors``: the index's entries, names checked by the caller); entries no worker holds are read here.
        Returns each worker's ``{"rank", "bytes_read"}``."""
        from torchpar.runtime.checkpoint_io import CheckpointSource, ShardReader, tensor_key

        self._check_open()
        with ShardReader(directory, tensors) as reader:
            source = CheckpointSource(reader)
            self._state_names = {n: list(keys) for n, keys in source.opt_state.items()}
            params, buffers = self._held_names()
            read = lambda kind, name: reader.read(tensor_key(kind, name))
            self._unheld = HostState(
                params={n: read("param", n) for n in source.params if n not in params},
                buffers={n: read("buffer", n) for n in source.buffers if n not in buffers},
                opt_state={
                    n: {k: read("state", (n, k)) for k in keys}
                    for n, keys in source.opt_state.items()
                    if n not in params
                },
            )
        return self._call(
            Worker.load_checkpoint, directory, tensors, what="loading the checkpoint", timeout_s=self.compile_timeout_s
        )

    def _held_names(self) -> tuple[set[str] | _Everything, set[str] | _Everything]:
        """Names of the parameters and buffers some worker holds (one-stage plans: all of them)."""
        if not self.spec.is_pipeline:
            return _Everything(), _Everything()
        params = {n for graph in self.spec.stage_graphs for n in graph.params}
        buffers = {i.target for graph in self.spec.stage_graphs for i in graph.graph.inputs if i.kind == "buffer"}
        return params, buffers

    # --- compilation ----------------------------------------------------------------------------------------

    def compile(
        self,
        key: Hashable,
        graph: Graph,
        trainable: tuple[str, ...],
        leaves: list[LeafSpec],
        scalars: StepScalars,
        stage_graphs: list[StageGraph] | None = None,
    ) -> dict[str, float]:
        """Compile the step for batch signature ``key`` on every worker (:meth:`.worker.Worker.compile`: ``graph``
        captured on one micro-batch, ``leaves`` the whole batch's ``(shape, dtype)``, ``stage_graphs`` a pipeline's
        stages for other batch shapes or ``None``); later :meth:`step` calls on ``key`` run it. Returns phase
        seconds (``lower``, ``xla_compile``)."""
        self._check_open()
        if self.spec.is_pipeline and self.spec.options.spmd != "auto" and not self._warned_spmd:
            log.warning(
                "torchpar: spmd=%r is ignored by pipelines (their stages run under GSPMD)", self.spec.options.spmd
            )
            self._warned_spmd = True
        results = self._call(
            Worker.compile,
            key,
            graph,
            trainable,
            leaves,
            scalars,
            stage_graphs,
            what="compiling the step",
            timeout_s=self.compile_timeout_s,
        )
        result = results[0]
        if not self.spec.is_pipeline:
            self._boxes[key] = [r["input_boxes"] for r in results]
        self._spmd = result.get("spmd", self._spmd)
        return {"lower": result["lower"], "xla_compile": result["xla_compile"]}

    # --- the batch each process receives ----------------------------------------------------------------------

    def payloads(self, key: Hashable, batch: Sequence[np.ndarray] | HostBatch) -> list[Payload]:
        """What each process receives for a step on ``batch`` (whole host leaves, or a host-loaded step's
        :class:`HostBatch`), by rank: one-stage plans, each leaf's piece its devices hold
        (:class:`~.batch_parts.LeafPiece`) or, host-loaded, the rows to load (:class:`~.batch_parts.HostRows`);
        pipelines, each micro-batch's leaves its stages read, or the whole batch's rows to load."""
        ranks = range(self.num_ranks)
        if isinstance(batch, HostBatch):
            return [self._host_rows(key, batch, rank) for rank in ranks]
        if self.spec.is_pipeline:
            micro = split_micro_batches(batch, self.spec.plan.num_micro_batches)
            return [[{i: m[i] for i in self._pipeline_leaves(rank)} for m in micro] for rank in ranks]
        return [[cut(leaf, box) for leaf, box in zip(batch, boxes)] for boxes in self._boxes[key]]

    def _host_rows(self, key: Hashable, batch: HostBatch, rank: int) -> HostRows:
        def span(step_key: Hashable, rows: int) -> tuple[int, int]:
            boxes = self._boxes.get(step_key)
            return (0, rows) if self.spec.is_pipeline or boxes is None else rows_of(boxes[rank])

        first = span(key, len(batch.indices))
        ahead = tuple(
            (
                step,
                step_key,
                span(step_key, len(indices)),
                tuple(indices[slice(*span(step_key, len(indices)))]),
                len(indices),
            )
            for step, step_key, indices in batch.ahead
        )
        return HostRows(
            step=batch.step,
            key=key,
            batch_rows=len(batch.indices),
            rows=first,
            indices=tuple(batch.indices[first[0] : first[1]]),
            ahead=ahead,
        )

    def _pipeline_leaves(self, rank: int) -> set[int]:
        stages = [s for s, members in self.spec.stage_ranks().items() if rank in members]
        return pipeline_leaves({s: g.batch_inputs for s, g in enumerate(self.spec.stage_graphs)}, stages)

    @property
    def num_ranks(self) -> int:
        """How many worker processes run the plan."""
        return 1

    def _await_prepared(self, prepared: Prepared) -> None:
        """Wait for the calls placing a prefetched batch (host actors); raises what they raised."""

    def attach_data(self, factory: DataFactory, depth: int) -> None:
        """Host-loaded training: every process loads its own rows with ``factory`` (``torchpar.HostData``),
        ``depth`` steps ahead."""
        self._check_open()
        self._call(Worker.attach_data, factory, depth, what="attaching the host-loaded data")

    @property
    def compile_timeout_s(self) -> float:
        return 1800.0

    # --- running ----------------------------------------------------------------------------------------------

    def prepare(self, key: Hashable, leaves: Sequence[np.ndarray]) -> Prepared:
        """A driver-fed batch made ready ahead of its step (``engine.prefetch``; safe on another thread): each
        process's payload, already on the devices in this process (local runtime) or in Ray's object store."""
        return Prepared(self.payloads(key, leaves))

    def step(
        self,
        key: Hashable,
        leaves: list[np.ndarray] | HostBatch | Prepared,
        scalars: StepScalars,
        key_data: np.ndarray,
    ) -> StepResult:
        """One optimizer step on the batch ``leaves``: the whole batch's loss (and aux values) and whether it was
        finite. A pipeline's micro-batch losses are combined here (:func:`.micro_batch_loss.whole_batch_loss`), as are
        its aux values (:func:`.aux_parts.combine_blocks`), and a ratio loss's gradients multiplied by ``M·r/D`` in
        the update (and in the clipping norm)."""
        self._check_open()
        start = time.time()
        if isinstance(leaves, Prepared):
            self._await_prepared(leaves)
        payloads = leaves.payloads if isinstance(leaves, Prepared) else self.payloads(key, leaves)
        reports: list[StepReport] = self._call_ranks(
            Worker.run_step, [(key, payload, scalars, key_data, start) for payload in payloads], what="running the step"
        )
        self.last_input_bytes = [r.input_bytes for r in reports]
        self.last_data_wait_s = max(r.data_wait_s for r in reports)
        losses = [loss for r in reports for loss in r.losses]
        if not losses:
            raise AssertionError("no worker reported the loss")
        loss, factor = float(np.mean(losses)), 1.0
        if self.spec.is_pipeline:
            kind = MicroBatchLoss.of(self.spec.stage_graphs[-1].graph).kind
            dens = [d for r in reports for d in r.loss_dens]
            loss = whole_batch_loss(kind, losses, dens)
            if kind == "ratio":
                reference = next(r.loss_reference for r in reports if r.losses)
                factor = gradient_factor(self.spec.plan.num_micro_batches, reference, dens)
        nonfinite = sum(v for r in reports for v in r.nonfinite.values())
        finite = all(r.finite for r in reports) and nonfinite == 0 and math.isfinite(loss)
        # under loss scaling the gradients are S times the true ones (scalars: (optimizer scalars, [S, 1/S])); a ratio
        # loss's accumulated gradients times M·r/D are the whole batch's: the true gradients are computed × unscale
        loss_scaled = cast("tuple[Scalars, LossScale]", scalars) if self.spec.options.loss_scaling else None
        unscale = float(loss_scaled[1][1]) if loss_scaled is not None else 1.0
        unscale *= factor
        squares = [v * unscale * unscale for r in reports for v in r.squared_norms.values()]
        norms = [r.grad_norm for r in reports if r.grad_norm is not None]
        grad_norm = norms[0] if norms else (math.sqrt(max(sum(squares), 0.0)) if squares else None)
        if not all(r.updated for r in reports):
            scale: float | None = None
            if finite or not self.spec.options.check_finite:
                # clip by the true norm (GradScaler's unscale_ before clip_grad_norm_)
                clip = self.spec.options.grad_clip_norm
                scale = (gradients.clip_scale(squares, clip) if clip is not None else 1.0) * unscale
            self._call(Worker.apply_update, scale, what="applying the optimizer update")
        blocks = {s: b for r in reports for s, b in r.blocks.items()}
        spans = {s: b for r in reports for s, b in r.spans.items()}
        stages = range(self._timeline_rows())  # one row per device group (fewer than stages: interleaved 1F1B)
        self._timeline = StepTimeline(
            blocks=[blocks.get(s, []) for s in stages],
            makespan=time.time() - start,
            spans=[spans.get(s, []) for s in stages],
        )
        parts = {key: values for r in reports for key, values in r.aux.items()}
        if self.spec.is_pipeline:
            aux = combine_blocks(self._aux_rules(), parts)
        else:
            aux = {key: values[0] for key, values in parts.items()}
        return StepResult(loss=loss, finite=finite, nonfinite_gradients=nonfinite, grad_norm=grad_norm, aux=aux)

    def _aux_rules(self) -> dict[str, str]:
        """A pipeline's aux keys → their combination rules (:mod:`torchpar.ir.aux_parts`), from its stages."""
        return {o.target: o.combine for stage in self.spec.stage_graphs for o in stage.graph.outputs if o.kind == "aux"}

    def forward(self, key: Hashable, graph: Graph, leaves: list[np.ndarray]) -> list[np.ndarray | None]:
        """Eval-mode outputs of ``graph`` (a forward capture) on ``leaves``, as host arrays."""
        self._check_open()
        if self.spec.is_pipeline:
            return self._forward_on_driver(graph, leaves)
        from torchpar.runtime.arrays import assemble

        results = self._call(
            Worker.forward, key, graph, leaves, what="running the forward", timeout_s=self.compile_timeout_s
        )
        outputs: list[np.ndarray | None] = []
        for index, first in enumerate(results[0]):
            if first is None:
                outputs.append(None)
                continue
            shape, dtype, payload = first
            if isinstance(payload, np.ndarray):
                outputs.append(payload)
                continue
            # every process has output `index` of the same graph: none is None where the first is not
            pieces = [piece for result in results for piece in cast(HostOutput, result[index])[2]]
            outputs.append(assemble(shape, dtype, pieces))
        return outputs

    def _forward_on_driver(self, graph: Graph, leaves: list[np.ndarray]) -> list[np.ndarray | None]:
        """A pipeline's eval forward: the whole graph on this process's default device, with the state
        exported from the stages (pipelines compile no eval program of their own)."""
        import jax

        from jaxbackend.lower import lower

        state = self.export_state()
        run = lower(graph, numerics=self.spec.options.numerics)
        outputs, _ = jax.jit(lambda p, b, i: run(p, b, i, jax.random.key(0)))(state.params, state.buffers, leaves)
        return [None if o is None else np.asarray(o) for o in outputs]

    # --- inspection -------------------------------------------------------------------------------------------

    def hlo_text(self) -> list[str]:
        """Optimized HLO of each stage's (forward) executable, in stage order."""
        return self._per_stage(Worker.hlo_text, "reading HLO")

    def memory_stats(self) -> dict[int, dict[str, int]]:
        """XLA's per-device memory analysis of each stage's executables, keyed by stage index (from each
        stage's lead process)."""
        return self._by_stage(Worker.memory_stats, "reading memory statistics")

    def describe_workers(self, programs: bool = False) -> list[dict[str, object]]:
        """Each worker's own account of itself (process, devices, stages, steps run; with ``programs`` the HLO
        it runs and its device assignment), in rank order (:meth:`.worker.Worker.describe`)."""
        self._check_open()
        return self._call(Worker.describe, programs, what="describing the workers")

    def _per_stage(self, method: Callable[..., dict[int, T]], what: str) -> list[T]:
        return list(self._by_stage(method, what).values())

    def _by_stage(self, method: Callable[..., dict[int, T]], what: str) -> dict[int, T]:
        """Every worker's ``{stage: answer}`` merged, in stage order."""
        self._check_open()
        merged: dict[int, T] = {}
        for result in self._call(method, what=what):
            merged.update(result)
        return {s: merged[s] for s in sorted(merged)}

    @property
    def spmd_mode(self) -> str:
        """``"shard_map"`` / ``"gspmd"`` / ``"single_device"`` for one-stage plans (of the last compiled step),
        ``"pipeline"``."""
        return self._spmd

    def _timeline_rows(self) -> int:
        """The device groups of a pipeline's stages (its stages but under interleaved 1F1B); 1 for one-stage plans."""
        from torchpar.planner.pipeline.schedules import device_groups

        return device_groups(self.spec.plan.schedule, [stage.devices() for stage in self.spec.plan.stages])

    @property
    def last_timeline(self) -> StepTimeline | None:
        """Measured compute blocks of each stage in the last step, and where the rest of its time went
        (:meth:`~torchpar.runtime.pipeline.timeline.StepTimeline.breakdown`)."""
        return self._timeline

    # --- lifecycle ----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the workers; the executor is unusable afterwards. Idempotent."""
        if self.closed:
            return
        self.closed = True
        _open_executors.discard(self)
        self._release()

    def _stop(self, reason: str) -> None:
        """Close after a failure; later calls say why."""
        self._closed_reason = reason
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise ExecutorClosedError(f"this engine's executor is closed ({self._closed_reason}); compile again")

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def summary(self) -> str:
        return f"{type(self).__name__}({self.label}, created {self.created})"


class LocalExecutor(Executor):
    """Every worker call in this process, on its own JAX devices (the local runtime)."""

    kind = "local"

    def __init__(self, spec: ExecutionSpec, label: str = ""):
        super().__init__(spec, label)
        from torchpar.runtime.worker import make_worker

        self.worker = make_worker(spec, rank=0)

    def _call(self, method: Callable[..., R], *args: object, what: str, timeout_s: float | None = None) -> list[R]:
        return [getattr(self.worker, method.__name__)(*args)]

    def _call_ranks(
        self, method: Callable[..., R], args_by_rank: Sequence[tuple], what: str, timeout_s: float | None = None
    ) -> list[R]:
        return [getattr(self.worker, method.__name__)(*args_by_rank[0])]

    def prepare(self, key: Hashable, leaves: Sequence[np.ndarray]) -> Prepared:
        payload = self.payloads(key, leaves)[0]
        if self.spec.is_pipeline:
            return Prepared([payload])
        worker = cast(OneStageWorker, self.worker)  # not a pipeline: the one-stage worker
        return Prepared([worker.step_inputs(key, payload)[0]])  # placed on the devices now

    def _release(self) -> None:
        if self.worker is not None:
            self.worker.detach_data()
        self.worker = None  # type: ignore[assignment]  # a closed executor drops its worker; every call checks `closed` first


@dataclass(frozen=True)
class Prepared:
    """A driver-fed batch made ready ahead of its step (:meth:`Executor.prepare`): each process's payload, and the
    calls placing it that the step must see finished (host actors, by rank)."""

    payloads: Sequence[object]
    """Each process's payload (:data:`~.worker.Payload`), or a reference to it in Ray's object store."""
    pending: dict[int, object] | None = None


class _Everything:
    """A set containing every name."""

    def __contains__(self, name: object) -> bool:
        return True


def split_micro_batches(leaves: Sequence[np.ndarray], num_micro_batches: int) -> list[dict[int, np.ndarray]]:
    """Split every batch leaf along dim 0 into ``num_micro_batches`` equal parts."""
    for index, leaf in enumerate(leaves):
        if leaf.ndim == 0 or leaf.shape[0] % num_micro_batches:
            raise ValueError(
                f"batch leaf {index} of shape {list(leaf.shape)} cannot be split into "
                f"{num_micro_batches} equal micro-batches along dim 0"
            )
    parts = [np.split(leaf, num_micro_batches) for leaf in leaves]
    return [{i: parts[i][m] for i in range(len(leaves))} for m in range(num_micro_batches)]

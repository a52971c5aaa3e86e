"""The last stage of ``torchpar.capture(...).plan(method).compile()``: a planned step
(:mod:`torchpar.engine.step_capture`) handed to an executor (:mod:`torchpar.runtime`) and compiled.

:class:`CompiledTraining` starts the executor's workers with the state and compiles the step on the planned capture
when built, and again per new batch signature (capture, cut the plan's stages out of the new graph, compile); the
plan is made once. Every method takes the same road: a one-stage plan is a pipeline of one stage, and what differs
lives under the planner's and the executor's doors.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from torchpar import checkpoint as _checkpoint
from torchpar import compile_cache
from torchpar.capture.export import Capture
from torchpar.capture.module_state import CapturedState, NumberAttribute
from torchpar.capture.optimizer import TorchOptimizerBridge
from torchpar.cluster import current_cluster
from torchpar.engine import batches
from torchpar.engine.guard import StepGuard
from torchpar.engine.host_arrays import jax_dtype, to_torch
from torchpar.engine.model_link import Tracked, pull_holders
from torchpar.engine.step_capture import PlannedStep, StepCapture
from torchpar.ir.graph import Graph, Ref, TensorMeta
from torchpar.ir.optimizer import step_scalars
from torchpar.planner.plan import Plan
from torchpar.planner.training_plan import TrainingPlan
from torchpar.progress import CompilePhases

if TYPE_CHECKING:
    from torchpar.runtime.executor import Executor
    from torchpar.runtime.loss_scale import LossScaler

log = logging.getLogger(__name__)


class CompiledTraining:
    """A planned training step (:class:`~torchpar.engine.step_capture.PlannedStep`) compiled per batch signature, and
    the executor running it: the last stage of ``torchpar.capture(...).plan(method).compile()``.

    ``signature`` keys are :func:`torchpar.engine.batches.signature` of a whole batch; every graph held is captured on
    one part of it (:class:`~torchpar.engine.step_capture.BatchParts`). ``timings`` gathers each phase's seconds for
    ``plan.timings`` (the step capture's own dict). On failure while building, the workers already started are
    freed."""

    def __init__(self, step: StepCapture, planned: PlannedStep, *, guard: StepGuard, loss_scaler: LossScaler | None):
        self.step, self.guard, self._loss_scaler = step, guard, loss_scaler
        self.model, self.optimizer, self.options = step.model, step.optimizer, step.options
        self.parts = planned.parts
        """How each batch is cut (micro-batches × data replicas along dim 0): the graphs are one part's."""
        self.example_signature = batches.signature(step.example_batch)
        self.timings = step.timings
        self.step_graphs: dict[tuple, Graph] = {}
        """Batch signature → the training graph its compiled step runs."""
        self._captures: dict[tuple, Capture] = {}
        self._eval: dict[tuple, Capture] = {}
        self._dtypes: dict[tuple, tuple[Capture, torch.dtype, dict[str, torch.dtype] | None]] = {}
        """Per batch signature: the capture and the PyTorch dtypes of what a step returns (:meth:`returned`)."""
        self._diagnosed: dict[tuple, Graph] = {}
        self.planned: TrainingPlan = planned.training
        self.executor: Executor | None = None
        try:
            self._build(planned.capture)
        except BaseException:
            self.close()
            raise

    def _build(self, capture: Capture) -> None:
        from torchpar.runtime import build_executor
        from torchpar.runtime.devices import DeviceMap
        from torchpar.runtime.worker import ExecutionSpec

        phases = CompilePhases(("start workers", "XLA compile"), "compiling the training step")
        try:
            with self.translating_failures("compiling the training step"):
                log.info("torchpar: plan %s (engine.plan.summary() lists every layout)", self.plan.headline())
                log.debug("torchpar plan:\n%s", self.plan.summary())
                with phases.phase("start workers"):
                    start = time.perf_counter()
                    cluster = current_cluster()
                    spec = ExecutionSpec(
                        plan=self.plan,
                        optimizer=self.bridge.spec,
                        devices=DeviceMap(cluster.devices_per_host),
                        options=self._run_options(),
                        stage_graphs=self.planned.stage_graphs,
                        trainable=tuple(sorted(self.planned.trainable)),
                    )
                    self.executor = executor = build_executor(spec, cluster, label=self.plan.method)
                    self.timings.update(executor.timings)
                    pull_holders(t.tensor for t in self.tracked.values())  # what other engines trained newer
                    executor.load_state(_checkpoint.torch_state(self.params, self.buffers, self.bridge))
                    self.timings["start_workers"] = time.perf_counter() - start
                with phases.phase("XLA compile"):
                    self._compile(self.example_signature, capture)
        finally:
            phases.close()

    def _run_options(self) -> Any:
        from torchpar.runtime.worker import RunOptions

        return RunOptions(
            grad_clip_norm=self.options.grad_clip_norm,
            library_fusions=self.options.xla_library_fusions,
            spmd=self.options.spmd,
            timeout_s=current_cluster().timeout_s,
            check_finite=self.options.on_nonfinite != "ignore" or self._loss_scaler is not None,
            numerics=self.step.numerics,
            loss_scaling=self._loss_scaler is not None,
            remat=self.plan.remat,
        )

    @property
    def plan(self) -> Plan:
        assert self.planned is not None, "the plan is made while building"
        return self.planned.plan

    @property
    def bridge(self) -> TorchOptimizerBridge:
        assert self.step.bridge is not None, "the optimizer bridge is built with the first capture"
        return self.step.bridge

    @property
    def tracked(self) -> dict[str, Tracked]:
        """Every state tensor the executor holds a copy of, by name (:attr:`StepCapture.tracked`)."""
        return self.step.tracked

    @property
    def captured_state(self) -> CapturedState:
        return self.step.state

    @property
    def numbers(self) -> tuple[NumberAttribute, ...]:
        return self.step.numbers

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """:attr:`StepCapture.params`: the parameters the executor holds by name."""
        return self.step.params

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """:attr:`StepCapture.buffers`: the buffers the executor holds by name."""
        return self.step.buffers

    # --- per batch signature -----------------------------------------------------------------------------------

    def ensure_compiled(self, signature: tuple, batch: Any) -> bool:
        """Compile the step for ``batch``'s signature if it has none yet (the plan stays as it is); whether it did."""
        if signature in self.step_graphs:
            return False
        log.info("torchpar: new batch shapes %s, recompiling the training step", batches.describe(signature))
        self._compile(signature, self.capture(self.first_part(batch)))
        return True

    def _compile(self, signature: tuple, capture: Capture) -> None:
        assert self.planned is not None and self.executor is not None
        try:
            stage_graphs = self.planned.stage_graphs_for(capture.graph)
        except ValueError as error:
            raise ValueError(
                f"batch shapes {batches.describe(signature)}: {error} {batches.describe(self.example_signature)}"
            ) from None
        # the graph is one part's (micro-batch of a data replica); the step takes the whole batch (parts along dim 0)
        leaves = [((m.shape[0] * self.parts.count, *m.shape[1:]), jax_dtype(m.dtype)) for m in capture.input_metas]
        hits = compile_cache.hits()
        with self.translating_failures("compiling the training step"):
            timings = self.executor.compile(
                signature,
                capture.graph,
                self.trainable(capture.graph),
                leaves,
                self.with_loss_scale(self.first_step_scalars()),
                stage_graphs,
            )
        self.timings.update(timings)
        loaded = compile_cache.hits() - hits  # this process's executables only (Ray host actors count their own)
        if loaded:
            log.info(
                "torchpar: %d executable(s) of the step for batch shapes %s loaded from the compile cache %s "
                "(XLA compile %.2fs)",
                loaded,
                batches.describe(signature),
                compile_cache.cache_dir(),
                timings.get("xla_compile", 0.0),
            )
        self._captures[signature] = capture
        self.guard.learn(signature, capture.graph)
        self.step_graphs[signature] = capture.graph

    def first_part(self, batch: Any) -> Any:
        """The part of ``batch`` the step's graph is captured on (:meth:`BatchParts.first`)."""
        return self.parts.first(batch)

    def capture(self, batch: Any) -> Capture:
        """The training graph on ``batch`` (one part): :meth:`StepCapture.capture`."""
        return self.step.capture(batch, self.parts)

    def returned(self, signature: tuple, result: Any) -> Any:
        """What ``engine.step`` returns for the executor's ``result`` of a step on a batch of ``signature``: the whole
        batch's loss as a 0-d CPU tensor of the loss's dtype, and, if the ``step_fn`` returned ``(loss, aux)``, the
        pair ``(loss, aux)`` with every aux value a CPU tensor of the dtype it had in PyTorch (the whole batch's:
        :mod:`torchpar.ir.aux_parts`)."""
        capture = self._captures[signature]
        cached = self._dtypes.get(signature)
        if cached is None or cached[0] is not capture:  # (a recompile for changes replaces the capture)
            cached = self._dtypes[signature] = (capture, *_returned_dtypes(capture))
        _, loss_dtype, aux_dtypes = cached
        loss = torch.tensor(result.loss, dtype=loss_dtype)
        if aux_dtypes is None:
            return loss
        return loss, {key: to_torch(result.aux[key]).to(dtype) for key, dtype in aux_dtypes.items()}

    def forward_capture(self, signature: tuple, batch: Any) -> Capture:
        """The eval-mode forward graph on ``batch`` (captured once per signature)."""
        if signature not in self._eval:
            self._eval[signature] = self.step.capture_forward(batch)
        return self._eval[signature]

    def graph(self, signature: tuple) -> Graph:
        """The training graph compiled for ``signature``."""
        return self.step_graphs[signature]

    def diagnosis_graph(self, signature: tuple, batch: Any) -> Graph:
        """The training graph for ``batch``: the compiled one of its signature, else captured (not compiled)."""
        if signature in self.step_graphs:
            return self.step_graphs[signature]
        if signature not in self._diagnosed:
            self._diagnosed[signature] = self.capture(self.first_part(batch)).graph
        return self._diagnosed[signature]

    def trainable(self, graph: Graph) -> tuple[str, ...]:
        """:meth:`StepCapture.trainable`: the parameters the optimizer updates this step."""
        return self.step.trainable(graph)

    # --- scalars and failures ----------------------------------------------------------------------------------

    def first_step_scalars(self) -> Any:
        """Scalars of a step with the optimizer's current hyper-parameters, counters at 1 (for compiling)."""
        spec = self.bridge.spec
        return step_scalars(spec, self.bridge.hparams(), [1] * spec.num_groups)

    def with_loss_scale(self, scalars: Any) -> Any:
        """A step's scalars: the optimizer's, with the loss scale under fp16 mixed precision."""
        return scalars if self._loss_scaler is None else (scalars, self._loss_scaler.step_input())

    def translating_failures(self, what: str) -> Any:
        """A context manager: failures inside become errors that name ``what`` and the plan (:class:`StepGuard`)."""
        return self.guard.translating_failures(
            what, self.planned.plan if self.planned else None, current_cluster().device_memory_bytes
        )

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()


def _returned_dtypes(capture: Capture) -> tuple[torch.dtype, dict[str, torch.dtype] | None]:
    """The loss's PyTorch dtype and each aux value's (``None``: the ``step_fn`` returns no aux) of ``capture``'s
    training graph."""
    graph = capture.graph
    metas = graph.metas()

    def torch_dtype(value: Ref | None) -> torch.dtype:
        assert value is not None, "a loss or aux output has a value"
        meta = metas[value.name]
        assert isinstance(meta, TensorMeta), f"{value.name}: a loss or aux value is one tensor"
        return getattr(torch, meta.dtype)

    loss = torch_dtype(next(o.value for o in graph.outputs if o.kind == "loss"))
    if capture.aux_keys is None:
        return loss, None
    values = {o.target: o.value for o in graph.outputs if o.kind == "aux"}
    return loss, {key: torch_dtype(values[key]) for key in capture.aux_keys}

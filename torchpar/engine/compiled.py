"""The road from a model to a running step, on three floors: capture (:mod:`torchpar.capture`) → plan
(:func:`torchpar.planner.training_plan.plan_training`) → executor (:mod:`torchpar.runtime`).

:class:`CompiledTraining` walks it once when built (capture the example batch's first micro-batch, plan, start
the executor's workers with the state, compile the step) and again per new batch signature (capture, cut the
plan's stages out of the new graph, compile); the plan is made once. Every method takes the same road: a
one-stage plan is a pipeline of one stage, and what differs lives under the planner's and the executor's doors.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import torch

from torchpar import checkpoint as _checkpoint
from torchpar import compile_cache
from torchpar.capture.export import Capture, ForwardFn, LossFn, StepFn, capture_forward, capture_train_step
from torchpar.capture.module_state import CapturedState, NumberAttribute
from torchpar.capture.optimizer import TorchOptimizerBridge
from torchpar.capture.semantics.grad_semantics import trainable_params
from torchpar.cluster import current_cluster
from torchpar.engine import batches
from torchpar.engine.guard import StepGuard
from torchpar.engine.host_arrays import jax_dtype, to_torch
from torchpar.engine.model_link import Tracked, pull_holders, suspended, tracked_state
from torchpar.engine.profiled import plan_training_profiled
from torchpar.ir.aux_parts import with_aux_parts
from torchpar.ir.graph import Graph
from torchpar.ir.loss_parts import with_loss_parts
from torchpar.ir.optimizer import step_scalars
from torchpar.methods import data_replicas, searches_micro_batches
from torchpar.options import CompileOptions, describe_numerics
from torchpar.planner.pipeline.micro_batch_counts import candidate_counts, plan_micro_batch_count
from torchpar.planner.plan import Plan
from torchpar.planner.training_plan import TrainingPlan
from torchpar.progress import CompilePhases

log = logging.getLogger(__name__)


class CompiledTraining:
    """A model's training step planned once and compiled per batch signature, and the executor running it.

    ``signature`` keys are :func:`torchpar.engine.batches.signature` of a whole batch; every graph held is captured on
    one micro-batch of it (``num_micro_batches`` per step: pipelines, gradient accumulation). ``timings`` gathers
    each phase's seconds for ``plan.timings``. On failure while building, the workers already started are freed."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        options: CompileOptions,
        method: Any,
        example_batch: Any,
        *,
        loss_fn: LossFn | None,
        step_fn: StepFn | None,
        forward_fn: ForwardFn | None,
        guard: StepGuard,
        loss_scaler: Any,
        numerics: Any,
        autocast: Any,
        orphans_allowed: bool = False,
        numbers: tuple[NumberAttribute, ...] = (),
    ):
        self.model, self.optimizer, self.options, self.guard = model, optimizer, options, guard
        self._loss_fn, self._step_fn, self._forward_fn = loss_fn, step_fn, forward_fn
        self._loss_scaler, self._numerics, self._autocast = loss_scaler, numerics, autocast
        self._searching = searches_micro_batches(method)
        """``num_micro_batches="auto"``: the count is searched while building (the largest candidate first)."""
        self.num_micro_batches = (
            candidate_counts(batches.splittable_rows(example_batch))[0]
            if self._searching
            else int(getattr(method, "num_micro_batches", 1))
        )
        self.data_replicas = data_replicas(method)
        self.batch_parts = self.num_micro_batches * self.data_replicas
        """Equal parts of dim 0 each batch is cut into (micro-batches × data replicas): the graphs are one part's."""
        self.example_signature = batches.signature(example_batch)
        self.tracked: dict[str, Tracked] = {}
        """Every state tensor the executor holds a copy of, by name
        (:func:`torchpar.engine.model_link.tracked_state`)."""
        self.captured_state = CapturedState()
        """The module state the first capture found (guards, tensor attributes, modules outside the model)."""
        self.bridge: TorchOptimizerBridge | None = None
        self._orphans_allowed = orphans_allowed
        self.numbers = numbers
        """Float attributes ``(module, name)`` the step reads as inputs rather than constants."""
        """The optimizer may hold tensors the model lost since it was built (a recompile after a weight was tied)."""
        self.timings: dict[str, float] = {}
        self.step_graphs: dict[tuple, Graph] = {}
        """Batch signature → the training graph its compiled step runs."""
        self._captures: dict[tuple, Capture] = {}
        self._eval: dict[tuple, Capture] = {}
        self._diagnosed: dict[tuple, Graph] = {}
        self.planned: TrainingPlan | None = None
        self.executor: Any = None
        try:
            self._build(method, example_batch)
        except BaseException:
            self.close()
            raise

    def _build(self, method: Any, example_batch: Any) -> None:
        from torchpar.runtime import build_executor
        from torchpar.runtime.devices import DeviceMap
        from torchpar.runtime.worker import ExecutionSpec

        phases = CompilePhases(("capture", "plan", "start workers", "XLA compile"), "compiling the training step")
        try:
            with self.translating_failures("compiling the training step"):
                with phases.phase("capture"):
                    capture = self.capture(self.first_part(example_batch))
                    self.captured_state = capture.state
                    self.tracked = tracked_state(self.model, capture.state)
                    self.bridge = TorchOptimizerBridge(
                        self.optimizer,
                        {id(p): n for n, p in self.params.items()},
                        orphans_allowed=self._orphans_allowed,
                    )
                with phases.phase("plan"):
                    cluster = current_cluster()
                    if self._searching:
                        capture, self.planned = self._plan_micro_batch_count(method, example_batch, capture, cluster)
                    else:
                        self.planned = self._plan(capture, method, cluster)
                    self.plan.numerics = describe_numerics(self._numerics, self.options.mixed_precision)
                    log.info("torchpar: plan %s (engine.plan.summary() lists every layout)", self.plan.headline())
                    log.debug("torchpar plan:\n%s", self.plan.summary())
                with phases.phase("start workers"):
                    start = time.perf_counter()
                    spec = ExecutionSpec(
                        plan=self.plan,
                        optimizer=self.bridge.spec,
                        devices=DeviceMap(cluster.devices_per_host),
                        options=self._run_options(),
                        stage_graphs=self.planned.stage_graphs,
                        trainable=tuple(sorted(self.planned.trainable)),
                    )
                    self.executor = build_executor(spec, cluster, label=self.plan.method)
                    self.timings.update(self.executor.timings)
                    pull_holders(t.tensor for t in self.tracked.values())  # what other engines trained newer
                    self.executor.load_state(_checkpoint.torch_state(self.params, self.buffers, self.bridge))
                    self.timings["start_workers"] = time.perf_counter() - start
                with phases.phase("XLA compile"):
                    self._compile(self.example_signature, capture)
        finally:
            phases.close()

    def _plan(self, capture: Capture, method: Any, cluster: Any, beat_s: float = math.inf) -> TrainingPlan:
        assert self.bridge is not None
        return plan_training_profiled(
            capture.graph,
            method,
            cluster,
            profile=self.options.profile,
            spec=self.bridge.spec,
            trainable=set(self.trainable(capture.graph)),
            remat=self.options.remat,
            numerics=self._numerics,
            library_fusions=self.options.xla_library_fusions,
            beat_s=beat_s,
        )

    def _plan_micro_batch_count(
        self, method: Any, example_batch: Any, first: Capture, cluster: Any
    ) -> tuple[Capture, TrainingPlan]:
        """``num_micro_batches="auto"``: each candidate count captured and planned
        (:func:`torchpar.planner.pipeline.micro_batch_counts.plan_micro_batch_count`; ``first`` is the capture at the
        largest); the chosen count's capture and plan, this object's counts set to it."""
        first_count = self.num_micro_batches

        def plan_with(concrete: Any, beat_s: float) -> tuple[Capture, TrainingPlan]:
            self._set_micro_batches(concrete.num_micro_batches)
            capture = (
                first if concrete.num_micro_batches == first_count else self.capture(self.first_part(example_batch))
            )
            return capture, self._plan(capture, concrete, cluster, beat_s)

        count, (capture, planned) = plan_micro_batch_count(
            method, batches.splittable_rows(example_batch), plan_with, lambda result: result[1].plan
        )
        self._set_micro_batches(count)
        return capture, planned

    def _set_micro_batches(self, count: int) -> None:
        self.num_micro_batches = count
        self.batch_parts = count * self.data_replicas

    def _run_options(self) -> Any:
        from torchpar.runtime.worker import RunOptions

        return RunOptions(
            grad_clip_norm=self.options.grad_clip_norm,
            library_fusions=self.options.xla_library_fusions,
            spmd=self.options.spmd,
            timeout_s=current_cluster().timeout_s,
            check_finite=self.options.on_nonfinite != "ignore" or self._loss_scaler is not None,
            numerics=self._numerics,
            loss_scaling=self._loss_scaler is not None,
            remat=self.plan.remat,
        )

    @property
    def plan(self) -> Plan:
        assert self.planned is not None, "the plan is made while building"
        return self.planned.plan

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The parameters the executor holds by name: the model's (a tied one under its first name) and those of
        the modules outside it the step calls."""
        return {n: t.tensor for n, t in self.tracked.items() if t.kind == "param"}

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The buffers the executor holds by name: the model's, its tensor attributes the step reads, and those of
        the modules outside it the step calls."""
        return {n: t.tensor for n, t in self.tracked.items() if t.kind == "buffer"}

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
        leaves = [((m.shape[0] * self.batch_parts, *m.shape[1:]), jax_dtype(m.dtype)) for m in capture.input_metas]
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
        """The part of ``batch`` the step's graph is captured on (:func:`torchpar.engine.batches.first_micro_batch`)."""
        return batches.first_micro_batch(batch, self.num_micro_batches, self.data_replicas)

    def capture(self, batch: Any) -> Capture:
        """The training graph on ``batch`` (one micro-batch); every op must have a lowering (checked here, before
        any worker starts, so the error lists them all at once)."""
        from jaxbackend.lower import check_supported

        start = time.perf_counter()
        with suspended():
            capture = capture_train_step(
                self.model,
                batch,
                self._loss_fn,
                autocast=self._autocast,
                step_fn=self._step_fn,
                outside=self.captured_state.outside,
                numbers=self.numbers,
            )
        self.timings["capture"] = time.perf_counter() - start
        self._check_state_known(capture)
        check_supported(capture.graph)
        if self.data_replicas > 1:  # before any worker starts
            from torchpar.runtime.one_stage.programs import check_replicable

            check_replicable(capture.graph, self.data_replicas)
        if self.batch_parts > 1:  # mark how the parts' losses and aux values make the whole batch's (before any worker
            # starts: torchpar.ir.loss_parts, torchpar.ir.aux_parts)
            graph = with_aux_parts(with_loss_parts(capture.graph), self._describe_parts())
            capture = dataclasses.replace(capture, graph=graph)
        return capture

    def _describe_parts(self) -> str:
        """``"4 micro-batches"``, ``"2 data replicas"``, ``"8 parts (4 micro-batches × 2 data replicas)"``."""
        micro, replicas = f"{self.num_micro_batches} micro-batches", f"{self.data_replicas} data replicas"
        if self.data_replicas == 1:
            return micro
        return replicas if self.num_micro_batches == 1 else f"{self.batch_parts} parts ({micro} × {replicas})"

    def returned(self, signature: tuple, result: Any) -> Any:
        """What ``engine.step`` returns for the executor's ``result`` of a step on a batch of ``signature``: the whole
        batch's loss as a 0-d CPU tensor of the loss's dtype, and, if the ``step_fn`` returned ``(loss, aux)``, the
        pair ``(loss, aux)`` with every aux value a CPU tensor of the dtype it had in PyTorch (the whole batch's:
        :mod:`torchpar.ir.aux_parts`)."""
        capture = self._captures[signature]
        graph = capture.graph
        metas = graph.metas()
        torch_dtype = lambda value: getattr(torch, metas[value.name].dtype)
        loss = torch.tensor(result.loss, dtype=torch_dtype(next(o.value for o in graph.outputs if o.kind == "loss")))
        if capture.aux_keys is None:
            return loss
        values = {o.target: o.value for o in graph.outputs if o.kind == "aux"}
        return loss, {key: to_torch(result.aux[key]).to(torch_dtype(values[key])) for key in capture.aux_keys}

    def forward_capture(self, signature: tuple, batch: Any) -> Capture:
        """The eval-mode forward graph on ``batch`` (captured once per signature)."""
        if signature not in self._eval:
            with suspended():
                capture = capture_forward(
                    self.model,
                    batch,
                    autocast=self._autocast,
                    forward_fn=self._forward_fn,
                    outside=self.captured_state.outside,
                    numbers=self.numbers,
                )
            self._check_state_known(capture)
            self._eval[signature] = capture
        return self._eval[signature]

    def _check_state_known(self, capture: Capture) -> None:
        """A later capture (another batch shape, the eval forward) may read no state the engine does not hold."""
        if not self.tracked:
            return
        unknown = sorted(
            i.target for i in capture.graph.inputs if i.kind in ("param", "buffer") and i.target not in self.tracked
        )
        if unknown:
            raise NotImplementedError(
                f"this capture reads state the engine does not hold: {unknown} (modules or tensor attributes the "
                "first training step did not read); compile the engine with a step that reads them all"
            )

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
        """Parameters the optimizer updates this step: in the optimizer, requiring grad, and reaching the
        loss (PyTorch leaves the others' ``.grad`` as ``None`` and skips them)."""
        assert self.bridge is not None, "the optimizer bridge is built with the first capture"
        return trainable_params(graph, self.params, self.bridge.spec.param_names)

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

"""The first two stages of ``torchpar.capture(...).plan(method).compile()``: the user's training step captured into
the IR (:mod:`torchpar.capture`) and planned (:func:`torchpar.engine.profiled.plan_training_profiled`), shared by
``torchpar.plan`` (which stops there) and ``torchpar.compile`` (which goes on to :mod:`torchpar.engine.compiled`).

A step's graph is one part's: a batch is cut into ``num_micro_batches × data_replicas`` equal parts along dim 0
(:class:`BatchParts`), which the method decides, so :meth:`StepCapture.plan` captures the example batch's first part
for the method it plans (once per count tried under ``num_micro_batches="auto"``). The first capture fixes the state
the step reads (parameters, buffers, tensor attributes, modules outside the model) and the optimizer's bridge.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import TYPE_CHECKING, TypedDict

import torch

from torchpar.capture.export import Capture, ForwardFn, LossFn, StepFn, capture_forward, capture_train_step
from torchpar.capture.module_state import CapturedState, NumberAttribute
from torchpar.capture.optimizer import TorchOptimizerBridge
from torchpar.capture.precision import autocast_dtype
from torchpar.capture.semantics.grad_semantics import trainable_params
from torchpar.cluster import current_cluster
from torchpar.engine import batches
from torchpar.engine.model_link import Tracked, suspended, tracked_state
from torchpar.engine.profiled import plan_training_profiled
from torchpar.ir.aux_parts import with_aux_parts
from torchpar.ir.graph import Graph
from torchpar.ir.loss_parts import with_loss_parts
from torchpar.methods import PipeshardParallel, data_replicas, searches_micro_batches
from torchpar.options import CompileOptions, describe_numerics, numerics_for
from torchpar.planner.pipeline.micro_batch_counts import plan_micro_batch_count
from torchpar.planner.plan import Plan
from torchpar.planner.training_plan import TrainingPlan
from torchpar.progress import CompilePhases

if TYPE_CHECKING:
    from jaxbackend.precision import Numerics
    from torchpar.methods import Method


class StepFns(TypedDict):
    """The functions feeding a batch to the model, by keyword, as ``torchpar.compile`` takes them."""

    loss_fn: LossFn | None
    step_fn: StepFn | None
    forward_fn: ForwardFn | None


@dataclasses.dataclass(frozen=True)
class BatchParts:
    """How one step cuts its batch: ``num_micro_batches × data_replicas`` equal parts of every leaf's dim 0; every
    graph a step runs is one part's (pipelines and gradient accumulation step through the micro-batches, data
    replicas each take theirs)."""

    num_micro_batches: int = 1
    data_replicas: int = 1

    @classmethod
    def of(cls, method: Method | Plan | None) -> BatchParts:
        """The parts a (concrete) method or saved plan asks for."""
        return cls(int(getattr(method, "num_micro_batches", 1)), data_replicas(method))

    @property
    def count(self) -> int:
        return self.num_micro_batches * self.data_replicas

    def first(self, batch: object) -> object:
        """The part of ``batch`` a graph is captured on (:func:`torchpar.engine.batches.first_micro_batch`)."""
        return batches.first_micro_batch(batch, self.num_micro_batches, self.data_replicas)

    def describe(self) -> str:
        """``"4 micro-batches"``, ``"2 data replicas"``, ``"8 parts (4 micro-batches × 2 data replicas)"``."""
        micro, replicas = f"{self.num_micro_batches} micro-batches", f"{self.data_replicas} data replicas"
        if self.data_replicas == 1:
            return micro
        return replicas if self.num_micro_batches == 1 else f"{self.count} parts ({micro} × {replicas})"


@dataclasses.dataclass
class PlannedStep:
    """A plan and what it was made on: the parts the method cuts a batch into and the example batch's first part
    captured (``capture.graph`` is the graph the plan's stages were cut from)."""

    parts: BatchParts
    capture: Capture
    training: TrainingPlan

    @property
    def plan(self) -> Plan:
        return self.training.plan


class StepCapture:
    """The user's training step — model, optimizer, how a batch is fed to the model (``loss_fn`` / ``step_fn`` /
    ``forward_fn``), the compile options — and what its first capture found: the state the step reads
    (``tracked``, ``state``) and the optimizer's bridge. ``timings`` gathers each phase's seconds (the latest
    capture's under ``"capture"``). ``numbers``: float attributes ``(module, name)`` the step reads as inputs rather
    than constants; ``orphans_allowed``: the optimizer may hold tensors the model lost since it was built (a recompile
    after a weight was tied)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        example_batch: object,
        options: CompileOptions,
        *,
        loss_fn: LossFn | None = None,
        step_fn: StepFn | None = None,
        forward_fn: ForwardFn | None = None,
        numbers: tuple[NumberAttribute, ...] = (),
        orphans_allowed: bool = False,
    ):
        self.model, self.optimizer, self.example_batch, self.options = model, optimizer, example_batch, options
        self.fns = StepFns(loss_fn=loss_fn, step_fn=step_fn, forward_fn=forward_fn)
        """The step functions by keyword, as ``torchpar.compile`` takes them."""
        self.numbers = numbers
        self.numerics: Numerics = numerics_for(options.matmul_precision)
        self.autocast = autocast_dtype(options.mixed_precision)
        self.state = CapturedState()
        """The module state the first capture found (guards, tensor attributes, modules outside the model)."""
        self.tracked: dict[str, Tracked] = {}
        """Every state tensor a step reads, by name (:func:`torchpar.engine.model_link.tracked_state`)."""
        self.bridge: TorchOptimizerBridge | None = None
        self.timings: dict[str, float] = {}
        self.compiled = False
        """Whether an engine was compiled from this step (one engine per capture: it owns the state)."""
        self._orphans_allowed = orphans_allowed

    # --- capture ---------------------------------------------------------------------------------------------------

    def capture(self, batch: object, parts: BatchParts) -> Capture:
        """The training graph on ``batch`` (one of ``parts``); every op must have a lowering (checked here, before any
        worker starts, so the error lists them all at once). The first capture fixes :attr:`tracked` and
        :attr:`bridge`."""
        from jaxbackend.lower import check_supported

        start = time.perf_counter()
        with suspended():
            capture = capture_train_step(
                self.model,
                batch,
                self.fns["loss_fn"],
                autocast=self.autocast,
                step_fn=self.fns["step_fn"],
                outside=self.state.outside,
                numbers=self.numbers,
            )
        self.timings["capture"] = time.perf_counter() - start
        if self.bridge is None:
            self.state = capture.state
            self.tracked = tracked_state(self.model, capture.state)
            self.bridge = TorchOptimizerBridge(
                self.optimizer, {id(p): n for n, p in self.params.items()}, orphans_allowed=self._orphans_allowed
            )
        self.check_state_known(capture)
        check_supported(capture.graph)
        if parts.data_replicas > 1:
            from torchpar.runtime.one_stage.programs import check_replicable

            check_replicable(capture.graph, parts.data_replicas)
        if parts.count > 1:  # how the parts' losses and aux values make the whole batch's (torchpar.ir.loss_parts)
            graph = with_aux_parts(with_loss_parts(capture.graph), parts.describe())
            capture = dataclasses.replace(capture, graph=graph)
        return capture

    def capture_forward(self, batch: object) -> Capture:
        """The eval-mode forward graph on ``batch`` (``forward_fn``, or the calling convention)."""
        with suspended():
            capture = capture_forward(
                self.model,
                batch,
                autocast=self.autocast,
                forward_fn=self.fns["forward_fn"],
                outside=self.state.outside,
                numbers=self.numbers,
            )
        self.check_state_known(capture)
        return capture

    def check_state_known(self, capture: Capture) -> None:
        """A later capture (another batch shape, the eval forward) may read no state the first did not."""
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

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The parameters a step reads by name: the model's (a tied one under its first name) and those of the
        modules outside it the step calls."""
        return {n: t.tensor for n, t in self.tracked.items() if t.kind == "param"}

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The buffers a step reads by name: the model's, its tensor attributes the step reads, and those of the
        modules outside it the step calls."""
        return {n: t.tensor for n, t in self.tracked.items() if t.kind == "buffer"}

    def trainable(self, graph: Graph) -> tuple[str, ...]:
        """Parameters the optimizer updates this step: in the optimizer, requiring grad, and reaching the loss
        (PyTorch leaves the others' ``.grad`` as ``None`` and skips them)."""
        assert self.bridge is not None, "the optimizer bridge is built with the first capture"
        return trainable_params(graph, self.params, self.bridge.spec.param_names)

    # --- plan ------------------------------------------------------------------------------------------------------

    def plan(self, method: Method | Plan | None, *, explain: bool = False) -> PlannedStep:
        """``method``'s plan of the step, on the example batch's first part at the method's :class:`BatchParts`; with
        ``PipeshardParallel(num_micro_batches="auto")`` each candidate count captured and planned
        (:func:`torchpar.planner.pipeline.micro_batch_counts.plan_micro_batch_count`). ``plan.timings`` has the
        capture's and the planner's seconds (``micro_batch_search`` for a searched count); ``explain``: as
        :func:`torchpar.plan`'s."""
        searching = searches_micro_batches(method)
        phases = CompilePhases(() if searching else ("capture", "plan"), "planning the training step")
        cluster = current_cluster()

        def plan_with(concrete: Method | Plan | None, beat_s: float = math.inf) -> PlannedStep:
            parts = BatchParts.of(concrete)
            label = (lambda phase: f"{phase} ({parts.num_micro_batches} micro-batches)") if searching else str
            with phases.phase(label("capture")):
                capture = self.capture(parts.first(self.example_batch), parts)
            with phases.phase(label("plan")):
                assert self.bridge is not None
                training = plan_training_profiled(
                    capture.graph,
                    concrete,
                    cluster,
                    profile=self.options.profile,
                    spec=self.bridge.spec,
                    trainable=set(self.trainable(capture.graph)),
                    remat=self.options.remat,
                    explain=explain,
                    numerics=self.numerics,
                    library_fusions=self.options.xla_library_fusions,
                    beat_s=beat_s,
                )
            training.plan.timings = {"capture": self.timings["capture"], **training.plan.timings}
            return PlannedStep(parts, capture, training)

        try:
            with suspended():
                if searching:
                    assert isinstance(method, PipeshardParallel)
                    start = time.perf_counter()
                    rows = batches.splittable_rows(self.example_batch)
                    _, planned = plan_micro_batch_count(method, rows, plan_with, lambda planned: planned.plan)
                    planned.plan.timings["micro_batch_search"] = time.perf_counter() - start
                else:
                    planned = plan_with(method)
        finally:
            phases.close()
        planned.plan.numerics = describe_numerics(self.numerics, self.options.mixed_precision)
        return planned

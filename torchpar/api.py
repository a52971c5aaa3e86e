"""``torchpar.capture_step(...).plan(method).compile()``: the three stages (:class:`Captured`, :class:`Planned`,
:class:`Engine`), and ``torchpar.compile`` and ``torchpar.plan``, shortcuts over them that cannot drift apart.

The engine owns three things and nothing more: the capture of the user's model (one training graph per
batch signature, one eval graph per forward signature), the :class:`~torchpar.planner.plan.Plan`, and one
executor (:mod:`torchpar.runtime`) that runs the plan — in this process, or on Ray host actors. Each
``step`` reads the optimizer's hyper-parameters from ``optimizer.param_groups`` (so torch LR schedulers
work) and hands the batch to the executor; ``sync_to_torch`` writes the state back into the user's model
and optimizer. ``close()`` (or leaving a ``with`` block) frees the executor's workers.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Unpack, cast

import numpy as np
import torch
import torch.utils._pytree as pytree

from torchpar import metrics as _metrics
from torchpar.capture.export import ForwardFn, LossFn, StepFn, check_model_fns
from torchpar.capture.module_state import NumberAttribute
from torchpar.capture.optimizer import mark_optimizer_stepped
from torchpar.capture.semantics.remat import warn_if_gradient_checkpointing
from torchpar.cluster import default_compile_cache
from torchpar.compile_arguments import check_materialized, check_method, check_model_and_optimizer
from torchpar.engine import batches, diagnosis, feeding, model_link
from torchpar.engine.compiled import CompiledTraining
from torchpar.engine.engine_checkpoints import EngineCheckpoints
from torchpar.engine.engine_readouts import EngineReadouts
from torchpar.engine.feeding import PREFETCH_DEPTH, HostData, HostFeed
from torchpar.engine.guard import StepGuard, leaf_names
from torchpar.engine.host_arrays import StepKeys, host_value, to_torch
from torchpar.engine.step_capture import BatchParts, PlannedStep, StepCapture
from torchpar.engine.torch_side import TorchSide, linked
from torchpar.ir.graph import Graph
from torchpar.methods import Method
from torchpar.options import (
    PLAN_OPTIONS,
    CompileKwargs,
    CompileOptions,
    PlanKwargs,
    compile_options,
    with_options,
)
from torchpar.planner.plan import Plan

if TYPE_CHECKING:
    from torchpar.runtime.executor import Executor

log = logging.getLogger(__name__)


@with_options()
def capture_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    example_batch: Any = None,
    data: HostData | None = None,
    loss_fn: LossFn | None = None,
    step_fn: StepFn | None = None,
    forward_fn: ForwardFn | None = None,
    **options: Unpack[CompileKwargs],
) -> Captured:
    """The first stage of ``torchpar.capture_step(...).plan(method).compile()`` (:func:`compile` in three steps, each
    inspectable): ``model``'s training step on ``example_batch`` (or ``data``'s first batch), checked and ready to be
    captured and planned. Arguments and options: :func:`compile`'s."""
    return _captured(model, optimizer, example_batch, data, (loss_fn, step_fn, forward_fn), compile_options(options))


@with_options()
def compile(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    example_batch: Any = None,
    data: HostData | None = None,
    loss_fn: LossFn | None = None,
    step_fn: StepFn | None = None,
    forward_fn: ForwardFn | None = None,
    method: Method | Plan | None = None,
    **options: Unpack[CompileKwargs],
) -> Engine:
    """Capture ``model``'s training step on ``example_batch`` and compile it with ``method``:
    ``capture_step(...).plan(method).compile()``.

    ``method=None`` runs on one device; a :class:`Plan` (e.g. loaded with ``Plan.from_dict``) runs as given,
    without solving. The calling convention and the loss rule: ``docs/user_guide.md``, "Compile and train". With
    ``torchpar.init(cluster="ray", ...)`` every method runs on the Ray host actors. The engine holds workers
    until ``engine.close()``; ``with torchpar.compile(...) as engine:`` closes it on exit. ``data``: host-loaded
    training (:class:`torchpar.HostData`: every process loads its own rows; ``engine.step()`` / ``engine.run(steps)``).
    """
    captured = _captured(
        model, optimizer, example_batch, data, (loss_fn, step_fn, forward_fn), compile_options(options)
    )
    check_method(method)
    check_materialized(model)  # before planning
    return captured.plan(method).compile()


@with_options(PLAN_OPTIONS)
def plan(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    example_batch: Any,
    loss_fn: LossFn | None = None,
    step_fn: StepFn | None = None,
    method: Method | None = None,
    explain: bool = True,
    **options: Unpack[PlanKwargs],
) -> Plan:
    """The plan ``method`` gives the model's training step, without XLA compilation or a step (for inspecting
    and comparing plans): ``capture_step(...).plan(method, explain=explain).plan``. Capture and planning phases are
    timed in ``plan.timings``.

    ``explain`` (default): also count each stage's collective bytes by kind and, for one-stage methods, price
    ShardParallel, DataParallel, Zero2Parallel and MegatronParallel on the same cost model
    (``plan.solver["method_comparison"]``), for the summary and the report; a few more solves. The options are
    :func:`compile`'s that change a plan (:data:`torchpar.options.PLAN_OPTIONS`); ``remat=None`` plans ``"none"``."""
    validated = compile_options(options, only=PLAN_OPTIONS, caller="plan")
    fns = (loss_fn, step_fn, None)
    return _captured(model, optimizer, example_batch, None, fns, validated).plan(method, explain=explain).plan


def _captured(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    example_batch: Any,
    data: HostData | None,
    fns: tuple[LossFn | None, StepFn | None, ForwardFn | None],
    options: CompileOptions,
) -> Captured:
    """:func:`capture_step`'s checks and result, for the three public doors (``options`` validated)."""
    check_model_and_optimizer(model, optimizer)
    check_model_fns(*fns)
    example_batch, feed = feeding.example_and_feed(example_batch, data)
    warn_if_gradient_checkpointing(model, stacklevel=4)  # the caller of torchpar.compile / plan / capture
    loss_fn, step_fn, forward_fn = fns
    step = StepCapture(
        model, optimizer, example_batch, options, loss_fn=loss_fn, step_fn=step_fn, forward_fn=forward_fn
    )
    return Captured(step, feed)


class Captured:
    """Stage 1 of ``torchpar.capture_step(...).plan(method).compile()``: the user's training step, checked, with the
    example batch. :attr:`graph` is the training graph on the whole example batch (captured when first read);
    :meth:`plan` captures the part of the batch its method steps on and plans it."""

    def __init__(self, step: StepCapture, feed: HostFeed | None):
        self.step, self.feed = step, feed
        """The step's capture and planning (:class:`~torchpar.engine.step_capture.StepCapture`); host-loaded data."""
        self._graph: Graph | None = None

    @property
    def graph(self) -> Graph:
        """The training step on the whole example batch, as the IR every planner pass reads."""
        if self._graph is None:
            self._graph = self.step.capture(self.step.example_batch, BatchParts()).graph
        return self._graph

    def plan(self, method: Method | Plan | None = None, *, explain: bool = False) -> Planned:
        """Stage 2: ``method``'s plan (``None``: one device; a :class:`Plan`: taken as given). ``explain``: as
        :func:`plan`'s."""
        check_method(method)
        return Planned(self, method, self.step.plan(method, explain=explain))

    def _again(self, batch: Any, numbers: tuple[NumberAttribute, ...]) -> Captured:
        """The same step captured anew on ``batch`` (a recompile: the optimizer may hold tensors the model lost;
        ``numbers`` are read as inputs)."""
        step = self.step
        again = StepCapture(
            step.model, step.optimizer, batch, step.options, **step.fns, numbers=numbers, orphans_allowed=True
        )
        return Captured(again, self.feed)


class Planned:
    """Stage 2 of ``torchpar.capture_step(...).plan(method).compile()``: :attr:`plan` made on :attr:`graph` (one part of
    the example batch: a micro-batch of a data replica); :meth:`compile` starts the workers and compiles it."""

    def __init__(self, captured: Captured, method: Method | Plan | None, planned: PlannedStep):
        self.captured, self.method, self.planned_step = captured, method, planned

    @property
    def plan(self) -> Plan:
        return self.planned_step.plan

    @property
    def graph(self) -> Graph:
        """The captured graph the plan's stages were cut from."""
        return self.planned_step.capture.graph

    def compile(self) -> Engine:
        """Stage 3: the :class:`Engine` running the plan (workers started, the step compiled for the example batch's
        shapes). Once per :class:`Captured`: an engine owns the state it captured (the optimizer's step counters
        among it), so a second engine captures again."""
        step = self.captured.step
        if step.compiled:
            raise RuntimeError(
                "this captured step was compiled already; call torchpar.capture_step(...) again for a second engine "
                "(an engine owns the state it captured, the optimizer's step counters among it)"
            )
        check_materialized(step.model)
        default_compile_cache()
        step.compiled = True
        return Engine(self)


class Engine(EngineReadouts, EngineCheckpoints):
    """A compiled training step bound to a model and optimizer. Create it with :func:`torchpar.compile`."""

    def __init__(self, planned: Planned):
        import jax

        from torchpar.runtime.loss_scale import LossScaler

        self._captured = planned.captured
        step = self._captured.step
        options = step.options
        self._jax = jax
        self.model, self.optimizer, self.options, self.method = step.model, step.optimizer, options, planned.method
        self._fns = step.fns
        self._feed = self._captured.feed
        self._recorder = _metrics.StepRecorder(log_every=options.log_every, on_metrics=options.on_metrics)
        self._steps_taken = 0
        self._last_step_s: float | None = None
        self._base_key = jax.random.key(options.seed)
        self._step_keys = StepKeys()
        self._numerics = step.numerics
        self._loss_scaler = LossScaler() if options.mixed_precision == "fp16" else None
        self._example_signature = batches.signature(step.example_batch)
        self._example_skeleton = batches.skeleton(step.example_batch)
        self._last_signature: tuple | None = None
        self._guard = StepGuard(check_inputs=options.check_inputs, on_nonfinite=options.on_nonfinite)
        self._capture_batch = step.example_batch
        """A batch to capture the step on again when it must recompile (the last step's)."""
        with model_link.suspended():
            self._compiled = CompiledTraining(
                step, planned.planned_step, guard=self._guard, loss_scaler=self._loss_scaler
            )
        self._bridge = self._compiled.bridge
        self._param_names = self._compiled.params  # tied tensors keep their first name; modules outside included
        self._buffer_names = self._compiled.buffers
        executor = self._compiled.executor
        assert executor is not None, "the executor starts while compiling"
        self._executor: Executor = executor
        self._finalizer = weakref.finalize(self, self._executor.close)
        self._inputs = feeding.StepInputs(self._feed, self._host_leaves, self._guard.input_checks)
        engine = weakref.ref(self)
        self._torch = TorchSide(
            self.model,
            self.optimizer,
            self._compiled,
            executor=lambda: getattr(engine(), "_executor", None),
            graph=lambda: cast(Engine, engine()).graph,  # TorchSide lives no longer than its engine
            options=options,
            fns=self._fns,
            params=self._param_names,
        )

    # --- public API --------------------------------------------------------------------------------

    @linked(bring_in=False)
    def step(self, batch: Any = None) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One optimizer step on ``batch`` (a batch, one from :meth:`prefetch`, or ``None``: the next batch of
        ``compile(data=...)``'s host-loaded data); returns the whole batch's loss (before the update) as a 0-d CPU
        tensor, or ``(loss, aux)`` for a ``step_fn`` that returns aux values, each the whole batch's
        (:meth:`CompiledTraining.returned`). Its measurements are then in :attr:`last_metrics`. Before it runs, what
        user code changed on the torch model since the last step reaches the engine (:mod:`torchpar.engine.model_link`);
        after it, the torch model shows the new weights whenever user code looks."""
        started = time.perf_counter()
        batch, fed, waited = self._inputs.take(batch, self._executor)
        signature = batches.signature(batch)
        self._check_compatible(signature, batch)
        recompiled = self._bring_in(batch)
        self._capture_batch = batch
        recompiled = self._compiled.ensure_compiled(signature, batch) or recompiled
        loss_scale = self.loss_scale
        leaves, converting_s = self._inputs.leaves(signature, batch, fed, self._executor)
        scalars = self._compiled.with_loss_scale(self._bridge.step_scalars())
        mark_optimizer_stepped(self.optimizer)
        key_data = self._step_key_data(self._steps_taken)
        with self._compiled.translating_failures(f"running step {self._steps_taken}"):
            start = time.perf_counter()
            result = self._executor.step(signature, leaves, scalars, key_data)
            self._last_step_s = time.perf_counter() - start
        step = self._steps_taken
        self._steps_taken += 1
        self._last_signature = signature
        self._torch.after_step(signature)
        if not result.finite:  # the update was skipped: torch's optimizer.step would not have run
            self._bridge.rollback_step()
        self._guard.after_step(
            step,
            result.loss,
            result.finite,
            self._loss_scaler,
            lambda: diagnosis.culprit(self._param_names, lambda: self.locate_nonfinite(batch)),
        )
        self._recorder.record(
            _metrics.StepFacts(
                step=self._steps_taken,
                loss=result.loss,
                step_time_s=time.perf_counter() - started,
                signature=signature,
                tokens=_metrics.count_tokens(batch),
                loss_scale=loss_scale,
                update_skipped=not result.finite,
                recompiled=recompiled,
                grad_norm=result.grad_norm,
                data_wait_s=waited + converting_s + self._executor.last_data_wait_s,
            ),
            lambda: self.last_metrics,
        )
        return self._compiled.returned(signature, result)

    def run(self, steps: int | None = None, *, epochs: int | None = None) -> Iterator[Any]:
        """Host-loaded training (``compile(data=...)``): ``for loss in engine.run(steps)`` (``epochs=``: to the end of
        that many epochs from the current position) runs :meth:`step` on each next batch, yielding what it returns."""
        return self._inputs.run(self.step, steps, epochs)

    def prefetch(self, loader: Iterable[Any], depth: int = PREFETCH_DEPTH) -> Iterator[Any]:
        """``for batch in engine.prefetch(loader): engine.step(batch)``: ``loader``'s next batches pulled, converted
        and placed on a background thread while the step runs (at most ``depth`` ahead;
        :mod:`torchpar.engine.feeding`)."""
        return self._inputs.prefetch(loader, lambda: self._executor, self._compiled.step_graphs, depth)

    def _bring_in(self, batch: Any, *, setup: bool = True) -> bool:
        """Before a step (or forward, save…) on ``batch``: what user code wrote into the torch model and optimizer
        since the last step goes into the engine (:meth:`TorchSide.changes`); a change the compiled step cannot take
        as new values recompiles it on ``batch`` (``setup=False``: training-setup changes wait for the next step).
        Returns whether it recompiled."""
        changes = self._torch.changes(setup=setup)
        if changes:
            self._recompile_for_changes(batch, changes, floats=self._torch.changed_floats())
        return bool(changes)

    def _recompile_for_changes(self, batch: Any, changes: list[str], floats: list[NumberAttribute]) -> None:
        """The model or optimizer changed what a step trains since compile (``changes``): carry the trained state into
        the torch objects, free the executor and compile again from them on ``batch`` with the same method and
        options, keeping the step count, PRNG stream, loss scale and skipped-step count. What PyTorch would train now
        is what the next step trains. ``floats``: float attributes that changed; those ``forward`` uses in tensor
        arithmetic are read as step inputs from now on, so their next changes need no recompile."""
        fed = self._torch.feedable_floats(batch, floats)
        self._torch.announce_recompile(changes, fed)
        self._torch.hand_over()
        carried = (self._steps_taken, self._base_key, self._loss_scaler, self._guard.skipped_steps)
        self._torch.close(pull=False)
        self._finalizer.detach()
        self._executor.close()
        again = self._captured._again(batch, numbers=(*self._compiled.numbers, *fed))
        Engine.__init__(self, again.plan(self.method))
        self._steps_taken, self._base_key, self._loss_scaler, self._guard.skipped_steps = carried

    def locate_nonfinite(self, batch: Any) -> str:
        """Re-run one step on ``batch`` eagerly on this process (the whole state exported) and say where the first
        inf/nan comes from: what ``on_nonfinite="raise"`` reports, on demand."""
        signature = batches.signature(batch)
        self._check_compatible(signature, batch)
        graph = self._compiled.diagnosis_graph(signature, batch)
        return diagnosis.locate(
            graph,
            state=self._executor.export_state(),
            batch=batch,
            key=self._jax.random.wrap_key_data(self._jax.numpy.asarray(self._step_key_data(self._steps_taken))),
            trainable=self._compiled.trainable(graph),
            num_micro_batches=self._compiled.parts.count,
        )

    @linked()
    def forward(self, batch: Any) -> Any:
        """The model's eval-mode outputs on ``batch``, as torch tensors in the model's output structure (with the
        torch model's current weights: what user code wrote into it since the last step is taken in first). The
        training setup plays no part (the model is captured in eval mode): ``model.eval()`` before an evaluation
        recompiles nothing, and neither does ``model.train()`` after it."""
        signature = batches.signature(batch)
        self._check_compatible(signature, batch)
        capture = self._compiled.forward_capture(signature, batch)
        self._guard.learn(("eval", signature), capture.graph)
        leaves = self._host_leaves(("eval", signature), batch)
        with self._compiled.translating_failures("running the forward"):
            outputs = self._executor.forward(("eval", signature), capture.graph, leaves)
        tensors = [to_torch(o) if o is not None else None for o in outputs]
        assert capture.out_spec is not None, "an eval capture unflattens its outputs"
        return pytree.tree_unflatten(tensors, capture.out_spec)

    @linked(bring_in=False)
    def sync_to_torch(self) -> None:
        """Copy parameters, buffers and optimizer state into the torch model and optimizer now. Not needed for the
        model (it is pulled whenever user code looks at it, :mod:`torchpar.engine.model_link`) nor for
        ``optimizer.state_dict()`` (pulled then too); kept for loops that read the optimizer's ``state`` directly."""
        self._torch.pull()
        self._torch.write_optimizer_state()

    def close(self) -> None:
        """Copy the engine's newer weights into the torch model, then free the engine's workers (Ray actors and what
        they hold); idempotent; also on leaving a ``with`` block and by ``torchpar.shutdown()`` (a garbage-collected
        engine frees its workers without the copy). The engine is unusable afterwards."""
        try:
            if not self._torch.closed:
                self._torch.close(pull=not self._executor.closed)
        finally:
            self._executor.close()

    shutdown = close
    """Former name of :meth:`close`."""

    @property
    def closed(self) -> bool:
        return self._executor.closed

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- checks and failures ------------------------------------------------------------------------------

    def _step_key_data(self, step: int) -> np.ndarray:
        return self._step_keys.data(self._base_key, step)

    def _host_leaves(self, key: Any, batch: Any) -> list[np.ndarray]:
        """The batch's leaves as host arrays in the dtypes JAX holds them in, index ranges checked."""
        return self._guard.host_leaves(key, batches.call_leaves(batch), leaf_names(batch), host_value)

    def _check_compatible(self, signature: tuple, batch: Any) -> None:
        batches.check_compatible(signature, batch, self._example_signature, self._example_skeleton)

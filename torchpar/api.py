"""``torchpar.compile`` and the :class:`Engine` it returns.

The engine owns three things and nothing more: the capture of the user's model (one training graph per
batch signature, one eval graph per forward signature), the :class:`~torchpar.planner.plan.Plan`, and one
executor (:mod:`torchpar.runtime`) that runs the plan — in this process, or on Ray host actors. Each
``step`` reads the optimizer's hyper-parameters from ``optimizer.param_groups`` (so torch LR schedulers
work) and hands the batch to the executor; ``sync_to_torch`` writes the state back into the user's model
and optimizer. ``close()`` (or leaving a ``with`` block) frees the executor's workers.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.utils._pytree as pytree

from torchpar import batches
from torchpar import checkpoint as _checkpoint
from torchpar import diagnosis
from torchpar import metrics as _metrics
from torchpar.capture.checkpointing import warn_if_gradient_checkpointing
from torchpar.capture.export import (Capture, ForwardFn, LossFn, StepFn, capture_forward, capture_train_step,
                                     check_model_fns, dtype_name)
from torchpar.capture.grad_semantics import params_reaching_loss, trainable_params
from torchpar.capture.optim import TorchOptimizerBridge, mark_optimizer_stepped
from torchpar.capture.precision import autocast_dtype
from torchpar.capture.training_setup import describe_changes, training_setup
from torchpar.cluster import current_cluster, default_compile_cache
from torchpar.guard import StepGuard, leaf_names
from torchpar.host_arrays import host_value, jax_dtype, to_torch
from torchpar.ir.graph import Graph
from torchpar.ir.optimizer import state_copies
from torchpar.methods import (DataParallel, MegatronParallel, Method, PipeshardParallel, ShardParallel, Zero2Parallel,
                              Zero3Parallel)
from torchpar.options import (CompileOptions, MatmulPrecision, MixedPrecision, OnNonfinite, Remat, SpmdMode,
                              describe_numerics, numerics_for)
from torchpar.planner.for_method import check_plan_fits, plan_for_method, single_device_plan
from torchpar.planner.plan import Plan
from torchpar.planner.remat import check_remat
from torchpar.profiled import finish_profiling, profiling_if
from torchpar.progress import CompilePhases

log = logging.getLogger(__name__)

def compile(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    example_batch: Any,
    loss_fn: LossFn | None = None,
    step_fn: StepFn | None = None,
    forward_fn: ForwardFn | None = None,
    method: Method | Plan | None = None,
    grad_clip_norm: float | None = None,
    seed: int = 0,
    xla_library_fusions: bool = True,
    spmd: SpmdMode = "auto",
    check_inputs: bool = True,
    on_nonfinite: OnNonfinite = "raise",
    matmul_precision: MatmulPrecision | None = None,
    mixed_precision: MixedPrecision | None = None,
    remat: Remat | None = None,
    profile: bool = False,
    log_every: int = 0,
    on_metrics: Callable[[_metrics.StepMetrics], None] | None = None,
) -> "Engine":
    """Capture ``model``'s training step on ``example_batch`` and compile it with ``method``.

    ``method=None`` runs on one device; a :class:`Plan` (e.g. loaded with ``Plan.from_dict``) runs as given,
    without solving. See DESIGN.md §2 for the calling convention and the loss rule. With
    ``torchpar.init(cluster="ray", ...)`` every method runs on the Ray host actors. The engine holds workers
    until ``engine.close()``; ``with torchpar.compile(...) as engine:`` closes it on exit. The keyword options
    are the fields of :class:`CompileOptions` (each documented there).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    methods = (DataParallel, Zero2Parallel, Zero3Parallel, MegatronParallel, ShardParallel, PipeshardParallel)
    if isinstance(method, type) and issubclass(method, methods):
        raise TypeError(f"method=torchpar.{method.__name__} is the class; pass an instance: "
                        f"method=torchpar.{method.__name__}() (its options, if any, inside the parentheses)")
    if method is not None and not isinstance(method, (*methods, Plan)):
        raise TypeError(f"method must be None, a torchpar parallel method or a Plan (e.g. torchpar.DataParallel()), "
                        f"got {method!r} of type {type(method).__name__}")
    check_model_fns(loss_fn, step_fn, forward_fn)
    options = CompileOptions(grad_clip_norm=grad_clip_norm, seed=seed, xla_library_fusions=xla_library_fusions,
                             spmd=spmd, check_inputs=check_inputs, on_nonfinite=on_nonfinite,
                             matmul_precision=matmul_precision, mixed_precision=mixed_precision, remat=remat,
                             profile=profile, log_every=log_every, on_metrics=on_metrics)
    warn_if_gradient_checkpointing(model, stacklevel=3)  # the caller of torchpar.compile
    default_compile_cache()
    return Engine(model, optimizer, example_batch, loss_fn, options, method, step_fn=step_fn, forward_fn=forward_fn)


def plan(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, example_batch: Any,
         loss_fn: LossFn | None = None, step_fn: StepFn | None = None, method: Method | None = None,
         explain: bool = True, mixed_precision: MixedPrecision | None = None, remat: Remat = "none",
         profile: bool = False) -> Plan:
    """The plan ``method`` gives the model's training step, without XLA compilation or a step (for inspecting
    and comparing plans). Capture and planning phases are timed in ``plan.timings``.

    ``explain`` (default): also count each stage's collective bytes by kind and, for one-stage methods, price
    ShardParallel, DataParallel, Zero2Parallel and MegatronParallel on the same cost model
    (``plan.solver["method_comparison"]``), for the summary and the report; a few more solves.
    ``mixed_precision`` as in :func:`compile` (the plan prices the autocast graph's dtypes); ``remat`` as in
    :func:`compile`: the plan prices it (kept activations in memory, recomputed FLOPs in the step); ``"auto"`` lets the
    planner pick (``plan.remat``, ``plan.solver["remat"]``). ``profile``: measured profiling as in :func:`compile`
    (compiles and times the candidates on this process's devices)."""
    check_remat(remat, allow_auto=True)
    check_model_fns(loss_fn, step_fn, None)
    warn_if_gradient_checkpointing(model, stacklevel=3)  # the caller of torchpar.plan
    start = time.perf_counter()
    pipeshard = isinstance(method, PipeshardParallel)
    batch = batches.first_micro_batch(example_batch, getattr(method, "num_micro_batches", 1))
    capture = capture_train_step(model, batch, loss_fn, autocast=autocast_dtype(mixed_precision), step_fn=step_fn)
    capture_s = time.perf_counter() - start
    names = dict(model.named_parameters())
    spec = TorchOptimizerBridge(optimizer, {id(p): n for n, p in names.items()}).spec
    trainable = {n for n in spec.param_names if names[n].requires_grad} & params_reaching_loss(capture.graph)
    with profiling_if(profile, current_cluster(), spec=spec, trainable=trainable,
                      num_micro_batches=getattr(method, "num_micro_batches", 1) if pipeshard else 1,
                      numerics=numerics_for(None), library_fusions=True) as profiling:
        cluster = profiling.cluster if profiling else current_cluster()
        if method is None:
            result = single_device_plan(capture.graph, cluster, remat, trainable=trainable,
                                        optimizer_state_copies=state_copies(spec))
        elif pipeshard:
            from torchpar.planner.pipeline_plan import plan_pipeline

            planned = plan_pipeline(capture.graph, method, cluster, trainable=trainable,
                                    optimizer_state_copies=state_copies(spec), remat=remat,
                                    stage_timer=profiling.timer if profiling else None)
            if explain:
                planned.explain()
            result = planned.plan
        else:
            result = plan_for_method(capture.graph, method, cluster, trainable=trainable,
                                     optimizer_state_copies=state_copies(spec), explain=explain, remat=remat)
        finish_profiling(profiling, result, capture.graph, pipeshard)
    result.timings = {"capture": capture_s, **result.timings}
    result.numerics = describe_numerics(numerics_for(None), mixed_precision)
    return result


class Engine:
    """A compiled training step bound to a model and optimizer. Create it with :func:`torchpar.compile`."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, example_batch: Any,
                 loss_fn: LossFn | None, options: CompileOptions, method: Method | Plan | None = None, *,
                 step_fn: StepFn | None = None, forward_fn: ForwardFn | None = None):
        on_meta = next((name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
        if on_meta is not None:
            raise ValueError(f"{on_meta} is on the meta device: the model has no weights to train. torchpar.plan(...) "
                             "plans such a model (python -m torchpar plan --meta); to train it, materialize the "
                             "weights first (model.to_empty(device='cpu') and initialize them, or load a checkpoint)")
        import jax

        self._jax = jax
        self.model = model
        self.optimizer = optimizer
        self.options = options
        self.method = method
        self._loss_fn = loss_fn
        self._step_fn = step_fn
        self._forward_fn = forward_fn
        self._recorder = _metrics.StepRecorder(log_every=options.log_every, on_metrics=options.on_metrics)
        self._timings: dict[str, float] = {}
        self._param_names = dict(model.named_parameters())  # tied tensors keep their first name
        self._buffer_names = dict(model.named_buffers())
        self._bridge = TorchOptimizerBridge(optimizer, {id(p): n for n, p in self._param_names.items()})
        self._spec = self._bridge.spec
        self._steps_taken = 0
        self._last_step_s: float | None = None
        self._base_key = jax.random.key(options.seed)
        self._autocast = autocast_dtype(options.mixed_precision)
        self._numerics = numerics_for(options.matmul_precision)
        from torchpar.runtime.loss_scale import LossScaler

        self._loss_scaler = LossScaler() if options.mixed_precision == "fp16" else None
        self._example_signature = batches.signature(example_batch)
        self._example_skeleton = batches.skeleton(example_batch)
        self._captures: dict[tuple, Capture] = {}
        self._eval: dict[tuple, Capture] = {}
        self._last_signature: tuple | None = None
        self._executor: Any = None
        self._guard = StepGuard(check_inputs=options.check_inputs, on_nonfinite=options.on_nonfinite)
        self._step_graphs: dict[tuple, Graph] = {}  # signature → the graph its step runs (diagnostic re-runs)
        self._pipelined = isinstance(method, PipeshardParallel) or (isinstance(method, Plan) and method.is_pipeline)
        # micro-batches per step (pipelines, gradient accumulation): each step's graph is captured on one of them
        self._micro_batches = int(getattr(method, "num_micro_batches", 1))
        self._setup = training_setup(model, optimizer)  # modes, requires_grad, param groups the step is compiled for
        try:
            with self._translating_failures("compiling the training step"):
                if self._pipelined:
                    self._init_pipeline(example_batch, method)
                else:
                    self._init_one_stage(example_batch, method)
        except BaseException:
            if self._executor is not None:
                self._executor.close()
            raise
        self._finalizer = weakref.finalize(self, self._executor.close)

    def _run_options(self) -> Any:
        from torchpar.runtime.worker import RunOptions

        return RunOptions(grad_clip_norm=self.options.grad_clip_norm, library_fusions=self.options.xla_library_fusions,
                          spmd=self.options.spmd, timeout_s=current_cluster().timeout_s,
                          check_finite=self.options.on_nonfinite != "ignore" or self._loss_scaler is not None,
                          numerics=self._numerics, loss_scaling=self._loss_scaler is not None,
                          remat=self._plan.remat)

    def _init_one_stage(self, example_batch: Any, method: Method | Plan | None) -> None:
        from torchpar.runtime import build_executor
        from torchpar.runtime.devices import DeviceMap
        from torchpar.runtime.worker import ExecutionSpec

        phases = CompilePhases(("capture", "plan", "start workers", "XLA compile"), "the training step")
        try:
            with phases.phase("capture"):
                capture = self._capture(batches.first_micro_batch(example_batch, self._micro_batches))
            with phases.phase("plan"):
                self._plan = self._make_plan(capture.graph, method)
                self._plan.numerics = describe_numerics(self._numerics, self.options.mixed_precision)
            with phases.phase("start workers"):
                cluster = current_cluster()
                spec = ExecutionSpec(plan=self._plan, optimizer=self._spec,
                                     devices=DeviceMap(cluster.devices_per_host), options=self._run_options())
                self._executor = build_executor(spec, cluster, label=self._plan.method)
                self._timings.update(self._executor.timings)
                self._executor.load_state(_checkpoint.torch_state(self._param_names, self._buffer_names, self._bridge))
            with phases.phase("XLA compile"):
                self._compile_step(self._example_signature, capture)
        finally:
            phases.close()

    def _init_pipeline(self, example_batch: Any, method: PipeshardParallel | Plan) -> None:
        """Plan a pipeline (or take a saved pipeline ``Plan`` as it is), start its executor, compile the stages."""
        from torchpar.ir.optimizer import step_scalars
        from torchpar.planner.pipeline_plan import plan_pipeline, stage_graphs_for
        from torchpar.runtime import build_executor
        from torchpar.runtime.devices import DeviceMap
        from torchpar.runtime.worker import ExecutionSpec

        if self.options.spmd != "auto":
            log.warning("torchpar: spmd=%r is ignored by pipelines (their stages run under GSPMD)", self.options.spmd)
        phases = CompilePhases(("capture", "plan", "start workers", "XLA compile"), "the pipeline stages")
        try:
            with phases.phase("capture"):
                micro_example = batches.first_micro_batch(example_batch, method.num_micro_batches)
                capture = self._capture(micro_example)
                self._guard.learn(self._example_signature, capture.graph)
                self._step_graphs[self._example_signature] = capture.graph
            with phases.phase("plan"):
                trainable = set(self._trainable(capture.graph))
                cluster = current_cluster()
                if isinstance(method, Plan):
                    check_plan_fits(method, cluster)
                    self._plan, stage_graphs = self._given_plan(method), stage_graphs_for(capture.graph, method)
                else:
                    with self._profiling(trainable, method.num_micro_batches) as profiling:
                        pipeline = plan_pipeline(capture.graph, method, profiling.cluster if profiling else cluster,
                                                 trainable=trainable, optimizer_state_copies=state_copies(self._spec),
                                                 remat=self.options.remat or "none",
                                                 stage_timer=profiling.timer if profiling else None)
                        finish_profiling(profiling, pipeline.plan, capture.graph, pipelined=True)
                    self._plan, stage_graphs = pipeline.plan, pipeline.stages
                self._plan.timings["capture"] = self._timings["capture"]
                self._plan.numerics = describe_numerics(self._numerics, self.options.mixed_precision)
            with phases.phase("start workers"):
                start = time.perf_counter()
                spec = ExecutionSpec(plan=self._plan, optimizer=self._spec, devices=DeviceMap(cluster.devices_per_host),
                                     options=self._run_options(), stage_graphs=stage_graphs,
                                     trainable=tuple(sorted(trainable)))
                self._executor = build_executor(spec, cluster, label="pipeshard")
                self._timings.update(self._executor.timings)
                self._executor.load_state(_checkpoint.torch_state(self._param_names, self._buffer_names, self._bridge))
                self._timings["lower"] = time.perf_counter() - start - sum(self._executor.timings.values())
            with phases.phase("XLA compile"):
                start = time.perf_counter()
                self._executor.warm_up(self._with_loss_scale(
                    step_scalars(self._spec, self._bridge.hparams(), [1] * self._spec.num_groups)))
                self._timings["xla_compile"] = time.perf_counter() - start
        finally:
            phases.close()
        log.info("torchpar plan:\n%s", self._plan.summary())

    # --- public API --------------------------------------------------------------------------------

    def step(self, batch: Any) -> float:
        """One optimizer step on ``batch``; returns the loss (before the update) as a float. Its measurements are
        then in :attr:`last_metrics`."""
        started = time.perf_counter()
        signature = batches.signature(batch)
        self._check_compatible(signature, batch)
        changes = describe_changes(self._setup, training_setup(self.model, self.optimizer))
        if changes:
            self._recompile_for_changes(batch, changes)
        recompiled = bool(changes) or signature not in (self._step_graphs if self._pipelined else self._captures)
        loss_scale = self.loss_scale
        if self._pipelined:
            if signature not in self._step_graphs:
                self._compile_pipeline_shapes(signature, batch)
        elif signature not in self._captures:
            log.info("torchpar: new batch shapes %s, recompiling the training step", batches.describe(signature))
            self._compile_step(signature, self._capture(batches.first_micro_batch(batch, self._micro_batches)))
        leaves = self._host_leaves(signature, batch)
        scalars = self._with_loss_scale(self._bridge.step_scalars())
        mark_optimizer_stepped(self.optimizer)
        key_data = self._step_key_data(self._steps_taken)
        with self._translating_failures(f"running step {self._steps_taken}"):
            start = time.perf_counter()
            result = self._executor.step(signature, leaves, scalars, key_data)
            self._last_step_s = time.perf_counter() - start
        step = self._steps_taken
        self._steps_taken += 1
        self._last_signature = signature
        if not result.finite:  # the update was skipped: torch's optimizer.step would not have run
            self._bridge.rollback_step()
        if self._loss_scaler is not None:
            self._loss_scaler.update(result.finite)
            if not result.finite and np.isfinite(result.loss):  # a gradient overflow: expected under fp16 scaling
                self._guard.skipped_steps += 1
                log.info("torchpar: step %d overflowed in fp16; update skipped, loss scale now %g", step,
                         self._loss_scaler.scale)
                self._record_step(batch, signature, result, started, loss_scale, recompiled)
                return result.loss
        self._guard.after_step(step, result.loss, result.finite,
                               lambda: diagnosis.culprit(self._param_names, lambda: self.locate_nonfinite(batch)))
        self._record_step(batch, signature, result, started, loss_scale, recompiled)
        return result.loss

    def _recompile_for_changes(self, batch: Any, changes: list[str]) -> None:
        """The model or optimizer changed what a step trains since compile (``changes``: modes, ``requires_grad``,
        param groups): carry the trained state into the torch objects, free the executor and compile again from
        them on ``batch`` with the same method and options, keeping the step count, PRNG stream, loss scale and
        skipped-step count. What PyTorch would train now is what the next step trains."""
        log.warning("torchpar: %s changed since compile; recompiling the training step", "; ".join(changes))
        self.sync_to_torch()
        carried = (self._steps_taken, self._base_key, self._loss_scaler, self._guard.skipped_steps)
        self._finalizer.detach()
        self._executor.close()
        Engine.__init__(self, self.model, self.optimizer, batch, self._loss_fn, self.options, self.method,
                        step_fn=self._step_fn, forward_fn=self._forward_fn)
        self._steps_taken, self._base_key, self._loss_scaler, self._guard.skipped_steps = carried

    def _record_step(self, batch: Any, signature: tuple, result: Any, started: float, loss_scale: float | None,
                     recompiled: bool) -> None:
        self._recorder.record(_metrics.StepFacts(
            step=self._steps_taken, loss=result.loss, step_time_s=time.perf_counter() - started, signature=signature,
            tokens=_metrics.count_tokens(batch), loss_scale=loss_scale, update_skipped=not result.finite,
            recompiled=recompiled), lambda: self.last_metrics)

    @property
    def last_metrics(self) -> _metrics.StepMetrics | None:
        """The last step's :class:`torchpar.metrics.StepMetrics` (step time, samples/s, tokens/s, model FLOPs, MFU,
        per-device memory, compile timings, loss, loss scale); ``None`` before the first step. Derived when first
        read (the memory once per batch signature: a pipeline compiles its stages once more to read it)."""
        return self._recorder.last(lambda: _metrics.MetricsSource(
            graphs=self._step_graphs, num_micro_batches=self._micro_batches, precision=_metrics.step_precision(
                self.options.mixed_precision, self._numerics.effective().matmul,
                [dtype_name(p.dtype) for p in self._param_names.values()]),
            cluster=current_cluster(), plan=self.plan, memory_stats=self.memory_stats))

    @property
    def loss_scale(self) -> float | None:
        """The dynamic loss scale the next step uses (``mixed_precision="fp16"``), else ``None``."""
        return None if self._loss_scaler is None else self._loss_scaler.scale

    @property
    def numerics(self) -> dict[str, Any]:
        """What the step computes with: ``matmul_precision`` / ``conv_precision`` asked (``"highest"``,
        ``"high"``, ``"medium"``), ``effective`` on this platform (the CPU computes fp32 products whatever is
        asked), ``mixed_precision`` and ``loss_scaling``."""
        return dict(self._plan.numerics)

    @property
    def skipped_steps(self) -> int:
        """Steps whose loss or gradients were inf/nan and whose update was skipped (``on_nonfinite="skip"``;
        with ``"raise"`` each such step raised)."""
        return self._guard.skipped_steps

    def locate_nonfinite(self, batch: Any) -> str:
        """Re-run one training step on ``batch`` on this process, eagerly and op by op, with the current state, and
        say where the first inf/nan comes from (an input, the state, the first op producing it, or the gradients):
        what ``on_nonfinite="raise"`` reports, on demand. The state is exported from the workers (all of it)."""
        signature = batches.signature(batch)
        self._check_compatible(signature, batch)
        graph = self._graph_for_diagnosis(batch, signature)
        return diagnosis.locate(graph, state=self._executor.export_state(), batch=batch,
                                key=self._jax.random.wrap_key_data(self._step_key_data(self._steps_taken)),
                                trainable=self._trainable(graph), num_micro_batches=self._micro_batches)

    def forward(self, batch: Any) -> Any:
        """The model's eval-mode outputs on ``batch``, as torch tensors in the model's output structure."""
        signature = batches.signature(batch)
        self._check_compatible(signature, batch)
        if signature not in self._eval:
            self._eval[signature] = capture_forward(self.model, batch, autocast=self._autocast,
                                                    forward_fn=self._forward_fn)
        capture = self._eval[signature]
        self._guard.learn(("eval", signature), capture.graph)
        leaves = self._host_leaves(("eval", signature), batch)
        with self._translating_failures("running the forward"):
            outputs = self._executor.forward(("eval", signature), capture.graph, leaves)
        tensors = [to_torch(o) if o is not None else None for o in outputs]
        return pytree.tree_unflatten(tensors, capture.out_spec)

    def sync_to_torch(self) -> None:
        """Copy parameters, buffers and optimizer state into the torch model and optimizer."""
        graph = self._step_graphs[self._last_signature or self._example_signature]
        _checkpoint.sync_to_torch(self._training_state(), trained=lambda: set(self._trainable(graph)))

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint of parameters, buffers, optimizer state, step count and PRNG position.

        Arrays are CPU torch tensors holding the exact values, parameters and buffers in the model's dtypes (an
        ``int64`` buffer JAX holds as ``int32`` comes back ``int64``); ``load_state_dict`` restores them. Save it
        with ``torch.save`` and read it back with ``torch.load(path, weights_only=True)``: tensors, numbers and
        dicts only, so nothing is unpickled that could run code."""
        return _checkpoint.state_dict(self._training_state())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint made by :meth:`state_dict` (same model and optimizer structure)."""
        self._restore(_checkpoint.load_state_dict, state)

    def save(self, path: str, *, scheduler: Any = None) -> Any:
        """Write a sharded checkpoint at ``path`` (a directory): every process writes the shards it holds (safetensors
        files) and an ``index.json`` maps each tensor to its pieces; atomic (a save killed midway leaves the previous
        checkpoint at ``path``). Holds the state, optimizer counters and ``param_groups`` hyper-parameters, step
        count, PRNG key, loss scale and ``scheduler``'s state. Returns the path. See :mod:`torchpar.checkpoint`."""
        return _checkpoint.save(self._training_state(), path, scheduler=scheduler)

    def load(self, path: str, *, scheduler: Any = None) -> None:
        """Restore a checkpoint written by :meth:`save` by an engine of any plan (another method, mesh, pipeline or
        runtime): each process reads only the slices its devices hold under this engine's plan."""
        self._restore(_checkpoint.load, path, scheduler=scheduler)

    def export_torch_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights as ``model.state_dict()`` keys them (CPU tensors, the model's dtypes), for
        ``model.load_state_dict``; gathers the whole model (not the optimizer state) to this process."""
        return _checkpoint.export_torch_state_dict(self._training_state())

    def save_pretrained(self, directory: str, **kwargs: Any) -> None:
        """A HuggingFace model's ``save_pretrained(directory, **kwargs)`` with the engine's current weights (copied
        into the torch model first): ``config.json`` + ``model.safetensors``, loadable with ``from_pretrained``."""
        _checkpoint.save_pretrained(self._training_state(), directory, **kwargs)

    def _training_state(self) -> _checkpoint.TrainingState:
        return _checkpoint.TrainingState(
            executor=self._executor, model=self.model, optimizer=self.optimizer, params=self._param_names,
            buffers=self._buffer_names, bridge=self._bridge, plan=self._plan, seed=self.options.seed,
            loss_scaler=self._loss_scaler, steps_taken=self._steps_taken, base_key=self._base_key,
            translating_failures=self._translating_failures)

    def _restore(self, restore: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """``restore(training_state, *args, **kwargs)``, then take back the step count and PRNG key it restored."""
        training = self._training_state()
        try:
            restore(training, *args, **kwargs)
        finally:
            self._steps_taken, self._base_key = training.steps_taken, training.base_key

    def close(self) -> None:
        """Free the engine's workers (the Ray actors and what they hold); the engine is unusable afterwards.
        Idempotent; also called on leaving ``with torchpar.compile(...) as engine:``, by
        ``torchpar.shutdown()``, and when the engine is garbage-collected."""
        if self._executor is not None:
            self._executor.close()

    shutdown = close
    """Former name of :meth:`close`."""

    @property
    def closed(self) -> bool:
        return self._executor is None or self._executor.closed

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def hlo_text(self) -> list[str]:
        """Optimized HLO of each compiled stage of the most recently used step (for a pipeline: each stage's
        forward)."""
        return self._executor.hlo_text()

    @property
    def last_timeline(self) -> Any:
        """Measured compute blocks of each pipeline stage in the last step, for
        ``plan.save_html(path, timeline=engine.last_timeline)``; ``None`` before the first step."""
        return self._executor.last_timeline

    def memory_stats(self) -> dict[int, dict[str, int]]:
        """XLA's per-device memory analysis of each compiled stage, keyed by stage index: ``{stage: {field:
        bytes}}`` with fields ``argument/output/alias/temp/generated_code_bytes``. A one-stage plan (one device,
        DataParallel, ZeRO, Megatron, ShardParallel) is stage ``0``: its step executable, for the most recently
        used batch signature. A pipeline has one entry per stage and two executables per stage: the fields are
        prefixed ``forward_`` (parameters and a micro-batch in, activations and residuals out) and ``backward_``
        (residuals and cotangents in, gradients out). Available once the engine is compiled; the same on the
        local and the Ray runtime (read by each stage's lead process)."""
        return self._executor.memory_stats()

    def measured(self) -> dict[str, Any]:
        """What this engine measured, in the form the plan report shows beside its estimates:
        ``{"step_s": wall seconds of the last step (None before one), "memory_bytes": {stage: per-device bytes of
        the stage's executables by XLA's memory analysis (runtime.resources.executable_peak_bytes)}}``; each stage's figure
        is also recorded in ``engine.plan`` (``StagePlan.compiled_memory_bytes``), so ``plan.summary()`` shows it beside
        the estimate."""
        from torchpar.runtime.resources import executable_peak_bytes

        memory = {stage: executable_peak_bytes(stats) for stage, stats in self.memory_stats().items()}
        for stage, nbytes in memory.items():  # plan.summary() shows them beside the estimates
            if stage < len(self.plan.stages):
                self.plan.stages[stage].compiled_memory_bytes = int(nbytes)
        return {"step_s": self._last_step_s, "memory_bytes": memory}

    def save_report(self, path: str, **options: Any) -> Any:
        """The plan's HTML report (:meth:`Plan.save_html`) with what the engine measured beside the estimates: the
        last step's wall time, each stage's memory (:meth:`measured`) and, for pipelines, the last step's
        timeline. ``options`` go to ``save_html`` (``param_shapes``, ``title``, ...)."""
        measured = self.measured()
        if measured["step_s"] is None:
            del measured["step_s"]
        shapes = {name: list(p.shape) for name, p in self.model.named_parameters()}
        return self._plan.save_html(path, timeline=self.last_timeline, measured=measured,
                                    **{"param_shapes": shapes, **options})

    def describe_workers(self, programs: bool = False) -> list[dict[str, Any]]:
        """Each worker process's own account: rank, pid, JAX process index and devices, stages, steps run, the
        devices holding its share of the state; with ``programs=True`` also the HLO it runs per stage and
        that program's device assignment (as process indices)."""
        return self._executor.describe_workers(programs)

    @property
    def executor(self) -> Any:
        """The :class:`torchpar.runtime.executor.Executor` running the plan."""
        return self._executor

    @property
    def spmd_mode(self) -> str:
        """How the most recently compiled step runs: ``"shard_map"`` (a per-device program with explicit
        collectives) or ``"gspmd"`` (XLA partitions it); ``"pipeline"`` for PipeshardParallel."""
        return self._executor.spmd_mode

    @property
    def compiled_signatures(self) -> int:
        """How many batch signatures have a compiled training step (a new batch shape compiles once)."""
        return len(self._step_graphs) if self._pipelined else len(self._captures)

    @property
    def plan(self) -> Plan:
        """The execution plan, with every compile phase's seconds in ``timings``."""
        self._plan.timings.update(self._timings)
        return self._plan

    @property
    def graph(self) -> Graph:
        """The captured training graph (IR) of the most recent batch signature."""
        if self._pipelined:
            raise NotImplementedError("a pipeline engine holds one graph per stage: engine.executor.spec.stage_graphs")
        return self._captures[self._last_signature or self._example_signature].graph

    # --- compilation ----------------------------------------------------------------------------

    def _capture(self, batch: Any) -> Capture:
        """The training graph on ``batch``; every op must have a lowering (checked here, before any worker
        starts, so the error lists them all at once)."""
        from jaxbackend.lower import check_supported

        start = time.perf_counter()
        capture = capture_train_step(self.model, batch, self._loss_fn, autocast=self._autocast, step_fn=self._step_fn)
        self._timings["capture"] = time.perf_counter() - start
        check_supported(capture.graph)
        if self._micro_batches > 1:  # mark how micro-batch losses make the whole batch's (torchpar.ir.loss_parts)
            import dataclasses

            from torchpar.ir.loss_parts import with_loss_parts

            capture = dataclasses.replace(capture, graph=with_loss_parts(capture.graph))
        return capture

    def _make_plan(self, graph: Graph, method: Method | Plan | None) -> Plan:
        cluster = current_cluster()
        remat = self.options.remat or "none"
        if method is None:
            trainable = set(self._trainable(graph))
            plan = single_device_plan(graph, cluster, remat, trainable=trainable,
                                      optimizer_state_copies=state_copies(self._spec))
            with self._profiling(trainable, 1) as profiling:  # a no-op without profile=True
                finish_profiling(profiling, plan, graph, pipelined=False)
            return plan
        if isinstance(method, Plan):
            check_plan_fits(method, cluster)
            return self._given_plan(method)
        trainable = set(self._trainable(graph))
        with self._profiling(trainable, 1) as profiling:
            plan = plan_for_method(graph, method, profiling.cluster if profiling else cluster, trainable=trainable,
                                   optimizer_state_copies=state_copies(self._spec), remat=remat)
            finish_profiling(profiling, plan, graph, pipelined=False)
        log.info("torchpar plan:\n%s", plan.summary())
        return plan

    def _profiling(self, trainable: set[str], num_micro_batches: int) -> contextlib.AbstractContextManager[Any]:
        return profiling_if(self.options.profile, current_cluster(), spec=self._spec, trainable=trainable,
                            num_micro_batches=num_micro_batches, numerics=self._numerics,
                            library_fusions=self.options.xla_library_fusions)

    def _with_loss_scale(self, scalars: Any) -> Any:
        """A step's scalars: the optimizer's, with the loss scale under fp16 mixed precision."""
        return scalars if self._loss_scaler is None else (scalars, self._loss_scaler.step_input())

    def _given_plan(self, plan: Plan) -> Plan:
        """A saved plan as this engine runs it: with ``compile(remat=...)``'s option when one is given (``"auto"``
        keeps the plan's, which its planner chose)."""
        if self.options.remat not in (None, "auto"):
            plan.remat = self.options.remat
        return plan

    def _compile_step(self, signature: tuple, capture: Capture) -> None:
        from torchpar.ir.optimizer import step_scalars

        scalars = self._with_loss_scale(step_scalars(self._spec, self._bridge.hparams(), [1] * self._spec.num_groups))
        # the graph is one micro-batch's; the step takes the whole batch (micro-batches along dim 0)
        leaves = [((m.shape[0] * self._micro_batches, *m.shape[1:]), jax_dtype(m.dtype)) for m in capture.input_metas]
        with self._translating_failures("compiling the training step"):
            self._timings.update(self._executor.compile_step(signature, capture.graph, self._trainable(capture.graph),
                                                             leaves, scalars))
        self._captures[signature] = capture
        self._guard.learn(signature, capture.graph)
        self._step_graphs[signature] = capture.graph

    def _compile_pipeline_shapes(self, signature: tuple, batch: Any) -> None:
        """A pipeline on new batch shapes (e.g. an epoch's smaller last batch): capture one micro-batch of them,
        cut it into the plan's stages (the plan stays as it is) and compile those on the stages' devices."""
        from torchpar.ir.optimizer import step_scalars
        from torchpar.planner.pipeline_plan import stage_graphs_on_new_shapes

        micro_batch = batches.first_micro_batch(batch, self._plan.num_micro_batches)  # a ValueError if it does not split
        log.info("torchpar: new batch shapes %s, recompiling the pipeline stages", batches.describe(signature))
        capture = self._capture(micro_batch)
        try:
            stage_graphs = stage_graphs_on_new_shapes(capture.graph, self._step_graphs[self._example_signature],
                                                      self._plan)
        except ValueError as error:
            raise ValueError(f"the pipeline plan cannot cut the model captured on batch shapes "
                             f"{batches.describe(signature)} into its stages ({error}); keep the example batch's shapes "
                             f"{batches.describe(self._example_signature)}") from None
        scalars = step_scalars(self._spec, self._bridge.hparams(), [1] * self._spec.num_groups)
        with self._translating_failures("compiling the pipeline stages for new batch shapes"):
            self._executor.compile_shapes(signature, stage_graphs, scalars)
        self._guard.learn(signature, capture.graph)
        self._step_graphs[signature] = capture.graph

    def _trainable(self, graph: Graph) -> tuple[str, ...]:
        """Parameters the optimizer updates this step: in the optimizer, requiring grad, and reaching the
        loss (PyTorch leaves the others' ``.grad`` as ``None`` and skips them)."""
        return trainable_params(graph, self._param_names, self._spec.param_names)

    # --- checks and failures ------------------------------------------------------------------------------

    def _step_key_data(self, step: int) -> np.ndarray:
        return np.asarray(self._jax.random.key_data(self._jax.random.fold_in(self._base_key, step)))

    def _host_leaves(self, key: Any, batch: Any) -> list[np.ndarray]:
        """The batch's leaves as host arrays in the dtypes JAX holds them in, index ranges checked."""
        return self._guard.host_leaves(key, batches.call_leaves(batch), leaf_names(batch), host_value)

    def _translating_failures(self, what: str) -> contextlib.AbstractContextManager[None]:
        return self._guard.translating_failures(what, getattr(self, "_plan", None),
                                                current_cluster().device_memory_bytes)

    def _graph_for_diagnosis(self, batch: Any, signature: tuple) -> Graph:
        if signature not in self._step_graphs:
            if self._pipelined:
                raise ValueError("a pipeline engine diagnoses the batch shapes it was compiled for only")
            self._step_graphs[signature] = self._capture(batches.first_micro_batch(batch, self._micro_batches)).graph
        return self._step_graphs[signature]

    def _check_compatible(self, signature: tuple, batch: Any) -> None:
        batches.check_compatible(signature, batch, self._example_signature, self._example_skeleton)

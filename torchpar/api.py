"""``torchpar.compile`` and the :class:`Engine` it returns.

The engine owns the training state as JAX arrays — parameters, buffers, optimizer state — and one
compiled XLA executable per batch shape signature. Each ``step`` reads the optimizer's hyper-parameters
from ``optimizer.param_groups`` (so torch LR schedulers work), runs forward + ``jax.value_and_grad``
+ the optimizer update in one executable, and returns the loss. ``sync_to_torch`` writes the state back
into the user's model and optimizer.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Literal

import numpy as np
import torch
import torch.utils._pytree as pytree

from torchpar.capture.export import Capture, LossFn, capture_forward, capture_train_step, dtype_name
from torchpar.capture.optim import TorchOptimizerBridge
from torchpar.cluster import current_cluster
from torchpar.ir.graph import Graph
from torchpar.methods import (DataParallel, MegatronParallel, Method, PipeshardParallel, ShardParallel, Zero2Parallel,
                              Zero3Parallel)
from torchpar.planner.for_method import plan_for_method, single_device_plan
from torchpar.planner.plan import Plan
from torchpar.runtime.placement import Placement

log = logging.getLogger(__name__)

SpmdMode = Literal["auto", "gspmd", "shard_map"]
SPMD_MODES: tuple[str, ...] = ("auto", "gspmd", "shard_map")
_SHARD_MAP_METHODS = ("data_parallel", "zero2", "zero3")


@dataclasses.dataclass(kw_only=True, frozen=True)
class CompileOptions:
    """Options of :func:`compile` beyond the model, optimizer and method."""

    grad_clip_norm: float | None = None
    """Clip gradients to this global L2 norm before the update (``clip_grad_norm_``); ``None`` = off."""
    seed: int = 0
    """Seed of the PRNG stream that dropout and other random ops draw from; a seed reproduces a run."""
    xla_library_fusions: bool = True
    """On CPU, compile with XLA's YNNPACK and oneDNN library fusions (``jaxbackend.compiler``); ``False``
    keeps XLA's defaults."""
    spmd: SpmdMode = "auto"
    """How a sharded one-stage plan becomes a program. ``"gspmd"``: global shapes, XLA's SPMD partitioner
    inserts the collectives. ``"shard_map"``: a per-device program with explicit collectives
    (``torchpar.runtime.spmd_step``; gradients are reduce-scattered as such under ZeRO) for any one-stage
    plan; one it cannot run is an error. ``"auto"``: ``shard_map`` for DataParallel/Zero2/Zero3 plans when it
    can run them (else GSPMD, with the reason logged), GSPMD for the others. ``engine.spmd_mode`` says which
    ran."""

    def __post_init__(self) -> None:
        if self.grad_clip_norm is not None and not self.grad_clip_norm > 0:
            raise ValueError(f"grad_clip_norm must be positive or None, got {self.grad_clip_norm}")
        if self.spmd not in SPMD_MODES:
            raise ValueError(f"spmd must be one of {SPMD_MODES}, got {self.spmd!r}")


def compile(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    example_batch: Any,
    loss_fn: LossFn | None = None,
    method: Method | Plan | None = None,
    grad_clip_norm: float | None = None,
    seed: int = 0,
    xla_library_fusions: bool = True,
    spmd: SpmdMode = "auto",
) -> "Engine":
    """Capture ``model``'s training step on ``example_batch`` and compile it with ``method``.

    ``method=None`` runs on one device; a :class:`Plan` (e.g. loaded with ``Plan.from_dict``) runs as given,
    without solving. See DESIGN.md §2 for the calling convention and the loss rule.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if method is not None and not isinstance(method, (DataParallel, Zero2Parallel, Zero3Parallel, MegatronParallel,
                                                      ShardParallel, PipeshardParallel, Plan)):
        raise TypeError(f"method must be None, a torchpar parallel method or a Plan, got {type(method).__name__}")
    options = CompileOptions(grad_clip_norm=grad_clip_norm, seed=seed, xla_library_fusions=xla_library_fusions,
                             spmd=spmd)
    return Engine(model, optimizer, example_batch, loss_fn, options, method)


def plan(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, example_batch: Any,
         loss_fn: LossFn | None = None, method: Method | None = None) -> Plan:
    """The plan ``method`` gives the model's training step, without XLA compilation or a step (for inspecting
    and comparing plans). Capture and planning phases are timed in ``plan.timings``."""
    from jaxbackend import optim as jax_optim

    start = time.perf_counter()
    pipeshard = isinstance(method, PipeshardParallel)
    batch = _first_micro_batch(example_batch, method.num_micro_batches) if pipeshard else example_batch
    capture = capture_train_step(model, batch, loss_fn)
    capture_s = time.perf_counter() - start
    names = _unique_named(model.named_parameters())
    spec = TorchOptimizerBridge(optimizer, {id(p): n for n, p in names.items()}).spec
    trainable = {n for n in spec.param_names if names[n].requires_grad} & _params_reaching_loss(capture.graph)
    if method is None:
        result = single_device_plan(capture.graph, current_cluster())
    elif pipeshard:
        from torchpar.planner.pipeline_plan import plan_pipeline

        result = plan_pipeline(capture.graph, method, current_cluster(), trainable=trainable,
                               optimizer_state_copies=_state_copies(spec, jax_optim)).plan
    else:
        result = plan_for_method(capture.graph, method, current_cluster(), trainable=trainable,
                                 optimizer_state_copies=_state_copies(spec, jax_optim))
    result.timings = {"capture": capture_s, **result.timings}
    return result


def _state_copies(spec: Any, jax_optim: Any) -> float:
    """Optimizer-state tensors per parameter (2 for Adam, 1 for SGD with momentum), averaged over groups."""
    return sum(len(jax_optim.state_keys(spec, g)) for g in range(spec.num_groups)) / max(spec.num_groups, 1)


@dataclasses.dataclass
class _Executable:
    """A compiled step for one batch signature."""

    capture: Capture
    compiled: Any
    trainable: tuple[str, ...]
    spmd: str
    """``"shard_map"`` or ``"gspmd"`` (see :attr:`CompileOptions.spmd`)."""


class Engine:
    """A compiled training step bound to a model and optimizer. Create it with :func:`torchpar.compile`."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, example_batch: Any,
                 loss_fn: LossFn | None, options: CompileOptions, method: Method | Plan | None = None):
        import jax

        from jaxbackend import optim as jax_optim

        self._jax = jax
        self._jax_optim = jax_optim
        self.model = model
        self.optimizer = optimizer
        self.options = options
        self.method = method
        self._loss_fn = loss_fn
        self._timings: dict[str, float] = {}

        self._param_names = _unique_named(model.named_parameters())
        self._buffer_names = _unique_named(model.named_buffers())
        self._bridge = TorchOptimizerBridge(optimizer, {id(p): n for n, p in self._param_names.items()})
        self._spec = self._bridge.spec
        self._steps_taken = 0
        self._base_key = jax.random.key(options.seed)
        self._example_signature = _signature(example_batch)
        self._train: dict[tuple, _Executable] = {}
        self._eval: dict[tuple, tuple[Capture, Any]] = {}
        self._last: _Executable | None = None

        self._pipeline = None
        if isinstance(method, PipeshardParallel):
            self._init_pipeline(example_batch, method)
            return
        capture = self._capture(example_batch)
        self._plan = self._make_plan(capture.graph, method)
        self._placement = Placement.from_stage(self._plan.stages[0], capture.graph)
        self._params = {n: self._put(p, self._placement.param(n)) for n, p in self._param_names.items()}
        self._buffers = {n: self._put(b, self._placement.replicated) for n, b in self._buffer_names.items()}
        initial_state = self._bridge.initial_state()
        self._opt_state = {name: {key: self._put_array(value, self._placement.state_of(name)) for key, value in entries.items()}
                           for name, entries in initial_state.items()}
        self._train_executable(example_batch, capture)

    def _init_pipeline(self, example_batch: Any, method: PipeshardParallel) -> None:
        from torchpar.planner.pipeline_plan import plan_pipeline
        from torchpar.runtime.pipeline_runner import PipelineRunner

        if self.options.spmd != "auto":
            log.warning("torchpar: spmd=%r is ignored by PipeshardParallel (its stages run under GSPMD)",
                        self.options.spmd)
        micro_example = _first_micro_batch(example_batch, method.num_micro_batches)
        capture = self._capture(micro_example)
        trainable = set(self._trainable(capture.graph))
        pipeline = plan_pipeline(capture.graph, method, current_cluster(), trainable=trainable,
                                 optimizer_state_copies=_state_copies(self._spec, self._jax_optim))
        self._plan = pipeline.plan
        self._plan.timings["capture"] = self._timings["capture"]
        start = time.perf_counter()
        self._pipeline = PipelineRunner(pipeline, spec=self._spec, trainable=trainable,
                                        grad_clip_norm=self.options.grad_clip_norm, cluster=current_cluster(),
                                        library_fusions=self.options.xla_library_fusions)
        params = {n: p.detach().cpu().numpy() for n, p in self._param_names.items()}
        buffers = {n: b.detach().cpu().numpy() for n, b in self._buffer_names.items()}
        from jaxbackend.lower import to_numpy_input

        to_host = lambda tree: self._jax.tree.map(lambda a: to_numpy_input(np.asarray(a)), tree)  # noqa: E731
        self._pipeline.load(to_host(params), to_host(buffers), to_host(self._bridge.initial_state()))
        self._timings["lower"] = time.perf_counter() - start
        start = time.perf_counter()
        self._pipeline.warm_up(self._jax_optim.step_scalars(self._spec, self._bridge.hparams(),
                                                            [1] * self._spec.num_groups))
        self._timings["xla_compile"] = time.perf_counter() - start
        log.info("torchpar plan:\n%s", self._plan.summary())

    # --- public API --------------------------------------------------------------------------------

    def step(self, batch: Any) -> float:
        """One optimizer step on ``batch``; returns the loss (before the update) as a float."""
        if self._pipeline is not None:
            return self._pipeline_step(batch)
        executable = self._train_executable(batch)
        inputs = self._inputs(batch)
        scalars = self._bridge.step_scalars()
        _mark_optimizer_stepped(self.optimizer)
        key = self._jax.random.fold_in(self._base_key, self._steps_taken)
        loss, self._params, self._opt_state, self._buffers = executable.compiled(
            self._params, self._opt_state, self._buffers, inputs, scalars, key)
        self._steps_taken += 1
        self._last = executable
        return float(loss)

    def _pipeline_step(self, batch: Any) -> float:
        signature = _signature(batch)
        self._check_compatible(signature)
        if signature != self._example_signature:
            raise ValueError(f"PipeshardParallel runs the batch shapes it was compiled for "
                             f"({_describe(self._example_signature)}); got {_describe(signature)}")
        from jaxbackend.lower import to_numpy_input
        from torchpar.capture.export import batch_to_call_args

        leaves = [to_numpy_input(leaf.detach().cpu().numpy()) for leaf in pytree.tree_leaves(batch_to_call_args(batch))]
        scalars = self._bridge.step_scalars()
        _mark_optimizer_stepped(self.optimizer)
        key = self._jax.random.fold_in(self._base_key, self._steps_taken)
        loss = self._pipeline.step(leaves, scalars, key)
        self._steps_taken += 1
        return loss

    def _state_arrays(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
        """Parameters, buffers and optimizer state (device arrays, or host arrays for a pipeline)."""
        if self._pipeline is not None:
            return self._pipeline.export()
        return self._params, self._buffers, self._opt_state

    def forward(self, batch: Any) -> Any:
        """The model's eval-mode outputs on ``batch``, as torch tensors in the model's output structure."""
        capture, compiled = self._eval_executable(batch)
        params, buffers, _ = self._state_arrays()
        outputs = compiled(params, buffers, self._eval_inputs(batch))
        tensors = [_to_torch(o) if o is not None else None for o in outputs]
        return pytree.tree_unflatten(tensors, capture.out_spec)

    def sync_to_torch(self) -> None:
        """Copy parameters, buffers and optimizer state into the torch model and optimizer."""
        params, buffers, opt_state = self._state_arrays()
        with torch.no_grad():
            for name, param in self._param_names.items():
                param.copy_(_to_torch(params[name]).to(param.dtype))
            for name, buffer in self._buffer_names.items():
                buffer.copy_(_to_torch(buffers[name]).to(buffer.dtype))
        self._bridge.write_back(self._jax.tree.map(np.asarray, opt_state))

    def state_dict(self) -> dict[str, Any]:
        """A checkpoint of parameters, buffers, optimizer state, step count and PRNG position.

        Arrays are CPU torch tensors holding the exact values; ``load_state_dict`` restores them."""
        to_torch = lambda x: _to_torch(x)  # noqa: E731
        params, buffers, opt_state = self._state_arrays()
        return {
            "params": {n: to_torch(v) for n, v in params.items()},
            "buffers": {n: to_torch(v) for n, v in buffers.items()},
            "optimizer": self._jax.tree.map(to_torch, opt_state),
            "optimizer_counters": self._bridge.state_dict(),
            "steps_taken": self._steps_taken,
            "seed": self.options.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint made by :meth:`state_dict` (same model and optimizer structure)."""
        for kind, current in (("params", self._param_names), ("buffers", self._buffer_names)):
            missing = set(current) ^ set(state[kind])
            if missing:
                raise ValueError(f"checkpoint {kind} differ from the model's: {sorted(missing)[:5]}")
        if self._pipeline is not None:
            from jaxbackend.lower import to_numpy_input

            host = lambda t: to_numpy_input(t.detach().cpu().numpy())  # noqa: E731
            self._pipeline.load({n: host(v) for n, v in state["params"].items()},
                                {n: host(v) for n, v in state["buffers"].items()},
                                {n: {k: host(v) for k, v in e.items()} for n, e in state["optimizer"].items()})
        else:
            self._params = {n: self._put(state["params"][n], self._placement.param(n)) for n in self._params}
            self._buffers = {n: self._put(state["buffers"][n], self._placement.replicated) for n in self._buffers}
            self._opt_state = {name: {key: self._put(value, self._placement.state_of(name))
                                      for key, value in entries.items()}
                               for name, entries in state["optimizer"].items()}
        self._bridge.load_state_dict(state["optimizer_counters"])
        self._steps_taken = int(state["steps_taken"])
        if int(state["seed"]) != self.options.seed:
            log.warning("checkpoint seed %s differs from this engine's seed %s; using the checkpoint's",
                        state["seed"], self.options.seed)
            self._base_key = self._jax.random.key(int(state["seed"]))

    def shutdown(self) -> None:
        """Free the engine's remote workers (Ray actors of a pipeline); the engine is unusable afterwards."""
        if self._pipeline is not None:
            self._pipeline.shutdown()

    def hlo_text(self) -> list[str]:
        """Optimized HLO of each compiled stage of the most recently used step (for a pipeline: each stage's
        forward)."""
        if self._pipeline is not None:
            return self._pipeline.hlo_text()
        executable = self._last or next(iter(self._train.values()))
        return [executable.compiled.as_text()]

    @property
    def last_timeline(self) -> Any:
        """Measured compute blocks of each pipeline stage in the last step (Ray runtime), for
        ``plan.save_html(path, timeline=engine.last_timeline)``; ``None`` when not recorded."""
        if self._pipeline is None:
            return None
        return getattr(self._pipeline.runtime, "last_timeline", None)

    def memory_stats(self) -> list[dict[str, int]]:
        """XLA's per-device memory analysis of each compiled stage (bytes of arguments, outputs, temporaries,
        generated code) for the most recently used step. A pipeline stage has two executables: its fields
        are prefixed ``forward_`` (parameters and a micro-batch in, activations and residuals out) and
        ``backward_`` (residuals and cotangents in, gradients out); available after the first step."""
        if self._pipeline is not None:
            return self._pipeline.memory_stats()
        from jaxbackend.compiler import memory_analysis

        executable = self._last or next(iter(self._train.values()))
        return [memory_analysis(executable.compiled)]

    @property
    def spmd_mode(self) -> str:
        """How the most recently used step runs: ``"shard_map"`` (a per-device program with explicit
        collectives) or ``"gspmd"`` (XLA partitions it); ``"pipeline"`` for PipeshardParallel."""
        if self._pipeline is not None:
            return "pipeline"
        return (self._last or next(iter(self._train.values()))).spmd

    @property
    def plan(self) -> Plan:
        """The execution plan, with every compile phase's seconds in ``timings``."""
        self._plan.timings.update(self._timings)
        return self._plan

    @property
    def graph(self) -> Graph:
        """The captured training graph (IR) of the most recent batch signature."""
        if self._pipeline is not None:
            raise NotImplementedError("a pipeline engine holds one graph per stage: engine.pipeline_stages")
        return (self._last or next(iter(self._train.values()))).capture.graph

    # --- compilation ----------------------------------------------------------------------------

    def _capture(self, batch: Any) -> Capture:
        start = time.perf_counter()
        capture = capture_train_step(self.model, batch, self._loss_fn)
        self._timings["capture"] = time.perf_counter() - start
        return capture

    def _make_plan(self, graph: Graph, method: Method | Plan | None) -> Plan:
        cluster = current_cluster()
        if method is None:
            return single_device_plan(graph, cluster)
        if isinstance(method, Plan):
            if len(method.stages) != 1:
                raise NotImplementedError("plans with several pipeline stages need PipeshardParallel (not implemented yet)")
            return method
        trainable = set(self._trainable(graph))
        plan = plan_for_method(graph, method, cluster, trainable=trainable,
                               optimizer_state_copies=_state_copies(self._spec, self._jax_optim))
        log.info("torchpar plan:\n%s", plan.summary())
        return plan

    def _train_executable(self, batch: Any, capture: Capture | None = None) -> _Executable:
        signature = _signature(batch)
        self._check_compatible(signature)
        if signature in self._train:
            return self._train[signature]
        if self._train:
            log.info("torchpar: new batch shapes %s, recompiling the training step", _describe(signature))
        jax = self._jax
        t0 = time.perf_counter()
        capture = capture or self._capture(batch)
        t1 = time.perf_counter()
        placement = self._placement
        trainable = self._trainable(capture.graph)
        out_shardings = (placement.replicated, {n: placement.param(n) for n in self._params},
                         {n: {k: placement.state_of(n) for k in entries} for n, entries in self._opt_state.items()},
                         {n: placement.replicated for n in self._buffers})
        scalars = self._jax_optim.step_scalars(self._spec, self._bridge.hparams(), [1] * self._spec.num_groups)
        args = (self._params, self._opt_state, self._buffers, self._inputs(batch), scalars, jax.random.key(0))
        jit_step = lambda step_fn: jax.jit(step_fn, donate_argnums=(0, 1, 2), out_shardings=out_shardings)  # noqa: E731
        lowered, spmd = None, "gspmd"
        layouts = self._shard_map_layouts(capture.graph)
        if layouts is not None:
            from jaxbackend.spmd import LocalModeError

            try:
                lowered = jit_step(self._spmd_step(capture, layouts, trainable, len(args[3]))).lower(*args)
                spmd = "shard_map"
            except LocalModeError as error:
                if self.options.spmd == "shard_map":
                    raise ValueError(f"spmd='shard_map' cannot run this plan: {error}\nTry spmd='gspmd'.") from error
                log.warning("torchpar: the per-device (shard_map) step cannot run this plan, using GSPMD: %s", error)
        if lowered is None:
            from jaxbackend.lower import lower

            run = lower(capture.graph, value_shardings=placement.values, operand_shardings=placement.operands)
            step_fn = _make_train_step(run, trainable, self._spec, self._jax_optim, self.options.grad_clip_norm,
                                       placement.grads)
            lowered = jit_step(step_fn).lower(*args)
        t2 = time.perf_counter()
        from jaxbackend.compiler import compiler_options

        compiled = lowered.compile(compiler_options=compiler_options(self.options.xla_library_fusions,
                                                                     placement.mesh.devices.size))
        t3 = time.perf_counter()
        self._timings.update(lower=t2 - t1, xla_compile=t3 - t2)
        log.info("torchpar: compiled training step (%d ops, %s) in %.2fs: lower %.2fs, XLA %.2fs",
                 len(capture.graph.nodes), spmd, t3 - t0, t2 - t1, t3 - t2)
        executable = _Executable(capture=capture, compiled=compiled, trainable=trainable, spmd=spmd)
        self._train[signature] = executable
        return executable

    def _shard_map_layouts(self, graph: Graph) -> Any:
        """The value layouts a per-device step runs with, or ``None`` for the GSPMD step (per
        :attr:`CompileOptions.spmd`; raises ``ValueError`` if ``"shard_map"`` was asked for and cannot run)."""
        mode = self.options.spmd
        if mode == "gspmd" or (mode == "auto" and self._plan.method not in _SHARD_MAP_METHODS):
            return None
        from torchpar.planner.sharding.layouts import replay_layouts

        layouts = replay_layouts(graph, self._plan.stages[0])
        obstacles = layouts.obstacles()
        if not obstacles:
            return layouts
        reasons = "\n  ".join(obstacles[:10] + ([f"… and {len(obstacles) - 10} more"] if len(obstacles) > 10 else []))
        if mode == "shard_map":
            raise ValueError(f"spmd='shard_map' cannot run this plan:\n  {reasons}\nTry spmd='gspmd'.")
        log.warning("torchpar: %s plan runs under GSPMD; a per-device (shard_map) step cannot run it:\n  %s",
                    self._plan.method, reasons)
        return None

    def _spmd_step(self, capture: Capture, layouts: Any, trainable: tuple[str, ...], num_inputs: int) -> Callable:
        from jaxbackend.lower import lower
        from torchpar.runtime.spmd_step import make_spmd_step

        run = lower(capture.graph, layouts=layouts)
        return make_spmd_step(run, layouts, self._plan.stages[0], mesh=self._placement.mesh,
                              param_names=list(self._params), buffer_names=list(self._buffers),
                              state_keys={n: list(e) for n, e in self._opt_state.items()}, num_inputs=num_inputs,
                              trainable=trainable, spec=self._spec, jax_optim=self._jax_optim,
                              grad_clip_norm=self.options.grad_clip_norm,
                              per_device_gradients=self._plan.method in _SHARD_MAP_METHODS)

    def _eval_executable(self, batch: Any) -> tuple[Capture, Any]:
        signature = _signature(batch)
        self._check_compatible(signature)
        if signature not in self._eval:
            from jaxbackend.lower import lower

            capture = capture_forward(self.model, batch)
            run = lower(capture.graph)  # eval: let XLA propagate from the parameters' layouts
            key = self._jax.random.key(0)
            from jaxbackend.compiler import compiler_options

            devices = 1 if self._pipeline is not None else self._placement.mesh.devices.size
            forward = self._jax.jit(lambda params, buffers, inputs: run(params, buffers, inputs, key)[0],
                                    compiler_options=compiler_options(self.options.xla_library_fusions, devices))
            self._eval[signature] = (capture, forward)
        return self._eval[signature]

    def _trainable(self, graph: Graph) -> tuple[str, ...]:
        """Parameters the optimizer updates this step: in the optimizer, requiring grad, and reaching the
        loss (PyTorch leaves the others' ``.grad`` as ``None`` and skips them)."""
        reaching = _params_reaching_loss(graph)
        names = []
        for name in self._spec.param_names:
            if not self._param_names[name].requires_grad:
                continue
            if name not in reaching:
                log.info("torchpar: parameter %s does not affect the loss; it is not updated (as in PyTorch)", name)
                continue
            names.append(name)
        return tuple(names)

    def _check_compatible(self, signature: tuple) -> None:
        spec, leaves = signature
        example_spec, example_leaves = self._example_signature
        if spec != example_spec:
            raise ValueError(f"batch structure {spec} differs from the example batch's {example_spec}")
        for index, ((shape, dtype), (example_shape, example_dtype)) in enumerate(zip(leaves, example_leaves)):
            if dtype != example_dtype or len(shape) != len(example_shape):
                raise ValueError(
                    f"batch leaf {index} is {dtype}{list(shape)} but the example batch has "
                    f"{example_dtype}{list(example_shape)}: dtype and rank must match the example "
                    "(sizes may change; each new shape compiles once)")

    # --- data movement --------------------------------------------------------------------------

    def _put(self, tensor: torch.Tensor, sharding: Any) -> Any:
        return self._put_array(tensor.detach().cpu().numpy(), sharding)

    def _put_array(self, array: Any, sharding: Any) -> Any:
        from jaxbackend.lower import to_numpy_input

        return self._jax.device_put(to_numpy_input(np.asarray(array)), sharding)

    def _eval_inputs(self, batch: Any) -> list[Any]:
        if self._pipeline is None:
            return self._inputs(batch)
        from jaxbackend.lower import to_numpy_input
        from torchpar.capture.export import batch_to_call_args

        return [to_numpy_input(leaf.detach().cpu().numpy()) for leaf in pytree.tree_leaves(batch_to_call_args(batch))]

    def _inputs(self, batch: Any) -> list[Any]:
        from torchpar.capture.export import batch_to_call_args

        leaves = pytree.tree_leaves(batch_to_call_args(batch))
        return [self._put(leaf, self._placement.input(i)) for i, leaf in enumerate(leaves)]


def _make_train_step(run: Callable, trainable: tuple[str, ...], spec: Any, jax_optim: Any,
                     grad_clip_norm: float | None, grad_shardings: dict[str, Any]) -> Callable:
    """The pure step ``(params, opt_state, buffers, inputs, scalars, key) → (loss, params, opt_state, buffers)``."""
    import jax

    def step(params, opt_state, buffers, inputs, scalars, key):
        frozen = {n: v for n, v in params.items() if n not in trainable}

        def loss_of(train_params):
            outputs, new_buffers = run({**frozen, **train_params}, buffers, inputs, key)
            return outputs[0], new_buffers

        (loss, new_buffers), grads = jax.value_and_grad(loss_of, has_aux=True)({n: params[n] for n in trainable})
        if grad_shardings:  # ZeRO: reduce-scatter the gradients instead of all-reducing them
            from jaxbackend.sharding import constrain

            grads = {n: constrain(g, grad_shardings.get(n)) for n, g in grads.items()}
        if grad_clip_norm is not None:
            grads, _ = jax_optim.clip_grads_by_global_norm(grads, grad_clip_norm)
        new_params, new_state = jax_optim.apply_updates(spec, params, grads, opt_state, scalars)
        return loss, new_params, new_state, {**buffers, **new_buffers}

    return step


def _params_reaching_loss(graph: Graph) -> set[str]:
    """Targets of parameter inputs with a data path to the loss output."""
    producers = {n.name: n for n in graph.nodes}
    stack = [o.value.name for o in graph.outputs if o.kind == "loss" and o.value is not None]
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in producers:
            stack.extend(producers[name].refs())
    return {i.target for i in graph.inputs if i.kind == "param" and i.name in seen}


def _unique_named(named: Any) -> dict[str, torch.Tensor]:
    """``named_parameters()``/``named_buffers()`` as a dict; tied tensors keep their first name."""
    return dict(named)


def _mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell torch LR schedulers the optimizer has stepped (the flag ``optimizer.step`` itself sets), so
    ``scheduler.step()`` after ``engine.step`` is not mistaken for a call before the first optimizer step."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def _first_micro_batch(batch: Any, num_micro_batches: int) -> Any:
    """The first of ``num_micro_batches`` equal slices of every batch leaf along dim 0 (for capture)."""
    from torchpar.capture.export import batch_to_call_args, call_args_to_batch

    args, kwargs = batch_to_call_args(batch)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for index, leaf in enumerate(leaves):
        if leaf.dim() == 0 or leaf.shape[0] % num_micro_batches:
            raise ValueError(f"batch leaf {index} of shape {list(leaf.shape)} cannot be split into {num_micro_batches} "
                             "equal micro-batches along dim 0")
    sliced = [leaf[: leaf.shape[0] // num_micro_batches] for leaf in leaves]
    args, kwargs = pytree.tree_unflatten(sliced, spec)
    return call_args_to_batch(type(batch), args, kwargs)


def _signature(batch: Any) -> tuple:
    from torchpar.capture.export import batch_to_call_args

    leaves, spec = pytree.tree_flatten(batch_to_call_args(batch))
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"every batch leaf must be a torch.Tensor, got {type(leaf).__name__}")
    return str(spec), tuple((tuple(leaf.shape), dtype_name(leaf.dtype)) for leaf in leaves)


def _describe(signature: tuple) -> str:
    return ", ".join(f"{dtype}{list(shape)}" for shape, dtype in signature[1])


def _to_torch(array: Any) -> torch.Tensor:
    value = np.asarray(array)
    if value.dtype.name == "bfloat16":
        return torch.from_numpy(value.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(np.array(value, copy=True))

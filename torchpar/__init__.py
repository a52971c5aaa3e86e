"""torchpar: automatic inter- and intra-operator parallelism for PyTorch training, on JAX/XLA.

The public face. ``import torchpar`` imports neither JAX nor torch, so ``torchpar.init(num_devices=N)`` can
still set the number of (fake CPU) devices before JAX starts, and Ray host actors start without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from torchpar import plan_writers as _plan_writers
from torchpar.cluster import ClusterSpec, init, shutdown
from torchpar.methods import (
    AutoLayerOption,
    DataParallel,
    ManualStageOption,
    MegatronParallel,
    PipeshardParallel,
    ShardParallel,
    Zero2Parallel,
    Zero3Parallel,
)

if TYPE_CHECKING:
    import torch

    from torchpar.api import Engine
    from torchpar.feeding import HostData
    from torchpar.methods import Method
    from torchpar.metrics import StepMetrics
    from torchpar.planner.plan import Plan


_LAZY = {  # public name → module defining it (imported on first use)
    "Plan": "torchpar.planner.plan",
    "InputRangeError": "torchpar.ir.index_inputs",
    "IntegerOverflowError": "torchpar.ir.integer_ranges",
    "NonFiniteError": "torchpar.runtime.nonfinite",
    "DeviceMemoryError": "torchpar.runtime.resources",
    "HostFailure": "torchpar.runtime.ray_executor",
    "CaptureError": "torchpar.capture.errors",
    "PlanFormatError": "torchpar.planner.plan_schema",
    "MemoryBudgetError": "torchpar.planner.sharding.ilp",
    "UnsupportedOpsError": "jaxbackend.lower",
    "LoweringError": "jaxbackend.lower",
    "CheckpointError": "torchpar.checkpoint",
    "HostData": "torchpar.feeding",
    "HostDataError": "torchpar.runtime.host_loading",
}
"""``torchpar.Plan`` and the errors a user may catch (``docs/debugging.md`` lists every one)."""


def __getattr__(name: str) -> Any:
    """``torchpar.Plan`` and the error classes on first use: importing the package pulls in no planner, lowering
    or runtime module (``jaxbackend`` imports ``torchpar.ir`` and must not drag the planner in with it)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'torchpar' has no attribute {name!r}")


def _save_html(plan: Plan, path: str, **options: Any) -> Any:
    """``Plan.save_html``'s writer (:func:`torchpar.report.html.save_html`), registered below."""
    from torchpar.report.html import save_html

    return save_html(plan, path, **options)


def _save_png(plan: Plan, path: str, **options: Any) -> None:
    """``Plan.save_png``'s writer (:func:`torchpar.report.png.save_png`), registered below."""
    from torchpar.report.png import save_png

    save_png(plan, path, **options)


# The plan imports none of its reports (data flows down): this floor, above both, hands it their writers.
_plan_writers.register("html", _save_html)
_plan_writers.register("png", _save_png)


def compile(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    example_batch: Any = None,
    data: HostData | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    step_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
    forward_fn: Callable[[torch.nn.Module, Any], Any] | None = None,
    method: Method | Plan | None = None,
    grad_clip_norm: float | None = None,
    seed: int = 0,
    xla_library_fusions: bool = True,
    spmd: Literal["auto", "gspmd", "shard_map"] = "auto",
    check_inputs: bool = True,
    on_nonfinite: Literal["raise", "skip", "ignore"] = "raise",
    matmul_precision: Literal["highest", "high", "medium"] | None = None,
    mixed_precision: Literal["bf16", "fp16"] | None = None,
    remat: Literal["none", "layers", "selective", "auto"] | None = None,
    profile: bool = False,
    log_every: int = 0,
    on_metrics: Callable[[StepMetrics], None] | None = None,
    grad_stand_ins: bool = True,
) -> Engine:
    """Capture ``model``'s training step on ``example_batch`` and compile it with ``method``; returns the
    :class:`~torchpar.api.Engine` (``engine.step(batch)``; ``engine.close()``, or use it in a ``with`` block).

    - ``model``: a ``torch.nn.Module`` (HF models included).
    - ``optimizer``: ``torch.optim.SGD``, ``Adam`` or ``AdamW`` over the model's parameters.
    - ``example_batch``: a batch as the training loop passes it: a dict → ``model(**batch)``, a tuple/list →
      ``model(*batch)``, a tensor → ``model(batch)``. Other batch sizes compile again when first stepped.
    - ``data``: a ``torchpar.HostData(dataset, batch_size=..., shuffle=..., seed=...)``: host-loaded training —
      every process (each Ray host actor) loads its own rows, the driver sends no batch bytes; ``engine.step()``
      / ``for loss in engine.run(steps)``; its first batch is the example when ``example_batch`` is not given.
    - ``loss_fn``: ``(outputs, batch) -> scalar tensor``; default: a scalar output, else ``outputs.loss`` /
      ``outputs["loss"]``.
    - ``step_fn``: ``(model, batch) -> scalar loss tensor``, calling the model its own way (``x, y = batch;
      return F.cross_entropy(model(x), y)``) instead of the calling convention; not with ``loss_fn``.
    - ``forward_fn``: ``(model, batch) -> outputs``, how ``engine.forward`` calls the model (eval mode); default:
      the calling convention.
    - ``method``: ``None`` (one device), ``DataParallel``, ``Zero2Parallel``, ``Zero3Parallel``,
      ``MegatronParallel``, ``ShardParallel``, ``PipeshardParallel``, or a saved ``Plan`` to run as given.
    - ``grad_clip_norm``: clip gradients to this global L2 norm before the update (``clip_grad_norm_``);
      ``None``: off.
    - ``seed``: seed of the PRNG stream that dropout and other random ops draw from.
    - ``xla_library_fusions``: on CPU, compile with XLA's YNNPACK/oneDNN library fusions; ``False`` keeps XLA's
      defaults.
    - ``spmd``: how a sharded one-stage plan becomes a program: ``"auto"`` (a per-device ``shard_map`` step for
      DataParallel/Zero2/Zero3 when it can run them, else GSPMD), ``"gspmd"`` (XLA's partitioner inserts the
      collectives) or ``"shard_map"`` (per-device step for any one-stage plan; an error if it cannot run it).
    - ``check_inputs``: check before each step and forward that integer batch values used as indices are in
      the range PyTorch accepts (XLA would clamp them silently), and that int64 arithmetic on them stays in
      int32's range (JAX would wrap it: ``IntegerOverflowError``).
    - ``on_nonfinite``: a step with an inf/nan loss or gradient never updates the state; ``"raise"``: then
      raise ``NonFiniteError`` naming the first culprit, ``"skip"``: log and count it in
      ``engine.skipped_steps``, ``"ignore"``: apply the update as PyTorch does.
    - ``matmul_precision``: float32 products and convolutions on a GPU in ``"highest"`` (fp32), ``"high"`` (TF32)
      or ``"medium"`` (bf16 passes) precision; ``None`` follows ``torch.get_float32_matmul_precision()`` and
      ``torch.backends.cudnn.allow_tf32`` at compile time. The CPU computes fp32 products whatever is asked.
    - ``mixed_precision``: ``"bf16"`` or ``"fp16"`` trains under ``torch.autocast`` semantics with float32
      master weights and optimizer state; ``"fp16"`` adds dynamic loss scaling as ``torch.amp.GradScaler``
      (``engine.loss_scale``). ``None``: the model's own dtypes (a bf16/fp16 model trains in its dtype).
    - ``remat``: activation checkpointing per layer (a numbered child such as ``model.layers.3``): ``"layers"``
      recomputes each layer's forward in its backward, keeping its input; ``"selective"`` also keeps its linear
      layers' outputs; ``"none"`` keeps every activation; ``"auto"``: the planner picks the one with the fastest
      estimated step that fits the memory budget. ``None``: a given ``Plan``'s, else ``"none"``.
    - ``profile``: measured profiling, as Alpa does: all-reduces timed on this process's devices calibrate the
      cost model's links, and the planner's candidates (a pipeline's stage partitions, or the one stage) are
      compiled and timed, the fastest measured kept; ``plan.summary()`` shows measured beside estimated times.
      Cached on disk (``TORCHPAR_PROFILE_DIR``). Local runtime only.
    - ``log_every``: log the step's metrics (``engine.last_metrics``: step time, samples/s, tokens/s, MFU, memory)
      every this many steps on the ``torchpar.metrics`` logger (INFO); ``0``: never.
    - ``on_metrics``: called after every step with its ``torchpar.metrics.StepMetrics`` (stream them to
      TensorBoard / wandb with ``metrics.scalars()``).
    - ``grad_stand_ins``: after each step, ``p.grad`` of each trained parameter is a stand-in that raises, naming
      the fix, when read (a manual update, a leftover ``optimizer.step()``); ``False``: ``.grad`` stays ``None``.

    Bad values raise ``ValueError``/``TypeError`` (each option: :class:`torchpar.api.CompileOptions`).
    """
    from torchpar import api

    return api.compile(
        model,
        optimizer,
        example_batch=example_batch,
        data=data,
        loss_fn=loss_fn,
        step_fn=step_fn,
        forward_fn=forward_fn,
        method=method,
        grad_clip_norm=grad_clip_norm,
        seed=seed,
        xla_library_fusions=xla_library_fusions,
        spmd=spmd,
        check_inputs=check_inputs,
        on_nonfinite=on_nonfinite,
        matmul_precision=matmul_precision,
        mixed_precision=mixed_precision,
        remat=remat,
        profile=profile,
        log_every=log_every,
        on_metrics=on_metrics,
        grad_stand_ins=grad_stand_ins,
    )


def plan(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    example_batch: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    step_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
    method: Method | None = None,
    explain: bool = True,
    mixed_precision: Literal["bf16", "fp16"] | None = None,
    remat: Literal["none", "layers", "selective", "auto"] = "none",
    profile: bool = False,
) -> Plan:
    """Capture and plan without compiling or running a step (for inspecting and comparing plans).

    ``example_batch``, ``loss_fn``, ``step_fn`` and ``method`` are :func:`compile`'s. ``explain`` (default): also
    count each stage's collective bytes by kind and, for one-stage methods, price ShardParallel, DataParallel,
    Zero2Parallel and MegatronParallel on the same cost model (``plan.solver["method_comparison"]``); a few more
    solves.
    ``mixed_precision`` as in :func:`compile` (the plan then prices the autocast graph's dtypes); ``remat`` as
    in :func:`compile` (priced by the plan's memory and step estimates), the choice in ``plan.remat``;
    ``profile`` as in :func:`compile` (compiles and times the candidates on this process's devices).
    """
    from torchpar import api

    return api.plan(
        model,
        optimizer,
        example_batch=example_batch,
        loss_fn=loss_fn,
        step_fn=step_fn,
        method=method,
        explain=explain,
        mixed_precision=mixed_precision,
        remat=remat,
        profile=profile,
    )


def load_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """The model's state dict stored in a checkpoint that ``engine.save(path)`` wrote, for ``model.load_state_dict``
    (no engine needed; read whole on this process). See :mod:`torchpar.checkpoint`."""
    from torchpar.checkpoint import load_checkpoint as load

    return load(path)


def mark_pipeline_boundary(x: Any) -> Any:
    """Identity on ``x`` inside ``forward`` that survives ``torch.export``: with ``layer_option="manual"`` a
    pipeline layer ends here (see :func:`torchpar.capture.boundary.mark_pipeline_boundary`)."""
    from torchpar.capture.boundary import mark_pipeline_boundary as mark

    return mark(x)


__all__ = [
    "AutoLayerOption",
    "ClusterSpec",
    "DataParallel",
    "ManualStageOption",
    "MegatronParallel",
    "PipeshardParallel",
    "Plan",
    "ShardParallel",
    "Zero2Parallel",
    "Zero3Parallel",
    "compile",
    "init",
    "load_checkpoint",
    "mark_pipeline_boundary",
    "plan",
    "shutdown",
]

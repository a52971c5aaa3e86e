"""torchpar: automatic inter- and intra-operator parallelism for PyTorch training, on JAX/XLA.

The public face. ``import torchpar`` imports neither JAX nor torch, so ``torchpar.init(num_devices=N)`` can
still set the number of (fake CPU) devices before JAX starts, and Ray host actors start without torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Unpack

from torchpar import options as _options
from torchpar import plan_writers as _plan_writers
from torchpar.cluster import init, shutdown
from torchpar.hardware import ClusterSpec
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

    from torchpar.api import Captured, Engine
    from torchpar.engine.feeding import HostData
    from torchpar.methods import Method
    from torchpar.options import CompileKwargs, PlanKwargs
    from torchpar.planner.plan import Plan


_LAZY = {  # public name → module defining it (imported on first use)
    "Plan": "torchpar.planner.plan",
    "InputRangeError": "torchpar.ir.index_inputs",
    "IntegerOverflowError": "torchpar.ir.integer_ranges",
    "NonFiniteError": "torchpar.runtime.nonfinite",
    "DeviceMemoryError": "torchpar.runtime.resources",
    "HostFailure": "torchpar.runtime.ray.ray_executor",
    "CaptureError": "torchpar.capture.errors",
    "PlanFormatError": "torchpar.planner.plan_schema",
    "MemoryBudgetError": "torchpar.planner.sharding.ilp",
    "UnsupportedOpsError": "jaxbackend.lower",
    "LoweringError": "jaxbackend.lower",
    "CheckpointError": "torchpar.checkpoint",
    "HostData": "torchpar.engine.feeding",
    "Captured": "torchpar.api",
    "Planned": "torchpar.api",
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


@_options.with_options()
def capture_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    example_batch: Any = None,
    data: HostData | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    step_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
    forward_fn: Callable[[torch.nn.Module, Any], Any] | None = None,
    **options: Unpack[CompileKwargs],
) -> Captured:
    """:func:`compile` in three inspectable stages: ``torchpar.capture_step(model, optimizer, example_batch=...)`` →
    :class:`~torchpar.api.Captured` (``.graph``: the training step as IR), ``.plan(method)`` →
    :class:`~torchpar.api.Planned` (``.plan``: the :class:`Plan`), ``.compile()`` → the
    :class:`~torchpar.api.Engine`. ``torchpar.compile`` and ``torchpar.plan`` are shortcuts over these objects.
    Arguments and options: :func:`compile`'s."""
    from torchpar import api

    return api.capture_step(
        model,
        optimizer,
        example_batch=example_batch,
        data=data,
        loss_fn=loss_fn,
        step_fn=step_fn,
        forward_fn=forward_fn,
        **options,
    )


@_options.with_options()
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
    **options: Unpack[CompileKwargs],
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

    Bad values raise ``ValueError``/``TypeError``.
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
        **options,
    )


@_options.with_options(_options.PLAN_OPTIONS)
def plan(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    example_batch: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    step_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
    method: Method | None = None,
    explain: bool = True,
    **options: Unpack[PlanKwargs],
) -> Plan:
    """Capture and plan without compiling or running a step (for inspecting and comparing plans).

    ``example_batch``, ``loss_fn``, ``step_fn`` and ``method`` are :func:`compile`'s. ``explain`` (default): also
    count each stage's collective bytes by kind and, for one-stage methods, price ShardParallel, DataParallel,
    Zero2Parallel and MegatronParallel on the same cost model (``plan.solver["method_comparison"]``); a few more
    solves. Its options are those of :func:`compile` that change a plan: the plan prices the autocast graph's dtypes,
    the kept and recomputed activations (``remat="auto"``: its choice in ``plan.remat``), or the measured candidates.
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
        **options,
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
    "Captured",
    "ClusterSpec",
    "DataParallel",
    "ManualStageOption",
    "MegatronParallel",
    "PipeshardParallel",
    "Plan",
    "Planned",
    "ShardParallel",
    "Zero2Parallel",
    "Zero3Parallel",
    "capture_step",
    "compile",
    "init",
    "load_checkpoint",
    "mark_pipeline_boundary",
    "plan",
    "shutdown",
]

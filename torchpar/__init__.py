"""torchpar: automatic inter- and intra-operator parallelism for PyTorch training, on JAX/XLA.

The public face. ``import torchpar`` imports neither JAX nor torch, so ``torchpar.init(num_devices=N)`` can
still set the number of (fake CPU) devices before JAX starts, and Ray host actors start without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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
    from torchpar.api import Engine
    from torchpar.planner.plan import Plan


_LAZY = {  # public name → module defining it (imported on first use)
    "Plan": "torchpar.planner.plan",
    "InputRangeError": "torchpar.ir.index_inputs",
    "NonFiniteError": "torchpar.runtime.nonfinite",
    "DeviceMemoryError": "torchpar.runtime.resources",
    "HostFailure": "torchpar.runtime.ray_executor",
    "CaptureError": "torchpar.capture.errors",
    "PlanFormatError": "torchpar.planner.plan_schema",
    "MemoryBudgetError": "torchpar.planner.sharding.ilp",
    "UnsupportedOpsError": "jaxbackend.lower",
    "LoweringError": "jaxbackend.lower",
}
"""``torchpar.Plan`` and the errors a user may catch (``docs/debugging.md`` lists every one)."""


def __getattr__(name: str) -> Any:
    """``torchpar.Plan`` and the error classes on first use: importing the package pulls in no planner, lowering
    or runtime module (``jaxbackend`` imports ``torchpar.ir`` and must not drag the planner in with it)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'torchpar' has no attribute {name!r}")


def compile(model: Any, optimizer: Any, **kwargs: Any) -> "Engine":
    """Compile a training step; see :func:`torchpar.api.compile` for the arguments."""
    from torchpar import api

    return api.compile(model, optimizer, **kwargs)


def plan(model: Any, optimizer: Any, **kwargs: Any) -> "Plan":
    """Capture and plan without compiling or running a step; see :func:`torchpar.api.plan`."""
    from torchpar import api

    return api.plan(model, optimizer, **kwargs)


def mark_pipeline_boundary(x: Any) -> Any:
    """Identity on ``x`` inside ``forward`` that survives ``torch.export``: with ``layer_option="manual"`` a
    pipeline layer ends here (see :func:`torchpar.capture.boundary.mark_pipeline_boundary`)."""
    from torchpar.capture.boundary import mark_pipeline_boundary as mark

    return mark(x)


compile.__doc__ = (
    "Capture ``model``'s training step on ``example_batch`` and compile it with ``method``.\n\n"
    "torchpar.compile(model, optimizer, *, example_batch, loss_fn=None, method=None, grad_clip_norm=None, "
    "seed=0) -> Engine"
)

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
    "mark_pipeline_boundary",
    "plan",
    "shutdown",
]

"""torchpar: automatic inter- and intra-operator parallelism for PyTorch training, on JAX/XLA.

The public face. ``import torchpar`` does not import JAX, so ``torchpar.init(num_devices=N)`` can still
set the number of (fake CPU) devices before JAX starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torchpar.capture.boundary import mark_pipeline_boundary
from torchpar.cluster import ClusterSpec, init
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
from torchpar.planner.plan import Plan

if TYPE_CHECKING:
    from torchpar.api import Engine


def compile(model: Any, optimizer: Any, **kwargs: Any) -> "Engine":
    """Compile a training step; see :func:`torchpar.api.compile` for the arguments."""
    from torchpar import api

    return api.compile(model, optimizer, **kwargs)


def plan(model: Any, optimizer: Any, **kwargs: Any) -> Plan:
    """Capture and plan without compiling or running a step; see :func:`torchpar.api.plan`."""
    from torchpar import api

    return api.plan(model, optimizer, **kwargs)


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
]

"""``mark_pipeline_boundary``: an identity that survives ``torch.export`` as its own op.

It is a registered custom op (``torchpar::pipeline_boundary``), so export keeps it as one node with
target :data:`BOUNDARY_TARGET`; the layer pass cuts there when ``layer_option="manual"`` and the
lowering treats it as identity.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("torchpar::pipeline_boundary", mutates_args=())
def _pipeline_boundary(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_pipeline_boundary.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _boundary_backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
    return grad


_pipeline_boundary.register_autograd(_boundary_backward)

BOUNDARY_TARGET = torch.ops.torchpar.pipeline_boundary.default


def mark_pipeline_boundary(x: torch.Tensor) -> torch.Tensor:
    """Mark the end of a pipeline layer: returns ``x`` unchanged (in eager PyTorch and in torchpar).

    With ``PipeshardParallel(layer_option="manual")`` the model is cut into layers at each mark.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"mark_pipeline_boundary takes a tensor, got {type(x).__name__}")
    return _pipeline_boundary(x)

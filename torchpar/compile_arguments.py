"""The checks of what a user hands ``torchpar.capture_step`` / ``compile`` / ``plan``, raised before any capture,
each naming the argument and what to pass instead."""

from __future__ import annotations

import torch

from torchpar.methods import Method
from torchpar.planner.plan import Plan


def check_model_and_optimizer(model: object, optimizer: object) -> None:
    """``model`` is a ``torch.nn.Module`` and ``optimizer`` one ``torch.optim.Optimizer`` (a list of them is refused
    with the way to train several)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(optimizer, (list, tuple)) and all(isinstance(o, torch.optim.Optimizer) for o in optimizer):
        raise TypeError(
            f"compile takes one optimizer, got {len(optimizer)}. Optimizers stepping on different losses (a GAN's D "
            "and G, actor and critic): compile one engine per model and optimizer, each with its step_fn; engines "
            "over models that call each other read each other's latest weights (docs/porting.md, 'Several "
            "optimizers'). Several optimizers stepping on the same loss are not supported yet"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")


def check_method(method: object) -> None:
    """``method`` is ``None``, an instance of a torchpar method, or a :class:`Plan`; a ``TypeError`` naming it else."""
    if isinstance(method, type) and issubclass(method, Method):
        raise TypeError(
            f"method=torchpar.{method.__name__} is the class; pass an instance: "
            f"method=torchpar.{method.__name__}() (its options, if any, inside the parentheses)"
        )
    if method is not None and not isinstance(method, Method | Plan):
        raise TypeError(
            f"method must be None, a torchpar parallel method or a Plan (e.g. torchpar.DataParallel()), "
            f"got {method!r} of type {type(method).__name__}"
        )


def check_materialized(model: torch.nn.Module) -> None:
    """A ``ValueError`` naming the first parameter or buffer on the meta device: such a model plans, but has no
    weights to train."""
    on_meta = next((name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta), None)
    if on_meta is not None:
        raise ValueError(
            f"{on_meta} is on the meta device: the model has no weights to train. torchpar.plan(...) "
            "plans such a model (python -m torchpar plan --meta); to train it, materialize the "
            "weights first (model.to_empty(device='cpu') and initialize them, or load a checkpoint)"
        )

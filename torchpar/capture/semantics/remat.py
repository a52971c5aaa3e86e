"""HuggingFace gradient checkpointing, which torchpar does not apply as such: detected at compile time and
refused with a warning that names torchpar's own option.

Also: a reentrant ``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` runs inline while a step is captured
(:func:`reentrant_checkpoints_inline`), so its no-grad forward does not stop the gradient.

``model.gradient_checkpointing_enable()`` makes HF blocks call ``torch.utils.checkpoint`` in train mode.
``torch.export`` traces through it (the captured step computes the same loss and gradients), but the
recompute-in-backward it asks for does not survive capture: XLA keeps every activation the backward reads,
so the option would be silently ignored. ``compile(remat="layers"|"selective"|"auto")`` is what recomputes
(:mod:`torchpar.planner.remat`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

T = TypeVar("T")


class GradientCheckpointingIgnoredWarning(UserWarning):
    """The model asks for HF gradient checkpointing, which the compiled step does not apply."""


def checkpointing_modules(model: torch.nn.Module) -> list[str]:
    """Names of the submodules of ``model`` with HF gradient checkpointing enabled (``gradient_checkpointing
    = True``, what ``gradient_checkpointing_enable()`` sets); ``[""]`` when only the model itself says so
    (``model.is_activation_checkpointing``; transformers before 5: ``is_gradient_checkpointing``, which 5.x still
    answers with a ``FutureWarning``, so it is read only where the new name is missing)."""
    names = [name for name, module in model.named_modules() if getattr(module, "gradient_checkpointing", False) is True]
    if not names:
        asked = (
            "is_activation_checkpointing"
            if hasattr(type(model), "is_activation_checkpointing")
            else "is_gradient_checkpointing"
        )
        if getattr(model, asked, False) is True:
            names = [""]
    return names


def warn_if_gradient_checkpointing(model: torch.nn.Module, *, stacklevel: int = 2) -> bool:
    """Warn (:class:`GradientCheckpointingIgnoredWarning`) if ``model`` has HF gradient checkpointing enabled;
    returns whether it warned. Compilation goes on without it."""
    names = checkpointing_modules(model)
    if not names:
        return False
    shown = ", ".join(n or type(model).__name__ for n in names[:3]) + (
        f" and {len(names) - 3} more" if len(names) > 3 else ""
    )
    warnings.warn(
        f"torchpar does not apply HF gradient checkpointing (enabled on {shown}, e.g. by "
        "model.gradient_checkpointing_enable()): the compiled step keeps every activation for the backward "
        "pass, as if it were off. torchpar's own activation checkpointing is compile(remat='layers') (or "
        "'selective', or 'auto' to let the planner choose); a smaller micro-batch (num_micro_batches) and "
        "Zero3Parallel also free memory. Call model.gradient_checkpointing_disable() to silence this warning.",
        GradientCheckpointingIgnoredWarning,
        stacklevel=stacklevel + 1,
    )
    return True


class _InlineCheckpoint:
    """``torch.utils.checkpoint.CheckpointFunction`` while a training step is captured: the checkpointed function
    run inline. The reentrant checkpoint (``checkpoint(f, *args, use_reentrant=True)``) runs ``f`` under
    ``torch.no_grad()`` and recomputes it in its backward with grad enabled; traced as it is, the capture would see a
    no-grad region and stop the gradient there. Its values and gradients are ``f``'s, which running it inline gives;
    the recomputation is torchpar's ``remat`` option, as for the non-reentrant checkpoint."""

    @staticmethod
    def apply(function: Callable[..., T], preserve_rng_state: bool, *args: object) -> T:
        return function(*args)


@contextlib.contextmanager
def reentrant_checkpoints_inline() -> Iterator[None]:
    """Within the block, reentrant activation checkpoints run their function inline (:class:`_InlineCheckpoint`);
    ``checkpoint`` looks ``CheckpointFunction`` up in its module at each call, so a ``checkpoint`` imported by name
    before the block is covered too."""
    import torch.utils.checkpoint as checkpoint_module

    original = checkpoint_module.CheckpointFunction
    setattr(checkpoint_module, "CheckpointFunction", _InlineCheckpoint)  # noqa: B010  (mypy: a swapped class)
    try:
        yield
    finally:
        setattr(checkpoint_module, "CheckpointFunction", original)  # noqa: B010  (mypy: a swapped class)

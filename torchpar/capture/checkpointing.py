"""HuggingFace gradient checkpointing, which torchpar does not apply: detected at compile time and refused
with a warning.

``model.gradient_checkpointing_enable()`` makes HF blocks call ``torch.utils.checkpoint`` in train mode.
``torch.export`` traces through it (the captured step computes the same loss and gradients), but the
recompute-in-backward it asks for does not survive capture: XLA keeps every activation the backward reads,
so the option would be silently ignored. torchpar has no activation checkpointing (remat) option yet.
"""

from __future__ import annotations

import warnings

import torch


class GradientCheckpointingIgnoredWarning(UserWarning):
    """The model asks for HF gradient checkpointing, which the compiled step does not apply."""


def checkpointing_modules(model: torch.nn.Module) -> list[str]:
    """Names of the submodules of ``model`` with HF gradient checkpointing enabled (``gradient_checkpointing
    = True``, what ``gradient_checkpointing_enable()`` sets); ``[""]`` when only the model itself says so
    (``model.is_gradient_checkpointing``)."""
    names = [name for name, module in model.named_modules() if getattr(module, "gradient_checkpointing", False) is True]
    if not names and getattr(model, "is_gradient_checkpointing", False) is True:
        names = [""]
    return names


def warn_if_gradient_checkpointing(model: torch.nn.Module, *, stacklevel: int = 2) -> bool:
    """Warn (:class:`GradientCheckpointingIgnoredWarning`) if ``model`` has HF gradient checkpointing enabled;
    returns whether it warned. Compilation goes on without it."""
    names = checkpointing_modules(model)
    if not names:
        return False
    shown = ", ".join(n or type(model).__name__ for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3
                                                                     else "")
    warnings.warn(
        f"torchpar does not apply HF gradient checkpointing (enabled on {shown}, e.g. by "
        "model.gradient_checkpointing_enable()): the compiled step keeps every activation for the backward "
        "pass, as if it were off. To use less activation memory, use a smaller (micro-)batch: PipeshardParallel "
        "with more num_micro_batches; to free the memory of parameters, gradients and optimizer state, "
        "Zero3Parallel. Activation checkpointing (remat) is planned. Call model.gradient_checkpointing_disable() "
        "to silence this warning.", GradientCheckpointingIgnoredWarning, stacklevel=stacklevel + 1)
    return True

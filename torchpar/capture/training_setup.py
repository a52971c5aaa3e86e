"""What of the user's model and optimizer is compiled into a training step, and what changed since.

A compiled step bakes in three things PyTorch reads afresh at every ``loss.backward(); optimizer.step()``:
each submodule's ``training`` flag (dropout on or off, batch statistics or running ones), each parameter's
``requires_grad`` (which parameters get a gradient) and which parameters each optimizer param group holds.
:func:`training_setup` takes their snapshot; :func:`describe_changes` says, in words a user recognizes,
how a later snapshot differs. The engine compares them before every step and recompiles on a change,
so the step always trains what PyTorch would train now.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class TrainingSetup:
    """A snapshot of what a compiled step depends on (module docstring)."""

    modes: tuple[tuple[str, bool], ...]
    """``(submodule name, training)`` for every submodule (``""`` is the model), in ``named_modules()`` order."""
    requires_grad: tuple[tuple[str, bool], ...]
    """``(parameter name, requires_grad)`` in ``named_parameters()`` order."""
    param_groups: tuple[tuple[str, ...], ...]
    """The names of each optimizer param group's parameters (ids the model does not own are named ``?``)."""


def training_setup(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> TrainingSetup:
    """The current :class:`TrainingSetup` of ``model`` and ``optimizer`` (O(modules + parameters)).

    One walk of the module tree (the engine takes this snapshot before every step): the parameters are those
    ``named_parameters()`` yields, in its order and under its names — each module's own ``_parameters`` in
    ``named_modules()`` order, a parameter shared by several modules once, under its first name."""
    modes = []
    parameters: dict[int, tuple[str, torch.nn.Parameter]] = {}
    for prefix, module in model.named_modules():
        modes.append((prefix, module.training))
        for name, parameter in module._parameters.items():
            if parameter is not None and id(parameter) not in parameters:
                parameters[id(parameter)] = (f"{prefix}.{name}" if prefix else name, parameter)
    return TrainingSetup(
        modes=tuple(modes),
        requires_grad=tuple((n, p.requires_grad) for n, p in parameters.values()),
        param_groups=tuple(
            tuple(parameters[id(p)][0] if id(p) in parameters else "?" for p in g["params"])
            for g in optimizer.param_groups
        ),
    )


def describe_changes(before: TrainingSetup, after: TrainingSetup, *, limit: int = 6) -> list[str]:
    """One line per kind of change from ``before`` to ``after`` (empty if none), naming at most ``limit``
    modules or parameters each."""
    changes = []
    modes = _changed(before.modes, after.modes)
    if modes:
        changes.append(
            "module mode " + _list([f"{n or '<model>'} {'train' if f else 'eval'}" for n, f in modes], limit)
        )
    grads = _changed(before.requires_grad, after.requires_grad)
    if grads:
        changes.append("requires_grad " + _list([f"{n}={f}" for n, f in grads], limit))
    if before.param_groups != after.param_groups:
        changes.append(
            f"optimizer param groups ({len(before.param_groups)} groups of "
            f"{[len(g) for g in before.param_groups]} parameters, now {len(after.param_groups)} of "
            f"{[len(g) for g in after.param_groups]})"
        )
    return changes


def _changed(before: tuple[tuple[str, bool], ...], after: tuple[tuple[str, bool], ...]) -> list[tuple[str, bool]]:
    old = dict(before)
    return [(name, flag) for name, flag in after if old.get(name) != flag]


def _list(items: list[str], limit: int) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")

"""``.grad`` of a parameter an engine trains: a stand-in that says where the gradient went.

PyTorch's ``loss.backward()`` leaves each parameter's gradient in ``p.grad``; torchpar computes it inside the
compiled step and applies the optimizer there, so no torch gradient exists. A loop ported from PyTorch that reads
``p.grad`` — a manual update (``p.data.add_(p.grad, alpha=-lr)``, as pytorch/examples' word_language_model does), a
leftover ``optimizer.step()`` or ``clip_grad_norm_`` after ``engine.step`` — would find ``None`` and skip silently,
or fail far from the cause. After each step the engine sets ``p.grad`` of every parameter it trained to a
:class:`GradStandIn`: a tensor of the parameter's shape and dtype with no storage, which ``optimizer.zero_grad()``
clears as usual and which raises, naming the parameter and the fix, on any other use.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch

_CLEARING = {torch.ops.aten.zero_.default, torch.ops.aten.detach_.default}
"""What ``optimizer.zero_grad(set_to_none=False)`` does to a gradient: allowed (nothing to clear)."""


class GradStandIn(torch.Tensor):
    """``p.grad`` after an engine's step (module docstring). ``param_name``: the parameter's name."""

    param_name: str

    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str) -> GradStandIn:
        stand_in = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype, device=param.device)
        stand_in.param_name = name
        return stand_in

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's stubs type it as a plain function, not a classmethod
        cls,
        func: torch._ops.OpOverload,
        types: Iterable[type],
        args: tuple[object, ...] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        if func in _CLEARING:
            return args[0]
        if func is torch.ops.aten._foreach_zero_.default:
            rest = [t for t in cast("list[torch.Tensor]", args[0]) if not isinstance(t, GradStandIn)]  # a tensor list
            return func(rest) if rest else None
        names = sorted({a.param_name for a in _flat(args) if isinstance(a, GradStandIn)})
        raise RuntimeError(
            f"{func} read the .grad of {', '.join(names)}, which torchpar trains: the gradient was computed and "
            "applied inside engine.step, and no torch gradient exists. Give the update to torchpar as a "
            "torch.optim optimizer (p.data.add_(p.grad, alpha=-lr) is torch.optim.SGD(params, lr=lr)); clip with "
            "compile(grad_clip_norm=...) and read engine.last_grad_norm; and remove an optimizer.step() or "
            "clip_grad_norm_() left after engine.step (docs/porting.md)"
        )

    def __repr__(  # type: ignore[override]  # mypy reads a dunder's parameters as positional: no keyword matches
        self, *, tensor_contents: object = None
    ) -> str:
        return f"GradStandIn({self.param_name}: computed and applied inside the torchpar engine)"


def _flat(args: object) -> list[object]:
    if isinstance(args, (list, tuple)):
        return [x for a in args for x in _flat(a)]
    return [args]


class GradStandIns:
    """One stand-in per trained parameter, set after each step (creating them once)."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self._pairs = [(p, GradStandIn(p, name)) for name, p in params.items()]

    def set(self) -> None:
        """Set ``p.grad`` of every trained parameter to its stand-in (a no-op where it already is)."""
        for param, stand_in in self._pairs:
            if param.grad is not stand_in:
                param.grad = stand_in

    def clear(self) -> None:
        """Take the stand-ins out again (``p.grad = None`` where one is)."""
        for param, stand_in in self._pairs:
            if param.grad is stand_in:
                param.grad = None

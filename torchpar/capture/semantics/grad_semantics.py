"""Where PyTorch's autograd stops a gradient, and the autograd features a capture cannot carry.

``torch.export`` records a training step's forward arithmetic, not its autograd semantics: after
``run_decompositions`` a ``detach()`` is an ``aten.alias`` and a ``torch.no_grad()`` block is inlined, so
``jax.grad`` would differentiate straight through both. This module keeps PyTorch's meaning:

- :func:`mark_stop_gradients` rewrites the exported (pre-decomposition) program so every value whose
  gradient PyTorch stops goes through ``torchpar::stop_gradient`` (IR target :data:`STOP_GRADIENT_OP`,
  lowered to ``jax.lax.stop_gradient``): the result of ``aten.detach`` / ``aten.detach_`` and every tensor
  result of a ``wrap_with_set_grad_enabled(False, ...)`` region (``torch.no_grad()``,
  ``torch.set_grad_enabled(False)``, ``torch._C._set_grad_enabled(False)``; a tensor made there and used
  later is one of its results). Export records ``torch.inference_mode()`` as nothing at all, so
  :func:`autograd_capture_guards` runs it as ``no_grad`` during the export (same gradients: neither
  records a graph), and reads ``x.data`` as ``x.detach()``.
- :func:`params_reaching_loss` reads the invariant below off a captured graph; :func:`trainable_params` is
  what a step trains (what PyTorch's ``optimizer.step`` updates after ``loss.backward()``).
- Gradient hooks change a gradient inside autograd, where the capture cannot see: a hook registered on a
  tensor inside ``forward`` (``register_hook``, ``register_post_accumulate_grad_hook``) raises
  :class:`UnsupportedAutogradError` while the model is exported, naming the line;
  :func:`check_gradient_hooks` refuses a model whose parameters or modules carry backward hooks (and the
  global module backward hooks), naming their owners. Forward hooks and forward pre-hooks are ordinary
  forward code and are captured.

The invariant for the rest of the system: in a captured training graph, a value has a gradient path
to the loss iff PyTorch's autograd would propagate a gradient along it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import torch

if TYPE_CHECKING:
    from torchpar.ir.graph import Graph

log = logging.getLogger(__name__)

STOP_GRADIENT_OP = "torchpar.stop_gradient"
"""The IR target of a stop-gradient (``torch.ops.torchpar.stop_gradient.default``)."""


class UnsupportedAutogradError(NotImplementedError):
    """An autograd feature torchpar cannot carry into the compiled step (a gradient hook); the message names
    its owner (parameter, module or source line) and what to write instead."""


@torch.library.custom_op("torchpar::stop_gradient", mutates_args=())
def _stop_gradient(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_stop_gradient.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _no_gradient(ctx: object, grad: torch.Tensor) -> None:
    return None


_stop_gradient.register_autograd(_no_gradient)

STOP_GRADIENT_TARGET = torch.ops.torchpar.stop_gradient.default

_DETACH_TARGETS = (torch.ops.aten.detach.default, torch.ops.aten.detach_.default)
_GRAD_MODE_REGION = torch.ops.higher_order.wrap_with_set_grad_enabled


def mark_stop_gradients(exported: torch.export.ExportedProgram) -> int:
    """Rewrite ``exported``'s graph in place (before ``run_decompositions``) so the gradient stops where
    PyTorch's does (module docstring); returns the number of stop-gradients inserted.

    ``detach`` / ``detach_`` nodes are retargeted to ``torchpar::stop_gradient`` (same operand, same result
    meta). For each ``wrap_with_set_grad_enabled(False, region, *operands)`` node, every tensor it returns
    (its ``getitem`` users) is routed through a new stop-gradient node before any other use. Regions that
    enable the gradient are left as they are (the step is exported with the gradient enabled)."""
    graph = exported.graph_module.graph
    inserted = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _DETACH_TARGETS:
            node.target = STOP_GRADIENT_TARGET
            inserted += 1
        elif node.target is _GRAD_MODE_REGION and node.args and node.args[0] is False:
            for result in [user for user in node.users if user.op == "call_function"]:
                if not isinstance(result.meta.get("val"), torch.Tensor) or not result.users:
                    continue
                with graph.inserting_after(result):
                    stopped = graph.call_function(STOP_GRADIENT_TARGET, (result,))
                stopped.meta = dict(result.meta)
                result.replace_all_uses_with(stopped, delete_user_cb=lambda user, stopped=stopped: user is not stopped)
                inserted += 1
    if inserted:
        graph.lint()
        exported.graph_module.recompile()
    return inserted


@contextlib.contextmanager
def autograd_capture_guards() -> Iterator[None]:
    """For the duration of an export: ``torch.inference_mode()`` acts as ``torch.no_grad()`` (so export records
    the region), reading ``x.data`` is ``x.detach()`` (export cannot trace the attribute; both read the values
    outside autograd), and registering a gradient hook on a tensor raises :class:`UnsupportedAutogradError`."""
    mode_class = torch.autograd.grad_mode.inference_mode
    saved = {name: getattr(mode_class, name) for name in ("__enter__", "__exit__")}
    saved_hooks = {
        name: getattr(torch.Tensor, name) for name in ("register_hook", "register_post_accumulate_grad_hook")
    }

    def enter(self: Any) -> None:
        self._torchpar_no_grad = torch.no_grad() if self.mode else torch.enable_grad()
        self._torchpar_no_grad.__enter__()

    def exit_(self: Any, *exc: object) -> None:
        self._torchpar_no_grad.__exit__(*exc)

    def refuse(name: str) -> Callable[..., NoReturn]:
        def hook(tensor: torch.Tensor, fn: object, *args: object, **kwargs: object) -> NoReturn:
            raise UnsupportedAutogradError(
                f"a gradient hook is registered inside the captured step (Tensor.{name}({_callable_name(fn)}) at "
                f"{user_line()}): torchpar computes the gradients with JAX and cannot call a hook on them. Write "
                "the change of the gradient as a custom torch.autograd.Function (its backward is honoured), or "
                "remove the hook"
            )

        return hook

    base_data = vars(torch._C.TensorBase)["data"]  # the C attribute's descriptor
    own_data = vars(torch.Tensor).get("data")  # None: inherited from the C base
    setattr(mode_class, "__enter__", enter)  # noqa: B010  (mypy: a swapped method)
    setattr(mode_class, "__exit__", exit_)  # noqa: B010  (mypy: a swapped method)
    for name in saved_hooks:
        setattr(torch.Tensor, name, refuse(name))
    # ``x.data`` reads the tensor outside autograd (a detach); export cannot trace the C-level attribute itself
    torch.Tensor.data = property(  # type: ignore[assignment]  # torch types Tensor.data as a Tensor: a descriptor
        lambda self: self.detach(), lambda self, value: base_data.__set__(self, value)
    )
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(mode_class, name, method)
        for name, method in saved_hooks.items():
            setattr(torch.Tensor, name, method)
        if own_data is None:
            del torch.Tensor.data
        else:
            torch.Tensor.data = own_data


def check_gradient_hooks(model: torch.nn.Module) -> None:
    """Raise :class:`UnsupportedAutogradError` naming every parameter and module of ``model`` that carries a
    backward hook (``param.register_hook``, ``register_post_accumulate_grad_hook``,
    ``module.register_full_backward_hook`` / ``register_full_backward_pre_hook`` / ``register_backward_hook``)
    and the global module backward hooks: torchpar's gradients never pass through them."""
    owners = []
    for name, param in model.named_parameters():
        hooks = [
            *(getattr(param, "_backward_hooks", None) or {}).values(),
            *(getattr(param, "_post_accumulate_grad_hooks", None) or {}).values(),
        ]
        owners += [f"parameter {name!r} ({_callable_name(h)})" for h in hooks]
    for name, module in model.named_modules():
        hooks = [*module._backward_hooks.values(), *module._backward_pre_hooks.values()]
        owners += [f"module {name or type(module).__name__!r} ({_callable_name(h)})" for h in hooks]
    from torch.nn.modules import module as module_impl

    owners += [
        f"global module backward hook ({_callable_name(h)})"
        for h in [*module_impl._global_backward_hooks.values(), *module_impl._global_backward_pre_hooks.values()]
    ]
    if owners:
        raise UnsupportedAutogradError(
            "torchpar computes the gradients with JAX, so backward hooks never run; the model carries "
            f"{len(owners)}: " + "; ".join(owners) + ". Remove them (handle.remove()) before torchpar.compile, or "
            "write the gradient change as a custom torch.autograd.Function in forward (its backward is honoured)"
        )


def _callable_name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def user_line() -> str:
    """``file:line: code`` of the innermost frame of the current stack outside torch and torchpar (the user's
    line that is running, e.g. the one that registered a hook or assigns an attribute in ``forward``)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for frame in reversed(traceback.extract_stack()):
        if f"{os.sep}torch{os.sep}" not in frame.filename and not os.path.abspath(frame.filename).startswith(package):
            return f"{frame.filename}:{frame.lineno}: {frame.line}"
    return "an unknown line"


def module_modes(model: torch.nn.Module) -> dict[str, bool]:
    """Every submodule's ``training`` flag, by its ``named_modules()`` name (``""`` is the model itself)."""
    return {name: module.training for name, module in model.named_modules(remove_duplicate=False)}


def restore_module_modes(model: torch.nn.Module, modes: dict[str, bool]) -> None:
    """Set each submodule's ``training`` flag back to ``modes[name]`` (:func:`module_modes`), one by one:
    ``model.train(flag)`` would set every submodule to the root's flag."""
    for name, module in model.named_modules(remove_duplicate=False):
        if name in modes:
            module.training = modes[name]


def params_reaching_loss(graph: Graph) -> set[str]:
    """Targets of parameter inputs with a gradient path to the loss output: a data path that passes no
    stop-gradient (``detach``, a ``no_grad`` region's result)."""
    producers = {n.name: n for n in graph.nodes}
    stack = [o.value.name for o in graph.outputs if o.kind == "loss" and o.value is not None]
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in producers and producers[name].target != STOP_GRADIENT_OP:
            stack.extend(producers[name].refs())
    return {i.target for i in graph.inputs if i.kind == "param" and i.name in seen}


def trainable_params(graph: Graph, params: Mapping[str, torch.Tensor], optimized: Sequence[str]) -> tuple[str, ...]:
    """Parameters the optimizer updates this step: in the optimizer (``optimized``, in its order), requiring grad,
    and reaching the loss (PyTorch leaves the others' ``.grad`` as ``None`` and skips them). A ``ValueError`` when
    no parameter that requires grad reaches the loss (PyTorch's ``loss.backward()`` raises then)."""
    reaching = params_reaching_loss(graph)
    if not any(params[name].requires_grad for name in reaching if name in params):
        frozen = sum(not p.requires_grad for p in params.values())
        raise ValueError(
            "the loss has no gradient: no parameter that requires grad reaches it (PyTorch's loss.backward() "
            "raises 'element 0 of tensors does not require grad'). "
            + (
                f"All {frozen} parameters have requires_grad=False; unfreeze some. "
                if frozen == len(params)
                else "It is computed from detached values or under torch.no_grad() (a loss.detach() in step_fn?). "
            )
            + "torchpar trains what PyTorch would, so there is nothing to compile"
        )
    names = []
    for name in optimized:
        if not params[name].requires_grad:
            continue
        if name not in reaching:
            log.info("torchpar: parameter %s does not affect the loss; it is not updated (as in PyTorch)", name)
            continue
        names.append(name)
    return tuple(names)

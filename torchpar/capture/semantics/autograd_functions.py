"""Custom ``torch.autograd.Function`` backwards, captured so the compiled step uses them.

``torch.export`` inlines a Function's forward and records nothing of its backward: left alone, ``jax.grad``
would differentiate the forward's arithmetic instead (a gradient-reversal layer would update with the opposite
sign, a straight-through estimator would get the gradient of ``round``). While the training step is exported,
:func:`capture_autograd_functions` routes the forward of every class with a backward of its own (all
``torch.autograd.Function`` subclasses that exist, and any first applied during the export; ``forward`` and
``setup_context`` are swapped for the export's duration, so ``f = F.apply`` bound earlier is caught too) through
:meth:`FunctionCalls.run`:

1. each tensor argument goes through the identity op ``torchpar::autograd_function_input(x, call, position)``;
2. the forward runs on them with a context of ours (``forward(ctx, *args)``, or ``forward(*args)`` then
   ``setup_context(ctx, inputs, output)``), so export traces it inline; the context records
   ``save_for_backward``, ``mark_non_differentiable``, ``set_materialize_grads``, ``needs_input_grad`` and the
   attributes the forward sets (tensors among them are saved like ``save_for_backward``'s);
3. each tensor result goes through ``torchpar::autograd_function_output(y, saved, call, position)``: ``saved``
   makes the saved tensors graph values (the residuals of the backward); a result marked non-differentiable is
   detached after its marker.

After the export, :meth:`FunctionCalls.backward_graphs` traces each call's backward on its own
(``backward(ctx, *grads)`` on fake tensors of the saved tensors' and results' shapes, a context holding the
saved tensors and the forward's attributes), decomposed to core ATen like the step: the IR graphs
``Graph.custom_backwards`` holds (layout in :mod:`torchpar.ir.function_regions`). A Function whose forward or
backward cannot be traced (NumPy inside, data-dependent Python, ``mark_dirty``) raises :class:`CaptureError`
naming the class and the model line that called it: torchpar never trains through a replaced backward.

Semantics kept from PyTorch: the backward receives materialized (zero) cotangents for unused results (so
``set_materialize_grads(False)`` backwards see zeros, not ``None``: equal for any backward linear in its
cotangents); a gradient the backward returns for an argument is summed to the argument's shape and cast to its
dtype (``validate_outputs``); ``None`` is a zero gradient; values the forward reads from outside its arguments
(closures, module attributes) get no gradient, as under PyTorch, where the forward runs without autograd.
Nested Functions (called inside a Function's forward or backward) run as PyTorch runs them there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from torchpar.capture.decompositions import decompose
from torchpar.capture.errors import CaptureError
from torchpar.capture.to_ir import to_ir

if TYPE_CHECKING:
    from torchpar.ir.graph import Graph

# --- the marker ops --------------------------------------------------------------------------------------------


@torch.library.custom_op("torchpar::autograd_function_input", mutates_args=())
def _function_input(x: torch.Tensor, call: int, position: int) -> torch.Tensor:
    return x.clone()


@_function_input.register_fake
def _(x: torch.Tensor, call: int, position: int) -> torch.Tensor:
    return torch.empty_like(x)


def _input_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    return grad, None, None


_function_input.register_autograd(_input_backward)


@torch.library.custom_op("torchpar::autograd_function_output", mutates_args=())
def _function_output(x: torch.Tensor, saved: list[torch.Tensor], call: int, position: int) -> torch.Tensor:
    return x.clone()


@_function_output.register_fake
def _(x: torch.Tensor, saved: list[torch.Tensor], call: int, position: int) -> torch.Tensor:
    return torch.empty_like(x)


def _output_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
    return grad, None, None, None


_function_output.register_autograd(_output_backward)


# --- contexts ----------------------------------------------------------------------------------------------------


class _ForwardContext:
    """The ``ctx`` a Function's forward (or ``setup_context``) sees during capture."""

    def __init__(self, needs_input_grad: tuple[bool, ...]):
        self.needs_input_grad = needs_input_grad
        self._torchpar_saved: tuple[object, ...] = ()
        self._torchpar_non_differentiable: list[torch.Tensor] = []
        self._torchpar_dirty: list[torch.Tensor] = []
        self._torchpar_materialize = True

    def save_for_backward(self, *tensors: object) -> None:
        self._torchpar_saved = tensors

    def save_for_forward(self, *tensors: object) -> None:  # forward-mode AD: not part of a training step
        pass

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        self._torchpar_non_differentiable.extend(tensors)

    def mark_dirty(self, *tensors: torch.Tensor) -> None:
        self._torchpar_dirty.extend(tensors)

    def set_materialize_grads(self, value: bool) -> None:
        self._torchpar_materialize = bool(value)

    def attributes(self) -> dict[str, object]:
        """What the forward stored on the context for its backward."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_torchpar_") and k != "needs_input_grad"}


class _BackwardContext:
    """The ``ctx`` a Function's backward sees while it is traced: the saved tensors, the forward's attributes."""

    def __init__(
        self,
        saved: tuple[object, ...],
        attributes: dict[str, object],
        needs_input_grad: tuple[bool, ...],
        materialize: bool,
    ):
        self.__dict__.update(attributes)
        self.saved_tensors = saved
        self.saved_variables = saved
        self.needs_input_grad = needs_input_grad
        self.materialize_grads = materialize

    def set_materialize_grads(self, value: bool) -> None:
        pass

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class _SavedSlot:
    """A tensor the forward left on its context (or saved): the ``index``-th residual."""

    index: int


@dataclasses.dataclass
class FunctionCall:
    """One intercepted ``F.apply(*args)`` of the step: what tracing its backward needs."""

    call: int
    cls: type[torch.autograd.Function]
    where: str
    num_args: int
    needs_input_grad: tuple[bool, ...]
    saved_layout: tuple[object, ...]
    """``ctx.saved_tensors`` as saved: a :class:`_SavedSlot` per tensor, ``None`` where ``None`` was saved."""
    attributes: dict[str, object]
    """The context's attributes, tensors replaced by :class:`_SavedSlot`."""
    residuals: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    """Shape and dtype of each residual."""
    results: tuple[tuple[tuple[int, ...], torch.dtype] | None, ...]
    """Shape and dtype of each result of the forward (``None``: not a tensor)."""
    materialize: bool

    @property
    def name(self) -> str:
        return describe_function(self.cls, self.where)


def describe_function(cls: type, where: str) -> str:
    """``torch.autograd.Function Foo (defined at file:line), called at file:line: code``."""
    defined = ""
    with contextlib.suppress(TypeError, OSError):
        defined = f" (defined at {inspect.getsourcefile(cls)}:{inspect.getsourcelines(cls)[1]})"
    return f"torch.autograd.Function {cls.__qualname__}{defined}, called at {where or 'an unknown line'}"


# --- interception ------------------------------------------------------------------------------------------------

_BASE = torch.autograd.function.Function
_ORIGINAL_APPLY = _BASE.__dict__["apply"]
_BASE_SETUP_CONTEXT = _BASE.setup_context
_ACTIVE: FunctionCalls | None = None
_MISSING = object()

_TORCH_MACHINERY = (
    "torch._library",
    "torch.utils.checkpoint",
    "torch._functorch",
    "torch._dynamo",
    "torch._higher_order_ops",
    "torch.export",
    "torch.fx",
    "torch._subclasses",
    "torch.autograd",
)
"""Modules whose Functions are torch's own machinery (custom ops' autograd, reentrant checkpointing): their
backward is the forward's derivative, which the lowering derives."""


class FunctionCalls:
    """The Function calls intercepted during one export (see the module docstring).

    ``Function.apply`` runs PyTorch's own machinery, which calls the class's ``forward`` (and
    ``setup_context``) inside; so the interception replaces ``forward`` and ``setup_context`` of every
    Function class with a backward of its own for the duration (a call ``F.apply`` bound before the export,
    ``grad_reverse = GradReverse.apply``, goes through them too), and ``Function.apply`` itself, which does the
    same for a class first seen during the export."""

    def __init__(self) -> None:
        self.calls: list[FunctionCall] = []
        self._depth = 0
        self._patched: dict[type, tuple[object, object]] = {}  # class -> its own forward, setup_context (or _MISSING)
        self._setup_pending: dict[type, list[list[torch.Tensor]]] = {}

    # the patches

    def patch(self, cls: type[torch.autograd.Function]) -> None:
        """Route ``cls``'s forward through :meth:`run` (once; not torch's own Functions, nor those without a
        backward of their own)."""
        if cls in self._patched or not has_custom_backward(cls) or cls.__module__.startswith(_TORCH_MACHINERY):
            return
        forward, setup_context = _unpatched(cls, "forward"), _unpatched(cls, "setup_context")
        setup_style = setup_context is not _BASE_SETUP_CONTEXT
        self._patched[cls] = (cls.__dict__.get("forward", _MISSING), cls.__dict__.get("setup_context", _MISSING))
        calls = self

        if setup_style:

            @functools.wraps(forward)
            def patched_forward(*args: object) -> object:
                if calls._depth > 0:
                    return forward(*args)
                output, non_differentiable = calls.run(cls, forward, setup_context, args)
                calls._setup_pending.setdefault(cls, []).append(non_differentiable)
                return output

            def patched_setup_context(
                ctx: torch.autograd.function.FunctionCtx, inputs: tuple[object, ...], output: object
            ) -> object:
                pending = calls._setup_pending.get(cls)
                if not pending:  # a nested call: PyTorch's own
                    return setup_context(ctx, inputs, output)
                non_differentiable = pending.pop()
                if non_differentiable:
                    ctx.mark_non_differentiable(*non_differentiable)
                return None

            patched_forward._torchpar_original = forward  # type: ignore[attr-defined]  # a marker on a function
            patched_setup_context._torchpar_original = setup_context  # type: ignore[attr-defined]  # a marker on a function
            setattr(cls, "forward", staticmethod(patched_forward))  # noqa: B010  (mypy: a swapped method)
            setattr(cls, "setup_context", staticmethod(patched_setup_context))  # noqa: B010  (mypy: a swapped method)
        else:

            @functools.wraps(forward)
            def patched_forward(ctx: torch.autograd.function.FunctionCtx, *args: object) -> object:
                if calls._depth > 0:
                    return forward(ctx, *args)
                output, non_differentiable = calls.run(cls, forward, None, args)
                if non_differentiable:
                    ctx.mark_non_differentiable(*non_differentiable)
                return output

            patched_forward._torchpar_original = forward  # type: ignore[attr-defined]  # a marker on a function
            setattr(cls, "forward", staticmethod(patched_forward))  # noqa: B010  (mypy: a swapped method)

    def unpatch(self) -> None:
        for cls, (forward, setup_context) in self._patched.items():
            for name, value in (("forward", forward), ("setup_context", setup_context)):
                if value is _MISSING:
                    if name in cls.__dict__:
                        delattr(cls, name)
                else:
                    setattr(cls, name, value)
        self._patched.clear()

    # one call

    def run(
        self,
        cls: type[torch.autograd.Function],
        forward: Callable[..., object],
        setup_context: Callable[..., object] | None,
        args: tuple[object, ...],
    ) -> tuple[object, list[torch.Tensor]]:
        """The forward of ``cls`` on ``args``, bracketed by markers; records the call. Returns the marked
        output and the marked results that are not differentiable."""
        call = len(self.calls)
        where = _caller_line()
        ctx = _ForwardContext(tuple(isinstance(a, torch.Tensor) and a.requires_grad for a in args))
        self._depth += 1
        try:
            marked = tuple(
                _function_input(a, call, i) if isinstance(a, torch.Tensor) else a for i, a in enumerate(args)
            )
            if setup_context is not None:
                output = forward(*marked)
                setup_context(ctx, marked, output)
            else:
                output = forward(ctx, *marked)
        except CaptureError:
            raise
        except Exception as error:
            raise CaptureError(
                f"{describe_function(cls, where)}: its forward cannot be traced by torch.export "
                f"({type(error).__name__}: {_first_line(error)}). torchpar runs a Function's own backward, so it "
                "must capture both: write the forward with torch operations (no NumPy, .item() or data-dependent "
                "Python), or drop the custom backward"
            ) from error
        finally:
            self._depth -= 1
        if ctx._torchpar_dirty:
            raise CaptureError(
                f"{describe_function(cls, where)} marks an input dirty (ctx.mark_dirty, an in-place "
                "Function): torchpar cannot capture in-place Functions; return a new tensor instead"
            )
        results = output if isinstance(output, tuple) else (output,)
        residuals: list[torch.Tensor] = []

        def slot(value: object) -> object:
            if not isinstance(value, torch.Tensor):
                return value
            residuals.append(value)
            return _SavedSlot(len(residuals) - 1)

        saved_layout = tuple(slot(t) if t is not None else None for t in ctx._torchpar_saved)
        attributes = {k: pytree.tree_map(slot, v) for k, v in ctx.attributes().items()}
        non_differentiable_ids = {id(t) for t in ctx._torchpar_non_differentiable}
        marked_results, non_differentiable = [], []
        position = 0
        self._depth += 1
        try:
            for result in results:
                if isinstance(result, torch.Tensor):
                    out = _function_output(result, list(residuals), call, position)
                    position += 1
                    if id(result) in non_differentiable_ids:
                        out = out.detach()
                        non_differentiable.append(out)
                    marked_results.append(out)
                else:
                    marked_results.append(result)
        finally:
            self._depth -= 1
        self.calls.append(
            FunctionCall(
                call=call,
                cls=cls,
                where=where,
                num_args=len(args),
                needs_input_grad=ctx.needs_input_grad,
                saved_layout=saved_layout,
                attributes=attributes,
                residuals=tuple((tuple(int(s) for s in r.shape), r.dtype) for r in residuals),
                results=tuple(
                    (tuple(int(s) for s in r.shape), r.dtype) if isinstance(r, torch.Tensor) else None for r in results
                ),
                materialize=ctx._torchpar_materialize,
            )
        )
        return (tuple(marked_results) if isinstance(output, tuple) else marked_results[0]), non_differentiable

    def backward_graphs(self, model: torch.nn.Module | None = None) -> dict[int, Graph]:
        """The IR backward graph of every intercepted call, by call id; a backward that reads ``model``'s parameters
        or buffers other than through ``ctx`` is refused (:func:`_refuse_read_parameters`)."""
        model_tensors = (
            {}
            if model is None
            else {
                t.untyped_storage().data_ptr(): name
                for name, t in [*model.named_parameters(), *model.named_buffers()]
                if t.device.type != "meta"
            }
        )
        self._depth += 1  # a Function the backward calls runs as PyTorch runs it there
        try:
            return {call.call: _trace_backward(call, model_tensors) for call in self.calls}
        finally:
            self._depth -= 1


@contextlib.contextmanager
def capture_autograd_functions(enabled: bool = True) -> Iterator[FunctionCalls]:
    """Inside, every Function with a backward of its own runs through :meth:`FunctionCalls.run` (module
    docstring); the :class:`FunctionCalls` yielded records the calls. ``enabled=False`` (an eval forward, whose
    Functions need no backward) intercepts nothing."""
    global _ACTIVE
    calls = FunctionCalls()
    if not enabled or _ACTIVE is not None:
        yield calls
        return
    _ACTIVE = calls
    try:
        for cls in _subclasses(_BASE):
            calls.patch(cls)
        setattr(_BASE, "apply", classmethod(_patching_apply))  # noqa: B010  (mypy: a swapped method)
        yield calls
    finally:
        setattr(_BASE, "apply", _ORIGINAL_APPLY)  # noqa: B010  (mypy: a swapped method)
        calls.unpatch()
        _ACTIVE = None


def _patching_apply(cls: type[torch.autograd.Function], *args: object, **kwargs: object) -> object:
    """``Function.apply`` during a capture: patches a class defined since the capture began, then runs PyTorch's."""
    if _ACTIVE is not None:
        _ACTIVE.patch(cls)
    return _ORIGINAL_APPLY.__get__(None, cls)(*args, **kwargs)


def _subclasses(cls: type[torch.autograd.Function]) -> list[type[torch.autograd.Function]]:
    found: list[type[torch.autograd.Function]] = []
    stack = list(cls.__subclasses__())
    while stack:
        sub = stack.pop()
        if sub not in found:
            found.append(sub)
            stack.extend(sub.__subclasses__())
    return found


def _unpatched(cls: type, name: str) -> Callable[..., object]:
    value = getattr(cls, name)
    return getattr(value, "_torchpar_original", value)


def has_custom_backward(cls: type) -> bool:
    """Whether ``cls`` defines its own ``backward`` (or ``vjp``)."""
    return (
        getattr(cls, "backward", _BASE.backward) is not _BASE.backward
        or getattr(cls, "vjp", _BASE.vjp) is not _BASE.vjp
    )


def _user_backward(cls: type[torch.autograd.Function]) -> Callable[..., object]:
    return cls.vjp if getattr(cls, "vjp", _BASE.vjp) is not _BASE.vjp else cls.backward


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TORCHPAR_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _caller_line() -> str:
    """``file:line: code`` of the innermost frame outside torch and torchpar (the model line calling apply)."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((_TORCH_DIR, _TORCHPAR_DIR)) and "<" not in filename:
            code = ""
            with contextlib.suppress(Exception):
                import linecache

                code = linecache.getline(filename, frame.f_lineno).strip()
            return f"{filename}:{frame.f_lineno}: {code}" if code else f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else ""


# --- the backward ------------------------------------------------------------------------------------------------


class _Backward(torch.nn.Module):
    """``(residuals..., cotangents of the tensor results...) -> the gradients backward returns`` (``None``
    where it returns none)."""

    def __init__(self, call: FunctionCall):
        super().__init__()
        self.call = call

    def forward(self, *values: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        call = self.call
        residuals, cotangents = values[: len(call.residuals)], iter(values[len(call.residuals) :])

        def fill(value: object) -> object:
            return residuals[value.index] if isinstance(value, _SavedSlot) else value

        saved = tuple(fill(v) for v in call.saved_layout)
        attributes = {
            k: pytree.tree_map(fill, v, is_leaf=lambda x: isinstance(x, _SavedSlot)) for k, v in call.attributes.items()
        }
        ctx = _BackwardContext(saved, attributes, call.needs_input_grad, call.materialize)
        grads = [next(cotangents) if meta is not None else None for meta in call.results]
        result = _user_backward(call.cls)(ctx, *grads)
        result = result if isinstance(result, tuple) else (result,)
        if len(result) < call.num_args or any(r is not None for r in result[call.num_args :]):
            raise CaptureError(
                f"{call.name}: backward returned {len(result)} gradient(s), expected {call.num_args} "
                "(one per argument of apply)"
            )
        return tuple(r if isinstance(r, torch.Tensor) else None for r in result[: call.num_args])


def _trace_backward(call: FunctionCall, model_tensors: dict[int, str]) -> Graph:
    """The IR graph of ``call``'s backward (layout in :mod:`torchpar.ir.function_regions`)."""
    from torchpar.ir.graph import Output

    module = _Backward(call)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        values = [torch.empty(shape, dtype=dtype) for shape, dtype in call.residuals]
        values += [torch.zeros(meta[0], dtype=meta[1]) for meta in call.results if meta is not None]
    try:
        with torch.no_grad():
            exported = torch.export.export(module, tuple(values), strict=False)
        exported = decompose(exported)
    except CaptureError:
        raise
    except Exception as error:
        raise CaptureError(
            f"{call.name}: its backward cannot be traced by torch.export ({type(error).__name__}: "
            f"{_first_line(error)}). torchpar runs a Function's own backward: write it with torch operations "
            "(no NumPy, .item() or data-dependent Python), or drop the custom backward"
        ) from error
    _refuse_read_parameters(call, exported, model_tensors)
    graph = to_ir(exported, torch.nn.Module(), user_output_kind="user")
    slots = pytree.tree_unflatten(list(range(len(graph.outputs))), exported.call_spec.out_spec)
    outputs = [graph.outputs[slot] if slot is not None else Output("user", None) for slot in slots]
    graph = graph.replace(outputs=outputs)
    graph.validate()
    return graph


def _refuse_read_parameters(
    call: FunctionCall, exported: torch.export.ExportedProgram, model_tensors: dict[int, str]
) -> None:
    """A backward that reads a parameter or buffer of the model other than through ``ctx`` (a closure over a module's
    weight) would see it as a constant of the captured graph, frozen at its compile-time value: refuse it, naming
    the Function and the tensor. ``model_tensors`` maps the storage address of each parameter and buffer to its name."""
    read = sorted(
        {
            model_tensors[value.untyped_storage().data_ptr()]
            for value in exported.constants.values()
            if isinstance(value, torch.Tensor)
            and not isinstance(value, FakeTensor)
            and value.device.type != "meta"
            and value.untyped_storage().data_ptr() in model_tensors
        }
    )
    if read:
        raise CaptureError(
            f"{call.name}: its backward reads {', '.join(read)} directly (not through ctx); the captured backward "
            "would keep their values from compile time. Pass them to apply(...) and ctx.save_for_backward(...) them "
            "instead"
        )

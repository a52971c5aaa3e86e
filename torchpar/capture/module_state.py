"""What ``forward`` reads from and writes to modules while a step is captured.

A compiled step is a program over tensors. Every Python value ``forward`` reads from a module — ``self.kl_weight``,
``Dropout.p``, a flag — is a constant in it, and every assignment ``forward`` makes to a module is lost: torch.export
runs ``forward`` on fake tensors and drops Python side effects (a reassigned buffer, ``self.calls += 1``,
``self.hidden = ...``) without a word. :func:`recording` watches one export and returns a :class:`ModuleAccess`:

- **reads** — ``(module, attribute, value)`` for every plain value (``None``, ``bool``, ``int``, ``float``, ``str``,
  an enum, and tuples/lists of them) read from a module's instance ``__dict__``. The engine compares them before each
  step (:mod:`torchpar.engine.model_link`): a change recompiles the step, with a warning naming the attribute.
- **tensor attributes** — tensors held in a module's ``__dict__`` (neither parameter nor buffer) are registered as
  non-persistent buffers for the length of the export (:func:`tensors_as_buffers`), so the step reads them as inputs
  (the current value at every step, never a constant) and an in-place change in ``forward`` is a buffer mutation.
- **writes** — ``forward`` reassigning a registered buffer with a tensor of its shape and dtype is carried out as an
  in-place copy into the buffer, which export keeps as a buffer mutation: after the step the buffer holds what
  PyTorch's would. Every other assignment to a module (a parameter, a submodule, a Python counter, a hidden state
  kept as ``self.hidden``, a tensor attribute) raises :class:`ModuleStateError` naming the attribute and the line;
  allowed are assigning an attribute the value it already has, a plain value to an attribute that did not exist (a
  library's one-time flag) and torch's own bookkeeping (``nn.LSTM``'s ``_flat_weights``).
- **called** — the modules called during the export (``torch.nn.modules.module.register_module_forward_pre_hook``),
  from which the capture finds modules outside the compiled model that the step runs (:func:`outside_modules`: a
  GAN's other network called from a ``step_fn``); the capture registers those beside the model and exports again.

Recording swaps each watched module's class for a cached subclass whose ``__getattribute__`` and ``__setattr__``
report to the active recorder, and swaps it back afterwards; outside :func:`recording` nothing changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

from torchpar.capture.errors import CaptureError
from torchpar.capture.semantics.grad_semantics import user_line

MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))
"""Attributes every ``nn.Module`` sets in ``__init__`` (``training``, ``_parameters``, hooks…): never guarded here
(modes have their own check, :mod:`torchpar.capture.training_setup`)."""

_MAX_PLAIN_ITEMS = 64

NumberAttribute = tuple[torch.nn.Module, str]
"""A float attribute ``(module, name)`` a step reads as an input (:func:`numbers_as_tensors`)."""


class ModuleStateError(CaptureError):
    """``forward`` assigns module state that a compiled step cannot carry from one step to the next."""


@dataclasses.dataclass(frozen=True)
class AttributeRead:
    """A plain value ``forward`` read from ``module.__dict__[name]`` while it was captured."""

    module: torch.nn.Module
    path: str
    """Where the module is, for messages: its ``named_modules()`` name in the model (``""``: the model itself), or
    ``external<i>.<name>`` for a module outside it (:func:`outside_modules`)."""
    name: str
    value: object
    source: str
    """``file:line: code`` of the first read."""

    def describe(self) -> str:
        """``path.name`` (the model itself by its class name)."""
        return f"{self.path or type(self.module).__name__}.{self.name}"


@dataclasses.dataclass
class ModuleAccess:
    """What one export read and called (module docstring)."""

    reads: dict[tuple[int, str], AttributeRead] = dataclasses.field(default_factory=dict)
    """``(id(module), name)`` → the read (the first of each)."""
    called: dict[int, torch.nn.Module] = dataclasses.field(default_factory=dict)
    """Every module called, by ``id``, in call order."""
    copied_buffers: list[str] = dataclasses.field(default_factory=list)
    """``path.name`` of each buffer ``forward`` reassigned (carried out as an in-place copy)."""


def is_plain(value: object) -> bool:
    """Whether ``value`` is a Python value a guard compares by ``==`` (module docstring)."""
    if value is None or isinstance(value, (bool, int, float, str, enum.Enum)):
        return True
    if isinstance(value, (tuple, list)) and len(value) <= _MAX_PLAIN_ITEMS:
        return all(is_plain(v) for v in value)
    return False


def same_plain(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same plain value (types too: ``1`` is not ``True``, ``1`` is not ``1.0``; NaN is NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same_plain(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and a != a and b != b)


class _Recorder:
    def __init__(self, paths: dict[int, str]):
        self.paths = paths
        self.access = ModuleAccess()

    def path(self, module: torch.nn.Module) -> str:
        return self.paths.get(id(module), type(module).__name__)

    def read(self, module: torch.nn.Module, name: str, value: object) -> None:
        key = (id(module), name)
        if key in self.access.reads or name in MODULE_INTERNALS or not is_plain(value):
            return
        if name not in object.__getattribute__(module, "__dict__"):  # a class attribute or a property
            return
        self.access.reads[key] = AttributeRead(module, self.path(module), name, value, user_line())

    def write(self, module: torch.nn.Module, name: str, value: object) -> bool:
        """Handle ``module.name = value`` in ``forward``: ``True`` if done here (a buffer copy), ``False`` to let
        ``nn.Module.__setattr__`` do it; raises for what a compiled step cannot carry out."""
        if name in MODULE_INTERNALS:
            return False
        state = object.__getattribute__(module, "__dict__")
        where = f"{self.path(module) or type(module).__name__}.{name}"
        if name in state["_buffers"]:
            buffer = state["_buffers"][name]
            if (
                isinstance(value, torch.Tensor)
                and buffer is not None
                and value.shape == buffer.shape
                and value.dtype == buffer.dtype
                and value.device == buffer.device
            ):
                buffer.copy_(value)
                self.access.copied_buffers.append(where)
                return True
            raise self._refused(
                where,
                "reassigns the registered buffer with a value of another shape, dtype or device",
                "assign a tensor of the buffer's shape and dtype, or copy into it "
                "in place (self.<buffer>.copy_(value))",
            )
        if name in state["_parameters"]:
            raise self._refused(
                where,
                "reassigns a parameter",
                "compute the new weight from the parameter instead of storing it on the module",
            )
        if name in state["_modules"]:
            raise self._refused(where, "replaces a submodule", "build the module once, in __init__")
        old = state.get(name, _MISSING)
        if old is value or (is_plain(old) and is_plain(value) and same_plain(old, value)):
            return False
        if old is _MISSING and is_plain(value):  # a flag set once at the first call (a library's lazy set-up)
            return False
        kind = "a tensor" if isinstance(value, torch.Tensor) or _holds_tensors(value) else "a Python value"
        raise self._refused(
            where,
            f"assigns {kind} to a module attribute, a side effect a compiled step cannot "
            "carry from one step to the next (torch.export would drop it silently)",
            "keep counters and schedules outside forward (set the attribute between steps: torchpar "
            "recompiles on a change), register state that changes every step as a buffer and "
            "update it in place, or return it from a step_fn as (loss, {'name': tensor}) and feed "
            "it back with the next batch (docs/porting.md)",
        )

    def _refused(self, where: str, what: str, fix: str) -> ModuleStateError:
        return ModuleStateError(f"forward {what}: {where}\n  at {user_line()}\n{fix}")


_MISSING = object()


def _holds_tensors(value: object) -> bool:
    if isinstance(value, (tuple, list)):
        return any(isinstance(v, torch.Tensor) or _holds_tensors(v) for v in value)
    if isinstance(value, dict):
        return any(isinstance(v, torch.Tensor) or _holds_tensors(v) for v in value.values())
    return False


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _by_torch(frame: types.FrameType) -> bool:
    """Whether the assignment is torch's own bookkeeping (an ``nn.LSTM`` refreshing ``_flat_weights``), not the
    model's code."""
    return os.path.abspath(frame.f_code.co_filename).startswith(_TORCH_DIR)


_PLAIN_TYPES = frozenset({type(None), bool, int, float, str, tuple, list})
"""Types of the values :func:`is_plain` may accept (enums aside): a cheap first test on every attribute read."""

_active: _Recorder | None = None
_recording_classes: dict[type, type] = {}


def _recording_class(cls: type[torch.nn.Module]) -> type:
    """``cls`` with reads and assignments reported to the active recorder (cached per class)."""
    if cls not in _recording_classes:

        def __getattribute__(self: torch.nn.Module, name: str) -> object:
            value = object.__getattribute__(self, name)
            if _active is not None and (type(value) in _PLAIN_TYPES or isinstance(value, enum.Enum)):
                _active.read(self, name, value)  # (methods, submodules and tensors — most reads — skip the call)
            return value

        def __setattr__(self: torch.nn.Module, name: str, value: object) -> None:
            if _active is None or _by_torch(sys._getframe(1)) or not _active.write(self, name, value):
                cls.__setattr__(self, name, value)  # type: ignore[arg-type]  # torch types it Tensor | Module

        _recording_classes[cls] = type(
            cls.__name__,
            (cls,),
            {
                "__getattribute__": __getattribute__,
                "__setattr__": __setattr__,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "_torchpar_recording_base": cls,
            },
        )
    return _recording_classes[cls]


@contextlib.contextmanager
def recording(root: torch.nn.Module, modules: dict[str, torch.nn.Module]) -> Iterator[ModuleAccess]:
    """Watch ``modules`` (path → module; see :class:`AttributeRead.path`) while ``root`` (the module the export
    calls) runs its ``forward`` inside the block — not while torch.export prepares the modules around it; yields the
    :class:`ModuleAccess` it fills. A module outside ``modules`` that ``forward`` calls runs on its real state
    (torch.export fakes only the exported module's): whatever the export writes into it is undone on exit. Not
    re-entrant."""
    global _active
    assert _active is None, "recording() does not nest"
    recorder = _Recorder({id(m): p for p, m in modules.items()})
    originals = {id(m): (m, type(m)) for m in modules.values()}

    def enter(module: torch.nn.Module, args: tuple[object, ...]) -> None:
        global _active
        _active = recorder

    def leave(module: torch.nn.Module, args: tuple[object, ...], output: object) -> None:
        global _active
        _active = None

    saved: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}

    def called(module: torch.nn.Module, args: tuple[object, ...]) -> None:
        recorder.access.called.setdefault(id(module), module)
        if id(module) not in originals:  # outside the watched modules: its real state, which forward may write
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():  # a real copy, not a fake one, and nothing traced into the graph
                for tensor in _state_of(module):
                    if id(tensor) not in saved and not isinstance(tensor, torch._subclasses.FakeTensor):
                        saved[id(tensor)] = (tensor, tensor._version, tensor.detach().clone())

    handles = [
        torch.nn.modules.module.register_module_forward_pre_hook(called),
        root.register_forward_pre_hook(enter),
        root.register_forward_hook(leave),
    ]
    try:
        for module, cls in originals.values():
            module.__class__ = _recording_class(cls)
        yield recorder.access
    finally:
        _active = None
        for handle in handles:
            handle.remove()
        for module, cls in originals.values():
            module.__class__ = cls
        with torch.no_grad():  # what the export wrote into a module outside (a BatchNorm's count) is undone
            for tensor, version, value in saved.values():
                if tensor._version != version:
                    tensor.copy_(value)


@contextlib.contextmanager
def tensors_as_buffers(modules: dict[str, torch.nn.Module]) -> Iterator[list[tuple[str, torch.nn.Module, str]]]:
    """Register every tensor attribute of ``modules`` (a tensor in a module's ``__dict__``) as a non-persistent
    buffer while the block runs; yields ``(path.name, module, name)`` of each; puts them back as plain attributes
    after (the same tensor objects)."""
    moved = []
    for path, module in modules.items():
        state = module.__dict__
        for name in [n for n, v in state.items() if isinstance(v, torch.Tensor) and n not in MODULE_INTERNALS]:
            tensor = state.pop(name)
            module._buffers[name] = tensor
            module._non_persistent_buffers_set.add(name)
            moved.append((f"{path}.{name}" if path else name, module, name))
    try:
        yield moved
    finally:
        for _, module, name in moved:
            tensor = module._buffers.pop(name)
            module._non_persistent_buffers_set.discard(name)
            module.__dict__[name] = tensor


@contextlib.contextmanager
def numbers_as_tensors(numbers: tuple[NumberAttribute, ...]) -> Iterator[dict[tuple[int, str], torch.Tensor]]:
    """Replace each Python float attribute ``(module, name)`` by a 0-d tensor of the default dtype holding its value
    while the block runs, so that the capture reads it as an input (a tensor attribute, :func:`tensors_as_buffers`)
    rather than baking it in; yields ``(id(module), name)`` → that tensor; puts the floats back after. A value that
    changes between steps (an annealed loss weight) then needs no recompile. ``forward`` must use it as PyTorch uses a
    number in tensor arithmetic: one that steers Python control flow makes the export fail (the caller then bakes it
    in)."""
    saved, tensors = [], {}
    for module, name in numbers:
        value = module.__dict__[name]
        tensors[(id(module), name)] = module.__dict__[name] = torch.tensor(float(value))
        saved.append((module, name, value))
    try:
        yield tensors
    finally:
        for module, name, value in saved:
            module.__dict__[name] = value


def outside_modules(called: dict[int, torch.nn.Module], root: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost modules among ``called`` outside ``root``'s tree (and not holding ``root``, as torch.export's
    own wrapper does) that own parameters or buffers somewhere below them, in call order: each with its submodules
    is one outside module."""
    inside = {id(m) for m in torch.nn.Module.modules(root)}
    outside = [
        m for i, m in called.items() if i not in inside and not any(sub is root for sub in torch.nn.Module.modules(m))
    ]
    below = {id(sub) for m in outside for sub in m.modules() if sub is not m}
    return [m for m in outside if id(m) not in below and any(True for _ in _state_of(m))]


def _state_of(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    yield from torch.nn.Module.parameters(module)
    yield from torch.nn.Module.buffers(module)


@dataclasses.dataclass(frozen=True)
class CapturedState:
    """The module state a capture found beside the model's parameters and buffers (module docstring)."""

    reads: tuple[AttributeRead, ...] = ()
    """The plain values the step baked in, to compare before each step."""
    tensor_attributes: tuple[tuple[str, torch.nn.Module, str], ...] = ()
    """``(state name, module, attribute)`` of each tensor attribute the step reads as a buffer input."""
    numbers: tuple[tuple[str, torch.nn.Module, str], ...] = ()
    """``(state name, module, attribute)`` of each Python float attribute captured as a step input
    (:func:`numbers_as_tensors`)."""
    outside: tuple[torch.nn.Module, ...] = ()
    """Modules outside the model the step calls; the ``i``-th one's state is named ``outside<i>.<name>``."""
    copied_buffers: tuple[str, ...] = ()
    """Buffers ``forward`` reassigns (carried out as in-place copies)."""


OUTSIDE_PREFIX = "outside"
"""State names of a module outside the model start with ``outside<i>.`` (:attr:`CapturedState.outside`)."""


def watched_modules(model: torch.nn.Module, outside: tuple[torch.nn.Module, ...]) -> dict[str, torch.nn.Module]:
    """Path → module for the model's modules and those of each outside module (``outside<i>.<name>``)."""
    modules = dict(model.named_modules())
    for i, module in enumerate(outside):
        prefix = f"{OUTSIDE_PREFIX}{i}"
        modules.update({f"{prefix}.{n}" if n else prefix: m for n, m in module.named_modules()})
    return modules

"""The torch model and its engines as one truth for the weights.

After ``torchpar.compile`` the parameters and buffers live in the engine, on its devices; the torch model keeps
tensors of the same names. A :class:`ModelLink` keeps the two one truth, lazily, in both directions.

**Engine → torch (pulls).** After a step the engine holds newer values than the torch tensors it wrote (the
trained parameters, the buffers the step mutates): it becomes their *holder*. Whenever user code reaches for the
torch model — calls it or one of its submodules (evaluation, sampling), asks for ``state_dict()``,
``parameters()``, ``named_parameters()``, ``buffers()``, ``named_buffers()``, reads an attribute holding a
parameter or buffer (``model.fc.weight``), copies or pickles it (``copy.deepcopy``, ``AveragedModel(model)``,
``torch.save(model)``), loads into it or moves it — each holder first copies its values into the torch tensors
(one export of its state). Watched modules get these triggers by a class swap to a cached subclass of their class
(as FSDP2 and ``torch.nn.utils.parametrize`` do), undone when the last engine over them closes; copies and pickles
come out as the original class. A class's ``device`` and ``dtype`` properties (Hugging Face's, read by loops at every
step) read metadata only and pull nothing.

**Torch → engine (pushes).** Before each step and ``engine.forward`` the engine compares every tensor it holds a
copy of with the torch model: the object (a reassigned buffer or tensor attribute of the same shape and dtype is
read from its new object; a replaced parameter — ``model.b.weight = model.a.weight``, ``load_state_dict(...,
assign=True)`` — or a changed dtype recompiles), its ``_version`` (any in-place write: ``load_state_dict``,
``p.mul_(0.5)`` under ``no_grad``) and its *touch* count, bumped by every trigger above (``p.data.add_(...)`` writes
without a version bump, so a tensor handed to user code counts as written) and by every pull (another engine's new
values; a pull writes through numpy, without a version bump). Those that differ are pushed
(:meth:`~torchpar.runtime.executor.Executor.update_state`, laid out by the plan).

**Several engines.** The holder is kept per tensor, not per engine: engines over models that call each other (a GAN:
the D step runs G, the G step runs D) or share a module read each other's updates — before engine B's step every
tensor B reads that engine A holds is pulled from A into torch, then pushed into B.

**Guards.** The plain values the capture baked in (:class:`~torchpar.capture.module_state.AttributeRead`) are
compared too; :meth:`ModelLink.before_step` returns what changed and the engine recompiles, with a warning.

**Not seen.** A reference user code keeps across steps (``w = model.fc.weight`` taken before the loop and read after
a step) shows the values of its last pull; writing into it while the engine holds newer values raises at the next
step. Module attributes ``forward`` does not read are not guarded.

Cost: :meth:`ModelLink.before_step` is one pass over the engine's tensors and guards (identity, ``_version``, touch;
tens of microseconds for a GPT-2); a pull or a push moves the engine's whole model state once.
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import inspect
import logging
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, SupportsIndex

import torch

from torchpar.capture.module_state import MODULE_INTERNALS, AttributeRead, CapturedState, NumberAttribute, same_plain

if TYPE_CHECKING:
    from torchpar.runtime.state import HostState

    _ModuleMixin = torch.nn.Module
    """What :class:`_Linked` is mixed into (to the type checker; at run time it is a plain mixin)."""
else:
    _ModuleMixin = object

log = logging.getLogger(__name__)

_MISSING = object()


# --- the registry shared by every link --------------------------------------------------------------------------

_holders: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[ModelLink]]] = {}
"""``id(tensor)`` → (the tensor, the link whose engine holds newer values than it), both weakly."""
_touches: dict[int, int] = {}
"""``id(tensor)`` → how many times user code was handed it (module docstring)."""
_watchers: dict[int, weakref.WeakSet[ModelLink]] = {}
"""``id(module)`` → the links watching it."""
_seen: dict[int, int] = {}
"""``id(module)`` → the epoch in which user code last reached its whole tree (later accesses in it are free)."""
_epoch = 0
"""Bumped by every step of every engine: what user code reached before it counts again after it."""
_suspended = 0


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """torchpar's own use of a watched model (capture, compile, checks): nothing is pulled or touched."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


def holder_of(tensor: torch.Tensor) -> ModelLink | None:
    """The link whose engine holds newer values than ``tensor``, if any."""
    entry = _holders.get(id(tensor))
    if entry is None or entry[0]() is not tensor:
        return None
    return entry[1]()


def _own_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    state = module.__dict__
    yield from (t for t in state["_parameters"].values() if t is not None)
    yield from (t for t in state["_buffers"].values() if t is not None)
    yield from (v for k, v in state.items() if isinstance(v, torch.Tensor) and k not in MODULE_INTERNALS)


def _user_access(module: torch.nn.Module, name: str | None = None) -> None:
    """User code reaches ``module`` (its whole tree) or its parameter/buffer ``name``: pull what an engine holds
    newer, and count the tensors as touched."""
    if _suspended or id(module) not in _watchers or _seen.get(id(module)) == _epoch:
        return  # (a module whose whole tree user code reached since the last step: nothing more to do)
    if name is None:
        modules = list(torch.nn.Module.modules(module))
        tensors = [t for m in modules for t in _own_tensors(m)]
    else:
        state = module.__dict__
        tensor = state["_parameters"].get(name, state["_buffers"].get(name))
        tensors = [tensor] if tensor is not None else []
    pull_holders(tensors)
    for tensor in tensors:
        _touches[id(tensor)] = _touches.get(id(tensor), 0) + 1
    if name is None:
        _seen.update((id(m), _epoch) for m in modules)


def pull_holders(tensors: Iterable[torch.Tensor], *, but: ModelLink | None = None) -> None:
    """Every engine holding newer values than one of ``tensors`` (other than ``but``'s) copies its values into
    torch."""
    for holder in {h for t in tensors if (h := holder_of(t)) is not None and h is not but}:
        holder.pull()


# --- the watched modules' class ---------------------------------------------------------------------------------


class _Linked(_ModuleMixin):
    """Mixed into the class of a watched module: user code reaching the module pulls first (module docstring).
    Each method passes its arguments on, as they came, to the module's own class (whose signature may extend
    ``torch.nn.Module``'s)."""

    _torchpar_base: ClassVar[type[torch.nn.Module]]
    """The module's own class (set on each linked class by :func:`_linked_class`)."""

    def __getattr__(self, name: str) -> torch.Tensor | torch.nn.Module:
        state = object.__getattribute__(self, "__dict__")
        if not _suspended and (name in state.get("_parameters", ()) or name in state.get("_buffers", ())):
            _user_access(self, name)
        return super().__getattr__(name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _user_access(self)
        return super().__call__(*args, **kwargs)

    def parameters(self, *args: Any, **kwargs: Any) -> Iterator[torch.nn.Parameter]:
        _user_access(self)
        return super().parameters(*args, **kwargs)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
        _user_access(self)
        return super().named_parameters(*args, **kwargs)

    def buffers(self, *args: Any, **kwargs: Any) -> Iterator[torch.Tensor]:
        _user_access(self)
        return super().buffers(*args, **kwargs)

    def named_buffers(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.Tensor]]:
        _user_access(self)
        return super().named_buffers(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        _user_access(self)
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        _user_access(self)
        return super().load_state_dict(*args, **kwargs)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        _user_access(self)
        return super()._apply(*args, **kwargs)

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[object, ...]:
        """Copies and pickles: the current weights, as the module's own class."""
        _user_access(self)
        reduced = super().__reduce_ex__(protocol)
        reconstructor = copyreg._reconstructor  # type: ignore[attr-defined]  # typeshed lacks this private helper
        return (reconstructor, (type(self)._torchpar_base, object, None), *reduced[2:])


_linked_classes: dict[type, type] = {}


METADATA_PROPERTIES = ("device", "dtype")
"""Properties a model class may define that read its parameters' metadata only (Hugging Face's ``model.device`` and
``model.dtype``, read by loops at every step): evaluated without a pull."""


def _metadata_property(prop: property) -> property:
    fget = prop.fget
    assert fget is not None, "only properties with a getter are wrapped"

    def get(self: object) -> object:
        with suspended():
            return fget(self)

    return property(get, doc=prop.__doc__)


def _linked_class(cls: type) -> type:
    if getattr(cls, "_torchpar_base", None) is not None:
        return cls
    if cls not in _linked_classes:
        namespace: dict[str, object] = {
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_torchpar_base": cls,
        }
        for name in METADATA_PROPERTIES:
            found = inspect.getattr_static(cls, name, None)
            if isinstance(found, property) and found.fget is not None:
                namespace[name] = _metadata_property(found)
        _linked_classes[cls] = type(cls.__name__, (_Linked, cls), namespace)
    return _linked_classes[cls]


def _watch(module: torch.nn.Module, link: ModelLink) -> None:
    watchers = _watchers.setdefault(id(module), weakref.WeakSet())
    watchers.add(link)
    module.__class__ = _linked_class(type(module))


def _unwatch(module: torch.nn.Module, link: ModelLink | None) -> None:
    watchers = _watchers.get(id(module))
    if watchers is not None:
        if link is not None:
            watchers.discard(link)
        if any(True for _ in watchers):
            return
        del _watchers[id(module)]
    _seen.pop(id(module), None)
    base = getattr(type(module), "_torchpar_base", None)
    if base is not None:
        module.__class__ = base


def _release(modules: list[torch.nn.Module]) -> None:
    """A link was garbage-collected without :meth:`ModelLink.close`: give back the modules no live link watches."""
    for module in modules:
        watchers = _watchers.get(id(module))
        if watchers is not None and not any(True for _ in watchers):  # (iteration skips links being collected)
            _unwatch(module, None)


# --- one engine's link ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where the torch model keeps one state tensor: ``module``'s parameter, buffer or plain tensor attribute."""

    module: torch.nn.Module
    attribute: str
    where: str
    """``"parameter"``, ``"buffer"``, ``"attribute"`` (a tensor in the module's ``__dict__``) or ``"number"`` (a Python
    float there, which the step reads as an input: :func:`torchpar.capture.module_state.numbers_as_tensors`)."""
    path: str
    """``path.attribute`` for messages."""

    def current(self) -> object:
        state = self.module.__dict__
        if self.where == "parameter":
            return state["_parameters"].get(self.attribute, _MISSING)
        if self.where == "buffer":
            return state["_buffers"].get(self.attribute, _MISSING)
        return state.get(self.attribute, _MISSING)


@dataclasses.dataclass
class Tracked:
    """One state tensor the engine holds a copy of."""

    name: str
    """The engine's state name."""
    kind: str
    """``"param"`` or ``"buffer"`` (the executor's state kind)."""
    slots: tuple[Slot, ...]
    """Every place the model keeps it (a tied parameter has several)."""
    tensor: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    outside: bool = False
    """It belongs to a module outside the engine's model (trained, if at all, by another engine)."""
    synced_version: int = -1
    synced_touch: int = -1
    """The tensor's ``_version`` and touch count when the engine's copy last equalled it."""
    reassigned: bool = False


class StateAccess:
    """What a link needs from its engine (the executor's state, and the optimizer state behind the bridge)."""

    def export(self, kinds: tuple[str, ...]) -> HostState:
        """The executor's state of ``kinds`` as a ``HostState``."""
        raise NotImplementedError

    def update(self, state: HostState) -> None:
        """Replace entries of the executor's state (a ``HostState``)."""
        raise NotImplementedError


class ModelLink:
    """One engine's side of the one truth (module docstring): its tracked tensors, its guards, its pulls and pushes.

    ``tracked``: the engine's state names → :class:`Tracked` (copies equal to torch when built); ``reads``: the
    capture's guards; ``roots``: the modules whose trees are watched (the model and the modules outside it the step
    calls); ``label`` names the engine in messages."""

    def __init__(
        self,
        tracked: dict[str, Tracked],
        reads: Iterable[AttributeRead],
        roots: Iterable[torch.nn.Module],
        state: StateAccess,
        label: str = "the engine",
    ):
        self.tracked = tracked
        self.reads = tuple(reads)
        self.state = state
        self.label = label
        self._ref = weakref.ref(self)
        self._modules = {id(m): m for root in roots for m in torch.nn.Module.modules(root)}
        for t in tracked.values():
            t.synced_version, t.synced_touch = t.tensor._version, _touches.get(id(t.tensor), 0)
        for module in self._modules.values():
            _watch(module, self)
        self.closed = False
        self._finalizer = weakref.finalize(self, _release, list(self._modules.values()))

    # --- engine → torch ---------------------------------------------------------------------------------------

    def holds(self) -> list[Tracked]:
        """The tensors this engine holds newer values of than torch."""
        return [t for t in self.tracked.values() if holder_of(t.tensor) is self]

    def pull(self) -> None:
        """Copy every value this engine holds newer than torch into the torch tensors (one export)."""
        held = self.holds()
        if not held:
            return
        from torchpar.engine.host_arrays import write_into
        from torchpar.runtime.executor import ExecutorClosedError

        try:
            state = self.state.export(("param", "buffer"))
        except ExecutorClosedError as error:  # its workers are gone (a failure): what they held is lost
            log.warning(
                "torchpar: %s cannot give the torch model its newer values of %d tensors (%s); the model "
                "keeps the values of the last pull",
                self.label,
                len(held),
                error,
            )
            for t in held:
                _holders.pop(id(t.tensor), None)
            return
        with suspended():
            for t in held:
                write_into(t.tensor, state.params[t.name] if t.kind == "param" else state.buffers[t.name])
                _holders.pop(id(t.tensor), None)
                touch = _touches[id(t.tensor)] = _touches.get(id(t.tensor), 0) + 1  # other engines' copies are old
                t.synced_version, t.synced_touch = t.tensor._version, touch
        log.debug("torchpar: %s copied %d tensors into the torch model", self.label, len(held))

    # --- torch → engine ---------------------------------------------------------------------------------------

    def before_step(self) -> list[str]:
        """Bring the engine's copies up to date with the torch model before a step (module docstring). Returns what
        changed that the compiled step cannot take as new values (then nothing is pushed: the engine recompiles)."""
        changes = self._guard_changes() + self._replaced()
        if changes:
            return changes
        pull_holders((t.tensor for t in self.tracked.values()), but=self)
        push = []
        for t in self.tracked.values():
            version, touch = t.tensor._version, _touches.get(id(t.tensor), 0)
            written = t.reassigned or version != t.synced_version or touch != t.synced_touch
            if not written:
                continue
            if holder_of(t.tensor) is self and not t.reassigned:
                raise RuntimeError(
                    f"{t.slots[0].path} was written in place while {self.label} held newer values of it (a reference "
                    "kept from before the last step?): the write applied to stale values. Read the tensor through the "
                    "model after each step (model.parameters(), model.<name>, state_dict()), or call "
                    "engine.sync_to_torch() before writing"
                )
            push.append(t)
        if push:
            self._push(push)
        return []

    def _guard_changes(self) -> list[str]:
        changes = []
        for read in self.reads:
            now = read.module.__dict__.get(read.name, _MISSING)
            if not same_plain(now, read.value):
                shown = "deleted" if now is _MISSING else repr(now)
                changes.append(
                    f"{read.describe()} changed from {read.value!r} to {shown} (forward read it at {read.source})"
                )
        return changes

    def changed_floats(self) -> list[NumberAttribute]:
        """``(module, name)`` of each guarded float attribute whose value changed (a float still): candidates to be
        read as step inputs from now on (:func:`torchpar.capture.module_state.numbers_as_tensors`)."""
        changed = []
        for read in self.reads:
            now = read.module.__dict__.get(read.name, _MISSING)
            if type(read.value) is float and type(now) is float and not same_plain(now, read.value):
                changed.append((read.module, read.name))
        return changed

    def _replaced(self) -> list[str]:
        changes = []
        for t in self.tracked.values():
            for slot in t.slots:
                now = slot.current()
                if slot.where == "number":
                    if isinstance(now, (int, float)) and not isinstance(now, bool):
                        if float(now) != t.tensor.item():
                            t.tensor.fill_(float(now))  # a new version: pushed below
                        continue
                    changes.append(f"{slot.path} changed from a number to {type(now).__name__}")
                    continue
                if now is t.tensor:
                    continue
                if (
                    slot.where != "parameter"
                    and len(t.slots) == 1
                    and isinstance(now, torch.Tensor)
                    and tuple(now.shape) == t.shape
                    and now.dtype == t.dtype
                ):
                    t.tensor, t.reassigned = now, True  # a new buffer / attribute object: its values are pushed
                    continue
                what = "removed" if now is _MISSING else "replaced by another tensor"
                changes.append(f"{slot.path} ({slot.where}) was {what}")
            if t.tensor.dtype != t.dtype or tuple(t.tensor.shape) != t.shape:
                changes.append(
                    f"{t.slots[0].path} changed from {t.dtype} {list(t.shape)} to {t.tensor.dtype} "
                    f"{list(t.tensor.shape)}"
                )
        return changes

    def _push(self, push: list[Tracked]) -> None:
        from torchpar.engine.host_arrays import host_copy
        from torchpar.runtime.state import HostState

        self.state.update(
            HostState(
                params={t.name: host_copy(t.tensor) for t in push if t.kind == "param"},
                buffers={t.name: host_copy(t.tensor) for t in push if t.kind == "buffer"},
            )
        )
        for t in push:
            t.synced_version, t.synced_touch, t.reassigned = t.tensor._version, _touches.get(id(t.tensor), 0), False
        log.debug("torchpar: %d tensors of the torch model pushed into %s", len(push), self.label)

    def after_step(self, written: Iterable[str]) -> None:
        """The step wrote the state named ``written``: the engine holds it newer than torch now."""
        global _epoch
        for name in written:
            tensor = self.tracked[name].tensor
            _holders[id(tensor)] = (weakref.ref(tensor), self._ref)
        _epoch += 1

    def restored(self) -> None:
        """The engine's state was replaced as a whole (a checkpoint loaded into it): it holds the model's tensors
        newer than torch; those of modules outside the model belong to whoever trains them, so they are read from
        torch again before the next step."""
        for t in self.tracked.values():
            t.reassigned = t.outside
        self.after_step(n for n, t in self.tracked.items() if not t.outside)

    # --- lifetime ---------------------------------------------------------------------------------------------

    def close(self, pull: bool = True) -> None:
        """Stop watching: pull what the engine holds (``pull``; a failed engine has nothing to give), forget it, and
        give the modules no other engine watches their own class back."""
        if self.closed:
            return
        try:
            if pull:
                self.pull()
        finally:
            self.closed = True
            for t in self.tracked.values():
                if holder_of(t.tensor) is self:
                    _holders.pop(id(t.tensor), None)
            for module in self._modules.values():
                _unwatch(module, self)
            self._finalizer.detach()


# --- what an engine tracks ----------------------------------------------------------------------------------------


def tracked_state(model: torch.nn.Module, captured: CapturedState) -> dict[str, Tracked]:
    """Every state tensor an engine over ``model`` holds, by state name: the model's parameters and buffers
    (``named_parameters()`` / ``named_buffers()`` names; a tied tensor under its first name, with a slot per place),
    the tensor attributes the capture reads as buffers, and the parameters and buffers of the modules outside the
    model the step calls (``outside<i>.<name>``; ``captured`` is the first capture's
    :class:`~torchpar.capture.module_state.CapturedState`)."""
    from torchpar.capture.module_state import OUTSIDE_PREFIX

    found: dict[str, Tracked] = {}
    first: dict[int, str] = {}

    def add(tensor: torch.Tensor, kind: str, slot: Slot, outside: bool) -> None:
        name = first.setdefault(id(tensor), slot.path)
        if name not in found:
            found[name] = Tracked(
                name=name,
                kind=kind,
                slots=(),
                tensor=tensor,
                shape=tuple(tensor.shape),
                dtype=tensor.dtype,
                outside=outside,
            )
        tracked = found[name]
        if all(s.module is not slot.module or s.attribute != slot.attribute for s in tracked.slots):
            tracked.slots = (*tracked.slots, slot)

    def add_tree(root: torch.nn.Module, prefix: str, outside: bool) -> None:
        for path, module in torch.nn.Module.named_modules(root, remove_duplicate=False):
            base = f"{prefix}{path}." if path else prefix
            for where, kind, entries in (
                ("parameter", "param", module.__dict__["_parameters"]),
                ("buffer", "buffer", module.__dict__["_buffers"]),
            ):
                for attr, tensor in entries.items():
                    if tensor is not None:
                        add(tensor, kind, Slot(module, attr, where, base + attr), outside)

    with suspended():
        add_tree(model, "", outside=False)
        for name, module, attr in captured.tensor_attributes:
            add(
                module.__dict__[attr],
                "buffer",
                Slot(module, attr, "attribute", name),
                outside=name.startswith(f"{OUTSIDE_PREFIX}"),
            )
        for name, module, attr in captured.numbers:  # the engine's copy of a float: a 0-d tensor of its own
            add(
                torch.tensor(float(module.__dict__[attr])),
                "buffer",
                Slot(module, attr, "number", name),
                outside=name.startswith(f"{OUTSIDE_PREFIX}"),
            )
        for i, module in enumerate(captured.outside):
            add_tree(module, f"{OUTSIDE_PREFIX}{i}.", outside=True)
    return found

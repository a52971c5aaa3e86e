"""An engine's side of the user's torch model and optimizer between steps.

One :class:`TorchSide` per compiled engine holds what keeps the training loop's torch objects and the engine one
truth (``docs/semantics.md``, "The torch model between steps"): the :class:`~torchpar.engine.model_link.ModelLink`
(weights pulled when user code looks, pushed when it wrote), the training setup compiled for (modes, ``requires_grad``,
param groups), the optimizer's ``state_dict`` hooks, and the ``.grad`` stand-ins. It says what changed since the
last step; recompiling for a change is the engine's business.

Invariant: between steps, every tensor of the torch model either equals the engine's copy or is marked held
(pulled on first access); the optimizer's ``state`` is stale iff :attr:`TorchSide.optimizer_stale`.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Concatenate, ParamSpec, Protocol, TypeVar

import torch

from torchpar.capture.export import capture_train_step
from torchpar.capture.module_state import NumberAttribute
from torchpar.capture.precision import autocast_dtype
from torchpar.capture.training_setup import describe_changes, training_setup
from torchpar.engine import model_link
from torchpar.engine.grad_stand_in import GradStandIns

if TYPE_CHECKING:
    from torchpar.engine.batches import Signature
    from torchpar.engine.compiled import CompiledTraining
    from torchpar.engine.step_capture import StepFns
    from torchpar.ir.graph import Graph
    from torchpar.options import CompileOptions
    from torchpar.runtime.executor import Executor
    from torchpar.runtime.state import HostState

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


class Linkable(Protocol):
    """An engine as a :func:`linked` method's wrapper sees it."""

    @property
    def _capture_batch(self) -> object: ...

    def _bring_in(self, batch: object, *, setup: bool = True) -> bool: ...


E = TypeVar("E", bound=Linkable)


class TorchSide:
    """The link between one engine and the torch ``model`` / ``optimizer`` it was compiled from.

    ``compiled``: the engine's :class:`~torchpar.engine.compiled.CompiledTraining`; ``executor`` and ``graph``: return
    the engine's executor and its latest training graph, ``None`` once the engine is gone (callables, so that the
    optimizer's hooks keep no engine alive); ``fns``: the user's ``loss_fn``, ``step_fn``, ``forward_fn`` (the trial
    captures of :meth:`feedable_floats` use them); ``params``: the engine's parameter names → torch parameters."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        compiled: CompiledTraining,
        executor: Callable[[], Executor | None],
        graph: Callable[[], Graph],
        options: CompileOptions,
        fns: StepFns,
        params: dict[str, torch.Tensor],
    ):
        self.model, self.optimizer, self._compiled = model, optimizer, compiled
        self._executor, self._graph = executor, graph
        self._options, self._fns = options, fns
        with model_link.suspended():
            self._setup = training_setup(model, optimizer)  # modes, requires_grad, param groups compiled for
        self.link = model_link.ModelLink(
            compiled.tracked,
            compiled.captured_state.reads,
            roots=(model, *compiled.captured_state.outside),
            state=_ExecutorState(executor),
            label=f"the engine over {type(model).__name__}",
        )
        self._written: dict[Signature, set[str]] = {}
        self._grads = (
            GradStandIns({n: params[n] for n in compiled.bridge.spec.param_names}) if options.grad_stand_ins else None
        )
        self.optimizer_stale = False
        """The torch optimizer's ``state`` is older than the engine's (pulled by ``optimizer.state_dict()``)."""
        self._optimizer_loaded = False
        self._hooks = [
            optimizer.register_state_dict_pre_hook(_weakly(self._on_optimizer_state_dict)),
            optimizer.register_load_state_dict_post_hook(_weakly(self._on_optimizer_loaded)),
        ]

    def changes(self, *, setup: bool = True) -> list[str]:
        """Before a step (or forward, save…): push what user code wrote into the torch model since the last step into
        the engine; return the changes the compiled step cannot take as new values (modes, ``requires_grad``, param
        groups, a replaced parameter, a Python value ``forward`` read), each as a phrase; empty when none. With none,
        an optimizer state user code loaded reaches the engine.

        ``setup=False`` (before anything but a step: an eval forward captures the model in eval mode, a checkpoint saves
        values): changes of the training setup — modes, ``requires_grad``, param groups — are left for the next step
        to find; they stay changes until the setup is the compiled one again (``model.eval()`` for an evaluation, then
        ``model.train()``, recompiles nothing)."""
        value_changes = self.link.before_step()
        setup_changes = (
            describe_changes(self._setup, training_setup(self.model, self.optimizer))
            if setup or self._optimizer_loaded
            else []
        )
        changes = value_changes + setup_changes if setup else value_changes
        if not value_changes and not setup_changes and self._optimizer_loaded:
            from torchpar.runtime.state import HostState

            executor = self._executor()
            assert executor is not None, "the engine asks for the changes while it lives"
            executor.update_state(HostState(opt_state=self._compiled.bridge.initial_state()))
            self._optimizer_loaded = self.optimizer_stale = False
        return changes

    def changed_floats(self) -> list[NumberAttribute]:
        """The float attributes ``forward`` read whose values changed since the last step."""
        return self.link.changed_floats()

    def after_step(self, signature: Signature) -> None:
        """The step of ``signature`` ran: what it wrote is now newer in the engine than in torch."""
        self.link.after_step(self._written_by(signature))
        self.optimizer_stale = True
        if self._grads is not None:
            self._grads.set()

    def restored(self) -> None:
        """A checkpoint was loaded into the engine: all of its state is newer than torch's."""
        self.link.restored()
        self.optimizer_stale = True

    def pull(self) -> None:
        """Copy the engine's newer weights into the torch model now."""
        self.link.pull()

    def hand_over(self) -> None:
        """Before a recompile from the torch objects: the engine's newer weights into the model, and its optimizer
        state into the optimizer unless user code loaded one since the last step (that one is newer: the recompiled
        step starts from it)."""
        self.pull()
        if not self._optimizer_loaded:
            self.write_optimizer_state()

    def write_optimizer_state(self) -> None:
        """Copy the engine's optimizer state (of what its latest step trains) into the torch optimizer now."""
        executor = self._executor()
        assert executor is not None, "the engine writes its optimizer state while it lives"
        state = executor.export_state(("state",))
        self._compiled.bridge.write_back(state.opt_state, trained=set(self._compiled.trainable(self._graph())))
        self.optimizer_stale = False

    def announce_recompile(self, changes: list[str], fed: list[NumberAttribute]) -> None:
        """Log why the step recompiles (``changes``) and which float attributes (``fed``) become step inputs."""
        log.warning(
            "torchpar: %s; recompiling the training step%s",
            "; ".join(c if " changed " in c or " was " in c else f"{c} changed since compile" for c in changes),
            f" (from now on {', '.join(name for _, name in fed)} "
            f"{'is a step input' if len(fed) == 1 else 'are step inputs'}: a change recompiles no more)"
            if fed
            else "",
        )

    def feedable_floats(self, batch: object, floats: Iterable[NumberAttribute]) -> list[NumberAttribute]:
        """Those of ``floats`` the step can read as inputs: each is tried in a capture on ``batch`` as a 0-d tensor; one
        that steers Python control flow in ``forward`` (``if self.w > 0``, ``F.dropout``'s range check) fails it and
        stays a constant of the step."""
        fed: list[NumberAttribute] = []
        for candidate in floats:
            try:
                capture_train_step(
                    self.model,
                    self._compiled.first_part(batch),
                    self._fns["loss_fn"],
                    autocast=autocast_dtype(self._options.mixed_precision),
                    step_fn=self._fns["step_fn"],
                    outside=self._compiled.captured_state.outside,
                    numbers=(*self._compiled.numbers, *fed, candidate),
                )
            except Exception as error:
                log.info(
                    "torchpar: %s.%s stays a constant of the step (each change recompiles): forward does not use "
                    "it as a number in tensor arithmetic only (%s: %s)",
                    type(candidate[0]).__name__,
                    candidate[1],
                    type(error).__name__,
                    str(error).splitlines()[0][:200] if str(error) else "",
                )
            else:
                fed.append(candidate)
        return fed

    @property
    def closed(self) -> bool:
        return self.link.closed

    def close(self, pull: bool) -> None:
        """Stop linking the torch model and optimizer to the engine (pulling its newer weights first if ``pull``)."""
        try:
            self.link.close(pull=pull)
        finally:
            if self._grads is not None:
                self._grads.clear()
            for handle in self._hooks:
                handle.remove()

    def _written_by(self, signature: Signature) -> set[str]:
        """The state the step of ``signature`` writes: the parameters it trains and the buffers it mutates."""
        if signature not in self._written:
            graph = self._compiled.graph(signature)
            self._written[signature] = {*self._compiled.trainable(graph)} | {
                o.target for o in graph.outputs if o.kind == "buffer"
            }
        return self._written[signature]

    def _on_optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.state_dict()`` by user code: the engine's optimizer state into the torch optimizer first."""
        executor = self._executor()
        if self.optimizer_stale and executor is not None and not executor.closed:
            self.write_optimizer_state()

    def _on_optimizer_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.load_state_dict(...)`` by user code: the next step starts from it."""
        self._optimizer_loaded = True


def linked(
    bring_in: bool = True,
) -> Callable[[Callable[Concatenate[E, P], R]], Callable[Concatenate[E, P], R]]:
    """Decorate an engine method that reads or writes the engine's state: it runs with the torch link suspended (its
    own reads of the torch model pull nothing), after — with ``bring_in`` — what user code wrote into the torch model
    since the last step was brought in (the engine's ``_bring_in(_capture_batch, setup=False)``: the values; a change
    of the training setup, such as ``model.eval()`` before an evaluation or a save, concerns only the training step
    and waits for the next one, :meth:`TorchSide.changes`)."""

    def decorate(method: Callable[Concatenate[E, P], R]) -> Callable[Concatenate[E, P], R]:
        @functools.wraps(method)
        def run(engine: E, *args: P.args, **kwargs: P.kwargs) -> R:
            with model_link.suspended():
                if bring_in:
                    engine._bring_in(engine._capture_batch, setup=False)
                return method(engine, *args, **kwargs)

        return run

    return decorate


def _weakly(method: Callable[[torch.optim.Optimizer], None]) -> Callable[[torch.optim.Optimizer], None]:
    """A hook calling ``method`` while its object lives (the optimizer must not keep the engine alive)."""
    ref = weakref.WeakMethod(method)

    def hook(*args: torch.optim.Optimizer) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return hook


class _ExecutorState(model_link.StateAccess):
    """The engine's executor state as its :class:`~torchpar.engine.model_link.ModelLink` reads and writes it."""

    def __init__(self, executor: Callable[[], Executor | None]):
        self._executor = executor

    def _live(self) -> Executor:
        executor = self._executor()
        assert executor is not None, "a link outlived its engine"
        return executor

    def export(self, kinds: tuple[str, ...]) -> HostState:
        return self._live().export_state(kinds)

    def update(self, state: HostState) -> None:
        self._live().update_state(state)

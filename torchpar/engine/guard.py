"""The checks an :class:`~torchpar.api.Engine` runs around each step, where eager PyTorch would have stopped.

A :class:`StepGuard` holds, per batch signature, what the batch's integer inputs index
(:mod:`torchpar.ir.index_inputs`) and the graph's integer arithmetic (:mod:`torchpar.ir.integer_ranges`), and
checks every batch against both before it leaves the host (``check_inputs``); after each step it applies the
``on_nonfinite`` policy to a step the executable skipped (count it, or raise
:class:`~torchpar.runtime.nonfinite.NonFiniteError` with the diagnostic re-run's culprit), logs once when the loss
diverges, and turns XLA's out-of-memory into a :class:`~torchpar.runtime.resources.DeviceMemoryError`. It also validates
checkpoints before they are loaded.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.utils._pytree as pytree

from torchpar.ir.graph import Graph
from torchpar.ir.index_inputs import IndexBound, check_index_inputs, index_bounds
from torchpar.ir.integer_ranges import IntegerRanges, integer_ranges

if TYPE_CHECKING:
    from torchpar.planner.plan import Plan
    from torchpar.runtime.loss_scale import LossScaler

log = logging.getLogger(__name__)

DIVERGENCE_FACTOR = 1e3
"""A loss this many times the first step's is logged as a diverging run (once per engine)."""

CHECKPOINT_KEYS = ("params", "buffers", "optimizer", "optimizer_counters", "steps_taken", "seed")


class StepGuard:
    """Input checks, the non-finite policy, divergence and out-of-memory for one engine (module docstring)."""

    def __init__(self, *, check_inputs: bool, on_nonfinite: str):
        self.check_inputs = check_inputs
        self.on_nonfinite = on_nonfinite
        self.skipped_steps = 0
        self.first_loss: float | None = None
        self._bounds: dict[Hashable, list[IndexBound]] = {}
        self._ranges: dict[Hashable, IntegerRanges] = {}
        self._warned_divergence = False

    def learn(self, key: Hashable, graph: Graph) -> None:
        """Record what the integer inputs of ``graph`` (the program run for signature ``key``) index, and its integer
        arithmetic."""
        if key not in self._bounds:
            self._bounds[key] = index_bounds(graph)
            self._ranges[key] = integer_ranges(graph)

    def bounds(self, key: Hashable) -> list[IndexBound]:
        """The index-range checks of signature ``key``'s batch leaves (empty if none, or before it compiled)."""
        return list(self._bounds.get(key) or []) if self.check_inputs else []

    def input_checks(self, key: Hashable) -> tuple[list[IndexBound], IntegerRanges | None]:
        """Signature ``key``'s index-range checks and integer-arithmetic check, for processes that load the batch
        themselves (empty and ``None`` if checks are off, or before it compiled)."""
        return self.bounds(key), self._ranges.get(key) if self.check_inputs else None

    def host_leaves(
        self,
        key: Hashable,
        leaves: list[torch.Tensor],
        names: list[str],
        to_host: Callable[[torch.Tensor | np.ndarray], np.ndarray],
    ) -> list[np.ndarray]:
        """The batch ``leaves`` as host arrays (``to_host``), after the index-range check of the values as the
        user passed them (before an ``int64 → int32`` cast could wrap a huge id into range); the graph's int64
        arithmetic is checked against them once they are known to fit int32 themselves."""
        raw = [leaf.detach().cpu().numpy() if leaf.dtype != torch.bfloat16 else None for leaf in leaves]
        if self.check_inputs and self._bounds.get(key):
            check_index_inputs(self._bounds[key], raw, names)
        from jaxbackend.lower import IntegerRangeError

        hosted = []
        for r, leaf, name in zip(raw, leaves, names):
            try:
                hosted.append(to_host(r if r is not None else leaf))
            except IntegerRangeError as error:
                raise IntegerRangeError(str(error).replace("an input array", f"batch leaf {name}", 1)) from None
        if self.check_inputs and key in self._ranges:
            self._ranges[key].check(raw, names)
        return hosted

    @contextlib.contextmanager
    def translating_failures(self, what: str, plan: Plan | None, device_memory_bytes: int) -> Iterator[None]:
        """Re-raise XLA's out-of-memory inside the block as a ``DeviceMemoryError`` naming ``plan``'s stages and
        what to try (``plan`` may be ``None`` before planning: then nothing is translated)."""
        from torchpar.runtime.resources import as_device_memory_error

        try:
            yield
        except Exception as error:
            translated = (
                None
                if plan is None
                else as_device_memory_error(error, plan, what=what, device_memory_bytes=device_memory_bytes)
            )
            if translated is not None:
                raise translated from error
            raise

    def after_step(
        self, step: int, loss: float, finite: bool, loss_scaler: LossScaler | None, locate: Callable[[], str]
    ) -> None:
        """Apply the policy to step ``step``: a finite one feeds the divergence watch; a skipped one is counted
        (``"skip"``) or raised with ``locate()``'s culprit (``"raise"``). Under fp16 loss scaling (``loss_scaler``, a
        :class:`~torchpar.runtime.loss_scale.LossScaler` or ``None``) a gradient overflow is expected: it adjusts the
        scale and counts as skipped, no failure."""
        from torchpar.runtime.nonfinite import NonFiniteError

        if loss_scaler is not None and loss_scaler.after_step(step, finite, loss):
            self.skipped_steps += 1
            return
        if finite or self.on_nonfinite == "ignore":
            self._watch_divergence(step, loss)
            return
        what = "loss" if not np.isfinite(loss) else "gradients"
        self.skipped_steps += 1
        if self.on_nonfinite == "skip":
            log.warning(
                "torchpar: step %d produced a non-finite %s (loss %s); its update was skipped (%d skipped so far)",
                step,
                what,
                loss,
                self.skipped_steps,
            )
            return
        culprit = locate()
        history = f"; the first step's loss was {self.first_loss:.4g}" if self.first_loss is not None else ""
        raise NonFiniteError(
            f"step {step} produced a non-finite {what} (loss {loss}){history}. Its update was skipped: the "
            f"parameters and optimizer state are those before step {step}.\n"
            f"  first culprit: {culprit}\n"
            "Try: a lower learning rate, gradient clipping (torchpar.compile(..., grad_clip_norm=1.0)), checking the "
            "batch for inf/nan; on_nonfinite='skip' skips such steps and goes on (as torch.amp.GradScaler does), "
            "'ignore' applies them as PyTorch would.",
            step=step,
            loss=loss,
            culprit=culprit,
        )

    def _watch_divergence(self, step: int, loss: float) -> None:
        """Log once when the loss has grown ``DIVERGENCE_FACTOR``-fold over the first step's."""
        if self.first_loss is None:
            self.first_loss = loss
            return
        first = abs(self.first_loss)
        if not self._warned_divergence and first > 0 and abs(loss) > DIVERGENCE_FACTOR * first:
            self._warned_divergence = True
            log.warning(
                "torchpar: the loss grew from %.4g (first step) to %.4g at step %d: the run looks divergent "
                "(lower the learning rate or clip gradients with grad_clip_norm)",
                self.first_loss,
                loss,
                step,
            )


def leaf_names(batch: object) -> list[str]:
    """How messages call each batch leaf: ``batch['input_ids']``, ``batch[1]``, or ``the batch``."""
    if isinstance(batch, torch.Tensor):
        return ["the batch"]
    paths, _ = pytree.tree_flatten_with_path(batch)
    return [f"batch{pytree.keystr(path)}" for path, _ in paths]


def validate_checkpoint(
    state: object,
    params: Mapping[str, torch.Tensor],
    buffers: Mapping[str, torch.Tensor],
    state_keys: Mapping[str, list[str]],
) -> None:
    """Raise ``ValueError`` naming the first way ``state`` is not a checkpoint of this model and optimizer
    (``Engine.state_dict``'s form): a missing section, parameters or buffers missing, extra or of another shape
    or dtype, optimizer entries missing. ``state_keys`` maps each trained parameter to its optimizer state keys."""
    if not isinstance(state, Mapping):
        raise ValueError(f"a checkpoint is the dict engine.state_dict() returns, got a {type(state).__name__}")
    missing = [k for k in CHECKPOINT_KEYS if k not in state]
    if missing:
        raise ValueError(
            f"the checkpoint lacks {missing}: it was not made by engine.state_dict() (its keys: {sorted(state)[:8]})"
        )
    for kind, current in (("parameters", params), ("buffers", buffers)):
        saved = state["params" if kind == "parameters" else "buffers"]
        absent, extra = sorted(set(current) - set(saved)), sorted(set(saved) - set(current))
        if absent or extra:
            raise ValueError(
                f"the checkpoint's {kind} differ from the model's: missing {absent[:5]}, not in the "
                f"model {extra[:5]} (a checkpoint of another model?)"
            )
        for name, tensor in current.items():
            value = saved[name]
            if tuple(value.shape) != tuple(tensor.shape) or value.dtype != tensor.dtype:
                raise ValueError(
                    f"checkpoint {kind[:-1]} {name} is {value.dtype}{list(value.shape)}, the model's is "
                    f"{tensor.dtype}{list(tensor.shape)}"
                )
    for name, keys in state_keys.items():
        entries = state["optimizer"].get(name, {})
        lacking = [k for k in keys if k not in entries]
        if lacking:
            raise ValueError(
                f"the checkpoint's optimizer state of {name} lacks {lacking}: it was saved with another "
                "optimizer (or none); build the engine with the optimizer the checkpoint was made with"
            )

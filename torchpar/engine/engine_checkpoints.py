"""The Engine's saved state: sharded checkpoints, ``state_dict``, the torch state dict export and ``save_pretrained``.

A mixin of :class:`torchpar.api.Engine` (as :class:`~torchpar.engine.engine_readouts.EngineReadouts` holds its read-only
views): each method hands one :class:`torchpar.checkpoint.TrainingState` — what the engine holds, as data — to
:mod:`torchpar.checkpoint`, which does the work. It reads the engine's executor, bridge, names, step count, PRNG key,
loss scaler and data cursor; it writes back only the step count and key a restore brings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from torchpar import checkpoint as _checkpoint
from torchpar.engine.torch_side import TorchSide, linked

if TYPE_CHECKING:
    import jax

    from torchpar.capture.optimizer import TorchOptimizerBridge
    from torchpar.engine.compiled import CompiledTraining
    from torchpar.engine.feeding import StepInputs
    from torchpar.options import CompileOptions
    from torchpar.planner.plan import Plan
    from torchpar.runtime.executor import Executor
    from torchpar.runtime.loss_scale import LossScaler


class EngineCheckpoints:
    """Checkpoints of a :class:`torchpar.api.Engine` (module docstring)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    options: CompileOptions
    _executor: Executor
    _compiled: CompiledTraining
    _bridge: TorchOptimizerBridge
    _param_names: dict[str, torch.Tensor]
    _buffer_names: dict[str, torch.Tensor]
    _loss_scaler: LossScaler | None
    _steps_taken: int
    _base_key: jax.Array
    _inputs: StepInputs
    _torch: TorchSide
    _capture_batch: object

    if TYPE_CHECKING:  # the Engine's, beside this mixin

        @property
        def plan(self) -> Plan: ...

        def _bring_in(self, batch: object, *, setup: bool = True) -> bool: ...

    @linked()
    def state_dict(self) -> dict[str, object]:
        """A checkpoint of parameters, buffers, optimizer state, step count and PRNG position.

        Arrays are CPU torch tensors holding the exact values, parameters and buffers in the model's dtypes (an
        ``int64`` buffer JAX holds as ``int32`` comes back ``int64``); ``load_state_dict`` restores them. Save it
        with ``torch.save`` and read it back with ``torch.load(path, weights_only=True)``: tensors, numbers and
        dicts only, so nothing is unpickled that could run code."""
        return _checkpoint.state_dict(self._training_state())

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Restore a checkpoint made by :meth:`state_dict` (same model and optimizer structure)."""
        self._restore(_checkpoint.load_state_dict, state)

    @linked()
    def save(self, path: str, *, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None) -> Path:
        """Write a sharded checkpoint at ``path`` (a directory): every process writes the shards it holds (safetensors
        files) and an ``index.json`` maps each tensor to its pieces; atomic (a save killed midway leaves the previous
        checkpoint at ``path``). Holds the state, optimizer counters and ``param_groups`` hyper-parameters, step
        count, PRNG key, loss scale and ``scheduler``'s state. Returns the path. See :mod:`torchpar.checkpoint`."""
        return _checkpoint.save(self._training_state(), path, scheduler=scheduler)

    def load(self, path: str, *, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None) -> None:
        """Restore a checkpoint written by :meth:`save` by an engine of any plan (another method, mesh, pipeline or
        runtime): each process reads only the slices its devices hold under this engine's plan. Host-loaded data
        (``compile(data=...)``) continues after the checkpoint's last batch."""
        restored = self._restore(_checkpoint.load, path, scheduler=scheduler)
        self._inputs.restore_cursor(restored.data_cursor)

    @linked()
    def export_torch_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's weights as ``model.state_dict()`` keys them (CPU tensors, the model's dtypes), for
        ``model.load_state_dict``; gathers the whole model (not the optimizer state) to this process."""
        return _checkpoint.export_torch_state_dict(self._training_state())

    @linked()
    def save_pretrained(self, directory: str, **kwargs: object) -> None:
        """A HuggingFace model's ``save_pretrained(directory, **kwargs)`` with the engine's current weights (copied
        into the torch model first): ``config.json`` + ``model.safetensors``, loadable with ``from_pretrained``."""
        save_pretrained = getattr(self.model, "save_pretrained", None)
        if not callable(save_pretrained):
            raise TypeError(
                f"{type(self.model).__name__} has no save_pretrained (not a HuggingFace PreTrainedModel): "
                "save model.state_dict() (it holds the engine's weights) with torch.save or safetensors"
            )
        self._torch.pull()
        save_pretrained(directory, **kwargs)

    def _training_state(self) -> _checkpoint.TrainingState:
        return _checkpoint.TrainingState(
            executor=self._executor,
            model=self.model,
            optimizer=self.optimizer,
            params=self._param_names,
            buffers=self._buffer_names,
            bridge=self._bridge,
            plan=self.plan,
            seed=self.options.seed,
            loss_scaler=self._loss_scaler,
            steps_taken=self._steps_taken,
            base_key=self._base_key,
            translating_failures=self._compiled.translating_failures,
            data_cursor=self._inputs.cursor(),
            check_data_cursor=self._inputs.check_cursor,
        )

    @linked(bring_in=False)
    def _restore(self, restore: Callable[..., object], *args: object, **kwargs: object) -> _checkpoint.TrainingState:
        """``restore(training_state, *args, **kwargs)``, then take back the step count and PRNG key it restored; the
        engine now holds the model's weights newer than the torch model (pulled when user code looks), and the
        modules outside the model the step calls are read from torch again at the next step."""
        training = self._training_state()
        try:
            restore(training, *args, **kwargs)
        finally:
            self._steps_taken, self._base_key = training.steps_taken, training.base_key
            self._torch.restored()
        return training

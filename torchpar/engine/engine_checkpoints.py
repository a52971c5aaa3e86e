"""The Engine's saved state: sharded checkpoints, ``state_dict``, the torch state dict export and ``save_pretrained``.

A mixin of :class:`torchpar.api.Engine` (as :class:`~torchpar.engine.engine_readouts.EngineReadouts` holds its read-only
views): each method hands one :class:`torchpar.checkpoint.TrainingState` — what the engine holds, as data — to
:mod:`torchpar.checkpoint`, which does the work. It reads the engine's executor, bridge, names, step count, PRNG key,
loss scaler and data cursor; it writes back only the step count and key a restore brings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torchpar import checkpoint as _checkpoint
from torchpar.engine.torch_side import linked


class EngineCheckpoints:
    """Checkpoints of a :class:`torchpar.api.Engine` (module docstring)."""

    @linked()
    def state_dict(self) -> dict[str, Any]:
        """A checkpoint of parameters, buffers, optimizer state, step count and PRNG position.

        Arrays are CPU torch tensors holding the exact values, parameters and buffers in the model's dtypes (an
        ``int64`` buffer JAX holds as ``int32`` comes back ``int64``); ``load_state_dict`` restores them. Save it
        with ``torch.save`` and read it back with ``torch.load(path, weights_only=True)``: tensors, numbers and
        dicts only, so nothing is unpickled that could run code."""
        return _checkpoint.state_dict(self._training_state())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint made by :meth:`state_dict` (same model and optimizer structure)."""
        self._restore(_checkpoint.load_state_dict, state)

    @linked()
    def save(self, path: str, *, scheduler: Any = None) -> Any:
        """Write a sharded checkpoint at ``path`` (a directory): every process writes the shards it holds (safetensors
        files) and an ``index.json`` maps each tensor to its pieces; atomic (a save killed midway leaves the previous
        checkpoint at ``path``). Holds the state, optimizer counters and ``param_groups`` hyper-parameters, step
        count, PRNG key, loss scale and ``scheduler``'s state. Returns the path. See :mod:`torchpar.checkpoint`."""
        return _checkpoint.save(self._training_state(), path, scheduler=scheduler)

    def load(self, path: str, *, scheduler: Any = None) -> None:
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
    def save_pretrained(self, directory: str, **kwargs: Any) -> None:
        """A HuggingFace model's ``save_pretrained(directory, **kwargs)`` with the engine's current weights (copied
        into the torch model first): ``config.json`` + ``model.safetensors``, loadable with ``from_pretrained``."""
        if not callable(getattr(self.model, "save_pretrained", None)):
            raise TypeError(
                f"{type(self.model).__name__} has no save_pretrained (not a HuggingFace PreTrainedModel): "
                "save model.state_dict() (it holds the engine's weights) with torch.save or safetensors"
            )
        self._torch.pull()
        self.model.save_pretrained(directory, **kwargs)

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
    def _restore(self, restore: Callable[..., Any], *args: Any, **kwargs: Any) -> _checkpoint.TrainingState:
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

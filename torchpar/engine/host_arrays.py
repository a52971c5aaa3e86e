"""Host copies of tensors and arrays exactly as JAX and torch hold them: bfloat16 by its bits (numpy has no
bfloat16 of its own; ``ml_dtypes`` provides the JAX one), 64-bit integers as JAX keeps them (``int32`` with x64
off), and the way back to CPU torch tensors; and each step's PRNG key data, a host array folded ahead of the steps
(:class:`StepKeys`).

Step ``s`` draws its randomness (dropout masks, ``torch.rand`` in ``forward``) from
``fold_in(base_key, s)``: a key that depends on the engine's seed and the step number only, so a resumed run or a
recompiled step draws what the uninterrupted run would have. Folding one key in per step costs a dispatched JAX
computation and a device-to-host copy each step (0.6 ms on a 2-core CPU, 4 % of a 15 ms ResNet step); this folds
:data:`KEY_BLOCK` consecutive steps in one vectorized call and serves the block from host memory. ``fold_in`` is
elementwise in the folded number, so the keys are those of folding each step alone (tested).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

if TYPE_CHECKING:
    import jax


def host_tensor(tensor: torch.Tensor) -> np.ndarray:
    """A torch tensor's exact values as a host array (bfloat16 by its bits: numpy has no bfloat16 of its own)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return host_array(tensor.numpy())


def host_copy(tensor: torch.Tensor) -> np.ndarray:
    """:func:`host_tensor` in memory of its own. On the CPU ``jax.device_put`` of a host array may alias its memory,
    so a tensor the user can still write (the model's state) is copied before it goes into the engine."""
    return np.array(host_tensor(tensor), copy=True)


def host_value(value: torch.Tensor | np.ndarray) -> np.ndarray:
    """A torch tensor or a numpy array as the host array JAX reads."""
    return host_tensor(value) if isinstance(value, torch.Tensor) else host_array(value)


def host_array(array: npt.ArrayLike) -> np.ndarray:
    from jaxbackend.lower import to_numpy_input

    return to_numpy_input(np.asarray(array))


def jax_dtype(torch_dtype_name: str) -> np.dtype:
    """The dtype JAX holds a torch dtype in (``int64`` → ``int32`` with x64 off)."""
    from jaxbackend.dtypes import to_jax

    return np.dtype(to_jax(torch_dtype_name))


def to_torch(array: npt.ArrayLike) -> torch.Tensor:
    """A host or JAX array as a CPU torch tensor holding the same values (bfloat16 by its bits)."""
    value = np.asarray(array)
    if value.dtype.name == "bfloat16":
        return torch.from_numpy(np.array(value.view(np.int16), copy=True)).view(torch.bfloat16)
    return torch.from_numpy(np.array(value, copy=True))


def write_into(tensor: torch.Tensor, array: npt.ArrayLike) -> None:
    """Copy a host or JAX array's values into ``tensor`` in place (cast to its dtype). A contiguous CPU tensor is
    written through numpy — several times faster than ``Tensor.copy_`` on a busy CPU — which, unlike ``copy_``, does
    not bump the tensor's ``_version``: a caller that tracks writes counts this one itself."""
    value = np.asarray(array)
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.dtype in (torch.complex32,):
        with torch.no_grad():
            tensor.copy_(to_torch(value).to(tensor.dtype))
        return
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        target = tensor.detach().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    else:
        target = tensor.detach().numpy()
    np.copyto(target, value.reshape(target.shape), casting="unsafe")


# --- each step's PRNG key ------------------------------------------------------------------------------------------

KEY_BLOCK = 256
"""Steps whose keys one call folds."""


class StepKeys:
    """``data(base_key, step)``: the key data of ``fold_in(base_key, step)`` (a host ``np.ndarray`` of the key
    implementation's data shape, e.g. ``(2,)`` uint32 for threefry), from a block folded at the first request in it;
    a different ``base_key`` object (a seed set, a checkpoint loaded) folds afresh."""

    def __init__(self) -> None:
        self._base: jax.Array | None = None
        self._block = -1
        self._data: np.ndarray | None = None

    def data(self, base_key: jax.Array, step: int) -> np.ndarray:
        block, offset = divmod(step, KEY_BLOCK)
        if base_key is not self._base or block != self._block or self._data is None:
            self._data = _fold_block(base_key, block * KEY_BLOCK)
            self._base, self._block = base_key, block
        return self._data[offset].copy()  # (the caller's to keep)


def _fold_block(base_key: jax.Array, first: int) -> np.ndarray:
    """The key data of ``fold_in(base_key, s)`` for ``s`` in ``first … first + KEY_BLOCK - 1``, stacked."""
    import jax

    return np.asarray(jax.random.key_data(_folded()(base_key, np.arange(first, first + KEY_BLOCK, dtype=np.uint32))))


@functools.cache
def _folded() -> Callable[[jax.Array, np.ndarray], jax.Array]:
    """``fold_in`` over a vector of step numbers, jitted (jax is imported on first use, after ``torchpar.init``)."""
    import jax

    return jax.jit(jax.vmap(jax.random.fold_in, in_axes=(None, 0)))

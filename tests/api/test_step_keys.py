"""Each step's random key (``torchpar/engine/host_arrays.py``): the keys folded a block at a time are exactly
``fold_in(base_key, step)``, across a block's end, for another base key, and for another key implementation."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from torchpar.engine.host_arrays import KEY_BLOCK, StepKeys


def _alone(base_key: jax.Array, step: int) -> np.ndarray:
    return np.asarray(jax.random.key_data(jax.random.fold_in(base_key, step)))


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_block_keys_are_each_steps_fold_in(impl):
    keys = StepKeys()
    base = jax.random.key(1234, impl=impl)
    for step in (0, 1, 2, KEY_BLOCK - 1, KEY_BLOCK, 3 * KEY_BLOCK + 7, 5):
        np.testing.assert_array_equal(keys.data(base, step), _alone(base, step), err_msg=f"step {step}")


def test_a_new_base_key_folds_afresh():
    keys = StepKeys()
    first, second = jax.random.key(0), jax.random.key(1)
    np.testing.assert_array_equal(keys.data(first, 3), _alone(first, 3))
    np.testing.assert_array_equal(keys.data(second, 3), _alone(second, 3))
    assert not np.array_equal(keys.data(first, 3), keys.data(second, 3))

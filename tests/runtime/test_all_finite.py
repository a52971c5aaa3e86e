"""The fused step's finiteness check (``torchpar.runtime.train_step.all_finite``) says what counting the non-finite
gradient elements says — inf, -inf and nan in any of several gradients, 16-bit dtypes, finite values whose sum
would overflow — compiled as the step compiles it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbackend.compiler import compiler_options
from torchpar.runtime.train_step import all_finite, nonfinite_count


def _grads(dtype) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    return {name: jnp.asarray(rng.standard_normal(shape), dtype)
            for name, shape in (("w", (64, 32)), ("b", (32,)), ("e", (3, 5, 7)))}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("bad", [None, np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", ["w", "b", "e"])
def test_agrees_with_the_count(dtype, bad, where):
    grads = _grads(dtype)
    if bad is not None:
        grads[where] = grads[where].ravel().at[3].set(bad).reshape(grads[where].shape)
    check = jax.jit(all_finite).lower(grads).compile(compiler_options=compiler_options())
    assert bool(check(grads)) == (int(nonfinite_count(grads)) == 0) == (bad is None)


def test_huge_finite_gradients_are_finite():
    big = jnp.finfo(jnp.float32).max
    grads = {"w": jnp.full((1000,), big), "h": jnp.full((8,), jnp.finfo(jnp.float16).max, jnp.float16)}
    assert bool(jax.jit(all_finite)(grads))

"""The blocked grouped matmul (``_grouped_mm`` with offsets): ``jax.lax.ragged_dot``'s values and gradients, with
work that follows the rows and not the number of experts."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxbackend.ops.grouped_matmul import block_count, block_rows_for, blocked_ragged_dot
from tests.models.routed_experts import train_like_pytorch


def _sizes(rng: np.random.Generator, groups: int, total: int) -> np.ndarray:
    cuts = np.sort(rng.integers(0, total + 1, size=groups - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


@pytest.mark.parametrize("seed", range(2))
def test_values_and_gradients_are_ragged_dots(seed):
    """Empty groups, groups shorter and longer than a block, rows past the last group (zero), any block size; the
    loop and the gathered path (in runs of blocks too); the weight as given and stored transposed."""
    rng = np.random.default_rng(seed)
    rows, groups = int(rng.integers(20, 70)), int(rng.integers(1, 9))
    sizes = _sizes(rng, groups, int(rng.integers(0, rows + 1)))
    sizes[rng.integers(0, groups)] = 0
    x = jnp.asarray(rng.standard_normal((rows, 6)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((groups, 6, 5)), jnp.float32)
    cotangent = jnp.asarray(rng.standard_normal((rows, 5)), jnp.float32)
    sizes = jnp.asarray(sizes)

    def loss(fn):
        return lambda x, w: (fn(x, w) * cotangent).sum()

    reference = lambda x, w: jax.lax.ragged_dot(x, w, sizes, precision="highest")  # noqa: E731
    cases = [(block, method, runs, transposed) for block, method, runs in
             ((None, "loop", None), (8, "loop", None), (None, "gathered", None), (8, "gathered", 3))
             for transposed in (False, True)]
    for block, method, runs, transposed in cases:
        def ours(x, w, block=block, method=method, runs=runs, transposed=transposed):
            # weight_transposed: the same product with the weight stored [E, N, K]
            return blocked_ragged_dot(x, jnp.swapaxes(w, 1, 2) if transposed else w, sizes, block_rows=block,
                                      method=method, run_blocks=runs, weight_transposed=transposed,
                                      precision="highest")
        np.testing.assert_allclose(ours(x, w), reference(x, w), atol=2e-5)
        assert not np.asarray(ours(x, w))[int(sizes.sum()):].any()
        for got, want in zip(jax.grad(loss(ours), (0, 1))(x, w), jax.grad(loss(reference), (0, 1))(x, w)):
            np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("method", ["loop", "gathered"])
def test_groups_with_gaps_and_their_own_weights(method):
    """``starts`` with gaps between groups and ``weight_index`` choosing any expert (an expert-parallel receive
    buffer): each group's rows by its weight, the rows in no group zero; fewer rows than a block; bf16 operands
    with an fp32 result."""
    rng = np.random.default_rng(3)
    rows = 10
    starts, sizes, weight_index = np.array([1, 4, 4, 9]), np.array([2, 0, 4, 1]), np.array([2, 0, 1, 2])
    x = jnp.asarray(rng.standard_normal((rows, 6)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 6, 5)), jnp.bfloat16)
    got = blocked_ragged_dot(x, w, jnp.asarray(sizes), starts=jnp.asarray(starts), weight_index=jnp.asarray(weight_index),
                             method=method, preferred_element_type=jnp.float32)
    assert got.dtype == jnp.float32
    want = np.zeros((rows, 5), np.float32)
    xf, wf = np.asarray(x, np.float32), np.asarray(w, np.float32)
    for start, size, expert in zip(starts, sizes, weight_index):
        want[start:start + size] = xf[start:start + size] @ wf[expert]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-2, atol=1e-2)
    assert not np.asarray(got)[[0, 3, 8]].any()
    grads = jax.grad(lambda w: blocked_ragged_dot(x, w, jnp.asarray(sizes), starts=jnp.asarray(starts),
                                                  weight_index=jnp.asarray(weight_index), method=method,
                                                  preferred_element_type=jnp.float32).sum())(w)
    want_grad = np.zeros((3, 6, 5), np.float32)
    for start, size, expert in zip(starts, sizes, weight_index):
        want_grad[expert] += xf[start:start + size].sum(0)[:, None]
    np.testing.assert_allclose(np.asarray(grads, np.float32), want_grad, rtol=1e-2, atol=3e-2)


def test_the_work_follows_the_rows_not_the_experts():
    """8 → 64 experts over the same 4,096 rows: XLA's expansion of ``jax.lax.ragged_dot`` multiplies its FLOPs by
    about 8 (every expert on every row); the blocked product's only matmuls are one block's ``[B, K] × [K, N]``
    (in a loop: no dot in the compiled program has an expert dim or more than ``B`` rows), run once per block
    holding rows — at most ``S / B + E`` of them, at most twice the rows' own work."""
    rows, width, out = 4096, 64, 128

    def compiled(fn, groups: int):
        x = jax.ShapeDtypeStruct((rows, width), jnp.float32)
        w = jax.ShapeDtypeStruct((groups, width, out), jnp.float32)
        sizes = jax.ShapeDtypeStruct((groups,), jnp.int32)
        return jax.jit(fn).lower(x, w, sizes).compile()

    def flops(fn, groups: int) -> float:
        cost = compiled(fn, groups).cost_analysis()
        return float((cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"])

    dense = {e: flops(lambda x, w, s: jax.lax.ragged_dot(x, w, s), e) for e in (8, 64)}
    assert dense[64] > 6 * dense[8]
    rng = np.random.default_rng(0)
    for groups in (8, 64):
        block = block_rows_for(rows, groups)
        hlo = compiled(lambda x, w, s: blocked_ragged_dot(x, w, s), groups).as_text()
        dots = re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} dot\(", hlo)
        assert dots and all(shape == f"{block},{out}" for shape in dots), dots
        sizes = jnp.asarray(np.bincount(rng.integers(0, groups, rows), minlength=groups), jnp.int32)
        blocks = int(block_count(sizes, block))
        assert rows / block <= blocks <= rows / block + groups and blocks * block <= 2 * rows
    assert block_rows_for(4096, 8) == 128 and block_rows_for(4096, 64) == 64 and block_rows_for(10, 64) == 16


def test_a_routed_expert_model_trains_like_pytorch():
    import torchpar

    losses, expected, model, reference = train_like_pytorch(torchpar.DataParallel(mesh_shape=(1, 1)), rows=32)
    assert losses == pytest.approx(expected, rel=1e-5)  # measured 1.2e-7
    torch.testing.assert_close(model.norm.running_mean, reference.norm.running_mean, rtol=1e-5, atol=1e-6)

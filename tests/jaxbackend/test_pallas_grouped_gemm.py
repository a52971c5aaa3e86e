"""The Pallas grouped GEMM (``jaxbackend/kernels/grouped_gemm.py``) in Pallas's interpret mode: values and both
gradients against a per-group product in float64, for empty, uneven and gapped groups, rows in no group, the weight
stored transposed and bf16; its CUDA lowering holds the Triton kernels; the grouped matmul's ``"pallas"`` method."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbackend.kernels import grouped_gemm
from jaxbackend.ops.grouped_matmul import blocked_ragged_dot, default_method


class Case(NamedTuple):
    rows: int
    k: int
    n: int
    sizes: list[int]
    experts: int
    starts: list[int] | None = None  # None: packed from row 0
    weight_index: list[int] | None = None  # None: group g by weight g
    transposed: bool = False
    dtype: Any = jnp.float32
    block: int = 16


CASES = {
    # empty first, middle and last groups; uneven groups across 16-row tiles; rows 58…69 in no group; K, N padded
    "uneven-empty-tail": Case(70, 24, 40, [0, 23, 0, 5, 30, 0], experts=6),
    # every row in one group between two empty ones; the weight stored [E, N, K]; rows padded to two 32-row tiles
    "one-group-transposed": Case(48, 32, 16, [0, 48, 0], experts=3, transposed=True, block=32),
    # gaps between groups, a weight shared by three groups (an expert-parallel receive buffer), one expert unused
    "gaps-shared-weights": Case(
        40, 16, 24, [2, 0, 17, 1, 5], experts=4, starts=[1, 4, 4, 21, 30], weight_index=[2, 0, 2, 1, 2]
    ),
    # four groups in one 64-row tile
    "bf16-transposed": Case(64, 32, 64, [10, 0, 37, 9], experts=4, transposed=True, dtype=jnp.bfloat16, block=64),
}


def _reference(x, w, ct, sizes, starts, weight_index, transposed):
    """``y``, ``dx``, ``dw`` group by group in float64 (``w`` as stored)."""
    x, w, ct = (np.asarray(a, np.float64) for a in (x, w, ct))
    w_kn = np.swapaxes(w, 1, 2) if transposed else w
    y, dx, dw = np.zeros((x.shape[0], w_kn.shape[2])), np.zeros_like(x), np.zeros_like(w_kn)
    for start, size, expert in zip(starts, sizes, weight_index):
        rows = slice(start, start + size)
        y[rows] = x[rows] @ w_kn[expert]
        dx[rows] = ct[rows] @ w_kn[expert].T
        dw[expert] += x[rows].T @ ct[rows]
    return y, dx, np.swapaxes(dw, 1, 2) if transposed else dw


@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients_equal_the_per_group_product(case):
    rows, k, n, sizes, experts, starts, weight_index, transposed, dtype, block = CASES[case]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((rows, k)), dtype)
    w = jnp.asarray(rng.standard_normal((experts, n, k) if transposed else (experts, k, n)), dtype)
    ct = jnp.asarray(rng.standard_normal((rows, n)), dtype)
    grouping = dict(
        starts=None if starts is None else jnp.asarray(starts, jnp.int32),
        weight_index=None if weight_index is None else jnp.asarray(weight_index, jnp.int32),
    )

    @jax.jit
    def forward_backward(x, w, ct):
        product = lambda x, w: grouped_gemm.grouped_gemm(
            x,
            w,
            jnp.asarray(sizes),
            block_rows=block,
            weight_transposed=transposed,
            precision="highest",
            interpret=True,
            **grouping,
        )
        y, vjp = jax.vjp(product, x, w)
        return (y, *vjp(ct))

    got = forward_backward(x, w, ct)
    starts = starts if starts is not None else np.cumsum([0, *sizes[:-1]])
    weight_index = weight_index if weight_index is not None else range(len(sizes))
    want = _reference(x, w, ct, sizes, starts, weight_index, transposed)
    tolerance = dict(rtol=2e-2, atol=2e-1) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for got_value, want_value, what in zip(got, want, ("y", "dx", "dw")):
        assert got_value.dtype == dtype, what
        np.testing.assert_allclose(np.asarray(got_value, np.float64), want_value, err_msg=what, **tolerance)
    covered = np.zeros(rows, bool)
    for start, size in zip(starts, sizes):
        covered[start : start + size] = True
    assert not np.asarray(got[0])[~covered].any() and not np.asarray(got[1])[~covered].any()
    unused = sorted(set(range(experts)) - {e for e, size in zip(weight_index, sizes) if size})
    assert not np.asarray(got[2])[unused].any()


def test_the_pallas_method_equals_the_loop_inside_jit():
    """``blocked_ragged_dot(method="pallas-interpret")``: the loop's values and gradients, bf16 operands with an fp32
    result and the weight stored ``[E, N, K]`` (HF's layout, read in place)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((80, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((5, 48, 32)), jnp.bfloat16)
    ct = jnp.asarray(rng.standard_normal((80, 48)), jnp.float32)
    sizes = jnp.asarray([7, 0, 40, 20, 3], jnp.int32)

    def run(method):
        def loss(x, w):
            y = blocked_ragged_dot(
                x, w, sizes, method=method, weight_transposed=True, preferred_element_type=jnp.float32
            )
            return (y * ct).sum(), y

        return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, w)

    (loss, y), grads = run("pallas-interpret")
    (want_loss, want_y), want_grads = run("loop")
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, want in zip(grads, want_grads):  # bf16 gradients, rounded at different places: a few ulps of the largest
        assert got.dtype == want.dtype == jnp.bfloat16
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=1e-2 * np.abs(want).max())


def test_the_cuda_program_holds_the_kernels():
    """The training step's program lowered for CUDA (no GPU needed): the forward kernel, ``dx`` (the same kernel
    with the other weight layout) and ``dw``, as Triton custom calls; nothing of the CPU loop."""
    x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((8, 128, 256), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    loss = lambda x, w, s: blocked_ragged_dot(x, w, s, method="pallas").astype(jnp.float32).sum()
    text = jax.jit(jax.value_and_grad(loss, (0, 1))).trace(x, w, sizes).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 3 and all("triton" in line for line in calls), calls
    assert sum('name = "grouped_gemm"' in line for line in calls) == 2
    assert sum('name = "grouped_gemm_weight_grad"' in line for line in calls) == 1
    assert "stablehlo.while" not in text  # the loops are inside the kernels


def test_the_kernel_is_the_gpu_default_for_its_dtypes():
    x, w = jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((2, 8, 8), jnp.bfloat16)
    assert grouped_gemm.chosen(x, w, platform="gpu") and grouped_gemm.chosen(x.astype(jnp.float32), w, platform="gpu")
    assert not grouped_gemm.chosen(x, w, platform="cpu") and not grouped_gemm.chosen(x, w, platform="tpu")
    assert not grouped_gemm.chosen(x.astype(jnp.int32), w, platform="gpu")
    assert default_method(x, w) == "loop"  # this machine: the CPU
    with pytest.raises(ValueError, match="pallas-interpret"):
        blocked_ragged_dot(x, w, jnp.asarray([4, 0]), method="triton")

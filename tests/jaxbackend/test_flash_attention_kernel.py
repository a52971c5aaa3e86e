"""The Pallas flash-attention block (``jaxbackend.kernels.flash_attention``) in interpret mode on the CPU against a
plain ``jnp`` attention: the output and the log-sum-exp, and the gradients of q, k and v under a random cotangent on
both outputs — causal (offsets 0, positive as in the zig-zag's second half, negative so that rows see no key) and
not, grouped and one key/value head, lengths not a multiple of the tile, ``E ≠ F``, bf16. The programs lowered for
CUDA hold the kernels' Triton custom calls (forward, dq, dk/dv)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxbackend.kernels.flash_attention import flash_block

ATOL = 1e-5  # fp32: scores and statistics in fp32, sums of at most 48 products in another order
CASES = {  # name: (batch, heads, kv heads, queries, keys, E, F, offset)
    "full,mha": (1, 2, 2, 32, 32, 16, 16, None),
    "full,gqa,ragged": (2, 4, 2, 40, 24, 8, 6, None),
    "causal,gqa,ragged": (1, 4, 2, 40, 40, 8, 6, 0),
    "causal-offset,mqa": (1, 2, 1, 24, 48, 16, 8, 24),  # the zig-zag's second half against both key chunks
    "causal-negative": (1, 1, 1, 20, 20, 8, 8, -5),  # rows 0-4 see no key: lse −inf, output 0
}
SCALE = 0.3


def _operands(batch, heads, kv_heads, queries, keys, e, f, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    shapes = [(batch, heads, queries, e), (batch, kv_heads, keys, e), (batch, kv_heads, keys, f)]
    shapes += [(batch, heads, queries, f), (batch, heads, queries)]  # the cotangents of out and lse
    return [jnp.asarray(rng.normal(size=shape), dtype) for shape in shapes]


def _reference(q, k, v, offset):
    """``(out, lse)`` of whole-precision attention, the keys repeated per query head."""
    group = q.shape[1] // k.shape[1]
    k, v = (jnp.repeat(x.astype(jnp.float32), group, axis=1) for x in (k, v))
    s = jnp.einsum("bhle,bhse->bhls", q.astype(jnp.float32), k, precision="highest") * SCALE
    if offset is not None:
        rows, keys = np.arange(q.shape[2])[:, None], np.arange(k.shape[2])[None, :]
        s = jnp.where(keys <= rows + offset, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    return jnp.einsum("bhls,bhsf->bhlf", p, v, precision="highest").astype(q.dtype), lse


def _values_and_grads(fn, q, k, v, d_out, d_lse):
    (out, lse), pullback = jax.vjp(fn, q, k, v)
    return out, lse, pullback((d_out.astype(out.dtype), d_lse.astype(jnp.float32)))


def _kernel(offset):
    return lambda q, k, v: flash_block(q, k, v, scale=SCALE, offset=offset, block_q=16, block_k=16, interpret=True)


@pytest.mark.parametrize("case", list(CASES))
def test_values_and_gradients_of_out_and_lse_are_the_reference(case):
    *shape, offset = CASES[case]
    q, k, v, d_out, d_lse = _operands(*shape)
    out, lse, grads = _values_and_grads(_kernel(offset), q, k, v, d_out, d_lse)
    want_out, want_lse, want_grads = _values_and_grads(lambda *a: _reference(*a, offset), q, k, v, d_out, d_lse)
    assert out.shape == want_out.shape and out.dtype == q.dtype and lse.dtype == jnp.float32
    np.testing.assert_allclose(out, want_out, atol=ATOL, rtol=0)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    np.testing.assert_allclose(
        jnp.where(jnp.isinf(lse), 0.0, lse), jnp.where(jnp.isinf(want_lse), 0, want_lse), atol=ATOL, rtol=0
    )
    for name, got, want in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=f"d{name}")
    if offset is not None and offset < 0:
        assert np.isinf(lse[..., :-offset]).all() and not np.asarray(out[..., :-offset, :]).any()


def test_bf16_is_close_to_the_fp32_reference():
    """bf16 operands, products in bf16 with fp32 accumulation, statistics fp32; the output in bf16."""
    q, k, v, d_out, d_lse = _operands(1, 4, 2, 40, 40, 16, 16, jnp.bfloat16)
    out, lse, grads = _values_and_grads(_kernel(0), q, k, v, d_out, d_lse)
    wide = [x.astype(jnp.float32) for x in (q, k, v)]
    want_out, want_lse, want_grads = _values_and_grads(lambda *a: _reference(*a, 0), *wide, d_out, d_lse)
    assert out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32 and grads[0].dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), want_out, atol=2e-2, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=2e-2, rtol=0)
    for name, got, want in zip("qkv", grads, want_grads):
        np.testing.assert_allclose(got.astype(jnp.float32), want, atol=6e-2, rtol=2e-2, err_msg=f"d{name}")


def test_unsupported_operands_are_refused():
    q, k, v, *_ = _operands(1, 2, 2, 16, 16, 8, 8)
    with pytest.raises(ValueError, match="one dtype"):
        flash_block(q, k.astype(jnp.bfloat16), v, scale=1.0, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        flash_block(q, k, v, scale=1.0, block_q=24, interpret=True)


@pytest.mark.parametrize("offset", [None, 0], ids=["full", "causal"])
def test_forward_and_backward_lowered_for_cuda_call_the_triton_kernels(offset):
    q = jnp.zeros((1, 4, 200, 128), jnp.bfloat16)  # 200: padded to the tile; F = 64 ≠ E
    k, v = jnp.zeros((1, 2, 200, 128), jnp.bfloat16), jnp.zeros((1, 2, 200, 64), jnp.bfloat16)

    def loss(q, k, v):
        out, lse = flash_block(q, k, v, scale=SCALE, offset=offset)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isinf(lse), 0.0, lse))

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert len(re.findall(r"stablehlo.custom_call @__gpu\$xla\.gpu\.triton", text)) == 3
    assert set(re.findall(r'name = "(flash_block_\w+)"', text)) == {
        "flash_block_forward",
        "flash_block_dq",
        "flash_block_dkv",
    }

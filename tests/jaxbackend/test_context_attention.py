"""Context-parallel attention (``jaxbackend.ops.context_attention``) on fake CPU devices against the whole-sequence
composition on one: the ring and the all-gather, causal (zig-zag chunks) or not, equal heads, grouped and one
key/value head, the sequence over one mesh axis or both, batch and heads split beside it; the output and the
gradients of q, k and v. The compiled programs: the ring's forward moves K|V ``P−1`` times around the ring and
gathers nothing; the all-gather's forward gathers once and its backward reduce-scatters."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxbackend import precision
from jaxbackend.ops.attention import _composed
from jaxbackend.ops import context_attention as context_attention_module
from jaxbackend.ops.context_attention import ContextSplit, context_attention, split_attention
from jaxbackend.sharding import make_mesh
from torchpar.report.hlo import collectives

ATOL = 2e-5  # fp32 at "highest": sums of up to 64 products, merged across blocks in another order
CASES = {  # name: (batch, heads, kv heads, length, mesh shape, q spec)
    "seq@0": (2, 4, 4, 64, (4, 1), (None, None, "d0", None)),
    "seq@01": (1, 2, 2, 64, (2, 2), (None, None, ("d0", "d1"), None)),
    "seq@0,heads@1,gqa": (1, 4, 2, 32, (2, 2), (None, "d1", "d0", None)),
    "seq@1,batch@0,mqa": (2, 4, 1, 32, (2, 2), ("d0", None, "d1", None)),
}


def _operands(batch, heads, kv_heads, length, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, heads, length, 8))
    k = rng.normal(size=(batch, kv_heads, length, 8))
    v = rng.normal(size=(batch, kv_heads, length, 6))
    cotangent = rng.normal(size=(batch, heads, length, 6))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v, cotangent))


def _kv_spec(q_spec, kv_heads):
    return q_spec if kv_heads > 1 else (q_spec[0], None) + tuple(q_spec[2:])


def _split_fn(case: str, variant: str, causal: bool):
    batch, heads, kv_heads, length, mesh_shape, q_spec = CASES[case]
    mesh = make_mesh(mesh_shape)
    seq = q_spec[2] if isinstance(q_spec[2], tuple) else (q_spec[2],)
    split = ContextSplit(seq, int(np.prod([mesh.shape[a] for a in seq])), variant, causal, 8 ** -0.5)
    shardings = [NamedSharding(mesh, PartitionSpec(*spec)) for spec in (q_spec, _kv_spec(q_spec, kv_heads),
                                                                          _kv_spec(q_spec, kv_heads))]
    return jax.jit(lambda q, k, v: split_attention(q, k, v, shardings, split)), shardings


def _reference(q, k, v, causal):
    return _composed(q, k, v, None, 0.0, causal, 8 ** -0.5, True, None)


# the ring causal with the sequence alone and beside split heads (GQA), unmasked over both axes; the all-gather
# causal, and unmasked beside a split batch (MQA)
VALUE_CASES = [("seq@0", "ring", True), ("seq@0,heads@1,gqa", "ring", True), ("seq@01", "ring", False),
               ("seq@0", "allgather", True), ("seq@1,batch@0,mqa", "allgather", False)]


@pytest.mark.parametrize("case, variant, causal", VALUE_CASES)
def test_context_attention_is_the_whole_sequence_attention(case, variant, causal, monkeypatch):
    if case == "seq@0,heads@1,gqa":  # blocks computed in tiles of 4 query rows (scan backward, map forward)
        monkeypatch.setattr(context_attention_module, "ROW_TILE", 4)
    if (case, variant) == ("seq@0", "ring"):  # blocks of at most ROW_TILE rows computed as two tiles
        monkeypatch.setattr(context_attention_module, "MIN_TILE", 2)
    batch, heads, kv_heads, length, _, _ = CASES[case]
    q, k, v, cotangent = _operands(batch, heads, kv_heads, length)
    split, shardings = _split_fn(case, variant, causal)
    q, k, v = (jax.device_put(x, s) for x, s in zip((q, k, v), shardings))
    with jax.default_matmul_precision("highest"):
        out, pullback = jax.vjp(split, q, k, v)
        grads = pullback(cotangent)
        expected, expected_pullback = jax.vjp(lambda *a: _reference(*a, causal), q, k, v)
        expected_grads = expected_pullback(cotangent)
    np.testing.assert_allclose(out, expected, atol=ATOL, rtol=0)
    for name, got, want in zip("qkv", grads, expected_grads):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=f"d{name}")


def test_bf16_context_attention_is_close_to_the_fp32_attention():
    """bf16 inputs: scores, softmax statistics and accumulators in float32, as the composition computes them."""
    q, k, v, cotangent = _operands(2, 4, 4, 64, jnp.bfloat16)
    split, shardings = _split_fn("seq@0", "ring", True)
    out, pullback = jax.vjp(split, *(jax.device_put(x, s) for x, s in zip((q, k, v), shardings)))
    expected, expected_pullback = jax.vjp(lambda *a: _reference(*a, True), q, k, v)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), expected.astype(jnp.float32), atol=2e-2, rtol=0)
    for got, want in zip(pullback(cotangent), expected_pullback(cotangent)):
        np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=6e-2, rtol=0)


def _ring_moves(hlo: str, devices: int) -> int:
    """Ring moves (``i → i+1``) the program makes: each permute times the trip count of the loop it is in."""
    ring = sorted([i, (i + 1) % devices] for i in range(devices))
    return sum(c.runs for c in collectives(hlo) if c.kind == "collective-permute" and sorted(c.groups) == ring)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_the_ring_moves_kv_p_minus_1_times_forward_and_gathers_nothing(causal):
    q, k, v, _ = _operands(2, 4, 4, 64)
    split, _ = _split_fn("seq@0", "ring", causal)
    forward = split.lower(q, k, v).compile().as_text()
    assert _ring_moves(forward, 4) == 3
    assert not [c for c in collectives(forward) if c.kind == "all-gather"]
    backward = jax.jit(jax.grad(lambda *a: jnp.sum(split(*a)), argnums=(0, 1, 2))).lower(q, k, v).compile().as_text()
    # the forward's 3 again, then K|V with its gradient (XLA may move the two in one permute), the gradient home
    assert _ring_moves(backward, 4) >= 3 + 4
    assert any(c.in_loop for c in collectives(forward))  # steps in a loop: one step's buffers at a time
    kinds = [c.kind for c in collectives(backward)]
    assert "all-gather" not in kinds and "all-reduce" not in kinds


def test_the_all_gather_gathers_once_forward_and_reduce_scatters_the_kv_gradient():
    q, k, v, _ = _operands(2, 4, 4, 64)
    split, _ = _split_fn("seq@0", "allgather", False)
    forward = [c.kind for c in collectives(split.lower(q, k, v).compile().as_text())]
    assert forward.count("all-gather") == 1 and "collective-permute" not in forward
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(split(*a)), argnums=(0, 1, 2)))
    backward = [c.kind for c in collectives(grad.lower(q, k, v).compile().as_text())]
    assert "reduce-scatter" in backward and "all-reduce" not in backward


def test_causal_attention_needs_as_many_queries_as_keys():
    split = ContextSplit(("d0",), 1, "ring", True, 1.0)
    with pytest.raises(ValueError, match="as many queries as keys"):
        context_attention(jnp.zeros((1, 1, 4, 2)), jnp.zeros((1, 1, 8, 2)), jnp.zeros((1, 1, 8, 2)), split)
    with pytest.raises(ValueError, match="variant"):
        ContextSplit(("d0",), 2, "ulysses", True, 1.0)


# --- the Pallas block kernel (jaxbackend.kernels.flash_attention) ---------------------------------------------------


@pytest.mark.parametrize("case, variant, causal", [("seq@0,heads@1,gqa", "ring", True), ("seq@01", "allgather", False)])
def test_the_pallas_blocks_interpreted_equal_the_xla_blocks(case, variant, causal, monkeypatch):
    """``BLOCK_KERNEL = "pallas-interpret"``: every block and its gradients by the flash-attention kernel in Pallas's
    interpret mode (the zig-zag's causal offsets, grouped heads, the ring's and the all-gather's backward)."""
    batch, heads, kv_heads, length, _, _ = CASES[case]
    q, k, v, cotangent = _operands(batch, heads, kv_heads, length)
    results = []
    for kernel in ("xla", "pallas-interpret"):
        monkeypatch.setattr(context_attention_module, "BLOCK_KERNEL", kernel)
        split, shardings = _split_fn(case, variant, causal)
        out, pullback = jax.vjp(split, *(jax.device_put(x, s) for x, s in zip((q, k, v), shardings)))
        results.append((out, *pullback(cotangent)))
    for name, got, want in zip(["out", "dq", "dk", "dv"], results[1], results[0]):
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0, err_msg=name)


def test_the_block_kernel_is_pallas_on_a_gpu_and_xla_on_the_cpu(monkeypatch):
    q, k, v, _ = _operands(1, 4, 2, 64)
    grouped = q.reshape(1, 2, 2, 64, 8)
    assert context_attention_module._block_kernel(grouped, k, v) == "xla"
    with precision.using(precision.Numerics(platform="cuda")):
        assert context_attention_module._block_kernel(grouped, k, v) == "pallas"
        wide_v = jnp.zeros(v.shape[:3] + (512,))  # a head dim over MAX_HEAD_DIM: not taken
        assert context_attention_module._block_kernel(grouped, k, wide_v) == "xla"
        # the whole context-parallel step lowered for CUDA: forward, dq and dk/dv kernels as Triton calls
        split, shardings = _split_fn("seq@0", "ring", True)
        grad = jax.jit(jax.grad(lambda *a: jnp.sum(split(*a)), argnums=(0, 1, 2)))
        text = grad.trace(*_operands(2, 4, 4, 64)[:3]).lower(lowering_platforms=("cuda",)).as_text()
    kernels = {"flash_block_forward", "flash_block_dq", "flash_block_dkv"}
    assert set(re.findall(r'name = "(flash_block_\w+)"', text)) == kernels
    assert "stablehlo.custom_call @__gpu$xla.gpu.triton" in text
    monkeypatch.setattr(context_attention_module, "BLOCK_KERNEL", "xla")
    with precision.using(precision.Numerics(platform="cuda")):
        assert context_attention_module._block_kernel(grouped, k, v) == "xla"
    monkeypatch.setattr(context_attention_module, "BLOCK_KERNEL", "triton")
    with pytest.raises(ValueError, match="BLOCK_KERNEL"):
        context_attention_module._block_kernel(grouped, k, v)
    monkeypatch.setattr(context_attention_module, "BLOCK_KERNEL", "pallas")
    with pytest.raises(ValueError, match="does not take"):
        context_attention_module._block_kernel(grouped.astype(jnp.bfloat16), k, v)

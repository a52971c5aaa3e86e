"""``aten.scaled_dot_product_attention`` (:mod:`jaxbackend.ops.attention`) against
``torch.nn.functional.scaled_dot_product_attention`` itself.

Each case runs the registered lowering on JAX arrays, forward and the VJP for one random cotangent with
respect to q, k, v and a float mask, and compares with torch's output and autograd gradients, on both
lowerings: the composition (what this CPU runs) and the fused lowering onto ``jax.nn.dot_product_attention``
(what a CUDA GPU runs with ``implementation="cudnn"``; here the tests select JAX's XLA implementation,
which the lowering never chooses by itself). A recording stand-in for ``jax.nn.dot_product_attention``
checks which path each call took. Capture-level cases (``torch.export`` → lowering) are in
``test_ops_extra.py``.

Tolerances, measured on CPU with torch 2.13 and jax 0.10.2 over every case below, on both lowerings:
- float32: ``rtol=1e-5, atol=1e-6``. Largest absolute difference 1.0e-6 (float mask gradients, which sum
  over broadcast dims), at most 0.44 of the tolerance; median relative difference 1.4e-7.
- bfloat16: ``rtol=1.6e-2, atol=1e-2`` (about two bf16 ulps). Largest absolute difference 3.1e-2 (one ulp of
  GQA value gradients of magnitude 4–8), at most 0.88 of the tolerance. Both lowerings run the softmax in
  float32 and round ``P`` to bf16 before ``P V``, as cuDNN does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from jaxbackend import precision
from jaxbackend import ops
from jaxbackend.ops import attention

FP32_TOL = {"rtol": 1e-5, "atol": 1e-6}
BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-2}
B, N, L, S, E = 2, 4, 6, 6, 8

_sdpa = ops.get("aten.scaled_dot_product_attention.default").fn


def _on_gpu_platform():
    """Lower as for a CUDA GPU: bf16 attention without a mask asks for cuDNN."""
    return precision.using(precision.Numerics(platform="cuda"))


@pytest.fixture
def take_xla_path(monkeypatch) -> None:
    """Make the lowering take its fused path with JAX's XLA implementation wherever the fused path applies."""

    def xla_where_it_applies(query, key_, value, attn_mask, dropout_p, is_causal, enable_gqa):
        applies = attention._fused_applies(query, key_, value, attn_mask, dropout_p, enable_gqa)
        return "xla" if applies else "composition"

    monkeypatch.setattr(attention, "_path", xla_where_it_applies)


@pytest.fixture
def fused_calls(monkeypatch) -> list:
    """The ``implementation=`` of every ``jax.nn.dot_product_attention`` call, in order."""
    calls = []
    real = jax.nn.dot_product_attention

    def recording(*args, **kwargs):
        calls.append(kwargs.get("implementation"))
        return real(*args, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    return calls


# --- masks -------------------------------------------------------------------------------------------

def _allowed(*shape: int) -> torch.Tensor:
    """A random boolean mask (True = attend) that keeps key 0, except in one query row of the first slice, which
    has no key at all: row 2, or the only row where the mask broadcasts over queries (a fully padded sequence)."""
    mask = torch.rand(*shape, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[..., 0] = True
    mask.view(-1, *shape[-2:])[0, min(2, shape[-2] - 1)] = False
    return mask


def _neg_inf_where_masked(*shape: int) -> torch.Tensor:
    """A float mask with random values, ``-inf`` where :func:`_allowed` masks (a fully ``-inf`` row)."""
    values = torch.randn(*shape, generator=torch.Generator().manual_seed(2))
    return values.masked_fill(~_allowed(*shape), float("-inf"))


def _lowest_row(*shape: int) -> torch.Tensor:
    """HF's float mask: ``finfo.min`` where masked. A row all ``finfo.min`` is finite: torch averages V there."""
    return torch.zeros(*shape).masked_fill(~_allowed(*shape), torch.finfo(torch.float32).min)


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(3))


# name → (query shape, key/value shape, mask or None, keyword arguments, fused path applies)
CASES = {
    "no_mask": ((B, N, L, E), (B, N, S, E), None, {}, True),
    "causal": ((B, N, L, E), (B, N, S, E), None, {"is_causal": True}, True),
    "causal_short_query": ((B, N, 3, E), (B, N, 7, E), None, {"is_causal": True}, True),
    "causal_long_query": ((B, N, 7, E), (B, N, 3, E), None, {"is_causal": True}, True),
    "bool_mask_dead_row": ((B, N, L, E), (B, N, S, E), _allowed(B, 1, L, S), {}, True),
    "bool_padding_B11S": ((B, N, L, E), (B, N, S, E), _allowed(B, 1, 1, S), {}, True),
    "bool_mask_LS": ((B, N, L, E), (B, N, S, E), _allowed(L, S), {}, True),
    "bool_mask_and_causal": ((B, N, L, E), (B, N, S, E), _allowed(B, 1, L, S), {"is_causal": True}, True),
    "float_mask": ((B, N, L, E), (B, N, S, E), _randn(B, N, L, S), {}, True),
    "float_mask_dead_row": ((B, N, L, E), (B, N, S, E), _neg_inf_where_masked(B, 1, L, S), {}, True),
    "float_mask_lowest_row": ((B, N, L, E), (B, N, S, E), _lowest_row(B, 1, L, S), {}, True),
    "float_mask_N1S": ((B, N, L, E), (B, N, S, E), _randn(N, 1, S), {}, True),
    "float_mask_1NLS": ((B, N, L, E), (B, N, S, E), _randn(1, N, L, S), {}, True),
    "gqa": ((B, N, L, E), (B, 2, S, E), None, {"enable_gqa": True, "is_causal": True}, True),
    "gqa_mask": ((B, N, L, E), (B, 2, S, E), _allowed(B, 1, L, S), {"enable_gqa": True}, True),
    "mqa_broadcast_heads": ((B, N, L, E), (B, 1, S, E), None, {}, True),
    "scale": ((B, N, L, E), (B, N, S, E), None, {"scale": 0.2}, True),
    "rank3": ((N, L, E), (N, S, E), None, {"is_causal": True}, True),
    "rank3_gqa_mask": ((N, L, E), (2, S, E), _allowed(L, S), {"enable_gqa": True}, True),
    "rank2_mask": ((L, E), (S, E), _allowed(L, S), {}, True),
    "rank5_broadcast_batch": ((3, B, N, L, E), (1, B, N, S, E), _randn(3, 1, 1, L, S), {}, True),
    "value_dim_differs": ((B, N, L, E), (B, N, S, E), None, {"value_dim": 5}, False),
}


def _run_case(q_shape, kv_shape, mask, kwargs, dtype):
    """Forward and gradients of the lowering and of torch, as lists of float64 numpy arrays (ours, torch's)."""
    kwargs = dict(kwargs)
    v_shape = kv_shape[:-1] + (kwargs.pop("value_dim", kv_shape[-1]),)
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=gen).to(dtype) for shape in (q_shape, kv_shape, v_shape)]
    if mask is not None:
        tensors.append(mask.to(dtype) if mask.is_floating_point() else mask)
    inputs = [t.clone().requires_grad_(t.is_floating_point()) for t in tensors]
    want = F.scaled_dot_product_attention(*inputs[:3], attn_mask=inputs[3] if mask is not None else None, **kwargs)
    cotangent = torch.randn(want.shape, generator=gen).to(dtype)
    diff = [t for t in inputs if t.requires_grad]
    want_grads = torch.autograd.grad(want, diff, cotangent)

    def to_jax(t):
        return jnp.asarray(t.float().numpy()).astype(jnp.bfloat16) if t.dtype == torch.bfloat16 else jnp.asarray(t.numpy())

    arrays = [to_jax(t) for t in tensors]

    def lowered(*diff_arrays):
        full = list(diff_arrays) + arrays[len(diff_arrays):]
        return _sdpa(*full[:3], full[3] if mask is not None else None, key=jax.random.key(0), **kwargs)

    @jax.jit
    def forward_and_grads(diff_arrays, cotangent):
        got, vjp = jax.vjp(lowered, *diff_arrays)
        return got, *vjp(cotangent)

    ours = [np.asarray(x, np.float64) for x in forward_and_grads(arrays[:len(diff)], to_jax(cotangent))]
    theirs = [t.detach().double().numpy() for t in (want, *want_grads)]
    return ours, theirs


def _assert_close(ours, theirs, tol):
    for i, (got, want) in enumerate(zip(ours, theirs)):
        what = "output" if i == 0 else f"gradient of input {i - 1}"
        assert np.isfinite(got).all(), f"{what} is not finite"
        np.testing.assert_allclose(got, want, **tol, err_msg=what)


@pytest.mark.parametrize("path", ["composition", "xla"])
@pytest.mark.parametrize("case", CASES)
def test_float32_matches_torch(case, path, fused_calls, request):
    q_shape, kv_shape, mask, kwargs, fused_applies = CASES[case]
    if path == "xla":
        request.getfixturevalue("take_xla_path")
    ours, theirs = _run_case(q_shape, kv_shape, mask, kwargs, torch.float32)
    _assert_close(ours, theirs, FP32_TOL)
    assert fused_calls == (["xla"] if path == "xla" and fused_applies else [])


@pytest.mark.parametrize("path", ["composition", "xla"])
@pytest.mark.parametrize("case", ["no_mask", "causal", "bool_mask_dead_row", "float_mask_dead_row", "gqa",
                                  "rank3", "rank5_broadcast_batch"])
def test_bfloat16_matches_torch_bfloat16(case, path, fused_calls, request):
    q_shape, kv_shape, mask, kwargs, _ = CASES[case]
    if path == "xla":
        request.getfixturevalue("take_xla_path")
    ours, theirs = _run_case(q_shape, kv_shape, mask, kwargs, torch.bfloat16)
    _assert_close(ours, theirs, BF16_TOL)
    assert fused_calls == (["xla"] if path == "xla" else [])


@pytest.mark.parametrize("path", ["composition", "xla"])
def test_fully_masked_rows_are_zero_with_zero_gradients(path, request):
    """The first slice's query row 2 has no key: zeros out, and no gradient flows to q through it."""
    if path == "xla":
        request.getfixturevalue("take_xla_path")
    q_shape, kv_shape, mask, kwargs, _ = CASES["bool_mask_dead_row"]
    ours, _ = _run_case(q_shape, kv_shape, mask, kwargs, torch.float32)
    out, grad_q = ours[0], ours[1]
    assert not out[0, :, 2].any() and not grad_q[0, :, 2].any()
    assert out[0, :, 1].any()


# --- which path ---------------------------------------------------------------------------------------

def _qkv(dtype=jnp.float32, shape=(B, N, L, E)):
    rng = np.random.default_rng(0)
    return [jnp.asarray(rng.standard_normal(shape, np.float32)).astype(dtype) for _ in range(3)]


def _jitted(**kwargs):
    return jax.jit(lambda q, k, v: _sdpa(q, k, v, key=jax.random.key(0), **kwargs))


def test_cpu_takes_the_composition(fused_calls):
    """JAX 0.10's ``implementation=None`` is its XLA composition, slower than ours: no call on a CPU."""
    for dtype in (jnp.float32, jnp.bfloat16):
        _jitted(is_causal=True)(*_qkv(dtype))
    assert fused_calls == []


def test_bfloat16_on_a_gpu_asks_cudnn_and_falls_back_to_the_composition(fused_calls):
    """Without a mask, bf16 on CUDA asks for cuDNN's flash kernel; this machine has none, so the composition
    runs, and gives torch's result."""
    q, k, v = _qkv(jnp.bfloat16)
    with _on_gpu_platform():
        out = _jitted(is_causal=True)(q, k, v)
    assert fused_calls == ["cudnn"]
    torch_qkv = [torch.from_numpy(np.asarray(x, np.float32)).bfloat16() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(*torch_qkv, is_causal=True)
    np.testing.assert_allclose(np.asarray(out, np.float64), want.double().numpy(), **BF16_TOL)


def test_bfloat16_on_a_gpu_with_gqa_or_rank3_asks_cudnn(fused_calls):
    q = _qkv(jnp.bfloat16)[0]
    k, v = _qkv(jnp.bfloat16, (B, 2, S, E))[:2]
    with _on_gpu_platform():
        _jitted(enable_gqa=True)(q, k, v)
        _jitted()(*_qkv(jnp.bfloat16, (N, L, E)))
    assert fused_calls == ["cudnn", "cudnn"]


@pytest.mark.parametrize("what", ["dropout", "bool_mask", "float_mask", "causal_with_L_ne_S", "value_dim_differs"])
def test_bfloat16_on_a_gpu_keeps_off_cudnn(what, fused_calls):
    """No dropout in JAX's API; masks and unaligned causal masks are not checked on a GPU yet."""
    q, k, v = _qkv(jnp.bfloat16)
    kwargs = {
        "dropout": {"dropout_p": 0.5}, "bool_mask": {"attn_mask": jnp.ones((L, S), bool)},
        "float_mask": {"attn_mask": jnp.zeros((L, S), jnp.bfloat16)}, "causal_with_L_ne_S": {"is_causal": True},
        "value_dim_differs": {},
    }[what]
    if what == "causal_with_L_ne_S":
        k, v = _qkv(jnp.bfloat16, (B, N, S + 2, E))[:2]
    if what == "value_dim_differs":
        v = _qkv(jnp.bfloat16, (B, N, S, E // 2))[0]
    with _on_gpu_platform():
        out = _jitted(**kwargs)(q, k, v)
    assert fused_calls == [] and np.isfinite(np.asarray(out, np.float32)).all()


def test_float32_on_a_gpu_takes_the_composition_at_the_asked_precision(fused_calls):
    """Only the composition honours ``torch.get_float32_matmul_precision()`` (``jax.nn.dot_product_attention``
    has no ``precision``; its float32 products would be XLA's default, TF32 on a GPU)."""
    q, k, v = _qkv()
    for matmul in precision.MATMUL_PRECISIONS:
        with precision.using(precision.Numerics(matmul=matmul, platform="cuda")):
            jaxpr = jax.make_jaxpr(lambda q, k, v: _sdpa(q, k, v, key=jax.random.key(0)))(q, k, v)
        assert fused_calls == []
        wanted = {"highest": "HIGHEST", "high": "TF32_TF32_F32", "medium": "BF16_BF16_F32"}[matmul]
        dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
        assert len(dots) == 2 and all(wanted in str(e.params["precision"]) for e in dots), matmul


def test_dropout_is_applied_by_the_composition():
    q, k, v = _qkv()
    out, dropped = _jitted()(q, k, v), _jitted(dropout_p=0.5)(q, k, v)
    assert dropped.shape == out.shape and np.isfinite(np.asarray(dropped)).all()
    assert not np.allclose(np.asarray(dropped), np.asarray(out))


# --- the composition in tiles of query rows (large scores on the CPU) -----------------------------------------------


@pytest.fixture
def row_tiles(monkeypatch):
    """Tile every composition on the CPU, 8 query rows a tile."""
    monkeypatch.setattr(attention, "ROW_TILED_MIN_BYTES", 0)
    monkeypatch.setattr(attention, "ROW_TILE_BYTES", 1)


def _composition_and_grads(q, k, v, mask, causal, dropout_p=0.0, key=None):
    def f(q, k, v):
        with precision.using(None):
            out = attention._composed(q, k, v, mask, dropout_p, causal, 0.25, False, key)
        return out, out

    out, vjp, _ = jax.vjp(f, q, k, v, has_aux=True)
    cotangent = jax.random.normal(jax.random.key(7), out.shape)
    return out, vjp(cotangent)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "bool rows", "float broadcast"])
def test_row_tiles_equal_the_whole_composition(mask_kind, monkeypatch):
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(key, (2, 3, 32, 8)) for key in keys[:3])
    mask = {"none": None, "causal": None,
            "bool rows": jax.random.bernoulli(keys[3], 0.8, (2, 1, 32, 32)),
            "float broadcast": jax.random.normal(keys[3], (32,))}[mask_kind]
    causal = mask_kind == "causal"
    whole, whole_grads = _composition_and_grads(q, k, v, mask, causal)
    monkeypatch.setattr(attention, "ROW_TILED_MIN_BYTES", 0)
    monkeypatch.setattr(attention, "ROW_TILE_BYTES", 1)
    with precision.using(None):
        assert attention._row_tile(q, k) == 8  # ROW_TILE_BYTES of 1: the smallest tile, 8 rows (4 tiles)
    tiled, tiled_grads = _composition_and_grads(q, k, v, mask, causal)
    np.testing.assert_allclose(tiled, whole, **FP32_TOL)
    for got, want in zip(tiled_grads, whole_grads):
        np.testing.assert_allclose(got, want, **FP32_TOL)


def test_row_tiles_draw_dropout_per_tile_and_differentiate_that_draw(row_tiles):
    keys = jax.random.split(jax.random.key(1), 3)
    q, k, v = (jax.random.normal(key, (2, 2, 32, 8)) for key in keys)
    dropout_key = jax.random.key(5)
    tiled, tiled_grads = _composition_and_grads(q, k, v, None, True, 0.25, dropout_key)

    def reference(q, k, v):  # the same per-tile draws, applied to the whole sequence at once
        keep = jnp.concatenate([jax.random.bernoulli(jax.random.fold_in(dropout_key, i), 0.75, (2, 2, 8, 32))
                                for i in range(4)], axis=-2)
        scores = jnp.where(jnp.tril(jnp.ones((32, 32), bool)), q @ jnp.swapaxes(k, -1, -2) * 0.25, -jnp.inf)
        weights = jnp.where(keep, jax.nn.softmax(scores, axis=-1) / 0.75, 0.0)
        return weights @ v

    want, vjp = jax.vjp(reference, q, k, v)
    np.testing.assert_allclose(tiled, want, **FP32_TOL)
    for got, expected in zip(tiled_grads, vjp(jax.random.normal(jax.random.key(7), want.shape))):
        np.testing.assert_allclose(got, expected, **FP32_TOL)


def test_small_scores_and_other_platforms_stay_whole():
    q = jnp.zeros((2, 3, 32, 8))
    with precision.using(None):
        assert attention._row_tile(q, q) is None  # far below ROW_TILED_MIN_BYTES
    with precision.using(precision.Numerics(platform="cuda")):
        assert attention._row_tile(jnp.zeros((8, 12, 4096, 64)), jnp.zeros((8, 12, 4096, 64))) is None

"""The blocked grouped matmul (``_grouped_mm`` with offsets): ``jax.lax.ragged_dot``'s values and gradients, with
work that follows the rows and not the number of experts."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxbackend.ops.grouped_matmul import block_rows_for, blocked_ragged_dot


def _sizes(rng: np.random.Generator, groups: int, total: int) -> np.ndarray:
    cuts = np.sort(rng.integers(0, total + 1, size=groups - 1))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int32)


@pytest.mark.parametrize("seed", range(2))
def test_values_and_gradients_are_ragged_dots(seed):
    """Empty groups, groups shorter and longer than a block, rows past the last group (zero), any block size."""
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
    for block in (None, 8):
        ours = lambda x, w: blocked_ragged_dot(x, w, sizes, block_rows=block, precision="highest")  # noqa: E731
        np.testing.assert_allclose(ours(x, w), reference(x, w), atol=2e-5)
        assert not np.asarray(ours(x, w))[int(sizes.sum()):].any()
        for got, want in zip(jax.grad(loss(ours), (0, 1))(x, w), jax.grad(loss(reference), (0, 1))(x, w)):
            np.testing.assert_allclose(got, want, atol=2e-5)


def test_the_work_follows_the_rows_not_the_experts():
    """XLA's FLOP count of the compiled product: 8 → 64 experts over the same 4,096 rows multiplies
    ``jax.lax.ragged_dot``'s work by about 8 (XLA computes every expert on every row) and the blocked one's by
    at most 1.6 (the padding of at most one block per expert: never over twice the rows' own work)."""
    rows, width, out = 4096, 64, 128

    def flops(fn, groups: int) -> float:
        x = jax.ShapeDtypeStruct((rows, width), jnp.float32)
        w = jax.ShapeDtypeStruct((groups, width, out), jnp.float32)
        sizes = jax.ShapeDtypeStruct((groups,), jnp.int32)
        cost = jax.jit(fn).lower(x, w, sizes).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        return float(cost["flops"])

    dense = {e: flops(lambda x, w, s: jax.lax.ragged_dot(x, w, s), e) for e in (8, 64)}
    blocked = {e: flops(lambda x, w, s: blocked_ragged_dot(x, w, s), e) for e in (8, 64)}
    assert dense[64] > 6 * dense[8]
    assert blocked[64] < 1.65 * blocked[8]
    assert blocked[64] <= 2.05 * 2 * rows * width * out
    assert block_rows_for(4096, 8) == 128 and block_rows_for(4096, 64) == 64 and block_rows_for(10, 64) == 16


class _RoutedExperts(torch.nn.Module):
    """Not a transformer: BatchNorm (train mode), a top-1 router and two expert matmuls by ``torch._grouped_mm``
    (its shape function takes bf16 operands only), rows sorted by expert and put back with ``index_put``."""

    def __init__(self, experts: int = 4, width: int = 8, hidden: int = 16):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(width)
        self.router = torch.nn.Linear(width, experts)
        self.w1 = torch.nn.Parameter(torch.randn(experts, width, hidden) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(experts, hidden, width) * 0.3)
        self.experts = experts

    def forward(self, x, y):
        h = self.norm(x)
        expert = self.router(h).argmax(-1)
        order = torch.argsort(expert, stable=True)
        counts = torch.histc(expert.float(), bins=self.experts, min=0, max=self.experts - 1)  # a static shape
        offs = torch.cumsum(counts, 0).to(torch.int32)
        bf16 = torch.bfloat16
        mid = torch._grouped_mm(h[order].to(bf16), self.w1.to(bf16), offs=offs).float()
        out = torch._grouped_mm(torch.relu(mid).to(bf16), self.w2.to(bf16), offs=offs).float()
        return torch.nn.functional.mse_loss(torch.empty_like(out).index_put((order,), out) + h, y)


def test_a_routed_expert_model_trains_like_pytorch():
    import torchpar

    torch.manual_seed(0)
    model = _RoutedExperts()
    x, y = torch.randn(32, 8), torch.randn(32, 8)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    expected = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = reference(x, y)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    with torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), example_batch=(x, y),
                          method=torchpar.DataParallel(mesh_shape=(1, 1))) as engine:
        losses = [float(engine.step((x, y))) for _ in range(4)]
        engine.sync_to_torch()
    assert losses == pytest.approx(expected, rel=1e-5)  # measured 1.2e-7
    torch.testing.assert_close(model.norm.running_mean, reference.norm.running_mean, rtol=1e-5, atol=1e-6)

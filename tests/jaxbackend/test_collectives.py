"""``jaxbackend.collectives`` on 4 fake CPU devices (a 2×2 mesh). Over gloo (forced here: a one-process mesh has
no gloo) the reduce-scatter is an all-reduce and a slice, with psum_scatter's values and gradients and no
reduce-scatter in the compiled program; elsewhere it is psum_scatter itself. The gloo bug it avoids is
intermittent, so the multi-process check is the Ray ZeRO tests' (no reduce-scatter in any host's program,
parameters as PyTorch's)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from jaxbackend import collectives

MESH = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("d0", "d1"))
EVERY_DEVICE = PartitionSpec(("d0", "d1"))


@pytest.fixture(params=[False, True], ids=["psum_scatter", "gloo"])
def over_gloo(request, monkeypatch):
    monkeypatch.setattr(collectives, "gloo_reduce_scatter_is_unsafe", lambda: request.param)
    return request.param


def _per_device(fn):
    """``fn`` on each device's block of dim 0 of its argument; the results stacked by device."""
    return jax.jit(jax.shard_map(lambda x: fn(x)[None], mesh=MESH, in_specs=EVERY_DEVICE, out_specs=EVERY_DEVICE))


@pytest.mark.parametrize("axes,dim,tiled", [(("d0", "d1"), 1, True), ("d1", 0, True), (("d1", "d0"), 2, True),
                                            (("d0", "d1"), 0, False)])
def test_reduce_scatter_sums_and_keeps_this_devices_chunk(over_gloo, axes, dim, tiled):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4 * 4, 8, 4)), jnp.float32)  # a [4, 8, 4] block each
    names = (axes,) if isinstance(axes, str) else axes
    program = _per_device(lambda v: collectives.reduce_scatter(v, axes, dim=dim, tiled=tiled))
    reference = _per_device(lambda v: jax.lax.psum_scatter(v, names, scatter_dimension=dim, tiled=tiled))
    np.testing.assert_allclose(program(x), reference(x), rtol=1e-6, atol=1e-6)
    compiled = program.lower(x).compile().as_text()
    assert ("reduce-scatter" in compiled) is not over_gloo
    assert ("all-reduce" in compiled) is over_gloo


def test_all_gather_gradient_is_the_devices_cotangents_summed_onto_the_shards(over_gloo):
    shard = jnp.asarray(np.random.default_rng(1).standard_normal((8, 6)), jnp.float32)   # [2, 6] on each device
    weight = jnp.asarray(np.random.default_rng(2).standard_normal((4, 8, 6)), jnp.float32)  # [1, 8, 6] each

    def loss(gather):
        def body(s, w):  # each device weighs the whole gathered tensor differently: per-device partial gradients
            return jax.lax.psum(jnp.sum(gather(s) * w[0]), ("d0", "d1"))
        return jax.shard_map(body, mesh=MESH, in_specs=(EVERY_DEVICE, EVERY_DEVICE), out_specs=PartitionSpec())

    ours = jax.jit(jax.grad(loss(lambda s: collectives.all_gather(s, ("d0", "d1"), axis=0))))
    np.testing.assert_allclose(ours(shard, weight), weight.sum(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.jit(loss(lambda s: collectives.all_gather(s, ("d0", "d1"), axis=0)))(shard, weight),
                               jnp.sum(shard[None] * weight), rtol=1e-5)
    compiled = ours.lower(shard, weight).compile().as_text()
    assert ("reduce-scatter" in compiled) is not over_gloo

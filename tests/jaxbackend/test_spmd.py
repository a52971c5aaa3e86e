"""Per-device helpers (jaxbackend.spmd) on a 2×2 fake-CPU mesh: resharding moves exactly the right pieces,
and the gather JAX does not re-export publicly keeps the typing and transpose the step relies on."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxbackend import sharding as jsh
from jaxbackend.spmd import LocalModeError, LocalProgram, require_invariant
from torchpar.planner.sharding.layouts import ValueLayouts

MESH_SHAPE = (2, 2)
SPECS = [(None, None), ((0,), None), (None, (1,)), ((0, 1), None), ((1,), (0,)), ((0,), (1,))]


def _program() -> LocalProgram:
    return LocalProgram(ValueLayouts(mesh_shape=MESH_SHAPE))


@pytest.mark.parametrize("have,wanted", [p for p in itertools.product(SPECS, SPECS) if p[0] != p[1]],
                         ids=lambda s: jsh.partition_spec(s).__repr__())
def test_reshard_gives_each_device_its_piece(have, wanted):
    mesh = jsh.make_mesh(MESH_SHAPE)
    x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    program = _program()
    resharded = jax.jit(jax.shard_map(lambda v: program.reshard(v, have, wanted), mesh=mesh,
                                      in_specs=jsh.partition_spec(have), out_specs=jsh.partition_spec(wanted),
                                      check_vma=False))
    out = resharded(jax.device_put(x, NamedSharding(mesh, jsh.partition_spec(have))))
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, jsh.partition_spec(wanted)), 2)
    np.testing.assert_array_equal(np.asarray(out), x)


def test_invariant_gather_types_its_result_as_replicated_and_slices_the_gradient_back():
    mesh = jsh.make_mesh(MESH_SHAPE)
    program = _program()
    x = np.arange(8, dtype=np.float32)

    def loss_and_grad(v):
        def loss(v):
            whole = require_invariant(program.reshard(v, ((0, 1),), (None,)), "gathered value")
            return jnp.sum(whole * jnp.arange(8.0))
        return jax.value_and_grad(loss)(v)

    step = jax.jit(jax.shard_map(loss_and_grad, mesh=mesh, in_specs=jsh.partition_spec(((0, 1),)),
                                 out_specs=(jsh.partition_spec(()), jsh.partition_spec(((0, 1),)))))
    loss, grad = step(jax.device_put(x, NamedSharding(mesh, jsh.partition_spec(((0, 1),)))))
    assert float(loss) == float(np.sum(x * np.arange(8.0)))
    np.testing.assert_array_equal(np.asarray(grad), np.arange(8.0))  # no sum across devices: sliced back
    assert "reduce-scatter" not in step.lower(x).compile().as_text()


def test_a_per_device_loss_is_refused():
    mesh = jsh.make_mesh(MESH_SHAPE)
    local_sum = jax.shard_map(lambda v: require_invariant(jnp.sum(v), "the loss"), mesh=mesh,
                              in_specs=jsh.partition_spec(((0, 1),)), out_specs=jsh.partition_spec(()))
    with pytest.raises(LocalModeError, match="the loss varies along mesh axes"):
        jax.jit(local_sum).lower(np.ones(8, np.float32))

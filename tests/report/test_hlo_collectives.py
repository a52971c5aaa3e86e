"""``torchpar.report.hlo.collectives`` on compiled programs: a collective in a ``fori_loop`` is marked as in a loop
and counted as many times as the loop runs (XLA's known trip count), nested loops multiplied; one outside runs
once."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxbackend.sharding import make_mesh
from torchpar.report.hlo import collectives


def _program(outer: int, inner: int) -> str:
    mesh = make_mesh((1, 4))

    def body(x):
        x = jax.lax.ppermute(x, "d1", [(i, (i + 1) % 4) for i in range(4)])  # once, outside the loops

        def inner_step(_, y):
            return jax.lax.ppermute(y, "d1", [(i, (i + 1) % 4) for i in range(4)]) * 2.0

        def outer_step(_, y):
            return jax.lax.fori_loop(0, inner, inner_step, y) + 1.0

        return jax.lax.fori_loop(0, outer, outer_step, x)

    spec = PartitionSpec("d1")
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec)).lower(
        jnp.zeros(8, jnp.float32)).compile().as_text()


def test_a_collective_in_nested_loops_runs_the_product_of_their_trip_counts():
    permutes = [c for c in collectives(_program(3, 5)) if c.kind == "collective-permute"]
    assert sorted((c.in_loop, c.runs) for c in permutes) == [(False, 1), (True, 15)]

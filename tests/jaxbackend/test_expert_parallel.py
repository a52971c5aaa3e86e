"""The split grouped matmul (``jaxbackend.ops.expert_parallel``) on fake CPU devices against ``jax.lax.ragged_dot``
on one: every expert / row / column split of a 2×2 mesh, balanced routing (the fast exchange) and skewed routing
(the exact path the fast one falls back to), values and the gradients of both operands; a capacity drops rows,
and only the ones past a slot; the exchange is an all-to-all pair in the compiled program. The ragged exchange (GPUs:
``jax.lax.ragged_all_to_all``, which XLA:CPU lacks) runs here through an emulation written from the collective's
documented semantics (checked on its documented example), and its programs lowered for CUDA call the collective."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import PartitionSpec

from jaxbackend import precision
from jaxbackend.ops import exchange_collective, grouped_matmul
from jaxbackend.ops.expert_parallel import GroupedMatmulSplit, grouped_mm_split_of, split_grouped_mm
from jaxbackend.sharding import make_mesh
from tests.jaxbackend.ragged_emulation import emulated_ragged_all_to_all
from torchpar.ir.costs import EXPERT_EXCHANGE_HEADROOM, expert_slot_rows
from torchpar.report.hlo import collectives

ROWS, WIDTH, COLUMNS, EXPERTS = 64, 8, 12, 4
ATOL = 1e-5  # fp32, "highest" precision on both sides: rounding of sums of 8 products
ROUTINGS = {
    "balanced": [16, 16, 16, 16],  # every device's rows fit a 2·L/P slot: the fast exchange
    "skewed": [40, 0, 4, 20],      # expert 0 takes most rows: slots overflow, the exact exchange runs
    "short": [30, 0, 10, 20],      # 60 of 64 rows: the last 4 belong to no expert and come out zero
}
SPLITS = {  # (expert axes, row axes, column axes) on a 2×2 mesh
    "experts@0": ((0,), (0,), ()),
    "experts@0,rows@01": ((0,), (0, 1), ()),
    "experts@1,rows@01": ((1,), (0, 1), ()),  # not a layout the planner offers (rows' major axis is not the experts')
    "experts@01": ((0, 1), (0, 1), ()),
    "experts@0,columns@1": ((0,), (0,), (1,)),
    "rows@0": ((), (0,), ()),
    "rows@01,columns": ((), (0,), (1,)),
}


def _operands(seed: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(ROWS, WIDTH)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(EXPERTS, WIDTH, COLUMNS)), jnp.float32)
    cotangent = jnp.asarray(rng.normal(size=(ROWS, COLUMNS)), jnp.float32)
    return x, w, cotangent


def _offsets(routing: str) -> jax.Array:
    return jnp.asarray(np.cumsum(ROUTINGS[routing]), jnp.int32)


def _reference(x, w, offs):
    return jax.lax.ragged_dot(x, w, jnp.diff(offs, prepend=0), precision="highest")


def _split(name: str, capacity: float | None = None) -> GroupedMatmulSplit:
    experts, rows, columns = SPLITS[name]
    return GroupedMatmulSplit(experts, rows, columns, (2, 2), capacity)


# every split on the skewed routing (the exact path, reached through the fast one's overflow test); the balanced
# and short routings with data beside the experts and with the experts over both axes
CASES = ([(name, "skewed") for name in SPLITS if name not in ("experts@0,rows@01", "experts@01")]
         + [(name, routing) for name in ("experts@0,rows@01", "experts@01") for routing in ROUTINGS])


EXTRA_CASES = {  # (split, routing, method, weight stored transposed)
    "experts@0,rows@01-balanced-gathered": ("experts@0,rows@01", "balanced", "gathered", False),
    "experts@01-skewed-gathered": ("experts@01", "skewed", "gathered", False),
    "experts@0,columns@1-skewed-transposed": ("experts@0,columns@1", "skewed", None, True),
    "rows@01,columns-skewed-transposed-gathered": ("rows@01,columns", "skewed", "gathered", True),
}


@pytest.mark.parametrize("name, routing, method, transposed",
                         [*((n, r, None, False) for n, r in CASES), *EXTRA_CASES.values()],
                         ids=[*(f"{n}-{r}" for n, r in CASES), *EXTRA_CASES])
def test_split_grouped_mm_matches_ragged_dot(name, routing, method, transposed, monkeypatch):
    """Each device's matmul in the default method (the loop on the CPU) and, for some cases, the gathered one (the
    default on a GPU: blocks in runs skipped by ``lax.cond``), or with the weight stored ``[E, N, K]`` and read in
    place (``weight_transposed``: HF's layout)."""
    monkeypatch.setattr(grouped_matmul, "METHOD", method)
    x, w, cotangent = _operands()
    offs = _offsets(routing)
    mesh = make_mesh((2, 2))
    split = _split(name)

    def split_product(x, w):  # w [E, K, N] as the reference has it, stored [E, N, K] when transposed
        stored = jnp.swapaxes(w, 1, 2) if transposed else w
        return split_grouped_mm(x, stored, offs, mesh, split, precision="highest", weight_transposed=transposed)

    def split_loss(x, w):
        return (split_product(x, w) * cotangent).sum()

    def reference_loss(x, w):
        return (_reference(x, w, offs) * cotangent).sum()

    got = jax.jit(split_product)(x, w)
    np.testing.assert_allclose(got, _reference(x, w, offs), atol=ATOL, rtol=0)
    grads = jax.jit(jax.grad(split_loss, argnums=(0, 1)))(x, w)
    want = jax.grad(reference_loss, argnums=(0, 1))(x, w)
    for got_grad, want_grad, what in zip(grads, want, ("x", "w")):
        np.testing.assert_allclose(got_grad, want_grad, atol=ATOL, rtol=0, err_msg=f"gradient of {what}")


def test_bf16_operands():
    """bf16 rows and experts (mixed precision): the exchange keeps the dtype, the products match ``ragged_dot`` on
    the same bf16 operands to bf16's precision."""
    x, w, _ = (a.astype(jnp.bfloat16) for a in _operands())
    offs = _offsets("skewed")
    got = jax.jit(lambda x, w: split_grouped_mm(x, w, offs, make_mesh((2, 2)), _split("experts@01")))(x, w)
    assert got.dtype == jnp.bfloat16
    want = jax.lax.ragged_dot(x, w, jnp.diff(offs, prepend=0))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=0.1, rtol=0.02)


def test_the_fast_exchange_suffices_for_a_balanced_router_and_not_for_a_skewed_one():
    """The fast exchange alone (a capacity of the default headroom, no exact fallback) is exact on a balanced
    routing and drops rows on the skewed one — where the default (exact) split still matches, so it took the
    fallback."""
    x, w, _ = _operands()
    mesh = make_mesh((2, 2))
    fast_only = _split("experts@01", capacity=EXPERT_EXCHANGE_HEADROOM)
    run = lambda split, offs: jax.jit(  # noqa: E731
        lambda x, w: split_grouped_mm(x, w, offs, mesh, split, precision="highest"))(x, w)
    balanced = _offsets("balanced")
    np.testing.assert_allclose(run(fast_only, balanced), _reference(x, w, balanced), atol=ATOL, rtol=0)
    skewed = _offsets("skewed")
    assert not np.allclose(run(fast_only, skewed), _reference(x, w, skewed), atol=ATOL)
    np.testing.assert_allclose(run(_split("experts@01"), skewed), _reference(x, w, skewed), atol=ATOL, rtol=0)


def test_a_capacity_drops_the_rows_past_a_slot_and_computes_the_others():
    """Experts split over one axis of 2 (experts 0, 1 on device 0; 2, 3 on device 1), 32 rows per device, capacity
    1: slots of ⌈L/2⌉ = 16 rows. Routing 4, 0, 40, 20: device 0's rows are 4 of expert 0 (they stay) and 28 of
    expert 2 — 16 travel to device 1 and the last 12 are dropped; device 1's 32 rows are all its own."""
    x, w, _ = _operands()
    mesh = make_mesh((2, 2))
    offs = jnp.asarray(np.cumsum([4, 0, 40, 20]), jnp.int32)
    run = lambda split: jax.jit(lambda x, w: split_grouped_mm(x, w, offs, mesh, split, precision="highest"))(x, w)  # noqa: E731
    got = np.asarray(run(_split("experts@0", capacity=1.0)))
    want = np.asarray(_reference(x, w, offs))
    zero = (got == 0).all(axis=1)
    expected_dropped = np.zeros(ROWS, bool)
    expected_dropped[20:32] = True
    np.testing.assert_array_equal(zero, expected_dropped)
    np.testing.assert_allclose(got[~zero], want[~zero], atol=ATOL, rtol=0)
    np.testing.assert_allclose(run(_split("experts@0")), want, atol=ATOL, rtol=0)


def test_the_exchange_is_an_all_to_all_pair_and_the_experts_never_gather():
    x, w, _ = _operands()
    mesh = make_mesh((2, 2))
    offs = _offsets("balanced")
    hlo = jax.jit(lambda x, w: split_grouped_mm(x, w, offs, mesh, _split("experts@01"))).lower(x, w).compile().as_text()
    found = collectives(hlo)
    kinds = [c.kind for c in found]
    # the fast exchange and the exact one (the branch a skewed batch takes): rows out and results back in each
    assert kinds.count("all-to-all") == 4, kinds
    assert not [c for c in found if c.kind == "all-gather"], "an expert-split grouped matmul gathered something"


def test_slot_rows_and_split_of_layouts():
    assert expert_slot_rows(128, 4) == 64 and expert_slot_rows(128, 1) == 128 and expert_slot_rows(3, 8) == 1
    assert grouped_mm_split_of((None, None), (None, None, None), (2, 2)) is None
    assert grouped_mm_split_of(((0,), None), (None, None, (1,)), (2, 2)) == GroupedMatmulSplit((), (0,), (1,), (2, 2))
    assert grouped_mm_split_of(((0, 1), None), ((1,), None, None), (2, 2)) == GroupedMatmulSplit((1,), (0, 1), (), (2, 2))
    with pytest.raises(ValueError, match="rows split over its expert axes"):
        grouped_mm_split_of(((0,), None), ((1,), None, None), (2, 2))
    with pytest.raises(ValueError, match="contracted dim split"):
        grouped_mm_split_of(((0,), (1,)), ((0,), (1,), None), (2, 2))


# --- the ragged exchange ---------------------------------------------------------------------------------------


def test_the_emulation_gives_the_documented_example():
    """``jax.lax.ragged_all_to_all``'s docstring: two devices, the arguments and results it lists."""
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:2]), ("d0",))
    per_device = {  # operand, output, input_offsets, send_sizes, output_offsets, recv_sizes
        0: ([1, 2, 2], [0, 0, 0, 0], [0, 1], [1, 2], [0, 0], [1, 1]),
        1: ([3, 4, 0], [0, 0, 0, 0], [0, 1], [1, 1], [1, 2], [2, 1]),
    }
    stacked = [jnp.asarray(np.concatenate([per_device[d][i] for d in (0, 1)]), jnp.int32) for i in range(6)]
    run = jax.shard_map(lambda *a: emulated_ragged_all_to_all(*a, axis_name="d0"), mesh=mesh,
                        in_specs=(PartitionSpec("d0"),) * 6, out_specs=PartitionSpec("d0"))
    np.testing.assert_array_equal(np.asarray(jax.jit(run)(*stacked)), [1, 3, 0, 0, 2, 2, 4, 0])


RAGGED_CASES = [("experts@0", "skewed"), ("experts@0,columns@1", "skewed"), ("experts@0,rows@01", "balanced"),
                ("experts@01", "balanced"), ("experts@01", "skewed"), ("experts@01", "short")]


@pytest.mark.parametrize("name, routing", RAGGED_CASES, ids=[f"{n}-{r}" for n, r in RAGGED_CASES])
def test_the_ragged_exchange_matches_ragged_dot(name, routing, monkeypatch):
    monkeypatch.setattr(exchange_collective, "EXCHANGE", "ragged")
    monkeypatch.setattr(exchange_collective, "COLLECTIVE", emulated_ragged_all_to_all)
    x, w, cotangent = _operands()
    offs = _offsets(routing)
    mesh = make_mesh((2, 2))
    product = lambda x, w: split_grouped_mm(x, w, offs, mesh, _split(name), precision="highest")  # noqa: E731
    np.testing.assert_allclose(jax.jit(product)(x, w), _reference(x, w, offs), atol=ATOL, rtol=0)
    grads = jax.jit(jax.grad(lambda x, w: (product(x, w) * cotangent).sum(), argnums=(0, 1)))(x, w)
    want = jax.grad(lambda x, w: (_reference(x, w, offs) * cotangent).sum(), argnums=(0, 1))(x, w)
    for got_grad, want_grad, what in zip(grads, want, ("x", "w")):
        np.testing.assert_allclose(got_grad, want_grad, atol=ATOL, rtol=0, err_msg=f"gradient of {what}")


def test_a_capacity_drops_the_same_rows_in_the_ragged_exchange(monkeypatch):
    """The dense case of ``test_a_capacity_drops_the_rows_past_a_slot_and_computes_the_others``, exchanged ragged:
    the same 12 rows past device 0's slot come back zero, the others are computed."""
    monkeypatch.setattr(exchange_collective, "COLLECTIVE", emulated_ragged_all_to_all)
    x, w, _ = _operands()
    offs = jnp.asarray(np.cumsum([4, 0, 40, 20]), jnp.int32)
    results = {}
    for exchange in ("dense", "ragged"):
        monkeypatch.setattr(exchange_collective, "EXCHANGE", exchange)
        run = jax.jit(lambda x, w: split_grouped_mm(x, w, offs, make_mesh((2, 2)), _split("experts@0", capacity=1.0),
                                                    precision="highest"))
        results[exchange] = np.asarray(run(x, w))
    np.testing.assert_array_equal(results["ragged"] == 0, results["dense"] == 0)
    np.testing.assert_allclose(results["ragged"], results["dense"], atol=ATOL, rtol=0)


def test_lowered_for_cuda_the_exchange_calls_ragged_all_to_all_both_ways(monkeypatch):
    """``EXCHANGE=None`` picks the ragged collective for a CUDA program (and the dense one for this CPU's); forward
    and backward of the fast and the exact exchange call it, and no dense all-to-all of row slots is left."""
    x, w, cotangent = _operands()
    offs = _offsets("balanced")
    mesh = make_mesh((2, 2))
    monkeypatch.setattr(exchange_collective, "EXCHANGE", None)

    def loss(x, w):
        return (split_grouped_mm(x, w, offs, mesh, _split("experts@01"), precision="highest") * cotangent).sum()

    with precision.using(precision.Numerics(platform="cuda")):
        cuda = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    cpu = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w).lower().as_text()
    assert cuda.count("custom_call @ragged_all_to_all") >= 6, cuda.count("custom_call @ragged_all_to_all")
    assert "ragged_all_to_all" not in cpu and "stablehlo.all_to_all" in cpu
    # what dense all-to-alls are left move the int32 offset vectors the collective's transpose exchanges, no rows
    dense = [line for line in cuda.splitlines() if "stablehlo.all_to_all" in line]
    assert dense and all(re.search(r"-> tensor<\d+xi32>$", line.strip()) for line in dense), dense

"""Sharded training on fake CPU devices: every method and mesh gives one device's losses, and the
compiled HLO moves exactly the communication the plan says."""

from __future__ import annotations

import copy

import pytest
import torch

import torchpar
from torchpar.harness import zoo
from torchpar.report.hlo import collectives

LOSS_RTOL = 1e-4
STEPS = 10
METHODS = {
    "shard": torchpar.ShardParallel,
    "dp": torchpar.DataParallel,
    "zero2": torchpar.Zero2Parallel,
    "zero3": torchpar.Zero3Parallel,
}
MESHES = [(1, 4), (2, 2), (2, 4)]


# One transformer block: every method × mesh still shards the embedding, a full block (attention, MLP, norms)
# and the tied head with the optimizer state; a second identical block adds compile time (~40% of this file's),
# not a code path. Layer-to-layer resharding is covered by the pipeline and tensor-parallel tests.
OVERRIDES = {"mlp": {"width": 32}, "gpt2": {"n_layer": 1}, "llama": {"num_hidden_layers": 1}}


def _losses(family: str, method, steps: int = STEPS) -> tuple[list[float], str]:
    torch.manual_seed(0)
    overrides = OVERRIDES[family]
    model, batch = zoo.build(family, overrides, batch_size=8, seq_len=16)
    engine = torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), example_batch=batch, method=method)
    return [engine.step(batch).item() for _ in range(steps)], engine.spmd_mode


_reference: dict[str, list[float]] = {}

# Every pair of axes is covered, not their whole product: the MLP under every method × mesh; each transformer under
# ShardParallel on every mesh (the ILP's sharding changes with the model and the mesh) and under each data-parallel
# method (DP, ZeRO-2, ZeRO-3) on one mesh, the meshes rotated between the two so that each meets every mesh there too.
CASES = ([("mlp", method, mesh) for method in METHODS for mesh in MESHES]
         + [(family, "shard", mesh) for family in ("gpt2", "llama") for mesh in MESHES]
         + [("gpt2", "dp", (1, 4)), ("gpt2", "zero2", (2, 2)), ("gpt2", "zero3", (2, 4)),
            ("llama", "dp", (2, 4)), ("llama", "zero2", (1, 4)), ("llama", "zero3", (2, 2))])


@pytest.mark.parametrize("family,method,mesh", CASES, ids=[f"{f}-{m}-{a}x{b}" for f, m, (a, b) in CASES])
def test_losses_match_one_device(family, method, mesh):
    if family not in _reference:
        _reference[family] = _losses(family, None)[0]
    losses, spmd_mode = _losses(family, METHODS[method](mesh_shape=mesh))
    torch.testing.assert_close(losses, _reference[family], rtol=LOSS_RTOL, atol=0)
    # data-parallel and ZeRO plans run as per-device programs with explicit collectives; the others under GSPMD
    assert spmd_mode == ("gspmd" if method == "shard" else "shard_map")


def _mlp_engine(width: int, batch: int, method, **options):
    torch.manual_seed(0)
    model = zoo.MLP(width=width, depth=6)
    data = (torch.randn(batch, width), torch.randn(batch, width))
    engine = torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), example_batch=data, method=method,
                              **options)
    engine.step(data)
    return engine


def _scalars(found) -> int:
    return sum(1 for c in found for _, shape in c.shapes if not shape)


@pytest.mark.parametrize("spmd", ["gspmd", "shard_map"])
def test_megatron_mlp_moves_exactly_five_all_reduces(spmd):
    engine = _mlp_engine(256, 32, torchpar.ShardParallel(mesh_shape=(1, 4)), spmd=spmd, on_nonfinite="ignore")
    assert engine.spmd_mode == spmd
    found = collectives(engine.hlo_text()[0])
    assert {c.kind for c in found} == {"all-reduce"}, [c.line for c in found]
    tensors = [shape for c in found for _, shape in c.shapes if shape]
    assert tensors == [(32, 256)] * 5  # three forward, two backward
    # besides them only scalars: the sharded gradients' sums of squares for the reported gradient norm — one psum in
    # the per-device step, folded by XLA into the same all-reduces under GSPMD
    if spmd == "shard_map":
        assert _scalars(found) == 1


@pytest.mark.parametrize("spmd", ["gspmd", "shard_map"])
def test_the_nonfinite_guard_costs_one_scalar_all_reduce(spmd):
    mlp = lambda **options: collectives(  # noqa: E731
        _mlp_engine(256, 32, torchpar.ShardParallel(mesh_shape=(1, 4)), spmd=spmd, **options).hlo_text()[0])
    guarded, unguarded = mlp(), mlp(on_nonfinite="ignore")
    tensors = sorted(shape for c in guarded for _, shape in c.shapes if shape)
    assert tensors == [(32, 256)] * 5
    assert _scalars(guarded) - _scalars(unguarded) == 1  # every device's inf/nan count


def test_data_parallel_mlp_only_all_reduces_gradients():
    engine = _mlp_engine(32, 256, torchpar.ShardParallel(mesh_shape=(1, 4)))
    params = engine.plan.stages[0].params
    assert all(spec == [None, None] for spec in params.values())
    found = collectives(engine.hlo_text()[0])
    assert {c.kind for c in found} == {"all-reduce"}
    tensors = [shape for c in found for _, shape in c.shapes if shape]  # leave out the scalar loss
    assert sorted(tensors) == [(32, 32)] * 6


def test_zero2_shards_optimizer_state_and_gathers_updated_parameters():
    dp = _mlp_engine(64, 64, torchpar.DataParallel(mesh_shape=(1, 4)))
    zero2 = _mlp_engine(64, 64, torchpar.Zero2Parallel(mesh_shape=(1, 4)))
    gathers = [c for c in collectives(zero2.hlo_text()[0]) if c.kind == "all-gather"]
    assert sorted(shape for c in gathers for _, shape in c.shapes) == [(64, 64)] * 6  # updated shards → params
    # arguments = parameters + optimizer state + batch; only the optimizer state (2 moments) shrinks 4×
    optimizer_bytes = 6 * 64 * 64 * 4 * 2
    dp_args = dp.memory_stats()[0]["argument_bytes"]
    zero2_args = zero2.memory_stats()[0]["argument_bytes"]
    assert dp_args - zero2_args == optimizer_bytes - optimizer_bytes // 4


@pytest.mark.parametrize("method", [torchpar.Zero2Parallel, torchpar.Zero3Parallel], ids=["zero2", "zero3"])
def test_zero_gradients_are_reduce_scattered(method):
    engine = _mlp_engine(64, 64, method(mesh_shape=(1, 4)))
    assert engine.spmd_mode == "shard_map"
    found = collectives(engine.hlo_text()[0])
    scattered = sorted(shape for c in found if c.kind == "reduce-scatter" for _, shape in c.shapes)
    assert scattered == [(16, 64)] * 6  # each 64×64 weight gradient, reduced onto its quarter
    all_reduced = [shape for c in found if c.kind == "all-reduce" for _, shape in c.shapes]
    # the scalar loss, the non-finite guard's count and the gradient norm's one psum: no gradient all-reduce
    assert all_reduced == [(), (), ()]


def test_data_parallel_all_reduces_each_gradient_once():
    engine = _mlp_engine(64, 64, torchpar.DataParallel(mesh_shape=(1, 4)))
    assert engine.spmd_mode == "shard_map"
    found = collectives(engine.hlo_text()[0])
    assert {c.kind for c in found} == {"all-reduce"}
    assert sorted(shape for c in found for _, shape in c.shapes) == [()] + [(64, 64)] * 6


def test_plan_round_trips_and_runs_without_solving():
    engine = _mlp_engine(256, 32, torchpar.ShardParallel(mesh_shape=(1, 4)))
    plan = engine.plan
    loaded = torchpar.Plan.from_json(plan.to_json())
    assert loaded.to_dict() == plan.to_dict()
    torch.manual_seed(0)
    model = zoo.MLP(width=256, depth=6)
    data = (torch.randn(32, 256), torch.randn(32, 256))
    reference = copy.deepcopy(model)
    replay = torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), example_batch=data, method=loaded)
    assert replay.plan.stages[0].params == plan.stages[0].params
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ref_opt.zero_grad()
    loss = reference(*data)
    loss.backward()
    assert replay.step(data) == pytest.approx(loss.item(), rel=LOSS_RTOL)


def test_plan_summary_reports_specs_solver_and_phases():
    engine = _mlp_engine(256, 32, torchpar.ShardParallel(mesh_shape=(1, 4)))
    summary = engine.plan.summary()
    assert "layers.0.weight" in summary and "S1 R" in summary
    assert "R = whole (replicated), S0 / S1 / S01 = split over logical mesh axis 0 / 1 / both" in summary  # the legend
    assert "solver:" in summary and "variables " in summary and "gap " in summary
    for phase in ("capture", "ilp", "lower", "xla_compile"):
        assert phase in engine.plan.timings

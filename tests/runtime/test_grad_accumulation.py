"""Gradient accumulation in one-stage plans (``num_micro_batches`` on DataParallel, ZeRO-2/3, MegatronParallel and
ShardParallel): the step trains like the whole batch at once (mean losses: the accumulated gradient is the whole
batch's), buffers see the micro-batches one after another as in a PyTorch accumulation loop, the gradients are
synchronized once per step (outside the executable's micro-batch loop, in the compiled HLO), and the ILP prices
that."""

from __future__ import annotations

import pytest
import torch

import torchpar
from torchpar.harness import zoo
from torchpar.report.hlo import collectives

@pytest.fixture(scope="module", autouse=True)
def session_cluster():
    """The session's local cluster of 8 devices, whatever an earlier module of this worker left."""
    torchpar.init(cluster="local", num_devices=8)


STEPS = 5
LOSS_RTOL = 1e-4  # measured ≤ 4e-7: only the order of the float32 sums differs from the whole batch
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-6
MICRO = 4


def _train(model: torch.nn.Module, batch, method, steps: int = STEPS, **options):
    # SGD: a mis-scaled gradient shows in the parameters (Adam normalizes it away, and turns the rounding noise of
    # gradients that are zero in exact arithmetic, e.g. attention's key bias, into full-size steps)
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), example_batch=batch,
                              method=method, **options)
    losses = [engine.step(batch).item() for _ in range(steps)]
    engine.sync_to_torch()
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, engine


def _gpt2():
    torch.manual_seed(0)
    return zoo.build("gpt2", {"n_layer": 1}, batch_size=16, seq_len=16)


def _mlp(width: int = 48, rows: int = 64):
    torch.manual_seed(0)
    return zoo.MLP(width=width, depth=4), (torch.randn(rows, width), torch.randn(rows, width))


@pytest.fixture(scope="module")
def gpt2_whole_batch():
    return _train(*_gpt2(), None)[:2]


@pytest.fixture(scope="module")
def mlp_whole_batch():
    return _train(*_mlp(), None)[:2]


def _assert_trains_like(result, reference) -> None:
    losses, params, _ = result
    ref_losses, ref_params = reference
    torch.testing.assert_close(losses, ref_losses, rtol=LOSS_RTOL, atol=0)
    for name, value in ref_params.items():
        torch.testing.assert_close(params[name], value, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)


@pytest.mark.parametrize("method", [torchpar.DataParallel, torchpar.ShardParallel], ids=["dp", "shard"])
def test_accumulating_on_one_device_trains_like_the_whole_batch(method, gpt2_whole_batch):
    result = _train(*_gpt2(), method(mesh_shape=(1, 1), num_micro_batches=MICRO))
    assert result[2].plan.num_micro_batches == MICRO
    _assert_trains_like(result, gpt2_whole_batch)


def test_a_data_parallel_transformer_accumulates_like_the_whole_batch(gpt2_whole_batch):
    result = _train(*_gpt2(), torchpar.DataParallel(mesh_shape=(1, 4), num_micro_batches=MICRO))
    assert result[2].spmd_mode == "shard_map"
    _assert_trains_like(result, gpt2_whole_batch)


MESH_METHODS = {
    "dp": torchpar.DataParallel(mesh_shape=(1, 4), num_micro_batches=MICRO),
    "zero2": torchpar.Zero2Parallel(mesh_shape=(1, 4), num_micro_batches=MICRO),
    "zero3": torchpar.Zero3Parallel(mesh_shape=(1, 4), num_micro_batches=MICRO),
    "megatron": torchpar.MegatronParallel(mesh_shape=(2, 2), num_micro_batches=MICRO),
    "shard": torchpar.ShardParallel(mesh_shape=(2, 2), num_micro_batches=MICRO),
}
# the MLP's parameters (48×48) and their pieces under the plans above; its activations per device and micro-batch
# have 4, 8 or 16 rows (64 rows / 4 micro-batches / 4, 2 or 1 data-parallel shards): none has these shapes
WEIGHT_SHAPES = {(48, 48), (24, 48), (48, 24), (12, 48)}


@pytest.mark.parametrize("name", list(MESH_METHODS))
def test_accumulating_on_a_mesh_trains_like_the_whole_batch(name, mlp_whole_batch):
    result = _train(*_mlp(), MESH_METHODS[name])
    assert result[2].spmd_mode == "shard_map"  # every method runs per device when it accumulates
    _assert_trains_like(result, mlp_whole_batch)
    hlo = result[2].hlo_text()[0]
    weight_collectives = [c for c in collectives(hlo) if any(shape in WEIGHT_SHAPES for _, shape in c.shapes)]
    looped = [c.line for c in weight_collectives if c.in_loop]
    if name == "zero3":  # it keeps only its gradient shard: reduce-scattered in every micro-batch
        assert looped and all("reduce-scatter" in line for line in looped), looped
        return
    assert not looped, looped  # no weight gradient is reduced inside the micro-batch loop
    if name in ("dp", "megatron"):  # … but once per step, after it (an all-reduce over the data-parallel axis)
        reduced = sum(c.elements for c in weight_collectives if c.kind == "all-reduce")
        assert reduced == 4 * 48 * 48 // (2 if name == "megatron" else 1)
    if name == "zero2":
        assert sorted(shape for c in weight_collectives if c.kind == "reduce-scatter" for _, shape in c.shapes) == \
            [(12, 48)] * 4


class _NormedMLP(torch.nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.fc1 = torch.nn.Linear(width, width)
        self.norm = torch.nn.BatchNorm1d(width)
        self.fc2 = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.fc2(torch.relu(self.norm(self.fc1(x)))), y)


def test_buffers_see_the_micro_batches_in_turn_as_in_a_pytorch_accumulation_loop():
    """Micro-batch ``m`` holds rows ``m, m+M, …``; batch norm normalizes each by its own statistics and updates its
    running statistics once per micro-batch, exactly what PyTorch does in an accumulation loop over them."""
    torch.manual_seed(0)
    model = _NormedMLP()
    batch = (torch.randn(16, 16), torch.randn(16, 16))
    reference = _NormedMLP()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_losses = []
    for _ in range(3):
        optimizer.zero_grad()
        losses = []
        for m in range(MICRO):
            loss = reference(batch[0][m::MICRO], batch[1][m::MICRO])
            (loss / MICRO).backward()
            losses.append(loss.item())
        optimizer.step()
        ref_losses.append(sum(losses) / MICRO)
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                              method=torchpar.DataParallel(mesh_shape=(1, 1), num_micro_batches=MICRO))
    losses = [engine.step(batch).item() for _ in range(3)]
    engine.sync_to_torch()
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=0)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_the_plan_prices_compute_per_micro_batch_and_the_gradient_sync_once():
    """The plan of ``M`` micro-batches of ``b`` rows against the plan of one batch of ``b`` rows: ``M`` times the
    compute; a data-parallel plan's communication (its gradient all-reduce) once, ZeRO-3's (parameters gathered
    and gradients reduce-scattered in every micro-batch) ``M`` times."""
    model, (x, y) = _mlp(rows=16)
    optimizer = torch.optim.AdamW(model.parameters())
    whole = (torch.cat([x] * MICRO), torch.cat([y] * MICRO))

    def stage(method, batch):
        plan = torchpar.plan(model, optimizer, example_batch=batch, method=method)  # explained: bytes by kind
        return plan, plan.stages[0]

    for method in (torchpar.DataParallel, torchpar.Zero3Parallel):
        _, once = stage(method(mesh_shape=(1, 4)), (x, y))
        plan, accumulated = stage(method(mesh_shape=(1, 4), num_micro_batches=MICRO), whole)
        assert plan.num_micro_batches == MICRO and plan.estimated_step_s == accumulated.estimated_cost_s
        assert accumulated.estimated_compute_s == pytest.approx(MICRO * once.estimated_compute_s, rel=1e-9)
        # bytes: the seconds also hold each collective's latency, and the loss is reduced in every micro-batch
        ratio = sum(accumulated.communication_bytes.values()) / sum(once.communication_bytes.values())
        assert ratio == pytest.approx(1.0 if method is torchpar.DataParallel else MICRO, rel=1e-3)
        assert accumulated.estimated_memory_bytes == once.estimated_memory_bytes  # one micro-batch's activations


def test_a_batch_that_does_not_split_into_the_micro_batches_is_named():
    model, (x, y) = _mlp(rows=30)
    with pytest.raises(ValueError, match=r"batch leaf 0 of shape \[30, 48\].*not a multiple of num_micro_batches=4"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=(x, y),
                         method=torchpar.DataParallel(mesh_shape=(1, 1), num_micro_batches=MICRO))
    with pytest.raises(ValueError, match="num_micro_batches must be an int ≥ 1"):
        torchpar.ShardParallel(num_micro_batches=0)

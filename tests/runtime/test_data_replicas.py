"""Data replicas of a 2-D plan (``ShardParallel(mesh_shape=(data, d0, d1))``): what the plan and the compiled step
hold, and what is refused (batch statistics; a loss that does not combine from the replicas'). Their training against PyTorch is tested beside the other losses
(``test_loss_reduction.py``: sum, mean and token mean, with and without micro-batches) and on GPT-2 split over
data × context × tensor (``test_context_parallel.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchpar
from torchpar.report.hlo import collectives
from torchpar.report.layout import device_grid


@pytest.fixture(scope="module", autouse=True)
def session_cluster():
    torchpar.init(cluster="local", num_devices=8)


class _MLP(torch.nn.Module):
    def __init__(self, norm: bool = False):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.norm = torch.nn.BatchNorm1d(32) if norm else torch.nn.Identity()
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.fc2(torch.relu(self.norm(self.fc1(x)))), y)


def _batch():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(16, 8, generator=generator), torch.randint(0, 4, (16,), generator=generator)


def test_the_plan_is_replicas_of_a_two_d_plan_and_the_step_syncs_them_once():
    torch.manual_seed(0)
    model, batch = _MLP(), _batch()
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                              method=torchpar.ShardParallel(mesh_shape=(2, 1, 4)))
    with engine:
        engine.step(batch)
        stage = engine.plan.stages[0]
        assert (stage.data_replicas, tuple(stage.logical_mesh_shape), stage.devices()) == (2, (1, 4), list(range(8)))
        assert "2 data × (1, 4)" in engine.plan.summary()
        assert "all-reduce over 2 data replicas" in engine.plan.solver["estimate"]["step_formula"]
        loaded = torchpar.Plan.from_json(engine.plan.to_json())
        assert loaded.stages[0].data_replicas == 2
        torch.manual_seed(0)
        again = _MLP()
        with torchpar.compile(again, torch.optim.SGD(again.parameters(), lr=0.1), example_batch=batch,
                              method=loaded) as replayed:  # a saved plan trains its replicas the same way
            first = replayed.step(batch).item()
        grid = device_grid(engine.plan)  # the report's device grid: (replica, row, column)
        assert [cell.mesh_coord for cell in grid.cells][3:6] == [(0, 0, 3), (1, 0, 0), (1, 0, 1)]
        # the replicas' gradients are summed across them (device i with i + 4), once per step
        across = [c for c in collectives(engine.hlo_text()[0])
                  if c.kind == "all-reduce" and sorted(map(sorted, c.groups)) == [[i, i + 4] for i in range(4)]]
        assert across
        engine.sync_to_torch()
        torch.testing.assert_close(engine.forward(batch), model(*batch), rtol=1e-6, atol=1e-6)
    torch.manual_seed(0)
    fresh = _MLP()
    torch.testing.assert_close(first, fresh(*batch).item(), rtol=1e-6, atol=0)


def test_a_model_with_batch_statistics_is_refused():
    """BatchNorm normalizes by the batch's statistics: each replica would see only its rows."""
    torch.manual_seed(0)
    model, batch = _MLP(norm=True), _batch()
    with pytest.raises(ValueError, match=r"2 data replicas .* updates buffers \(norm\.running_mean"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                         method=torchpar.ShardParallel(mesh_shape=(2, 2, 2)))


class _WithBatchStatistic(_MLP):
    """Cross-entropy plus a penalty on the batch's mean activation (a product of batch means, like a mixture of
    experts' load-balancing loss): not a sum of the replicas' losses."""

    def forward(self, x, y):
        hidden = torch.relu(self.fc1(x))
        return F.cross_entropy(self.fc2(hidden), y) + 0.1 * (hidden.mean(0) ** 2).sum()


def test_a_loss_that_is_not_made_of_the_replicas_losses_is_refused():
    torch.manual_seed(0)
    model, batch = _WithBatchStatistic(), _batch()
    with pytest.raises(ValueError, match=r"2 data replicas .* the whole batch's loss is not made of the replicas'"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                         method=torchpar.ShardParallel(mesh_shape=(2, 2, 2)))


def test_only_shard_parallel_takes_a_data_axis():
    assert torchpar.ShardParallel(mesh_shape=(2, 2, 2)).mesh_shape == (2, 2, 2)
    with pytest.raises(ValueError, match="two positive ints"):
        torchpar.DataParallel(mesh_shape=(2, 2, 2))
    with pytest.raises(ValueError, match=r"three \(data, d0, d1\)"):
        torchpar.ShardParallel(mesh_shape=(2, 0, 2))

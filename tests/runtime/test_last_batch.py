"""An epoch's last batch: a ``DataLoader`` whose last batch is smaller — 100 samples in batches of 16 or 24 leave 4
rows; 98 samples leave 2, which do not split over a 4-way data axis (DataParallel and ZeRO shard the batch by
construction; ShardParallel and the pipeline's stages keep this tiny model's batch whole) — trains under every
method as PyTorch trains on the same batches, for two epochs. Each new batch shape compiles its step once under
the same plan (:mod:`torchpar.engine.compiled`); a batch that does not split evenly runs under GSPMD with its leaves whole
on entry (:func:`torchpar.runtime.arrays.fitting`)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import torchpar

WIDTH, EPOCHS = 8, 2
RTOL, ATOL = 1e-5, 1e-6
"""float32 sums in another order (sharded reductions): relative error of a few ulps per step."""


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(WIDTH, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x, y):
        h = torchpar.mark_pipeline_boundary(torch.tanh(self.fc1(x)))
        return F.mse_loss(self.fc2(h), y)


def _pipeline() -> torchpar.PipeshardParallel:
    stages = torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)),
                                        submesh_physical_shapes=((1, 4), (1, 4)),
                                        submesh_logical_shapes=((1, 4), (1, 4)))
    return torchpar.PipeshardParallel(num_micro_batches=2, layer_option="manual", stage_option=stages)


METHODS = {
    "dp": lambda: torchpar.DataParallel(mesh_shape=(1, 4)),
    "zero2": lambda: torchpar.Zero2Parallel(mesh_shape=(1, 4)),
    "shard": lambda: torchpar.ShardParallel(mesh_shape=(1, 4)),
    "pipeshard": _pipeline,
    "dp-accumulating": lambda: torchpar.DataParallel(mesh_shape=(1, 4), num_micro_batches=2),
}
CASES = [(method, samples, 16) for method in METHODS for samples in (100, 98)] + [("dp", 100, 24)]
"""Under gradient accumulation the last 4 rows split over the devices but their 2-row micro-batches do not."""


def _loader(samples: int, batch_size: int) -> DataLoader:
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(samples, WIDTH, generator=generator), torch.randn(samples, 4, generator=generator))
    return DataLoader(data, batch_size=batch_size, shuffle=False)


@pytest.mark.parametrize("method, samples, batch_size", CASES, ids=[f"{m}-{n}by{b}" for m, n, b in CASES])
def test_every_batch_of_two_epochs_trains_as_pytorch(method, samples, batch_size):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    torch_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    loader = _loader(samples, batch_size)
    assert samples % batch_size, "the case needs a smaller last batch"
    engine = torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), example_batch=next(iter(loader)),
                              method=METHODS[method]())
    losses, expected = [], []
    if method in ("dp", "zero2", "dp-accumulating"):  # the uneven last batch meets a batch-sharded plan
        assert all(spec[0] == [1] for spec in engine.plan.stages[0].inputs.values())
    with engine:
        for _ in range(EPOCHS):
            for x, y in loader:
                torch_optimizer.zero_grad()
                loss = reference(x, y)
                loss.backward()
                torch_optimizer.step()
                expected.append(loss.item())
                losses.append(engine.step((x, y)).item())
        assert engine.compiled_signatures == 2  # the full batches' step and the last batch's, each compiled once
        engine.sync_to_torch()
    torch.testing.assert_close(losses, expected, rtol=RTOL, atol=ATOL)
    for name, value in model.named_parameters():
        torch.testing.assert_close(value, dict(reference.named_parameters())[name], rtol=RTOL, atol=ATOL, msg=name)


def test_a_sharding_that_does_not_split_a_shape_leaves_those_dims_whole():
    import jax
    import numpy as np

    from torchpar.runtime.arrays import fitting, put, put_batch

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("d0", "d1"))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("d0", "d1"), None))
    assert fitting(rows, (8, 3)) is rows
    assert fitting(rows, (6, 3)).spec == jax.sharding.PartitionSpec(None, None)
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d0", "d1"))
    assert fitting(sharding, (3, 6)).spec == jax.sharding.PartitionSpec(None, "d1")
    assert fitting(sharding, (4, 3)).spec == jax.sharding.PartitionSpec("d0", None)
    value = np.arange(9.0).reshape(3, 3)
    np.testing.assert_array_equal(np.asarray(put_batch(value, sharding)), value)
    with pytest.raises(ValueError):  # the state is placed as the plan says, or not at all
        put(value, sharding)


def test_micro_batches_that_cannot_split_over_the_devices_are_named():
    model = Net()
    batch = (torch.randn(8, WIDTH), torch.randn(8, 4))
    with pytest.raises(ValueError, match=r"num_micro_batches=4 micro-batches: the batch's 8 rows must be a multiple of "
                                         r"4 micro-batches × 4 devices = 16"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                         method=torchpar.DataParallel(mesh_shape=(1, 4), num_micro_batches=4))

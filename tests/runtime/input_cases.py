"""Shared set-up of the input-pipeline tests: a classifier dataset with an epoch's smaller last batch, the
classifier and its step, and the reference ``DataLoader`` order a host-loaded run must follow."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import torchpar

SEED = 3
BATCH = 16


class Points(torch.utils.data.Dataset):
    """100 points of 16 features in 4 classes (100 = 6 batches of 16 and one of 4); ``broken`` makes sample
    ``broken`` raise, as a missing file would."""

    def __init__(self, n: int = 100, broken: int | None = None):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 16, generator=generator)
        self.y = torch.randint(0, 4, (n,), generator=generator)
        self.broken = broken

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index == self.broken:
            raise FileNotFoundError(f"shard-{index}.bin")
        return self.x[index], self.y[index]


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.relu(self.layers[0](x)))


def step_fn(model: torch.nn.Module, batch) -> torch.Tensor:
    return F.cross_entropy(model(batch[0]), batch[1])


def loader(dataset: torch.utils.data.Dataset, drop_last: bool) -> torch.utils.data.DataLoader:
    """The order one process sees: what ``HostData(dataset, BATCH, seed=SEED, drop_last=...)`` must reproduce."""
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, drop_last=drop_last,
                                       generator=torch.Generator().manual_seed(SEED))


def example(dataset: torch.utils.data.Dataset):
    return torch.utils.data.default_collate([dataset[i] for i in range(BATCH)])


def driver_fed_losses(method, dataset, drop_last: bool, epochs: int = 2) -> list[float]:
    model = Classifier()
    batches = loader(dataset, drop_last)  # one loader for every epoch: its generator moves on between them
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=example(dataset),
                          step_fn=step_fn, method=method) as engine:
        return [engine.step(batch).item() for _ in range(epochs) for batch in batches]


def host_loaded(method, dataset, drop_last: bool):
    model = Classifier()
    return torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), step_fn=step_fn, method=method,
                            data=torchpar.HostData(dataset, batch_size=BATCH, seed=SEED, drop_last=drop_last))


def two_stage_pipeline(devices_per_stage: int = 2) -> torchpar.PipeshardParallel:
    stages = torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)),
                                        submesh_physical_shapes=((1, devices_per_stage),) * 2,
                                        submesh_logical_shapes=((1, devices_per_stage),) * 2)
    return torchpar.PipeshardParallel(num_micro_batches=2, layer_option=torchpar.AutoLayerOption(layer_num=2),
                                      stage_option=stages)

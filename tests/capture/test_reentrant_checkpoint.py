"""Activation checkpointing written with ``torch.utils.checkpoint`` trains as the uncheckpointed model, reentrant
or not: the reentrant one's no-grad forward runs inline while the step is captured
(:func:`torchpar.capture.checkpointing.reentrant_checkpoints_inline`) instead of stopping the gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import torchpar

CHECKPOINT_FUNCTION = torch.utils.checkpoint.CheckpointFunction


class Blocks(nn.Module):
    def __init__(self, reentrant: bool | None):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(2)])
        self.head = nn.Linear(8, 1)
        self.reentrant = reentrant

    def forward(self, x):
        for block in self.blocks:
            x = x + (block(x) if self.reentrant is None else checkpoint(block, x, use_reentrant=self.reentrant))
        return self.head(x).pow(2).mean()


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("method", [None, "data_parallel"])
def test_checkpointed_blocks_train_as_the_uncheckpointed_model(reentrant, method):
    model, reference = Blocks(reentrant), Blocks(None)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 8, generator=generator) for _ in range(3)]
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    method = torchpar.DataParallel(mesh_shape=(1, 4)) if method else None
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), example_batch=batches[0],
                          method=method) as engine:
        for batch in batches:
            optimizer.zero_grad()
            expected = reference(batch)
            expected.backward()
            optimizer.step()
            assert engine.step(batch).item() == pytest.approx(expected.item(), rel=1e-6)
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # only the capture ran the checkpoint inline: PyTorch's reentrant checkpoint is back in place
    assert torch.utils.checkpoint.CheckpointFunction is CHECKPOINT_FUNCTION

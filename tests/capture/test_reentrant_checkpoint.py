"""Activation checkpointing written with ``torch.utils.checkpoint`` trains as the uncheckpointed model, reentrant
or not: the reentrant one's no-grad forward runs inline while the step is captured
(:func:`torchpar.capture.semantics.remat.reentrant_checkpoints_inline`) instead of stopping the gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tests.capture.beside_pytorch import assert_trains_as_pytorch

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
@pytest.mark.parametrize("method", [None, "data_parallel", "pipeline"])
def test_checkpointed_blocks_train_as_the_uncheckpointed_model(reentrant, method):
    model, reference = Blocks(reentrant), Blocks(None)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 8, generator=generator) for _ in range(3)]
    assert_trains_as_pytorch(model, reference, batches,
                             lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                             method=method)
    # only the capture ran the checkpoint inline: PyTorch's reentrant checkpoint is back in place
    assert torch.utils.checkpoint.CheckpointFunction is CHECKPOINT_FUNCTION

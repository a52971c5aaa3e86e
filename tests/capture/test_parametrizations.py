"""``torch.nn.utils.parametrizations`` (spectral norm with its power-iteration buffers, weight norm, orthogonal by
the matrix exponential) and the losses that compare rows (triplet margin, cosine embedding, InfoNCE over
``F.normalize``d rows) train as PyTorch, on one device and under DataParallel (whose step is the whole batch's: a loss
mixing rows sees every row, as in one PyTorch process)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrizations

from tests.capture.beside_pytorch import assert_trains_as_pytorch

PARAMETRIZED = {"spectral_norm": parametrizations.spectral_norm, "weight_norm": parametrizations.weight_norm,
                "orthogonal": parametrizations.orthogonal, "none": lambda module: module}


class Embedder(nn.Module):
    def __init__(self, parametrize: str, loss: str):
        super().__init__()
        torch.manual_seed(0)
        self.lin = PARAMETRIZED[parametrize](nn.Linear(6, 6))
        self.loss = loss

    def forward(self, x):
        y = self.lin(x)
        if self.loss == "triplet":
            return F.triplet_margin_loss(y[:4], y[4:8], y[8:12])
        if self.loss == "cosine":
            return F.cosine_embedding_loss(y[:6], y[6:], torch.ones(6))
        if self.loss == "infonce":  # every row against every other: under DataParallel the whole batch's rows
            z = F.normalize(y, dim=-1)
            return F.cross_entropy(z[:6] @ z[6:].T / 0.1, torch.arange(6))
        return y.pow(2).mean()


@pytest.mark.parametrize("parametrize, loss", [("spectral_norm", "square"), ("weight_norm", "square"),
                                               ("orthogonal", "square"), ("none", "triplet"), ("none", "cosine"),
                                               ("none", "infonce")])
@pytest.mark.parametrize("method", [None, "data_parallel"])
def test_parametrized_layers_and_embedding_losses_train_as_pytorch(parametrize, loss, method):
    model = Embedder(parametrize, loss)
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(12, 6, generator=generator) for _ in range(3)]
    assert_trains_as_pytorch(model, reference, batches, lambda params: torch.optim.SGD(params, lr=0.1),
                             method=method)

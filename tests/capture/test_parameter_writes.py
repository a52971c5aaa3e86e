"""Writes into a parameter inside ``forward`` — ``nn.Embedding(max_norm=...)``'s ``embedding_renorm_``, a
``p.data.clamp_()`` — are refused at capture, naming the op, the parameter and the line: torch.export leaves them
out of the program, so the step would silently train something else (the embedding's loss differed from step 0)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchpar
from torchpar.capture.errors import CaptureError


class Lookup(nn.Module):
    def __init__(self, max_norm: float | None):
        super().__init__()
        self.emb = nn.Embedding(10, 4, max_norm=max_norm)

    def forward(self, ids):
        return self.emb(ids).pow(2).mean()


class Clamped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.fc.weight.data.clamp_(-0.1, 0.1)  # a weight clip written where WGAN code keeps it
        return self.fc(x).pow(2).mean()


@pytest.mark.parametrize("method", [None, "data_parallel"])
def test_an_embedding_with_max_norm_is_refused_by_name(method):
    model = Lookup(max_norm=1.0)
    method = torchpar.DataParallel(mesh_shape=(1, 2)) if method else None
    with pytest.raises(CaptureError, match=r"(?s)writes into the parameter 'emb.weight' in place.*"
                                           r"test_parameter_writes.py:\d+ in forward.*aten.embedding_renorm_"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randint(0, 10, (8, 3)),
                         method=method)


def test_a_clamp_of_weight_data_in_forward_is_refused_by_name():
    model = Clamped()
    with pytest.raises(CaptureError, match=r"(?s)writes into the parameter 'fc.weight'.*aten.clamp_"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(8, 4))


def test_an_embedding_without_max_norm_trains():
    model = Lookup(max_norm=None)
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          example_batch=torch.randint(0, 10, (8, 3))) as engine:
        assert torch.isfinite(engine.step(torch.randint(0, 10, (8, 3))))

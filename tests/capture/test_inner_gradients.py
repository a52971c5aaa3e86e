"""A gradient taken inside the step — WGAN-GP's penalty with ``torch.autograd.grad(create_graph=True)``, an R1
penalty with ``torch.func.grad`` — is refused at compile naming the call's line (torchpar differentiates the step
once); before, torch.export stopped with its own internal message and no line of the model's code."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import torchpar
from torchpar.capture.errors import CaptureError


class Critic(nn.Module):
    def __init__(self, penalty: str):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.penalty = penalty

    def forward(self, x):
        if self.penalty == "autograd":  # WGAN-GP
            x = x.clone().requires_grad_(True)
            out = self.net(x)
            g, = torch.autograd.grad(out.sum(), x, create_graph=True)
        else:  # R1 with torch.func
            out = self.net(x)
            g = torch.func.grad(lambda y: self.net(y).sum())(x)
        return out.mean() + 10 * ((g.norm(2, dim=1) - 1) ** 2).mean()


@pytest.mark.parametrize("penalty", ["autograd", "func"])
def test_a_gradient_penalty_is_refused_naming_its_line(penalty):
    model = Critic(penalty)
    with pytest.raises(CaptureError, match=r"(?s)takes a gradient inside itself.*test_inner_gradients.py:\d+.*"
                                           r"differentiating twice"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(8, 4))
    assert torch.autograd.grad(model.net(torch.ones(1, 4, requires_grad=True)).sum(), model.net[0].weight)  # restored

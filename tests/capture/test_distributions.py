"""``torch.distributions`` in a training step (a VAE's reparameterised sample, a policy's Laplace noise): built with
PyTorch's default validation, captured with it off (:mod:`torchpar.capture.semantics.distributions`), sampled with
torchpar's PRNG. The deterministic parts equal PyTorch's; the samples have PyTorch's statistics."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import torchpar
from tests.capture.beside_pytorch import assert_trains_as_pytorch


class Encoder(nn.Module):
    """``z ~ Normal(mu(x), exp(log_std(x)))`` by ``rsample``; the loss reads ``z``."""

    def __init__(self, log_std_bias: float, distribution: str = "normal"):
        super().__init__()
        torch.manual_seed(0)
        self.mu, self.log_std = nn.Linear(4, 3), nn.Linear(4, 3)
        nn.init.constant_(self.log_std.bias, log_std_bias)
        self.distribution = distribution

    def sample(self, x):
        mu, std = self.mu(x), self.log_std(x).exp()
        if self.distribution == "laplace":
            return mu, std, torch.distributions.Laplace(mu, std).rsample()
        return mu, std, torch.distributions.Normal(mu, std).rsample()

    def forward(self, x):
        mu, std, z = self.sample(x)
        kl = (0.5 * (mu.pow(2) + std.pow(2)) - std.log() - 0.5).sum(-1).mean()
        return z.pow(2).mean() + 0.1 * kl


@pytest.mark.parametrize("method", [None, "data_parallel"])
def test_the_deterministic_part_of_a_vae_step_is_pytorchs(method):
    """A scale of e^-30: the sample is the mean to float precision, so every step's loss and update is
    deterministic, and equals PyTorch's."""
    model = Encoder(log_std_bias=-30.0)
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 4, generator=generator) for _ in range(3)]
    assert_trains_as_pytorch(model, reference, batches, lambda params: torch.optim.SGD(params, lr=0.05),
                             method=method)


class Standardized(Encoder):
    """The loss is the mean of ((z − mu) / std)²: 1 in expectation for a Normal, 2 for a Laplace."""

    def forward(self, x):
        mu, std, z = self.sample(x)
        return ((z - mu) / std).pow(2).mean()


@pytest.mark.parametrize("distribution, expected", [("normal", 1.0), ("laplace", 2.0)])
def test_samples_have_pytorchs_statistics(distribution, expected):
    model = Standardized(log_std_bias=0.5, distribution=distribution)
    batch = torch.randn(4096, 4, generator=torch.Generator().manual_seed(2))
    assert model(batch).item() == pytest.approx(expected, rel=0.1)  # PyTorch's own draw
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.0), example_batch=batch) as engine:
        losses = [engine.step(batch).item() for _ in range(2)]
    # 12,288 draws: the standard error of the mean square is 1.3 % (Normal) and 2.0 % (Laplace); 10 % is 5+ of them
    assert all(loss == pytest.approx(expected, rel=0.1) for loss in losses)
    assert losses[0] != losses[1]  # each step draws anew

"""PyTorch's training semantics on the Ray runtime (issue 27; ``docs/semantics.md``): a 2-stage pipeline over two
simulated hosts whose step holds a ``detach``, a custom ``autograd.Function`` (gradient reversal) and a token-mean
cross-entropy with uneven ``-100`` counts over 2 micro-batches, and whose model is partly frozen after the first step
(the engine recompiles on the host actors), trains like PyTorch's whole-batch step: losses and parameters within
1e-6 over 3 steps."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torchpar
from tests.capture.test_autograd_functions import GradReverse
from tests.runtime.ray_helpers import ray_cluster

TOL = 1e-6


class TokenNet(torch.nn.Module):
    def __init__(self, vocab: int = 16, width: int = 8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids, labels):
        h = torch.tanh(self.a(self.embed(ids)))
        h = h + GradReverse.apply(self.b(h.detach()))  # b learns reversed; a gets nothing through b
        h = torchpar.mark_pipeline_boundary(h)
        logits = self.head(h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _freeze_a_after_first_step(model: torch.nn.Module, step: int) -> None:
    if step == 1:
        model.a.requires_grad_(False)


def test_pipeline_on_two_hosts_trains_with_pytorchs_semantics():
    torch.manual_seed(0)
    model = TokenNet()
    ids = torch.randint(0, 16, (8, 6))
    labels = torch.randint(0, 16, (8, 6))
    labels[:4, 1:] = -100  # rows 0-3 keep one token each, rows 4-7 all six: uneven counts per micro-batch
    batch = (ids, labels)
    reference = copy.deepcopy(model)
    optimizer = lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)  # noqa: E731
    ref_opt = optimizer(reference)
    method = torchpar.PipeshardParallel(
        num_micro_batches=2, layer_option="manual",
        stage_option=torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)),
                                                submesh_physical_shapes=((1, 1), (1, 1)),
                                                submesh_logical_shapes=((1, 1), (1, 1))))
    with ray_cluster(num_hosts=2, devices_per_host=1):
        with torchpar.compile(model, optimizer(model), example_batch=batch, method=method) as engine:
            for step in range(3):
                _freeze_a_after_first_step(model, step)
                _freeze_a_after_first_step(reference, step)
                ref_opt.zero_grad()
                expected = reference(*batch)
                expected.backward()
                ref_opt.step()
                assert engine.step(batch) == pytest.approx(expected.item(), rel=TOL, abs=TOL), f"step {step}"
            engine.sync_to_torch()
    for (name, want), got in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, msg=name)

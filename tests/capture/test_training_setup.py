"""The snapshot of what a compiled step depends on (``torchpar/capture/training_setup.py``), taken in one walk of
the module tree: the same modes, parameter names and order, and param-group names as PyTorch's own
``named_modules()`` / ``named_parameters()`` give, for tied weights, absent biases and a parameter the model does not
own; and a change of each kind is described."""

from __future__ import annotations

import torch

from torchpar.capture.training_setup import describe_changes, training_setup


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.Dropout(0.1), torch.nn.Linear(4, 4))
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, named once (as embed.weight)
        self.shared = self.body[0]  # one module under two names


def _torch_view(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple:
    names = {id(p): n for n, p in model.named_parameters()}
    return (
        tuple((n, m.training) for n, m in model.named_modules()),
        tuple((n, p.requires_grad) for n, p in model.named_parameters()),
        tuple(tuple(names.get(id(p), "?") for p in g["params"]) for g in optimizer.param_groups),
    )


def test_one_walk_sees_what_pytorchs_walks_see():
    model = Tied()
    stranger = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([{"params": list(model.parameters())}, {"params": [stranger]}], lr=0.1)
    model.body[1].eval()
    model.body[2].bias.requires_grad_(False)
    setup = training_setup(model, optimizer)
    assert (setup.modes, setup.requires_grad, setup.param_groups) == _torch_view(model, optimizer)
    assert setup.param_groups[1] == ("?",)


def test_changes_are_described():
    model = Tied()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = training_setup(model, optimizer)
    model.eval()
    model.body[0].weight.requires_grad_(False)
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    changes = describe_changes(before, training_setup(model, optimizer))
    assert len(changes) == 3
    assert changes[0].startswith("module mode <model> eval") and "body.0.weight=False" in changes[1]
    assert "optimizer param groups (1 groups" in changes[2]

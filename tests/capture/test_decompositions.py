"""The core-ATen decomposition with its table split once per process (torchpar/capture/decompositions.py) gives the
graph ``ExportedProgram.run_decompositions`` gives, op by op, and a newly registered op makes it split again."""

from __future__ import annotations

import pytest
import torch

from torchpar.capture import decompositions
from torchpar.capture.export import capture_train_step
from torchpar.harness import zoo


def _ops(graph) -> list[tuple]:
    return [(n.name, n.target, repr(n.args), repr(n.kwargs), repr(n.out)) for n in graph.nodes]


@pytest.mark.parametrize(("family", "overrides", "dropout", "autocast"), [
    ("gpt2", {"n_layer": 2}, 0.1, None),  # dropout in train mode: random ops
    ("llama", {"num_hidden_layers": 2}, 0.0, torch.bfloat16),  # autocast casts; attention kept whole
    ("resnet", {}, 0.0, None),  # BatchNorm's running statistics: mutated buffers
    ("mixtral", {"num_hidden_layers": 1}, 0.0, None),  # routing, grouped expert matmuls
])
def test_the_cached_split_gives_run_decompositions_graph(family, overrides, dropout, autocast, monkeypatch):
    assert decompositions._private_functions() is not None, "this torch takes the cached path"
    model, batch = zoo.build(family, overrides, batch_size=2, seq_len=8, dropout=dropout)
    capture_train_step(model, batch, autocast=autocast)  # the first capture may register op namespaces: split again
    split = decompositions._cached[0]
    cached = capture_train_step(model, batch, autocast=autocast).graph
    assert decompositions._cached[0] is split, "the second capture reuses the split"
    monkeypatch.setattr(decompositions, "_private_functions", lambda: None)  # the public run_decompositions path
    public = capture_train_step(model, batch, autocast=autocast).graph
    assert _ops(cached) == _ops(public)
    assert cached.inputs == public.inputs and cached.outputs == public.outputs
    if family == "llama":
        assert any(n.target.startswith("aten.scaled_dot_product_attention") for n in cached.nodes)


def test_a_newly_registered_op_splits_the_table_again():
    """A custom op with a CompositeImplicitAutograd kernel registered after a capture changes the registry state: the
    next capture splits again, and decomposes the op as ``run_decompositions`` does (into its kernel's ops)."""
    batch = (torch.randn(2, 4), torch.randn(2, 4))

    def step(model, batch):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    capture_train_step(torch.nn.Linear(4, 4), batch, step_fn=step)
    before = decompositions._cached[0]
    library = torch.library.Library("torchpar_test_decomp", "FRAGMENT")
    library.define("twice(Tensor x) -> Tensor")
    library.impl("twice", lambda x: x * 2, "CompositeImplicitAutograd")

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            return torch.ops.torchpar_test_decomp.twice(self.linear(x))

    graph = capture_train_step(Twice(), batch, step_fn=step).graph
    assert decompositions._cached[0] is not before and decompositions._cached[0].state != before.state
    targets = [n.target for n in graph.nodes]
    assert not any("twice" in t for t in targets) and "aten.mul.Tensor" in targets

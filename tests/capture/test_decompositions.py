"""The core-ATen decomposition with its table split once per process (torchpar/capture/decompositions.py) gives the
graph ``ExportedProgram.run_decompositions`` gives, op by op, and a newly registered op makes it split again; a
program reduced once is not retraced again, and what it reuses is bound to the new export's own state."""

from __future__ import annotations

import contextlib
from collections import OrderedDict

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
    monkeypatch.setattr(decompositions, "_decomposed", OrderedDict())  # every capture here retraces
    monkeypatch.setattr(decompositions, "DECOMPOSED_KEPT", 0)
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


@pytest.fixture
def retraces(monkeypatch) -> list[int]:
    """The number of retraces :func:`decompositions.decompose` runs from here on (one entry each), nothing kept
    from earlier tests."""
    monkeypatch.setattr(decompositions, "_decomposed", OrderedDict())
    calls: list[int] = []
    retrace = decompositions._retraced

    def counted(*args):
        calls.append(1)
        return retrace(*args)

    monkeypatch.setattr(decompositions, "_retraced", counted)
    return calls


class _LSTMRegressor(torch.nn.Module):
    """A recurrent model (no transformer, no zoo family): an LSTM's last step regressed onto a target."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = torch.nn.LSTM(8, 8, batch_first=True)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return torch.nn.functional.mse_loss(self.head(out[:, -1]), y)


def _built(family: str, overrides: dict, dropout: float) -> tuple[torch.nn.Module, object]:
    if family == "lstm":
        return _LSTMRegressor(), (torch.randn(2, 5, 8), torch.randn(2, 1))
    return zoo.build(family, overrides, batch_size=2, seq_len=8, dropout=dropout)


@pytest.mark.parametrize(("family", "overrides", "dropout"), [
    ("gpt2", {"n_layer": 2}, 0.1),
    ("resnet", {}, 0.0),
    ("mixtral", {"num_hidden_layers": 1}, 0.0),
    ("lstm", {}, 0.0),
])
def test_a_model_captured_again_reuses_its_core_aten_graph(family, overrides, dropout, retraces, monkeypatch):
    """A second model of the same architecture on the same batch shapes (other weights) is not retraced, and its
    capture is the one a retrace gives: every op, input and output."""
    capture_train_step(*_built(family, overrides, dropout))
    before = len(retraces)
    model, batch = _built(family, overrides, dropout)
    reused = capture_train_step(model, batch).graph
    assert len(retraces) == before, "the second capture reused the first one's graph"
    monkeypatch.setattr(decompositions, "DECOMPOSED_KEPT", 0)
    monkeypatch.setattr(decompositions, "_decomposed", OrderedDict())
    retraced = capture_train_step(model, batch).graph
    assert len(retraces) == before + 1
    assert _ops(reused) == _ops(retraced)
    assert [(n.source, n.module_path) for n in reused.nodes] == [(n.source, n.module_path) for n in retraced.nodes]
    assert reused.inputs == retraced.inputs and reused.outputs == retraced.outputs


class _Scaled(torch.nn.Module):
    """A linear layer times a plain tensor attribute, which ``torch.export`` lifts as a constant."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.scale = torch.full((4,), scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def test_a_reused_graph_computes_with_the_new_exports_parameters_and_constants(retraces):
    x = torch.randn(2, 4)
    first, second = _Scaled(2.0), _Scaled(3.0)
    reduced_first = decompositions.decompose(torch.export.export(first, (x,)))
    reduced_second = decompositions.decompose(torch.export.export(second, (x,)))
    assert len(retraces) == 1
    assert list(reduced_second.constants.values())[0][0].item() == 3.0
    assert reduced_second.state_dict["linear.weight"] is second.linear.weight
    torch.testing.assert_close(reduced_second.module()(x), second(x), rtol=0, atol=0)
    torch.testing.assert_close(reduced_first.module()(x), first(x), rtol=0, atol=0)


def test_the_caller_owns_the_returned_graph(retraces):
    """A caller rewriting its graph in place (as the attention-mask folding does) changes no later capture's."""
    x = torch.randn(2, 4)
    model = _Scaled(2.0)
    reduced = decompositions.decompose(torch.export.export(model, (x,)))
    code = reduced.graph_module.code
    for node in reduced.graph.nodes:
        if node.target is torch.ops.aten.mul.Tensor:
            node.target = torch.ops.aten.add.Tensor
    again = decompositions.decompose(torch.export.export(model, (x,)))
    assert len(retraces) == 1 and again.graph is not reduced.graph
    assert again.graph_module.code == code
    torch.testing.assert_close(again.module()(x), model(x), rtol=0, atol=0)


@pytest.mark.parametrize("change", ["batch shape", "autocast", "no_grad", "another op"])
def test_what_the_retrace_depends_on_is_retraced_when_it_changes(change, retraces):
    x = torch.randn(2, 4)
    decompositions.decompose(torch.export.export(_Scaled(2.0), (x,)))
    model, ambient = _Scaled(2.0), contextlib.nullcontext()
    if change == "batch shape":
        x = torch.randn(3, 4)
    elif change == "autocast":
        ambient = torch.autocast("cpu", torch.bfloat16)
    elif change == "no_grad":
        ambient = torch.no_grad()
    else:
        model.forward = lambda x: model.linear(x) - model.scale
    with ambient:
        decompositions.decompose(torch.export.export(model, (x,)))
    assert len(retraces) == 2

"""Layers: cuts at pipeline boundaries and Alpa's operator clustering (torchpar/planner/pipeline/layers.py)."""

import itertools
import warnings

import numpy as np
import pytest
import torch

import torchpar
from torchpar.capture.export import capture_train_step
from torchpar.harness import zoo
from torchpar.planner.pipeline.layers import (  # the DP's inputs, for the brute-force check
    Layering,
    _entering_bytes,
    _units,
    cluster_layers,
    heavy_op_flops,
    manual_layers,
)

BATCH, WIDTH = 8, 32


class MarkedMLP(torch.nn.Module):
    """Three Linear layers with a pipeline boundary after the first two."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = torch.relu(layer(x))
            if index < 2:
                x = torchpar.mark_pipeline_boundary(x)
        return torch.nn.functional.mse_loss(x, y)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)


def _check_well_formed(layering: Layering, graph) -> None:
    ids = [layering.layer_of[n.name] for n in graph.nodes]
    assert len(ids) == len(graph.nodes) == len(layering.layer_of)
    assert ids[0] == 0 and ids[-1] == layering.num_layers - 1
    assert all(b - a in (0, 1) for a, b in zip(ids, ids[1:])), "layers are contiguous, in graph order"
    assert len(layering.flops) == len(layering.heavy_flops) == len(layering.boundary_bytes) == layering.num_layers
    assert sum(layering.flops) >= sum(layering.heavy_flops) > 0
    for layer, (start, end) in enumerate(layering.node_ranges):
        assert {layering.layer_of[n.name] for n in graph.nodes[start:end]} == {layer}


def _heavy_per_layer(layering: Layering, graph) -> list[int]:
    metas = graph.metas()
    return [sum(heavy_op_flops(n, metas) > 0 for n in graph.nodes[start:end]) for start, end in layering.node_ranges]


@pytest.fixture(scope="module")
def gpt2_graph():
    model, batch = zoo.build("gpt2", {"n_layer": 4}, batch_size=2, seq_len=16)
    return capture_train_step(model, batch).graph


def test_manual_layers_cut_after_each_boundary():
    graph = capture_train_step(MarkedMLP(), _batch()).graph
    layering = manual_layers(graph)
    _check_well_formed(layering, graph)
    assert layering.num_layers == 3
    assert _heavy_per_layer(layering, graph) == [1, 1, 1]
    boundaries = [n for n in graph.nodes if n.target == "torchpar.pipeline_boundary"]
    assert [layering.layer_of[n.name] for n in boundaries] == [0, 1]  # a boundary ends the layer before the cut
    for layer in (0, 1):  # each boundary node is the last node of its layer
        assert graph.nodes[layering.node_ranges[layer][1] - 1].target == "torchpar.pipeline_boundary"
    activation = BATCH * WIDTH * 4
    # layer 0 reads the batch input x; layer 1 the first boundary's output; layer 2 the second one and y.
    # Parameters are state, not activations, and never count.
    assert layering.boundary_bytes == (activation, activation, 2 * activation)
    assert "layer   2" in layering.summary()


def test_manual_layers_without_boundary_is_an_error():
    model, batch = zoo.build("mlp", {})
    graph = capture_train_step(model, batch).graph
    with pytest.raises(ValueError, match="mark_pipeline_boundary"):
        manual_layers(graph)


def test_cluster_mlp_one_matmul_per_layer():
    model, batch = zoo.build("mlp", {"depth": 4}, batch_size=BATCH)
    graph = capture_train_step(model, batch).graph
    layering = cluster_layers(graph, 4)
    _check_well_formed(layering, graph)
    assert layering.method == "cluster" and layering.num_layers == 4
    assert _heavy_per_layer(layering, graph) == [1, 1, 1, 1]
    assert len(set(layering.heavy_flops)) == 1


def test_cluster_gpt2_balances_flops(gpt2_graph):
    eps = 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the tiny LM head fits the cap: no relaxation
        layering = cluster_layers(gpt2_graph, 4, eps=eps)
    _check_well_formed(layering, gpt2_graph)
    assert layering.num_layers == 4
    mean = sum(layering.heavy_flops) / 4
    assert max(layering.heavy_flops) <= (1 + eps) * mean * (1 + 1e-9)
    assert min(layering.heavy_flops) > 0
    # attention counts as its two matmuls, not as its output size
    metas = gpt2_graph.metas()
    attention = next(n for n in gpt2_graph.nodes if "scaled_dot_product" in n.target)
    q = metas[next(attention.refs())]
    assert heavy_op_flops(attention, metas) == 2 * 2 * q.numel * q.shape[-2]  # Lk = Lq, Ev = E


def test_cluster_is_fast_and_deterministic(gpt2_graph):
    first = cluster_layers(gpt2_graph, 8)
    again = cluster_layers(gpt2_graph, 8)
    assert first.layer_of == again.layer_of
    assert first.solve_s < 0.5


def test_cluster_one_layer_and_too_many_layers(gpt2_graph):
    whole = cluster_layers(gpt2_graph, 1)
    assert whole.num_layers == 1 and whole.node_ranges == ((0, len(gpt2_graph.nodes)),)
    heavy = sum(heavy_op_flops(n, gpt2_graph.metas()) > 0 for n in gpt2_graph.nodes)
    with pytest.warns(UserWarning, match="layer by itself"):  # the MLP matmuls are > 1.5× a 1-op mean
        finest = cluster_layers(gpt2_graph, heavy)
    assert _heavy_per_layer(finest, gpt2_graph) == [1] * heavy
    with pytest.raises(ValueError, match=f"at most {heavy}"):
        cluster_layers(gpt2_graph, heavy + 1)
    with pytest.raises(ValueError):
        cluster_layers(gpt2_graph, 0)


def test_cluster_oversized_op_gets_its_own_layer_with_a_warning():
    # a wide LM head: its matmul alone is above (1+eps)·mean for 6 layers
    model, batch = zoo.build("gpt2", {"n_layer": 2, "vocab_size": 4096}, batch_size=2, seq_len=16)
    graph = capture_train_step(model, batch).graph
    with pytest.warns(UserWarning, match="layer by itself"):
        layering = cluster_layers(graph, 6, eps=0.2)
    _check_well_formed(layering, graph)
    assert _heavy_per_layer(layering, graph)[-1] == 1
    cap = 1.2 * sum(layering.heavy_flops) / 6
    assert all(f <= cap * (1 + 1e-9) for f in layering.heavy_flops[:-1])


def test_cluster_dp_matches_brute_force(gpt2_graph):
    """Over the units (one heavy op each), the DP's split is the lexicographic optimum of
    (max entering bytes, sum of entering bytes, Σ FLOPs²) among the splits within the FLOP cap, and its
    entering bytes agree with the independently computed ``Layering.boundary_bytes``."""
    metas = gpt2_graph.metas()
    heavy = [(i, f) for i, n in enumerate(gpt2_graph.nodes) if (f := heavy_op_flops(n, metas)) > 0]
    starts = _units(gpt2_graph, [i for i, _ in heavy])
    entering = _entering_bytes(gpt2_graph, starts)
    flops = np.array([f for _, f in heavy])
    num_layers, eps = 5, 0.5
    cap = (1 + eps) * flops.sum() / num_layers
    best = None
    for cuts in itertools.combinations(range(1, len(heavy)), num_layers - 1):
        bounds = [0, *cuts, len(heavy)]
        blocks = [(a, b - 1) for a, b in zip(bounds, bounds[1:])]
        layer_flops = [flops[a:b + 1].sum() for a, b in blocks]
        if any(f > cap and a != b for f, (a, b) in zip(layer_flops, blocks)):
            continue
        bytes_in = [entering[a, b] for a, b in blocks]
        key = (max(bytes_in), sum(bytes_in), sum(f * f for f in layer_flops))
        best = min(best or (key, cuts), (key, cuts))
    layering = cluster_layers(gpt2_graph, num_layers, eps=eps)
    chosen = tuple(starts.index(start) for start, _ in layering.node_ranges[1:])
    bytes_in = [entering[a, b] for a, b in zip((0, *chosen), (*(c - 1 for c in chosen), len(heavy) - 1))]
    assert (max(bytes_in), sum(bytes_in)) == best[0][:2]
    assert sum(f * f for f in layering.heavy_flops) == pytest.approx(best[0][2], rel=1e-9)
    assert tuple(bytes_in) == layering.boundary_bytes

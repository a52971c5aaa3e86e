"""Layouts replayed from a plan alone equal the solver graph's layouts under the solved choice."""

from __future__ import annotations

import pytest
import torch

from torchpar.capture.export import capture_train_step
from torchpar.cluster import ClusterSpec
from torchpar.harness import zoo
from torchpar.planner.intra_op import StageProblem, plan_stage
from torchpar.planner.plan import Plan
from torchpar.planner.sharding.layouts import ValueLayouts, replay_layouts

CLUSTER = ClusterSpec(num_hosts=1, devices_per_host=8)


def _problem(kind, trainable):
    return StageProblem(kind=kind, cluster=CLUSTER, trainable=trainable, optimizer_state_copies=2.0)


@pytest.mark.parametrize("kind", ["shard", "data_parallel", "zero3", "megatron"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_replayed_layouts_equal_the_solvers(family, kind):
    torch.manual_seed(0)
    model, batch = zoo.build(family, batch_size=8, seq_len=16)
    graph = capture_train_step(model, batch).graph
    trainable = {n for n, _ in model.named_parameters()}
    result = plan_stage(graph, _problem(kind, trainable), (2, 2))
    plan = Plan(method=kind, stages=[result.stage])
    stage = Plan.from_json(plan.to_json()).stages[0]  # from the serialized plan alone
    layouts = replay_layouts(graph, stage)
    choice = result.solution.choice
    compared = 0
    for name, layout in result.solver_graph.values.items():
        assert layouts.values[name] == layout.specs[choice[layout.root]], name
        compared += 1
    assert compared > len(graph.nodes) // 2


def test_data_parallel_layouts_split_the_batch_and_finish_the_loss_with_psums():
    torch.manual_seed(0)
    model, batch = zoo.build("gpt2", batch_size=8, seq_len=16)
    graph = capture_train_step(model, batch).graph
    result = plan_stage(graph, _problem("data_parallel", {n for n, _ in model.named_parameters()}), (2, 2))
    layouts = replay_layouts(graph, result.stage)
    assert not layouts.obstacles()
    anchors = [n for n in graph.nodes if n.name in result.stage.activations]
    assert anchors and all(layouts.values[n.name][0] == (0, 1) for n in anchors if n.out.shape[0] % 4 == 0)
    # cross-entropy's numerator and its count of unmasked labels, each summed over the split batch
    partial = {name: kind for name, (kind, axes) in layouts.partial.items()}
    assert sorted(partial.values()) == ["sum", "sum"]
    assert all(axes == (0, 1) for _, axes in layouts.partial.values())


def test_batch_norm_over_the_split_batch_averages_statistics_across_the_batch_axes():
    torch.manual_seed(0)
    model, batch = zoo.build("resnet", batch_size=8)
    graph = capture_train_step(model, batch).graph
    result = plan_stage(graph, _problem("data_parallel", {n for n, _ in model.named_parameters()}), (2, 2))
    layouts = replay_layouts(graph, result.stage)
    assert not layouts.obstacles()
    norms = [n.name for n in graph.nodes if n.target == "aten._native_batch_norm_legit_functional.default"]
    assert norms and {layouts.statistics_axes[name] for name in norms} == {(0, 1)}


def test_obstacles_are_grouped_by_reason():
    layouts = ValueLayouts(mesh_shape=(1, 4))
    for index in range(5):
        layouts.add_problem("aten.example.default has no per-device rule", f"example_{index}")
    layouts.add_problem("a buffer's new value is split across devices", "running_mean")
    assert layouts.obstacles() == [
        "aten.example.default has no per-device rule: example_0, example_1, example_2 and 2 more",
        "a buffer's new value is split across devices: running_mean"]


def test_a_tied_parameter_has_one_layout_in_the_plan():
    torch.manual_seed(0)
    model, batch = zoo.build("gpt2", batch_size=2, seq_len=16)
    graph = capture_train_step(model, batch).graph
    readers = [i.name for i in graph.inputs if i.target == "transformer.wte.weight"]
    assert len(readers) == 2  # the embedding and the LM head read one tensor
    result = plan_stage(graph, _problem("megatron", {n for n, _ in model.named_parameters()}), (1, 4))
    roots = {result.solver_graph.values[name].root for name in readers}
    assert len(roots) == 1

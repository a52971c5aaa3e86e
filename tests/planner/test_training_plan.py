"""The planner's one door: ``plan_training`` answers every method with the same shape — the plan and the stage
graphs its executor runs (none for a one-stage plan, one per stage for a pipeline) — and cuts a pipeline plan's
stages again out of the model captured on other batch shapes."""

from __future__ import annotations

import pytest
import torch

import torchpar
from torchpar.capture.export import capture_train_step
from torchpar.cluster import current_cluster
from torchpar.planner.plan import Plan
from torchpar.planner.training_plan import plan_training


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x, y):
        h = torchpar.mark_pipeline_boundary(torch.relu(self.fc1(x)))
        return torch.nn.functional.mse_loss(self.fc2(h), y)


def _graph(rows: int):
    torch.manual_seed(0)
    return capture_train_step(TwoLayers(), (torch.randn(rows, 8), torch.randn(rows, 1))).graph


PIPELINE = torchpar.PipeshardParallel(num_micro_batches=2, layer_option="manual", stage_option=torchpar.ManualStageOption(
    forward_stage_layer_ids=((0,), (1,)), submesh_physical_shapes=((1, 4), (1, 4)),
    submesh_logical_shapes=((1, 4), (1, 4))))
TRAINABLE = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


@pytest.mark.parametrize("method", [None, torchpar.DataParallel(mesh_shape=(1, 4)), torchpar.ShardParallel(mesh_shape=(2, 2)),
                                    PIPELINE], ids=["one-device", "dp", "shard", "pipeshard"])
def test_every_method_comes_back_as_a_plan_and_its_stage_graphs(method):
    graph = _graph(8)
    planned = plan_training(graph, method, current_cluster(), trainable=TRAINABLE, optimizer_state_copies=1)
    assert planned.graph is graph and planned.trainable == frozenset(TRAINABLE)
    assert planned.stage_graphs_for(graph) is None  # the planned graph: nothing new to cut
    if planned.plan.is_pipeline:
        assert [s.index for s in planned.stage_graphs] == list(range(len(planned.plan.stages))) == [0, 1]
        smaller = _graph(4)  # an epoch's last batch: the same plan cut out of the new capture
        cut = planned.stage_graphs_for(smaller)
        rows = {i.meta.shape[0] for stage in cut for i in stage.graph.inputs if i.kind == "input"}
        assert len(cut) == 2 and rows == {4}
    else:
        assert planned.stage_graphs == [] and len(planned.plan.stages) == 1
        assert planned.stage_graphs_for(_graph(4)) is None  # one stage: the executor compiles the whole graph


def test_a_saved_plan_is_taken_as_it_is_with_its_stages_cut_from_the_graph():
    graph = _graph(8)
    made = plan_training(graph, PIPELINE, current_cluster(), trainable=TRAINABLE, optimizer_state_copies=1)
    saved = Plan.from_json(made.plan.to_json())
    again = plan_training(graph, saved, current_cluster(), trainable=TRAINABLE, optimizer_state_copies=1, remat="layers")
    assert again.plan is saved and saved.remat == "layers"  # a remat option given at compile overrides the plan's
    assert [s.params for s in again.stage_graphs] == [s.params for s in made.stage_graphs]

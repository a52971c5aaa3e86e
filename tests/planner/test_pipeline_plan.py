"""Pipeline planning end to end on captured graphs: the stage DP's partitions, and slicing invariants."""

from __future__ import annotations

import pytest
import torch

import torchpar
from torchpar.capture.export import capture_train_step
from torchpar.cluster import ClusterSpec
from torchpar.planner.pipeline import pipeline_plan
from torchpar.planner.pipeline.pipeline_plan import plan_pipeline
from torchpar.planner.pipeline.slicing import slice_stages

# 2 hosts × 4 devices with a slow network (10 GB/s inner, 1 GB/s outer), where pipelining pays off
SLOW_NETWORK = ClusterSpec(num_hosts=2, devices_per_host=4, alpha=(1e-3, 1e-4), beta=(1e-8, 1e-9))
WIDTH, BATCH, MICRO = 1024, 512, 8


class Blocks(torch.nn.Module):
    """Blocks of ``depth[i]`` Linear+ReLU layers each, a pipeline boundary after every block."""

    def __init__(self, depths: list[int]):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(*[m for _ in range(d) for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())])
            for d in depths)

    def forward(self, x, y):
        for index, block in enumerate(self.blocks):
            x = block(x)
            if index < len(self.blocks) - 1:
                x = torchpar.mark_pipeline_boundary(x)
        return torch.nn.functional.mse_loss(x, y)


def _plan(depths: list[int], stage_option: str = "auto"):
    torch.manual_seed(0)
    model = Blocks(depths)
    micro_batch = (torch.randn(BATCH // MICRO, WIDTH), torch.randn(BATCH // MICRO, WIDTH))
    graph = capture_train_step(model, micro_batch).graph
    method = torchpar.PipeshardParallel(num_micro_batches=MICRO, layer_option="manual", stage_option=stage_option)
    return plan_pipeline(graph, method, SLOW_NETWORK, trainable={n for n, _ in model.named_parameters()},
                         optimizer_state_copies=2)


def test_equal_layers_get_equal_stages():
    stages = _plan([1, 1, 1, 1]).plan.stages
    assert len(stages) > 1
    assert len({len(s.layers) for s in stages}) == 1
    assert len({tuple(s.submesh_shape) for s in stages}) == 1


def test_a_layer_four_times_heavier_gets_more_devices_or_its_own_stage():
    stages = _plan([1, 1, 4, 1, 1]).plan.stages
    heavy = next(s for s in stages if 2 in s.layers)
    devices = lambda s: s.submesh_shape[0] * s.submesh_shape[1]  # noqa: E731
    assert heavy.layers == [2] or devices(heavy) > max(devices(s) for s in stages if s is not heavy)


def test_plan_reports_partition_runners_up_and_phase_timings():
    plan = _plan([1, 1, 1, 1]).plan
    assert plan.solver["stage_partition"]["stages"]
    assert plan.solver["runners_up"], "the alternatives the DP weighed are reported"
    for runner_up in plan.solver["runners_up"]:  # priced by the plan's own model (the ILP), never better
        # (or left unsolved once its proven bound showed it could not win)
        assert runner_up.get("estimated_step_s", runner_up.get("step_at_least_s")) >= plan.estimated_step_s - 1e-12
        assert runner_up["screening_step_s"] > 0
    assert {"cluster", "stage_dp", "ilp"} <= set(plan.timings)


@pytest.mark.parametrize("depths", [[1, 1, 1, 1], [1, 1, 4, 1, 1]])
def test_candidates_go_unsolved_only_when_they_cannot_win(depths, monkeypatch):
    """The refinement of the DP's candidates is a branch and bound: the plan is the one refining every candidate to
    the end gives, and each candidate it left unsolved carries a bound no better than the plan and no worse than
    what solving it gave."""
    pruned = _plan(depths).plan
    monkeypatch.setattr(pipeline_plan, "PRUNE_CANDIDATES", False)
    every = _plan(depths).plan
    assert pruned.estimated_step_s == every.estimated_step_s
    layout = lambda p: [(s.layers, s.submesh_shape, s.logical_mesh_shape) for s in p.stages]  # noqa: E731
    assert layout(pruned) == layout(every)

    def key(row: dict) -> tuple:
        return tuple((tuple(s["layers"]), tuple(s["submesh_shape"]), tuple(s["logical_mesh_shape"]))
                     for s in row["stages"])

    solved = {key(row): row["estimated_step_s"] for row in every.solver["runners_up"]}
    bounds = [row for row in pruned.solver["runners_up"] if "step_at_least_s" in row]
    assert bounds, "this case exercises the pruning"
    for row in bounds:
        assert every.estimated_step_s <= row["step_at_least_s"] <= solved[key(row)] * (1 + 1e-12)
    assert "(bound, not solved)" in pruned.summary()


def test_values_crossing_several_stages_pass_through_neighbours():
    class Skip(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))

        def forward(self, x):
            h = torchpar.mark_pipeline_boundary(self.a(x))
            k = torchpar.mark_pipeline_boundary(self.b(h))
            return (self.c(k) + h).sum()  # h is made in stage 0 and read in stage 2

    graph = capture_train_step(Skip(), torch.randn(4, 8)).graph
    from torchpar.planner.pipeline.layers import manual_layers
    from torchpar.planner.pipeline.slicing import stage_of_nodes

    layering = manual_layers(graph)
    stages = slice_stages(graph, stage_of_nodes(graph, layering.layer_of, [[0], [1], [2]]))
    for previous, current in zip(stages, stages[1:]):
        assert current.activation_inputs == previous.activation_outputs
    skipped = set(stages[0].activation_outputs) & set(stages[2].activation_inputs)
    assert skipped and skipped <= set(stages[1].activation_inputs) & set(stages[1].activation_outputs)
    assert stages[-1].has_loss and not stages[0].has_loss
    with pytest.raises(ValueError):
        slice_stages(graph, {**stage_of_nodes(graph, layering.layer_of, [[0], [1], [2]]),
                             graph.nodes[-1].name: 0})


def test_a_stage_whose_every_mesh_is_unbounded_is_a_value_error_naming_the_meshes():
    """No alternative worth solving (every lower bound infinite) and none failed: a ValueError the stage DP counts as
    a partition without a plan, never ``raise None``."""
    import math
    from types import SimpleNamespace

    def unsolvable(shape):
        def solve(*args, **kwargs):
            raise AssertionError("an alternative whose bound is infinite is not solved")

        return SimpleNamespace(final=None, lower_bound_s=math.inf, mesh=SimpleNamespace(shape=shape), solve=solve)

    choice = pipeline_plan._MeshChoice([unsolvable((1, 4)), unsolvable((2, 2))])
    with pytest.raises(ValueError, match=r"no logical mesh of this stage \(1x4, 2x2\)"):
        choice.solve(memory_budget=1e9, time_limit_s=1.0)


def test_stages_answered_from_a_roomier_twin_plan_as_solving_each(monkeypatch):
    """Stages of identical layers differ only in the micro-batches they hold (here the middle two of four stages,
    one layer each): a later stage's optimum answers an earlier one's problem when it fits its memory
    (``ilp_problems["reused_roomier"]``, exact by :func:`torchpar.planner.sharding.ilp._looser_optimum`). With that
    answer switched off every stage is solved by CP-SAT, and the plan is the same, stage by stage."""
    from torchpar.planner.sharding import ilp

    ilp.forget_solutions()
    reused = _plan([1, 1, 1, 1], "uniform").plan
    assert reused.solver["ilp_problems"]["reused_roomier"] > 0
    ilp.forget_solutions()
    monkeypatch.setattr(ilp, "_looser_optimum", lambda *args: None)
    solved = _plan([1, 1, 1, 1], "uniform").plan
    assert solved.solver["ilp_problems"]["reused_roomier"] == 0
    assert solved.solver["ilp_problems"]["solved"] > reused.solver["ilp_problems"]["solved"]
    assert reused.estimated_step_s == solved.estimated_step_s

    def stages(plan):
        return [(s.layers, s.submesh_shape, s.logical_mesh_shape, s.params, s.estimated_cost_s) for s in plan.stages]

    assert stages(reused) == stages(solved)

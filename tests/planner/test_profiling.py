"""Measured profiling (``profile=True``): the link fit, candidates ranked by timed stages, the disk cache."""

from __future__ import annotations

import math

import pytest
import torch

import torchpar
from torchpar.capture.export import capture_train_step
from torchpar.cluster import ClusterSpec
from torchpar.planner.pipeline.pipeline_plan import plan_pipeline
from torchpar.planner.profiling import (LinkFit, StageTiming, calibrated_cluster, fit_alpha_beta, measured_step,
                                        rank_candidates)

WIDTH, BATCH, MICRO = 128, 64, 4


class Blocks(torch.nn.Module):
    """``depth`` Linear+tanh blocks with a pipeline boundary after each."""

    def __init__(self, depth: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH) for _ in range(depth))

    def forward(self, x, y):
        for index, block in enumerate(self.blocks):
            x = torch.tanh(block(x))
            if index < len(self.blocks) - 1:
                x = torchpar.mark_pipeline_boundary(x)
        return torch.nn.functional.mse_loss(x, y)


@pytest.fixture
def profile_dir(tmp_path, monkeypatch):
    directory = tmp_path / "profiles"
    monkeypatch.setenv("TORCHPAR_PROFILE_DIR", str(directory))
    return directory


def test_alpha_beta_fit_recovers_the_line_and_never_goes_negative():
    alpha, beta, devices = 3e-5, 2e-10, 4
    points = [(b, alpha + 2 * beta * (devices - 1) / devices * b) for b in (1e4, 1e5, 1e6, 1e7)]
    fit_a, fit_b = fit_alpha_beta(points, devices)
    assert fit_a == pytest.approx(alpha, rel=1e-6) and fit_b == pytest.approx(beta, rel=1e-6)
    # timings that fall faster than linear would give a negative intercept: refit through the origin instead
    fit_a, fit_b = fit_alpha_beta([(1e3, 1e-9), (1e6, 1e-3)], 2)
    assert fit_a == 0.0 and fit_b > 0
    with pytest.raises(ValueError, match="two sizes"):
        fit_alpha_beta([(1e3, 1e-5), (1e3, 2e-5)], 2)
    with pytest.raises(ValueError, match="no link"):
        fit_alpha_beta([(1e3, 1e-5), (1e4, 2e-5)], 1)
    cluster = calibrated_cluster(ClusterSpec(num_hosts=2, devices_per_host=4),
                                 [LinkFit(axis=1, devices=4, alpha=1e-6, beta=1e-11, points=())])
    assert cluster.alpha[1] == 1e-6 and cluster.beta[1] == 1e-11
    assert cluster.alpha[0] == ClusterSpec().alpha[0] and cluster.inter_host_beta == ClusterSpec().inter_host_beta


def test_candidates_are_ranked_by_measured_step_and_shared_stages_are_timed_once():
    calls = []

    def timer(stage, plan, remat):
        calls.append((stage, plan))
        return StageTiming(forward_s=plan, backward_s=2 * plan)

    shared = ("s", 0.1)
    candidates = [(1.0, [shared, ("a", 0.5)]), (2.0, [shared, ("b", 0.2)])]
    ranked = rank_candidates(candidates, timer, num_micro_batches=4)
    assert [r.index for r in ranked] == [1, 0], "the measured step decides, not the estimate"
    assert len(calls) == 3, "a stage met in two candidates is timed once"
    assert ranked[0].measured_step_s == pytest.approx(measured_step(ranked[0].timings, 4))
    assert ranked[0].measured_step_s == pytest.approx(0.3 + 0.6 + 3 * 0.6)


def _graph_and_method(depth: int = 4):
    torch.manual_seed(0)
    model = Blocks(depth)
    micro_batch = (torch.randn(BATCH // MICRO, WIDTH), torch.randn(BATCH // MICRO, WIDTH))
    graph = capture_train_step(model, micro_batch).graph
    method = torchpar.PipeshardParallel(num_micro_batches=MICRO, layer_option="manual", stage_option="auto")
    return model, graph, method


def test_a_measurement_that_contradicts_the_estimate_changes_the_pipeline_plan():
    model, graph, method = _graph_and_method()
    cluster = ClusterSpec(num_hosts=2, devices_per_host=4, alpha=(1e-3, 1e-4), beta=(1e-8, 1e-9))
    trainable = {n for n, _ in model.named_parameters()}
    unprofiled = plan_pipeline(graph, method, cluster, trainable=trainable, optimizer_state_copies=0).plan
    assert len(unprofiled.solver["runners_up"]) >= 1
    estimated_best = [list(s.layers) for s in unprofiled.stages]
    slow_meshes = {tuple(s.logical_mesh_shape) for s in unprofiled.stages}

    def timer(stage, plan, remat):  # stages on the estimate's favourite meshes measure 10× slower than estimated
        slow = 10.0 if tuple(plan.logical_mesh_shape) in slow_meshes else 1.0
        return StageTiming(forward_s=slow * plan.estimated_cost_s / 3, backward_s=slow * 2 * plan.estimated_cost_s / 3)

    profiled = plan_pipeline(graph, method, cluster, trainable=trainable, optimizer_state_copies=0,
                             stage_timer=timer).plan
    record = profiled.solver["profile"]
    assert [list(s.layers) for s in profiled.stages] != estimated_best
    assert record["changed_choice"] and record["chosen"] != 0
    assert record["measured_step_s"] == min(c["measured_step_s"] for c in record["candidates"])
    assert all(s.measured_cost_s is not None for s in profiled.stages)
    assert "the measurement changed the choice" in profiled.summary()
    assert torchpar.Plan.from_json(profiled.to_json()).solver["profile"] == record


def test_profiled_pipeline_plan_times_real_stages_and_reads_them_back_from_the_cache(profile_dir):
    model = Blocks(4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = (torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH))
    method = torchpar.PipeshardParallel(num_micro_batches=MICRO, layer_option="manual", stage_option="auto")
    first = torchpar.plan(model, optimizer, example_batch=batch, method=method, profile=True, explain=False)
    record = first.solver["profile"]
    # a stage equal to one timed for an earlier candidate (same graph, layouts, mesh) is read from the cache
    assert record["timed_stages"] >= len(first.stages) and record["cached_stages"] < record["timed_stages"]
    for stage in first.stages:
        assert 0 < stage.measured_cost_s < 10
    for link in record["links"]:  # fitted to timed all-reduces over the 8 devices
        assert link["devices"] == 8 and len(link["points"]) == 4 and link["alpha"] >= 0 and link["beta"] >= 0
    assert tuple(first.cluster["alpha"]) == tuple(link["alpha"] for link in record["links"])
    assert "measured" in first.summary() and "profiled: measured step" in first.summary()
    assert any(profile_dir.iterdir())
    first.save_html(str(profile_dir.parent / "plan.html"))
    page = (profile_dir.parent / "plan.html").read_text()
    assert "measured profiling" in page and "profiled F+B" in page

    again = torchpar.plan(model, optimizer, example_batch=batch, method=method, profile=True, explain=False)
    record_again = again.solver["profile"]
    assert record_again["timed_stages"] == 0, "every stage and link comes from the disk cache"
    assert record_again["cached_stages"] == record["timed_stages"] + record["cached_stages"]
    assert [s.layers for s in again.stages] == [s.layers for s in first.stages]
    assert [s.measured_cost_s for s in again.stages] == [s.measured_cost_s for s in first.stages]


def test_profiled_one_stage_engine_trains_as_without_profiling(profile_dir):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    batch = (torch.randn(16, 32), torch.randn(16, 1))
    step_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])  # noqa: E731
    losses = {}
    for profile in (False, True):
        fresh = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        fresh.load_state_dict(model.state_dict())
        with torchpar.compile(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1), example_batch=batch,
                              step_fn=step_fn, method=torchpar.DataParallel(), profile=profile) as engine:
            losses[profile] = [engine.step(batch).item() for _ in range(3)]
            if profile:
                stage = engine.plan.stages[0]
                assert stage.measured_cost_s is not None and stage.measured_cost_s > 0
                assert engine.plan.solver["profile"]["links"]
                assert not math.isnan(stage.measured_cost_s)
    assert losses[True] == losses[False]


def test_profiling_needs_the_devices_in_this_process():
    from torchpar.engine.profiled import start_profiling

    with pytest.raises(ValueError, match="Ray runtime"):
        start_profiling(ClusterSpec(runtime="ray"), spec=None, trainable=set(), num_micro_batches=1, numerics=None,
                        library_fusions=True)
    with pytest.raises(ValueError, match="needs the cluster's 64 devices"):
        start_profiling(ClusterSpec(num_hosts=8, devices_per_host=8), spec=None, trainable=set(), num_micro_batches=1,
                        numerics=None, library_fusions=True)

"""PipeshardParallel planning: layers → stages on submeshes → a sharding ILP inside each stage.

1. Layers: cut at ``mark_pipeline_boundary`` (``layer_option="manual"``) or cluster the ops
   (:func:`.layers.cluster_layers`).
2. Stages: by hand (:class:`ManualStageOption`), ``"uniform"`` (equal layer counts on equal
   submeshes), or ``"auto"`` — the inter-op DP of :mod:`.stages` over contiguous layer ranges ×
   submesh shapes × logical meshes.
3. Each stage's sub-graph (:func:`.slicing.slice_stages`) is planned by the intra-op ILP on its logical
   mesh, and placed on its devices (:func:`assign_devices`).

The graph is captured on one micro-batch, so every stage graph has micro-batch shapes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from torchpar.cluster import ClusterSpec
from torchpar.ir.graph import Graph
from torchpar.methods import ManualStageOption, PipeshardParallel
from torchpar.planner import layers as layers_mod
from torchpar.planner.intra_op import plan_stage
from torchpar.planner.plan import Plan
from torchpar.planner.slicing import StageGraph, slice_stages, stage_of_nodes

log = logging.getLogger(__name__)


@dataclass
class PipelinePlan:
    """The plan and what executing it needs: each stage's sub-graph and device indices."""

    plan: Plan
    stages: list[StageGraph]
    devices: list[list[int]]
    layering: object


def assign_devices(submeshes: list[tuple[int, int]], cluster: ClusterSpec) -> list[list[int]]:
    """Device indices of each stage's submesh, packed in order: ``(1, k)`` takes ``k`` free devices of one
    host, ``(h, D)`` takes ``h`` whole free hosts. Host ``i`` owns devices ``[i·D, (i+1)·D)``."""
    per_host = cluster.devices_per_host
    free = [list(range(h * per_host, (h + 1) * per_host)) for h in range(cluster.num_hosts)]
    result = []
    for stage, (hosts, devices) in enumerate(submeshes):
        if hosts == 1 and devices <= per_host:
            host = next((h for h in range(cluster.num_hosts) if len(free[h]) >= devices), None)
            if host is None:
                raise ValueError(f"stage {stage}'s submesh (1, {devices}) does not fit on any host's free devices")
            taken, free[host] = free[host][:devices], free[host][devices:]
            result.append(taken)
        elif devices == per_host:
            whole = [h for h in range(cluster.num_hosts) if len(free[h]) == per_host][:hosts]
            if len(whole) < hosts:
                raise ValueError(f"stage {stage}'s submesh ({hosts}, {devices}) needs {hosts} free hosts")
            result.append([d for h in whole for d in free[h]])
            for h in whole:
                free[h] = []
        else:
            raise ValueError(f"stage {stage}: submesh {(hosts, devices)} is neither (1, k≤{per_host}) nor (k, {per_host})")
    return result


def plan_pipeline(graph: Graph, method: PipeshardParallel, cluster: ClusterSpec, *, trainable: set[str],
                  optimizer_state_copies: float) -> PipelinePlan:
    """Plan ``graph`` (captured on one micro-batch) with ``method`` on ``cluster``."""
    timings: dict[str, float] = {}
    start = time.perf_counter()
    if method.layer_option == "manual":
        layering = layers_mod.manual_layers(graph)
    else:
        layering = layers_mod.cluster_layers(graph, method.layer_option.layer_num, method.layer_option.eps)
    timings["cluster"] = time.perf_counter() - start
    num_layers = layering.num_layers
    option = method.stage_option
    start = time.perf_counter()
    runners_up: list = []
    if isinstance(option, ManualStageOption):
        stage_layers = [list(ids) for ids in option.forward_stage_layer_ids]
        submeshes = [tuple(s) for s in option.submesh_physical_shapes]
        logical = [tuple(s) for s in option.submesh_logical_shapes]
        _validate_manual(stage_layers, submeshes, logical, num_layers)
    elif option == "uniform":
        from torchpar.planner import stages as stages_mod

        stage_layers, submeshes, logical = stages_mod.uniform_stages(num_layers, cluster.num_hosts,
                                                                     cluster.devices_per_host)
    else:
        from torchpar.planner import stages as stages_mod

        cost = stages_mod.AnalyticStageCost(layering, graph, cluster, method.num_micro_batches, optimizer_state_copies)
        result = stages_mod.stage_dp(num_layers, cluster.num_hosts, cluster.devices_per_host, method.num_micro_batches,
                                     cost, cluster.device_memory_bytes)
        stage_layers = [list(range(s.first_layer, s.last_layer + 1)) for s in result.stages]
        submeshes = [tuple(s.submesh) for s in result.stages]
        logical = [tuple(s.logical) for s in result.stages]
        runners_up = result.runners_up
    timings["stage_dp"] = time.perf_counter() - start
    stage_graphs = slice_stages(graph, stage_of_nodes(graph, layering.layer_of, stage_layers))
    devices = assign_devices(submeshes, cluster)
    start = time.perf_counter()
    stage_plans, solver = [], {}
    for index, (stage, mesh_shape) in enumerate(zip(stage_graphs, logical)):
        result = plan_stage(stage.graph, kind="auto", mesh_shape=mesh_shape, cluster=cluster,
                            trainable=trainable & set(stage.params), optimizer_state_copies=optimizer_state_copies,
                            memory_budget=cluster.device_memory_bytes)
        result.stage.layers = stage_layers[index]
        result.stage.submesh_shape = submeshes[index]
        stage_plans.append(result.stage)
        solver[f"stage{index}"] = result.solver_stats()
    timings["ilp"] = time.perf_counter() - start
    latencies = [s.estimated_cost_s for s in stage_plans]
    micro = method.num_micro_batches
    estimated = sum(latencies) + (micro - 1) * max(latencies)
    solver["runners_up"] = [_describe_runner_up(r) for r in runners_up]
    plan = Plan(method="pipeshard", stages=stage_plans, num_micro_batches=micro, schedule=method.schedule,
                estimated_step_s=estimated, solver=solver, timings=timings)
    log.info("pipeline plan: %d layers → %d stages %s on %s", num_layers, len(stage_plans), stage_layers, submeshes)
    return PipelinePlan(plan=plan, stages=stage_graphs, devices=devices, layering=layering)


def _validate_manual(stage_layers: list[list[int]], submeshes: list[tuple[int, int]], logical: list[tuple[int, int]],
                     num_layers: int) -> None:
    flat = [layer for layers in stage_layers for layer in layers]
    if flat != list(range(num_layers)):
        raise ValueError(f"ManualStageOption.forward_stage_layer_ids must cover layers 0..{num_layers - 1} in order, "
                         f"each once; got {stage_layers}")
    for index, (physical, mesh) in enumerate(zip(submeshes, logical)):
        if physical[0] * physical[1] != mesh[0] * mesh[1]:
            raise ValueError(f"stage {index}: logical mesh {mesh} has {mesh[0] * mesh[1]} devices but its submesh "
                             f"{physical} has {physical[0] * physical[1]}")


def _describe_runner_up(candidate: object) -> dict:
    if isinstance(candidate, dict):
        return candidate
    return {"description": str(candidate)}

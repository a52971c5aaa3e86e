"""PipeshardParallel planning: layers → stages on submeshes → a sharding ILP inside each stage.

1. Layers: cut at ``mark_pipeline_boundary`` (``layer_option="manual"``) or cluster the ops
   (:func:`.layers.cluster_layers`).
2. Stages: by hand (:class:`ManualStageOption`), ``"uniform"`` (equal layer counts on equal
   submeshes), or ``"auto"`` — the inter-op DP of :mod:`.stages` over contiguous layer ranges ×
   submesh shapes × logical meshes.
3. Each stage's sub-graph (:func:`.slicing.slice_stages`) is planned by the intra-op ILP on its logical
   mesh, and placed on its devices (:func:`.stages.assign_devices`).

The graph is captured on one micro-batch, so every stage graph has micro-batch shapes.
"""

from __future__ import annotations

import logging
import math
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
    from torchpar.planner import stages as stages_mod

    hosts, per_host = cluster.num_hosts, cluster.devices_per_host
    if isinstance(option, ManualStageOption):
        partition = stages_mod.manual_stages(option.forward_stage_layer_ids, option.submesh_physical_shapes,
                                             option.submesh_logical_shapes, num_layers=num_layers,
                                             cluster_hosts=hosts, devices_per_host=per_host)
    elif option == "uniform":
        partition = stages_mod.uniform_stages(num_layers, None, hosts, per_host)
    else:
        cost = stages_mod.AnalyticStageCost(layering, graph, cluster, method.num_micro_batches, optimizer_state_copies)
        result = stages_mod.stage_dp(num_layers, hosts, per_host, method.num_micro_batches, cost,
                                     cluster.device_memory_bytes, schedule=method.schedule)
        partition = result.best
        alternatives = list(result.runners_up)
        for count in range(1, min(num_layers, hosts * per_host) + 1):  # uniform splits as reference points
            try:
                alternatives.append(stages_mod.uniform_stages(num_layers, count, hosts, per_host, cost=cost,
                                                              num_micro_batches=method.num_micro_batches,
                                                              memory_budget=cluster.device_memory_bytes,
                                                              schedule=method.schedule))
            except ValueError:
                continue
        seen = {str(partition)}
        for candidate in sorted(alternatives, key=lambda p: p.cost_s):
            if str(candidate) not in seen and math.isfinite(candidate.cost_s):
                seen.add(str(candidate))
                runners_up.append(candidate.to_dict())
        runners_up = runners_up[:3]
        timings["stage_dp_search"] = result.dp_s
    stage_layers = [list(ids) for ids in partition.forward_stage_layer_ids]
    submeshes = [tuple(s) for s in partition.submesh_physical_shapes]
    logical = [tuple(s) for s in partition.submesh_logical_shapes]
    timings["stage_dp"] = time.perf_counter() - start
    stage_graphs = slice_stages(graph, stage_of_nodes(graph, layering.layer_of, stage_layers))
    devices = [list(d) for d in stages_mod.assign_devices(submeshes, hosts, per_host)]
    start = time.perf_counter()
    stage_plans, solver = [], {}
    for index, (stage, mesh_shape) in enumerate(zip(stage_graphs, logical)):
        result = plan_stage(stage.graph, kind="shard", mesh_shape=mesh_shape, cluster=cluster,
                            trainable=trainable & set(stage.params), optimizer_state_copies=optimizer_state_copies,
                            memory_budget=cluster.device_memory_bytes)
        result.stage.layers = stage_layers[index]
        result.stage.submesh_shape = submeshes[index]
        result.stage.device_ids = devices[index]
        stage_plans.append(result.stage)
        solver[f"stage{index}"] = result.solver_stats()
    timings["ilp"] = time.perf_counter() - start
    latencies = [s.estimated_cost_s for s in stage_plans]
    micro = method.num_micro_batches
    estimated = sum(latencies) + (micro - 1) * max(latencies)
    solver["stage_partition"] = partition.to_dict()
    solver["runners_up"] = runners_up
    plan = Plan(method=PipeshardParallel.name, stages=stage_plans, num_micro_batches=micro, schedule=method.schedule,
                estimated_step_s=estimated, solver=solver, timings=timings,
                layers=[{"flops": float(f), "activation_bytes": float(b)}
                        for f, b in zip(layering.flops, layering.boundary_bytes)],
                cluster={"num_hosts": hosts, "devices_per_host": per_host}, layer_of_node=dict(layering.layer_of))
    log.info("pipeline plan: %d layers → %d stages %s on %s", num_layers, len(stage_plans), stage_layers, submeshes)
    return PipelinePlan(plan=plan, stages=stage_graphs, devices=devices, layering=layering)


def stage_graphs_for(graph: Graph, plan: Plan) -> list[StageGraph]:
    """The stage graphs of a saved pipeline ``plan`` for ``graph`` (the model captured on one micro-batch of the
    batch the plan was made for): every node's layer from ``plan.layer_of_node``, each stage's layers from
    ``plan.stages``. Raises ``ValueError`` if the graph is not the one the plan was made for."""
    if not plan.layer_of_node:
        raise ValueError("this pipeline plan has no node → layer map (layer_of_node); it was saved by an older "
                         "torchpar: plan it again")
    names = {n.name for n in graph.nodes}
    missing = sorted(names - set(plan.layer_of_node))
    extra = sorted(set(plan.layer_of_node) - names)
    if missing or extra:
        raise ValueError(f"the plan was made for another graph: {len(missing)} op(s) of this model are not in it "
                         f"({missing[:5]}) and {len(extra)} of its ops are not in this model ({extra[:5]}); "
                         "compile with the model, batch size (÷ num_micro_batches) and loss the plan was made for")
    stages = slice_stages(graph, stage_of_nodes(graph, plan.layer_of_node, [list(s.layers) for s in plan.stages]))
    if len(stages) != len(plan.stages):
        raise ValueError(f"the plan has {len(plan.stages)} stages but its layers cut this graph into {len(stages)}")
    return stages

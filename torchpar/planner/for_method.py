"""Method → Plan: the single-device plan, the hand plans and the automatic ShardParallel plan."""

from __future__ import annotations

import time
from typing import Any

from torchpar.cluster import ClusterSpec
from torchpar.ir.graph import Graph
from torchpar.methods import SINGLE_DEVICE, DataParallel, MegatronParallel, ShardParallel, Zero2Parallel, Zero3Parallel
from torchpar.planner.intra_op import mesh_shapes_for, plan_best_mesh, plan_stage
from torchpar.planner.plan import Plan, StagePlan

_ONE_STAGE = (DataParallel, Zero2Parallel, Zero3Parallel, MegatronParallel, ShardParallel)


def single_device_plan(graph: Graph, cluster: ClusterSpec) -> Plan:
    """Everything on one device: one stage, every tensor whole."""
    compute_s = 3.0 * graph.total_flops / cluster.device_flops
    params = {i.target: [None] * len(i.meta.shape) for i in graph.inputs if i.kind == "param"}
    state_bytes = sum(i.meta.nbytes for i in graph.inputs if i.kind == "param") * 4
    activation_bytes = sum(n.out_bytes for n in graph.nodes)
    stage = StagePlan(layers=[0], submesh_shape=(1, 1), logical_mesh_shape=(1, 1), params=params,
                      estimated_cost_s=compute_s, estimated_compute_s=compute_s,
                      estimated_memory_bytes=state_bytes + activation_bytes)
    return Plan(method=SINGLE_DEVICE, stages=[stage], estimated_step_s=compute_s)


def plan_for_method(graph: Graph, method: Any, cluster: ClusterSpec, *, trainable: set[str],
                    optimizer_state_copies: float, kind: str | None = None) -> Plan:
    """The plan ``method`` (or the hand-plan ``kind``, e.g. ``"megatron"``) gives ``graph`` on ``cluster``."""
    kind = kind or (method.name if isinstance(method, _ONE_STAGE) else None)
    if kind is None:
        raise NotImplementedError(f"method {type(method).__name__} is not a one-stage sharding method")
    mesh_shape = getattr(method, "mesh_shape", None)
    budget = getattr(method, "memory_budget", None) or cluster.device_memory_bytes
    time_limit = getattr(method, "solver_time_limit_s", 30.0)
    start = time.perf_counter()
    common = dict(kind=kind, cluster=cluster, trainable=trainable, optimizer_state_copies=optimizer_state_copies,
                  memory_budget=budget, time_limit_s=time_limit)
    if mesh_shape is not None:
        if mesh_shape[0] * mesh_shape[1] > cluster.num_devices:
            raise ValueError(f"mesh_shape {tuple(mesh_shape)} needs {mesh_shape[0] * mesh_shape[1]} devices; the cluster "
                             f"has {cluster.num_devices} (torchpar.init(num_devices=...))")
        result = plan_stage(graph, mesh_shape=tuple(mesh_shape), **common)
    elif kind == "shard":
        result = plan_best_mesh(graph, mesh_shapes=mesh_shapes_for(cluster.num_devices), **common)
    else:
        result = plan_stage(graph, mesh_shape=(1, cluster.num_devices), **common)
    elapsed = time.perf_counter() - start
    count = result.stage.logical_mesh_shape[0] * result.stage.logical_mesh_shape[1]
    per_host = cluster.devices_per_host
    result.stage.submesh_shape = (count // per_host, per_host) if count > per_host and count % per_host == 0 else (1, count)
    result.stage.device_ids = list(range(count))
    stats = result.solver_stats()
    return Plan(method=kind, stages=[result.stage], estimated_step_s=result.stage.estimated_cost_s,
                solver=stats, timings={"ilp": elapsed},
                cluster={"num_hosts": cluster.num_hosts, "devices_per_host": cluster.devices_per_host})

"""Method → Plan: the single-device plan, the hand plans and the automatic ShardParallel plan."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import cast

from torchpar.hardware import ClusterSpec
from torchpar.ir.graph import Graph
from torchpar.ir.layout import JsonSpec, MeshShape
from torchpar.methods import (
    SINGLE_DEVICE,
    DataParallel,
    MegatronParallel,
    ShardParallel,
    Zero2Parallel,
    Zero3Parallel,
    data_replicas,
)
from torchpar.planner.intra_op import (
    PlanKind,
    StageProblem,
    logical_mesh,
    memory_breakdown,
    mesh_shapes_for,
    plan_best_mesh,
    plan_stage,
)
from torchpar.planner.mesh_links import submesh_of
from torchpar.planner.plan import EXPERT_FAMILIES, Plan, StagePlan, expert_family, expert_layouts
from torchpar.planner.remat import check_remat, remat_memory
from torchpar.planner.remat_choice import choose_remat
from torchpar.planner.sharding.ilp import SolveTimeout
from torchpar.planner.sharding.solver_graph import build_solver_graph

_ONE_STAGE = (DataParallel, Zero2Parallel, Zero3Parallel, MegatronParallel, ShardParallel)


def single_device_plan(
    graph: Graph,
    cluster: ClusterSpec,
    remat: str = "none",
    *,
    trainable: set[str] | None = None,
    optimizer_state_copies: float = 2.0,
) -> Plan:
    """Everything on one device: one stage, every tensor whole. ``remat`` (an option, or ``"auto"``: the cheapest
    that fits the device's memory, :mod:`.remat_choice`) prices what activation checkpointing keeps and
    recomputes, as the ILP does: ``compute = (3·F + F_recomputed) / device_flops``. Memory is the sharding ILP's
    memory model on a 1×1 mesh (:func:`.intra_op.memory_breakdown`: each trainable parameter with its gradient and
    ``optimizer_state_copies`` optimizer tensors, the activations ``remat`` keeps, the largest recomputed layer's,
    buffers), so one device, the sharded methods and pipeline stages are priced by one function. ``trainable``:
    the parameters the optimizer updates (default: every parameter)."""
    if check_remat(remat, allow_auto=True) == "auto":
        return choose_remat(
            lambda option: single_device_plan(
                graph, cluster, option, trainable=trainable, optimizer_state_copies=optimizer_state_copies
            ),
            cluster.device_memory_bytes,
        )
    if trainable is None:
        trainable = {i.target for i in graph.inputs if i.kind == "param"}
    kept = remat_memory(graph, remat)
    recomputed_flops = sum(n.flops for n in graph.nodes if n.name in kept.recomputed)
    compute_s = (3.0 * graph.total_flops + recomputed_flops) / cluster.device_flops
    params: dict[str, JsonSpec] = {i.target: [None] * len(i.meta.shape) for i in graph.inputs if i.kind == "param"}
    solver_graph = build_solver_graph(
        graph,
        logical_mesh((1, 1), cluster),
        trainable=trainable,
        optimizer_state_copies=optimizer_state_copies,
        remat=remat,
    )
    choice = [int(root.memory.argmin()) for root in solver_graph.roots]
    breakdown = memory_breakdown(solver_graph, choice, trainable, optimizer_state_copies)
    stage = StagePlan(
        layers=[0],
        submesh_shape=(1, 1),
        logical_mesh_shape=(1, 1),
        params=params,
        estimated_cost_s=compute_s,
        estimated_compute_s=compute_s,
        estimated_memory_bytes=int(sum(breakdown.values())),
        memory_breakdown=breakdown,
    )
    return Plan(
        method=SINGLE_DEVICE, stages=[stage], estimated_step_s=compute_s, cluster=cluster.cost_constants(), remat=remat
    )


def plan_for_method(
    graph: Graph,
    method: object,
    cluster: ClusterSpec,
    *,
    trainable: set[str],
    optimizer_state_copies: float,
    kind: str | None = None,
    explain: bool = False,
    remat: str = "none",
) -> Plan:
    """The plan ``method`` (or the hand-plan ``kind``, e.g. ``"megatron"``) gives ``graph`` on ``cluster``.

    ``explain``: also price the hand plans :data:`COMPARED_KINDS` (at their default meshes) on the same cost
    model (``plan.solver["method_comparison"]``) and count the bytes of every collective kind the stage sends
    (``StagePlan.communication_bytes``); a few more solves, for reports rather than for compiling. ``remat``: the
    activation checkpointing the plan prices (``plan.remat``), or ``"auto"``: the planner picks it
    (:mod:`.remat_choice`; one solve per option)."""
    kind = kind or (method.name if isinstance(method, _ONE_STAGE) else None)
    if kind is None:
        raise NotImplementedError(f"method {type(method).__name__} is not a one-stage sharding method")
    mesh_shape = getattr(method, "mesh_shape", None)
    budget = getattr(method, "memory_budget", None) or cluster.device_memory_bytes
    if check_remat(remat, allow_auto=True) == "auto":

        def make(option: str) -> Plan:
            return plan_for_method(
                graph,
                method,
                cluster,
                trainable=trainable,
                optimizer_state_copies=optimizer_state_copies,
                kind=kind,
                remat=option,
            )

        chosen = choose_remat(make, budget)
        if not explain:
            return chosen
        explained = plan_for_method(
            graph,
            method,
            cluster,
            trainable=trainable,
            optimizer_state_copies=optimizer_state_copies,
            kind=kind,
            explain=True,
            remat=chosen.remat,
        )
        explained.solver["remat"] = chosen.solver["remat"]
        return explained
    time_limit = getattr(method, "solver_time_limit_s", 30.0)
    micro = getattr(method, "num_micro_batches", 1)
    start = time.perf_counter()
    problem = StageProblem(
        kind=cast(PlanKind, kind),  # a one-stage method's name, or a hand plan's kind: the plan kinds
        cluster=cluster,
        trainable=frozenset(trainable),
        optimizer_state_copies=optimizer_state_copies,
        num_micro_batches=micro,
        remat=remat,
        experts=getattr(method, "experts", "auto"),
        context=getattr(method, "context", "auto"),
        sequence_parallel=getattr(method, "sequence_parallel", False),
    )
    replicas = data_replicas(method)
    if mesh_shape is not None and len(mesh_shape) == 3:  # (data, d0, d1): the ILP plans one replica's d0 × d1
        mesh_shape = tuple(mesh_shape[1:])
    if mesh_shape is not None:
        if replicas * mesh_shape[0] * mesh_shape[1] > cluster.num_devices:
            raise ValueError(
                f"mesh_shape {(replicas, *mesh_shape) if replicas > 1 else tuple(mesh_shape)} needs "
                f"{replicas * mesh_shape[0] * mesh_shape[1]} devices; the cluster has "
                f"{cluster.num_devices} (torchpar.init(num_devices=...))"
            )
        result = plan_stage(graph, problem, tuple(mesh_shape), budget, time_limit)
    elif kind == "shard":
        result = plan_best_mesh(graph, problem, mesh_shapes_for(cluster.num_devices), budget, time_limit)
    else:
        result = plan_stage(graph, problem, (1, cluster.num_devices), budget, time_limit)
    elapsed = time.perf_counter() - start
    if replicas > 1:
        add_data_replicas(result.stage, replicas, cluster)
    count = result.stage.num_devices
    result.stage.submesh_shape = submesh_of(count, cluster.devices_per_host)
    result.stage.device_ids = list(range(count))
    stats = result.solver_stats()
    stats["estimate"] = {
        "model": ESTIMATE_MODEL,
        "step_formula": "one step = the stage's estimate"
        + (
            f" ({micro} micro-batches: compute and activation collectives ×{micro}, weight-gradient sync once)"
            if micro > 1
            else ""
        )
        + (f" + the gradients' all-reduce over {replicas} data replicas" if replicas > 1 else ""),
    }
    if result.mesh_trials:
        stats["mesh_shapes"] = result.mesh_trials
    timings = {"ilp": elapsed}
    if explain:
        start = time.perf_counter()
        result.explain()
        if replicas > 1:
            gradients = result.stage.memory_breakdown.get("gradients", 0.0)
            sent = result.stage.communication_bytes
            sent["all_reduce"] = sent.get("all_reduce", 0.0) + 2.0 * (replicas - 1) / replicas * gradients
        # the hand plans are priced on the whole cluster; a replica's graph holds 1/replicas of the rows
        stats["method_comparison"] = (
            []
            if replicas > 1
            else _compare_methods(
                graph, kind, result.stage, cluster, trainable, optimizer_state_copies, budget, time_limit, micro
            )
        )
        if replicas == 1 and problem.experts == "auto" and expert_layouts(result.stage):
            stats["expert_layouts"] = _compare_expert_layouts(graph, result.stage, problem, budget, time_limit)
        timings["explain"] = time.perf_counter() - start
    return Plan(
        method=kind,
        stages=[result.stage],
        estimated_step_s=result.stage.estimated_cost_s,
        num_micro_batches=micro,
        solver=stats,
        timings=timings,
        cluster=cluster.cost_constants(),
        remat=remat,
    )


def add_data_replicas(stage: StagePlan, replicas: int, cluster: ClusterSpec) -> None:
    """Make ``stage`` (planned for one replica's rows on ``d0 × d1`` devices) ``replicas`` data replicas of itself on
    the mesh ``(replicas, d0, d1)``, pricing the one all-reduce of every replica's gradients per step over the data
    axis: ``α + 2·β·(R−1)/R·G`` for ``G`` gradient bytes per device (a ring all-reduce), with the link between
    hosts where the replicas span more than one host (the data axis is the outermost: replica ``r`` holds devices
    ``[r·d0·d1, (r+1)·d0·d1)``). Memory per device is the replica's: the parameters are not split over the data
    axis."""
    per_replica = stage.logical_mesh_shape[0] * stage.logical_mesh_shape[1]
    crosses = replicas * per_replica > cluster.devices_per_host
    alpha = max(cluster.alpha[0], cluster.inter_host_alpha) if crosses else cluster.alpha[0]
    beta = max(cluster.beta[0], cluster.inter_host_beta) if crosses else cluster.beta[0]
    gradients = stage.memory_breakdown.get("gradients", 0.0)
    sync = alpha + 2.0 * beta * (replicas - 1) / replicas * gradients
    stage.data_replicas = replicas
    stage.estimated_cost_s += sync
    stage.estimated_communication_s += sync


ESTIMATE_MODEL = "sharding ILP (alpha-beta, host-aware links)"
COMPARED_KINDS: tuple[PlanKind, ...] = ("shard", "data_parallel", "zero2", "megatron")
"""The methods an explained one-stage plan is compared with (each at its default mesh)."""


def _compare_methods(
    graph: Graph,
    kind: str,
    stage: StagePlan,
    cluster: ClusterSpec,
    trainable: set[str],
    optimizer_state_copies: float,
    budget: float,
    time_limit: float,
    num_micro_batches: int = 1,
) -> list[dict[str, object]]:
    """Each of :data:`COMPARED_KINDS` priced on the same model; the plan's own row is its stage."""
    rows: list[dict[str, object]] = []
    for other in COMPARED_KINDS:
        if other == kind:
            chosen = stage
        else:
            shapes = mesh_shapes_for(cluster.num_devices) if other == "shard" else [(1, cluster.num_devices)]
            try:
                problem = StageProblem(
                    kind=other,
                    cluster=cluster,
                    trainable=frozenset(trainable),
                    optimizer_state_copies=optimizer_state_copies,
                    num_micro_batches=num_micro_batches,
                )
                chosen = plan_best_mesh(graph, problem, shapes, budget, time_limit).stage
            except ValueError as error:  # does not fit the memory budget, or the batch does not divide
                rows.append({"method": other, "logical_mesh_shape": list(shapes[0]), "error": str(error)})
                continue
        rows.append(
            {
                "method": other,
                "logical_mesh_shape": list(chosen.logical_mesh_shape),
                "estimated_step_s": chosen.estimated_cost_s,
                "estimated_compute_s": chosen.estimated_compute_s,
                "estimated_communication_s": chosen.estimated_communication_s,
                "estimated_memory_bytes": chosen.estimated_memory_bytes,
            }
        )
    return rows


def _compare_expert_layouts(
    graph: Graph, stage: StagePlan, problem: StageProblem, budget: float, time_limit: float
) -> list[dict[str, object]]:
    """The stage re-planned on its own logical mesh with its grouped matmuls forced to each other family of
    :data:`.plan.EXPERT_FAMILIES` (``ShardParallel.experts``), beside the chosen one: what the expert layout the
    ILP chose won against, on the same cost model. A family the plan already uses everywhere is its own row."""
    chosen = {expert_family(strategy) for _, strategy, _ in expert_layouts(stage)}
    rows: list[dict[str, object]] = [
        {
            "experts": family,
            "meaning": EXPERT_FAMILIES[family],
            "chosen": True,
            "estimated_step_s": stage.estimated_cost_s,
            "estimated_memory_bytes": stage.estimated_memory_bytes,
        }
        for family in sorted(chosen)
    ]
    for family in ("split", "tensor", "replicated"):
        if chosen == {family}:
            continue
        try:
            mesh_shape = cast(MeshShape, tuple(stage.logical_mesh_shape))  # a stage's mesh has two axes
            other = plan_stage(graph, replace(problem, experts=family), mesh_shape, budget, time_limit).stage
        except (ValueError, SolveTimeout) as error:  # does not fit the memory budget, or no layout in time
            rows.append({"experts": family, "meaning": EXPERT_FAMILIES[family], "error": str(error)})
            continue
        rows.append(
            {
                "experts": family,
                "meaning": EXPERT_FAMILIES[family],
                "estimated_step_s": other.estimated_cost_s,
                "estimated_memory_bytes": other.estimated_memory_bytes,
            }
        )
    return rows


def check_plan_fits(plan: Plan, cluster: ClusterSpec) -> None:
    """A saved plan names cluster devices: they must exist in the cluster this process runs on (and a pipeline's
    submeshes are whole hosts or parts of one: the hosts must have the plan's size)."""
    per_host = plan.cluster.get("devices_per_host", cluster.devices_per_host)
    used = [d for stage in plan.stages for d in stage.devices()]
    if (plan.is_pipeline and per_host != cluster.devices_per_host) or max(used, default=0) >= cluster.num_devices:
        raise ValueError(
            f"the plan was made for {plan.cluster.get('num_hosts', '?')} host(s) × {per_host} device(s) "
            f"and uses devices up to {max(used, default=0)}; this cluster is {cluster.num_hosts} × "
            f"{cluster.devices_per_host}: call torchpar.init with the plan's cluster"
        )

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
from dataclasses import dataclass, field

from torchpar.cluster import ClusterSpec
from torchpar.ir.graph import Graph
from torchpar.methods import ManualStageOption, PipeshardParallel
from torchpar.planner import layers as layers_mod
from torchpar.planner.interleaved_stages import interleaved_stage_dp
from torchpar.planner.intra_op import plan_stage
from torchpar.planner.sharding.ilp import SOLVE_COUNTS
from torchpar.planner.plan import Plan
from torchpar.planner.profiling import StageTimer, rank_candidates, record_profile
from torchpar.planner.remat import check_remat
from torchpar.planner.remat_choice import choose_remat
from torchpar.planner.slicing import StageGraph, slice_stages, stage_of_nodes

log = logging.getLogger(__name__)


@dataclass
class PipelinePlan:
    """The plan and what executing it needs: each stage's sub-graph and device indices."""

    plan: Plan
    stages: list[StageGraph]
    devices: list[list[int]]
    layering: object
    stage_results: list = field(default_factory=list)
    """The solved stages (:class:`~torchpar.planner.intra_op.IntraOpResult`), for :meth:`explain`."""

    def explain(self) -> None:
        """Add each stage's collective bytes to the plan (a few solver-graph rebuilds per stage)."""
        for result in self.stage_results:
            result.explain()


def plan_pipeline(graph: Graph, method: PipeshardParallel, cluster: ClusterSpec, *, trainable: set[str],
                  optimizer_state_copies: float, remat: str = "none",
                  stage_timer: StageTimer | None = None) -> PipelinePlan:
    """Plan ``graph`` (captured on one micro-batch) with ``method`` on ``cluster``, every stage running with
    activation checkpointing ``remat`` (one of ``planner.remat.REMAT_OPTIONS``; the stage DP and each stage's ILP
    price it), or ``"auto"``: the option of the fastest plan that fits (:mod:`.remat_choice`; one planning per
    option). With a ``stage_timer`` (measured profiling, :mod:`.profiling`) every ILP-refined candidate's stages
    are compiled and timed, and the candidate with the least measured step wins (``plan.solver["profile"]``)."""
    if check_remat(remat, allow_auto=True) == "auto":
        planned: dict[str, PipelinePlan] = {}
        seconds: dict[str, float] = {}

        def make(option: str) -> Plan:
            started = time.perf_counter()
            try:
                planned[option] = plan_pipeline(graph, method, cluster, trainable=trainable,
                                                optimizer_state_copies=optimizer_state_copies, remat=option,
                                                stage_timer=stage_timer)
            finally:
                seconds[option] = time.perf_counter() - started
            return planned[option].plan

        chosen = planned[choose_remat(make, cluster.device_memory_bytes).remat]
        # the chosen option's own phases, then what planning every option took (remat="auto" plans each)
        chosen.plan.timings.update({f"remat_{option}": s for option, s in seconds.items()})
        chosen.plan.timings["remat_choice"] = sum(seconds.values())
        return chosen
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
    virtual = method.virtual_stages or 1  # interleaved 1F1B: stages per device group
    if isinstance(option, ManualStageOption):
        partition = stages_mod.manual_stages(option.forward_stage_layer_ids, option.submesh_physical_shapes,
                                             option.submesh_logical_shapes, num_layers=num_layers,
                                             cluster_hosts=hosts, devices_per_host=per_host,
                                             num_micro_batches=method.num_micro_batches, schedule=method.schedule,
                                             virtual_stages=virtual)
    elif option == "uniform":
        partition = stages_mod.uniform_stages(num_layers, None, hosts, per_host,
                                              num_micro_batches=method.num_micro_batches, schedule=method.schedule,
                                              virtual_stages=virtual)
    else:
        cost = stages_mod.AnalyticStageCost(layering, graph, cluster, method.num_micro_batches, optimizer_state_copies,
                                            remat=remat)
        if virtual > 1:
            result = interleaved_stage_dp(num_layers, hosts, per_host, method.num_micro_batches, cost,
                                          cluster.device_memory_bytes, virtual_stages=virtual)
        else:
            result = stages_mod.stage_dp(num_layers, hosts, per_host, method.num_micro_batches, cost,
                                         cluster.device_memory_bytes, schedule=method.schedule)
        partition = result.best
        alternatives = list(result.runners_up)
        for count in range(1, min(num_layers // virtual, hosts * per_host) + 1):  # uniform splits as reference points
            try:
                alternatives.append(stages_mod.uniform_stages(num_layers, count, hosts, per_host, cost=cost,
                                                              num_micro_batches=method.num_micro_batches,
                                                              memory_budget=cluster.device_memory_bytes,
                                                              schedule=method.schedule, warn_over_budget=False,
                                                              virtual_stages=virtual))
            except ValueError:
                continue
        seen = {str(partition)}
        for candidate in sorted(alternatives, key=lambda p: p.cost_s):
            # a uniform split over the budget by the stage DP's memory model (the ILP's minimum) is not a candidate
            fits = all(stage.memory_bytes <= cluster.device_memory_bytes / virtual for stage in candidate.stages)
            if str(candidate) not in seen and math.isfinite(candidate.cost_s) and fits:
                seen.add(str(candidate))
                runners_up.append(candidate)
        runners_up = runners_up[:REFINED_CANDIDATES - 1]
        timings["stage_dp_search"] = result.dp_s
        timings["stage_table"] = result.table_s
    timings["stage_dp"] = time.perf_counter() - start
    start = time.perf_counter()
    counts_before = dict(SOLVE_COUNTS)
    refined = []
    failures = []
    for index, candidate in enumerate([partition, *runners_up]):
        try:
            refined.append(_refine(graph, layering, candidate, cluster, method.num_micro_batches, trainable,
                                   optimizer_state_copies, remat,
                                   STAGE_TIME_LIMIT_S if index == 0 else RUNNER_UP_STAGE_TIME_LIMIT_S,
                                   method.schedule, virtual))
        except ValueError as error:  # no sharding fits the memory budget, or a batch that does not divide
            failures.append((candidate, error))
            log.info("stage partition %s: the ILP found no plan (%s)", candidate, error)
    timings["ilp"] = time.perf_counter() - start
    timings["ilp_graphs"] = sum(r.build_s for refinement in refined for r in refinement.results)
    timings["ilp_solves"] = sum(r.solution.solve_s for refinement in refined for r in refinement.results)
    ilp_counts = {kind: SOLVE_COUNTS[kind] - counts_before[kind] for kind in SOLVE_COUNTS}
    if not refined:
        raise failures[0][1]
    best = min(refined, key=lambda r: r.step_s)
    profile = None
    if stage_timer is not None:
        start = time.perf_counter()
        ranked = rank_candidates([(r.step_s, list(zip(r.stage_graphs, r.stage_plans))) for r in refined], stage_timer,
                                 method.num_micro_batches, remat=remat, schedule=method.schedule,
                                 virtual_stages=virtual)
        best = refined[ranked[0].index]
        profile = record_profile(ranked, ranked[0], best.stage_plans)
        timings["profile"] = time.perf_counter() - start
        log.info("profiled %d candidate partition(s): measured step %.4g s (estimate %.4g s)", len(refined),
                 ranked[0].measured_step_s, best.step_s)
    solver: dict = {f"stage{index}": stats for index, stats in enumerate(best.solver_stats)}
    if profile is not None:
        solver["profile"] = profile
    solver["ilp_problems"] = ilp_counts  # CP-SAT solves run, and identical stages' problems answered from them
    solver["estimate"] = {"model": ESTIMATE_MODEL, "step_formula": stages_mod.latency_formula(
        method.schedule, method.num_micro_batches, virtual)}
    if option == "auto":
        solver["stage_partition"] = {**best.partition.to_dict(), "model": SCREENING_MODEL}
        solver["runners_up"] = [r.summary() for r in sorted(refined, key=lambda r: r.step_s) if r is not best]
        solver["runners_up"] += [{"screening_step_s": c.cost_s, "model": SCREENING_MODEL, "error": str(e),
                                  "stages": c.to_dict()["stages"]} for c, e in failures]
    plan = Plan(method=PipeshardParallel.name, stages=best.stage_plans, num_micro_batches=method.num_micro_batches,
                schedule=method.schedule, estimated_step_s=best.step_s, solver=solver, timings=timings,
                layers=_layer_stats(graph, layering), cluster=cluster.cost_constants(),
                layer_of_node=dict(layering.layer_of), remat=remat)
    log.info("pipeline plan: %d layers → %d stages %s on %s", num_layers, len(best.stage_plans),
             [s.layers for s in best.stage_plans], [s.submesh_shape for s in best.stage_plans])
    return PipelinePlan(plan=plan, stages=best.stage_graphs, devices=best.devices, layering=layering,
                        stage_results=best.results)


REFINED_CANDIDATES = 3
"""Stage partitions (the DP's best and its runners-up) priced again, stage by stage, by the sharding ILP."""
STAGE_TIME_LIMIT_S = 30.0
"""CP-SAT time limit of each stage's ILP in the stage DP's best partition."""
RUNNER_UP_STAGE_TIME_LIMIT_S = 5.0
"""… and in a runner-up's: a stage whose memory constraint makes the solve hard stops with its best plan so far
(its gap is in ``solver``); measured on GPT-3 39B over 8×8 V100s, two such stages took the 30 s limit each."""
ESTIMATE_MODEL = "sharding ILP per stage (alpha-beta, host-aware links)"
SCREENING_MODEL = "stage DP screening (analytic: 3·FLOPs, data- and tensor-parallel all-reduces)"


@dataclass
class _Refined:
    """A stage partition priced by the sharding ILP: its stage plans and the pipeline step they give."""

    partition: object
    stage_graphs: list[StageGraph]
    devices: list[list[int]]
    results: list
    stage_plans: list
    step_s: float
    solver_stats: list[dict]

    def summary(self) -> dict:
        stages = [{"layers": s.layers, "submesh_shape": list(s.submesh_shape),
                   "logical_mesh_shape": list(s.logical_mesh_shape), "estimated_cost_s": s.estimated_cost_s,
                   "estimated_memory_bytes": s.estimated_memory_bytes} for s in self.stage_plans]
        return {"estimated_step_s": self.step_s, "screening_step_s": self.partition.cost_s, "model": ESTIMATE_MODEL,
                "stages": stages}


def _refine(graph: Graph, layering, partition, cluster: ClusterSpec, num_micro_batches: int, trainable: set[str],
            optimizer_state_copies: float, remat: str = "none", time_limit_s: float = STAGE_TIME_LIMIT_S,
            schedule: str = "1f1b", virtual_stages: int = 1) -> _Refined:
    from torchpar.planner import stages as stages_mod

    stage_layers = [list(ids) for ids in partition.forward_stage_layer_ids]
    submeshes = [tuple(s) for s in partition.submesh_physical_shapes]
    logical = [tuple(s) for s in partition.submesh_logical_shapes]
    stage_graphs = slice_stages(graph, stage_of_nodes(graph, layering.layer_of, stage_layers))
    groups = len(submeshes) // virtual_stages  # interleaved 1F1B: stage s on the devices of group s mod G
    group_devices = stages_mod.assign_devices(submeshes[:groups], cluster.num_hosts, cluster.devices_per_host)
    devices = [list(group_devices[s % groups]) for s in range(len(submeshes))]
    results = []
    # micro-batches each stage holds at once, as the stage DP counts them (1F1B: the stages from it to the last)
    in_flight = stages_mod.micro_batches_in_flight(len(stage_graphs), num_micro_batches, schedule, virtual_stages)
    for index, (stage, mesh_shape) in enumerate(zip(stage_graphs, logical)):
        result = plan_stage(stage.graph, kind="shard", mesh_shape=mesh_shape, cluster=cluster,
                            trainable=trainable & set(stage.params), optimizer_state_copies=optimizer_state_copies,
                            memory_budget=cluster.device_memory_bytes / virtual_stages, submesh=submeshes[index],
                            remat=remat,
                            time_limit_s=time_limit_s, in_flight=in_flight[index])
        result.stage.layers = stage_layers[index]
        result.stage.submesh_shape = submeshes[index]
        result.stage.device_ids = devices[index]
        results.append(result)
    plans = [r.stage for r in results]
    return _Refined(partition, stage_graphs, devices, results, plans,
                    stages_mod.pipeline_latency([p.estimated_cost_s for p in plans], num_micro_batches, schedule,
                                                virtual_stages),
                    [r.solver_stats() for r in results])


def _layer_stats(graph: Graph, layering) -> list[dict]:
    """Per layer: forward FLOPs, entering activation bytes, and the modules whose ops it holds (block level)."""
    modules: list[dict[str, None]] = [{} for _ in range(layering.num_layers)]
    for node in graph.nodes:
        layer = layering.layer_of.get(node.name)
        if layer is not None and node.module_path:
            modules[layer][".".join(node.module_path.split(".")[:3])] = None
    return [{"flops": float(f), "activation_bytes": float(b), "modules": list(m)}
            for f, b, m in zip(layering.flops, layering.boundary_bytes, modules)]


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


def stage_graphs_on_new_shapes(graph: Graph, example: Graph, plan: Plan) -> list[StageGraph]:
    """The stage graphs of pipeline ``plan`` for ``graph``, the training step captured on one micro-batch of other
    batch shapes than the ``example`` graph the plan was made for (see :func:`layers_on_new_shapes`). Raises
    ``ValueError`` if the plan has no node → layer map or its layers do not cut ``graph`` into its stages."""
    if not plan.layer_of_node:
        raise ValueError("the plan has no node → layer map (layer_of_node)")
    layers = layers_on_new_shapes(graph, example, plan.layer_of_node)
    stages = slice_stages(graph, stage_of_nodes(graph, layers, [list(s.layers) for s in plan.stages]))
    if len(stages) != len(plan.stages):
        raise ValueError(f"its layers cut the graph into {len(stages)} stages, not {len(plan.stages)}")
    return stages


def layers_on_new_shapes(graph: Graph, example: Graph, layer_of_node: dict[str, int]) -> dict[str, int]:
    """The pipeline layer of every node of ``graph``, the training graph captured on other batch shapes than the
    ``example`` graph the plan was made for: a node the example has (same name, same op) keeps its planned layer;
    another one (a copy that a size-1 dim makes unnecessary leaves one out, or adds one) takes the layer of the
    node before it, so every stage stays a contiguous run of the graph."""
    example_ops = {n.name: n.target for n in example.nodes}
    layers: dict[str, int | None] = {}
    previous: int | None = None
    for node in graph.nodes:
        known = example_ops.get(node.name) == node.target and node.name in layer_of_node
        layers[node.name] = layer_of_node[node.name] if known else previous
        previous = layers[node.name]
    first = next((layer for layer in layers.values() if layer is not None), 0)
    return {name: first if layer is None else layer for name, layer in layers.items()}

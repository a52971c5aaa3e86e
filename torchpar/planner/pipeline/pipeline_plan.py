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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from torchpar.hardware import ClusterSpec
from torchpar.ir.graph import Graph
from torchpar.methods import ManualStageOption, PipeshardParallel
from torchpar.planner.intra_op import IntraOpResult, PreparedStage, StageProblem, prepare_stage
from torchpar.planner.pipeline import layers as layers_mod
from torchpar.planner.pipeline.interleaved_stages import interleaved_stage_dp
from torchpar.planner.pipeline.layers import Layering
from torchpar.planner.pipeline.slicing import StageGraph, slice_stages, stage_of_nodes
from torchpar.planner.plan import Plan, StagePlan
from torchpar.planner.profiling import StageTimer, rank_candidates, record_profile
from torchpar.planner.remat import check_remat
from torchpar.planner.remat_choice import ORDER, PIPELINE_ORDER, NoFasterPlan, choose_remat
from torchpar.planner.sharding.ilp import SOLVE_COUNTS, AboveCutoff, SolveTimeout

if TYPE_CHECKING:
    from torchpar.planner.pipeline.stages import AnalyticStageCost, Schedule, StagePartition

log = logging.getLogger(__name__)


@dataclass
class PipelinePlan:
    """The plan and what executing it needs: each stage's sub-graph and device indices."""

    plan: Plan
    stages: list[StageGraph]
    devices: list[list[int]]
    layering: Layering
    stage_results: list[IntraOpResult] = field(default_factory=list)
    """The solved stages (:class:`~torchpar.planner.intra_op.IntraOpResult`), for :meth:`explain`."""

    def explain(self) -> None:
        """Add each stage's collective bytes to the plan (a few solver-graph rebuilds per stage)."""
        for result in self.stage_results:
            result.explain()


def plan_pipeline(
    graph: Graph,
    method: PipeshardParallel,
    cluster: ClusterSpec,
    *,
    trainable: set[str],
    optimizer_state_copies: float,
    remat: str = "none",
    stage_timer: StageTimer | None = None,
    beat_s: float = math.inf,
) -> PipelinePlan:
    """Plan ``graph`` (captured on one micro-batch) with ``method`` on ``cluster``, every stage running with
    activation checkpointing ``remat`` (one of ``planner.remat.REMAT_OPTIONS``; the stage DP and each stage's ILP
    price it), or ``"auto"`` (:func:`_plan_auto_remat`). With a ``stage_timer`` (measured profiling,
    :mod:`torchpar.planner.profiling`) every ILP-refined candidate's stages are compiled and timed, and the candidate
    with the least measured step wins (``plan.solver["profile"]``). ``beat_s``: a step reached elsewhere (another
    micro-batch count's plan, :mod:`.micro_batch_counts`): a plan whose step is provably no less is not solved to the
    end, and if no plan can beat it :class:`torchpar.planner.remat_choice.NoFasterPlan` is raised."""
    if check_remat(remat, allow_auto=True) == "auto":
        return _plan_auto_remat(
            graph,
            method,
            cluster,
            trainable=trainable,
            optimizer_state_copies=optimizer_state_copies,
            stage_timer=stage_timer,
            beat_s=beat_s,
        )
    screened = _screen(graph, method, cluster, optimizer_state_copies, remat)
    return _plan_screened(
        screened,
        graph,
        method,
        cluster,
        trainable,
        optimizer_state_copies,
        remat,
        [screened.partition, *screened.runners_up],
        stage_timer,
        beat=(beat_s, True),
    )


def _plan_auto_remat(
    graph: Graph,
    method: PipeshardParallel,
    cluster: ClusterSpec,
    *,
    trainable: set[str],
    optimizer_state_copies: float,
    stage_timer: StageTimer | None,
    beat_s: float = math.inf,
) -> PipelinePlan:
    """``remat="auto"`` (:mod:`torchpar.planner.remat_choice`): the whole pipeline planned once per option (stage DP,
    ILP refinement of its best partition and runners-up), the fastest that fits kept. Every option is screened first
    (the stage DP alone); the options are then planned likeliest winner first — least screened step, ties in
    :data:`torchpar.planner.remat_choice.PIPELINE_ORDER`, an option the screening found nothing for last —, each
    bounded by the best step so far (or ``beat_s``, a step reached elsewhere, which loses no tie): one whose candidates'
    proven lower bounds cannot beat it is not solved to the end (:class:`torchpar.planner.remat_choice.NoFasterPlan`;
    ties go to the option first in :data:`torchpar.planner.remat_choice.ORDER`, as
    :func:`torchpar.planner.remat_choice.choose_remat` breaks them). Exact, as the candidates' branch and bound is: a
    pruned option could not have been chosen, whatever the order; the order only decides how early a good bound is
    known (Mixtral-8×7B on 16 × 8: "selective" planned first took 177 s to lose to "none"'s 6.57 s step). Raises
    :class:`torchpar.planner.remat_choice.NoFasterPlan` when every option that fits was pruned by ``beat_s``."""
    planned: dict[str, PipelinePlan] = {}
    seconds: dict[str, float] = {}
    screened: dict[str, _Screened | ValueError] = {}
    for option in PIPELINE_ORDER:
        started = time.perf_counter()
        try:
            screened[option] = _screen(graph, method, cluster, optimizer_state_copies, option)
        except ValueError as error:  # nothing fits this option by the screening: make() raises it in its turn
            screened[option] = error
        seconds[option] = time.perf_counter() - started

    def screened_step(option: str) -> float:
        result = screened[option]
        return math.inf if isinstance(result, ValueError) else result.partition.cost_s

    order = tuple(sorted(PIPELINE_ORDER, key=lambda o: (screened_step(o), PIPELINE_ORDER.index(o))))

    def make(option: str) -> Plan:
        started = time.perf_counter()
        best = min(planned, key=lambda o: (planned[o].plan.estimated_step_s, ORDER.index(o)), default=None)
        bound = (
            (beat_s, True)
            if best is None or planned[best].plan.estimated_step_s > beat_s
            else (planned[best].plan.estimated_step_s, ORDER.index(option) > ORDER.index(best))
        )
        try:
            result = screened[option]
            if isinstance(result, ValueError):
                raise result
            planned[option] = _plan_screened(
                result,
                graph,
                method,
                cluster,
                trainable,
                optimizer_state_copies,
                option,
                [result.partition, *result.runners_up],
                stage_timer,
                beat=bound,
            )
        finally:
            seconds[option] += time.perf_counter() - started
        return planned[option].plan

    chosen = planned[choose_remat(make, cluster.device_memory_bytes, order=order).remat]
    # the chosen option's own phases, then what planning every option took
    chosen.plan.timings.update({f"remat_{option}": s for option, s in seconds.items()})
    chosen.plan.timings["remat_choice"] = sum(seconds.values())
    chosen.plan.solver["remat_order"] = list(order)
    return chosen


@dataclass
class _Screened:
    """Layers and the stage DP's partitions for one remat option, before the sharding ILP."""

    layering: Layering
    partition: StagePartition
    runners_up: list[StagePartition]
    timings: dict[str, float]
    cost: AnalyticStageCost | None = None
    """The stage DP's cost model (``None``: stages given by hand or uniform, their logical meshes kept as given)."""


def _screen(
    graph: Graph, method: PipeshardParallel, cluster: ClusterSpec, optimizer_state_copies: float, remat: str
) -> _Screened:
    timings: dict[str, float] = {}
    start = time.perf_counter()
    if method.layer_option == "manual":
        layering = layers_mod.manual_layers(graph)
    else:
        layering = layers_mod.cluster_layers(graph, method.layer_option.layer_num, method.layer_option.eps)
    timings["cluster"] = time.perf_counter() - start
    num_layers = layering.num_layers
    micro = _micro_batches(method)
    option = method.stage_option
    start = time.perf_counter()
    runners_up: list[StagePartition] = []
    cost = None
    from torchpar.planner.pipeline import stages as stages_mod

    hosts, per_host = cluster.num_hosts, cluster.devices_per_host
    virtual = method.virtual_stages or 1  # interleaved 1F1B: stages per device group
    if isinstance(option, ManualStageOption):
        partition = stages_mod.manual_stages(
            option.forward_stage_layer_ids,
            option.submesh_physical_shapes,
            option.submesh_logical_shapes,
            num_layers=num_layers,
            cluster_hosts=hosts,
            devices_per_host=per_host,
            num_micro_batches=micro,
            schedule=method.schedule,
            virtual_stages=virtual,
        )
    elif option == "uniform":
        partition = stages_mod.uniform_stages(
            num_layers,
            None,
            hosts,
            per_host,
            num_micro_batches=micro,
            schedule=method.schedule,
            virtual_stages=virtual,
        )
    else:
        cost = stages_mod.AnalyticStageCost(layering, graph, cluster, micro, optimizer_state_copies, remat=remat)
        if virtual > 1:
            result = interleaved_stage_dp(
                num_layers,
                hosts,
                per_host,
                micro,
                cost,
                cluster.device_memory_bytes,
                virtual_stages=virtual,
            )
        else:
            result = stages_mod.stage_dp(
                num_layers,
                hosts,
                per_host,
                micro,
                cost,
                cluster.device_memory_bytes,
                schedule=method.schedule,
            )
        partition = result.best
        alternatives = list(result.runners_up)
        for count in range(1, min(num_layers // virtual, hosts * per_host) + 1):  # uniform splits as reference points
            try:
                alternatives.append(
                    stages_mod.uniform_stages(
                        num_layers,
                        count,
                        hosts,
                        per_host,
                        cost=cost,
                        num_micro_batches=micro,
                        memory_budget=cluster.device_memory_bytes,
                        schedule=method.schedule,
                        warn_over_budget=False,
                        virtual_stages=virtual,
                    )
                )
            except ValueError:
                continue
        seen = {str(partition)}
        for candidate in sorted(alternatives, key=lambda p: p.cost_s):
            # a uniform split over the budget by the stage DP's memory model (the ILP's minimum) is not a candidate
            fits = all(stage.memory_bytes <= cluster.device_memory_bytes / virtual for stage in candidate.stages)
            if str(candidate) not in seen and math.isfinite(candidate.cost_s) and fits:
                seen.add(str(candidate))
                runners_up.append(candidate)
        runners_up = runners_up[: REFINED_CANDIDATES - 1]
        timings["stage_dp_search"] = result.dp_s
        timings["stage_table"] = result.table_s
    timings["stage_dp"] = time.perf_counter() - start
    return _Screened(layering, partition, runners_up, timings, cost)


def _plan_screened(
    screened: _Screened,
    graph: Graph,
    method: PipeshardParallel,
    cluster: ClusterSpec,
    trainable: set[str],
    optimizer_state_copies: float,
    remat: str,
    candidates: list[StagePartition],
    stage_timer: StageTimer | None,
    beat: tuple[float, bool] = (math.inf, True),
) -> PipelinePlan:
    """The plan of the best of ``candidates`` (stage partitions of ``screened``) refined by the sharding ILP. Raises
    the first candidate's ``ValueError`` when none fits. ``beat``: ``(step, loses_ties)`` of a plan made before
    (another remat option's); a candidate that cannot beat it is not refined, and if none can,
    :class:`torchpar.planner.remat_choice.NoFasterPlan` is raised."""
    bounded = stage_timer is None and PRUNE_CANDIDATES  # a measured profile ranks every candidate: none left out
    from torchpar.planner.pipeline import stages as stages_mod

    layering, timings = screened.layering, dict(screened.timings)
    virtual = method.virtual_stages or 1
    micro = _micro_batches(method)
    start = time.perf_counter()
    counts_before = dict(SOLVE_COUNTS)
    refined_at: list[tuple[int, _Refined]] = []  # (position in candidates, its refinement)
    failed_at: list[tuple[int, StagePartition, ValueError | SolveTimeout]] = []  # (position, candidate, error)
    pruned: list[tuple[StagePartition, float, float]] = []  # (candidate, its step's lower bound, the best step then)
    prepared: list[tuple[int, _Prepared]] = []
    for position, candidate in enumerate(candidates):
        try:
            prepared.append(
                (
                    position,
                    _prepare(
                        graph,
                        layering,
                        candidate,
                        cluster,
                        micro,
                        trainable,
                        optimizer_state_copies,
                        remat,
                        method.schedule,
                        virtual,
                        method.experts,
                        method.context,
                        screened.cost,
                    ),
                )
            )
        except ValueError as error:  # e.g. a batch that does not divide a stage's mesh
            failed_at.append((position, candidate, error))
    if bounded and (len(prepared) > 1 or math.isfinite(beat[0])):
        probing = time.perf_counter()
        prepared = _probe(prepared, cluster.device_memory_bytes / virtual, failed_at, reached=beat[0])
        timings["ilp_probe"] = time.perf_counter() - probing
    for position, problem in prepared:
        candidate = problem.partition
        # a measured profile ranks every candidate by its timing, so none may be left out by the estimate
        leader = min(refined_at, key=lambda item: (item[1].step_s, item[0]), default=None)
        beat_s, loses_ties = beat if bounded else (math.inf, True)
        if bounded and leader is not None and leader[1].step_s < beat_s:
            beat_s, loses_ties = leader[1].step_s, position > leader[0]
        try:
            refined_at.append(
                (
                    position,
                    _refine(
                        problem,
                        cluster.device_memory_bytes / virtual,
                        STAGE_TIME_LIMIT_S if candidate is screened.partition else RUNNER_UP_STAGE_TIME_LIMIT_S,
                        beat_s=beat_s,
                        loses_ties=loses_ties,
                    ),
                )
            )
        except _CannotWin as bound:
            pruned.append((candidate, bound.step_s, beat_s))
            log.info(
                "stage partition %s: its step is at least %.4g s, no better than %.4g s: not refined further",
                candidate,
                bound.step_s,
                beat_s,
            )
        except (ValueError, SolveTimeout) as error:  # no sharding fits the memory budget, or none found in time
            failed_at.append((position, candidate, error))
            log.info("stage partition %s: the ILP found no plan (%s)", candidate, error)
    refined = [r for _, r in sorted(refined_at, key=lambda item: item[0])]  # candidates' order: ties go to the first
    failures = [(candidate, error) for _, candidate, error in sorted(failed_at, key=lambda item: item[0])]
    timings["ilp"] = time.perf_counter() - start
    timings["ilp_graphs"] = sum(p.build_s for _, problem in prepared for p in problem.problems)
    timings["ilp_solves"] = sum(r.solution.solve_s for refinement in refined for r in refinement.results)
    ilp_counts = {kind: SOLVE_COUNTS[kind] - counts_before[kind] for kind in SOLVE_COUNTS}
    if not refined:
        if pruned:  # every candidate that fits is provably no faster than the plan ``beat`` describes
            raise NoFasterPlan(min(bound for _, bound, _ in pruned), beat[0])
        raise failures[0][1]
    best = min(refined, key=lambda r: r.step_s)
    profile: dict[str, object] | None = None
    if stage_timer is not None:
        start = time.perf_counter()
        ranked = rank_candidates(
            [(r.step_s, list(zip(r.stage_graphs, r.stage_plans))) for r in refined],
            stage_timer,
            micro,
            remat=remat,
            schedule=method.schedule,
            virtual_stages=virtual,
        )
        best = refined[ranked[0].index]
        profile = record_profile(ranked, ranked[0], best.stage_plans)
        timings["profile"] = time.perf_counter() - start
        log.info(
            "profiled %d candidate partition(s): measured step %.4g s (estimate %.4g s)",
            len(refined),
            ranked[0].measured_step_s,
            best.step_s,
        )
    solver: dict = {f"stage{index}": stats for index, stats in enumerate(best.solver_stats)}
    if profile is not None:
        solver["profile"] = profile
    solver["ilp_problems"] = ilp_counts  # CP-SAT solves run, and identical stages' problems answered from them
    solver["estimate"] = {
        "model": ESTIMATE_MODEL,
        "step_formula": stages_mod.latency_formula(method.schedule, micro, virtual),
    }
    if method.stage_option == "auto":
        solver["stage_partition"] = {**best.partition.to_dict(), "model": SCREENING_MODEL}
        solver["runners_up"] = [r.summary() for r in sorted(refined, key=lambda r: r.step_s) if r is not best]
        solver["runners_up"] += [
            {"screening_step_s": c.cost_s, "model": SCREENING_MODEL, "error": str(e), "stages": c.to_dict()["stages"]}
            for c, e in failures
        ]
        # a bound on the ILP's model; its stages carry their layout only (no stage was priced to the end)
        solver["runners_up"] += [
            {
                "screening_step_s": c.cost_s,
                "model": ESTIMATE_MODEL,
                "step_at_least_s": bound,
                "pruned": f"its step is at least {bound:.6g} s by the ILP's lower bounds, no better "
                f"than {beat:.6g} s: not solved to the end",
                "stages": [
                    {key: stage[key] for key in ("layers", "submesh_shape", "logical_mesh_shape")}
                    for stage in c.to_dict()["stages"]
                ],
            }
            for c, bound, beat in pruned
        ]
    plan = Plan(
        method=PipeshardParallel.name,
        stages=best.stage_plans,
        num_micro_batches=micro,
        schedule=method.schedule,
        estimated_step_s=best.step_s,
        solver=solver,
        timings=timings,
        layers=_layer_stats(graph, layering),
        cluster=cluster.cost_constants(),
        layer_of_node=dict(layering.layer_of),
        remat=remat,
    )
    log.info(
        "pipeline plan: %d layers → %d stages %s on %s",
        layering.num_layers,
        len(best.stage_plans),
        [s.layers for s in best.stage_plans],
        [s.submesh_shape for s in best.stage_plans],
    )
    return PipelinePlan(
        plan=plan, stages=best.stage_graphs, devices=best.devices, layering=layering, stage_results=best.results
    )


REFINED_CANDIDATES = 3
"""Stage partitions (the DP's best and its runners-up) priced again, stage by stage, by the sharding ILP."""
STAGE_TIME_LIMIT_S = 30.0
"""CP-SAT time limit of each stage's ILP in the stage DP's best partition."""
PRUNE_CANDIDATES = True
"""Probe every candidate's stages first and stop refining the candidates that cannot win (:func:`_probe`,
:func:`_refine`); ``False`` refines every candidate to the end (the reference the tests compare against)."""
PROBE_STAGE_TIME_LIMIT_S = 2.0
"""CP-SAT time limit of the first, probing solve of every candidate's stages (:func:`_probe`): the bounds it proves
let a candidate that cannot win go unsolved (Mixtral-8×7B on 8×8: the stage DP's best partition had two stages that
ran to the 30 s limit, and a runner-up solved in 0.7 s was 3× faster)."""
RUNNER_UP_STAGE_TIME_LIMIT_S = 5.0
"""… and in a runner-up's: a stage whose memory constraint makes the solve hard stops with its best plan so far
(its gap is in ``solver``); measured on GPT-3 39B over 8×8 V100s, two such stages took the 30 s limit each."""
ESTIMATE_MODEL = "sharding ILP per stage (alpha-beta, host-aware links)"
SCREENING_MODEL = "stage DP screening (analytic: 3·FLOPs, data- and tensor-parallel all-reduces)"


@dataclass
class _Refined:
    """A stage partition priced by the sharding ILP: its stage plans and the pipeline step they give."""

    partition: StagePartition
    stage_graphs: list[StageGraph]
    devices: list[list[int]]
    results: list[IntraOpResult]
    stage_plans: list[StagePlan]
    step_s: float
    solver_stats: list[dict]

    def summary(self) -> dict:
        stages = [
            {
                "layers": s.layers,
                "submesh_shape": list(s.submesh_shape),
                "logical_mesh_shape": list(s.logical_mesh_shape),
                "estimated_cost_s": s.estimated_cost_s,
                "estimated_memory_bytes": s.estimated_memory_bytes,
            }
            for s in self.stage_plans
        ]
        return {
            "estimated_step_s": self.step_s,
            "screening_step_s": self.partition.cost_s,
            "model": ESTIMATE_MODEL,
            "stages": stages,
        }


def _probe(
    prepared: list[tuple[int, _Prepared]],
    memory_budget: float,
    failures: list[tuple[int, StagePartition, ValueError | SolveTimeout]],
    reached: float = math.inf,
) -> list[tuple[int, _Prepared]]:
    """Every candidate's stages solved under :data:`PROBE_STAGE_TIME_LIMIT_S` first (:meth:`.PreparedStage.probe`):
    most stage problems are solved to optimality at once; a hard one leaves a proven lower bound and a layout. A
    candidate stops being probed once its bound exceeds the best step a probed candidate reached. Returns the
    candidates that fit, likeliest winner first (least probed step, then least bound), so that its step prunes the
    others in :func:`_refine`; a candidate with no layout that fits goes to ``failures``. ``reached``: a step already
    reached elsewhere (another remat option's plan), which stops probing as the candidates' own steps do."""
    kept: list[tuple[int, _Prepared]] = []
    for position, candidate in sorted(prepared, key=lambda item: item[1].lower_bound_s):
        try:
            for index in candidate.solve_order():
                if candidate.lower_bound_s > reached:
                    break
                candidate.problems[index].probe(memory_budget, PROBE_STAGE_TIME_LIMIT_S)
        except ValueError as error:  # no layout of a stage fits the memory budget
            failures.append((position, candidate.partition, error))
            continue
        reached = min(reached, candidate.probed_step_s)
        kept.append((position, candidate))
    return sorted(kept, key=lambda item: (item[1].probed_step_s, item[1].lower_bound_s))


def _micro_batches(method: PipeshardParallel) -> int:
    """``method``'s micro-batch count: an int by the time a pipeline is planned (``"auto"`` is a search over counts,
    :mod:`.micro_batch_counts`, each planned with its own count)."""
    count = method.num_micro_batches
    assert isinstance(count, int), "num_micro_batches='auto' is resolved before a pipeline is planned"
    return count


class _CannotWin(Exception):
    """A partition's step is provably no better than one already refined (``step_s``: its lower bound)."""

    def __init__(self, step_s: float):
        super().__init__(step_s)
        self.step_s = step_s


@dataclass
class _Prepared:
    """A stage partition's sharding problems, built and not yet solved, and the bound on its step they give."""

    partition: StagePartition
    stage_graphs: list[StageGraph]
    stage_layers: list[list[int]]
    submeshes: list[tuple[int, int]]
    devices: list[list[int]]
    problems: list[_MeshChoice]
    step: Callable[[list[float]], float]
    in_flight: list[int]
    """Micro-batches each stage holds at once (its activations' copies in the memory model)."""

    def solve_order(self, bounds: list[float] | None = None) -> list[int]:
        """Stage indices, slowest ``bounds`` first (default: the stages' lower bounds), so that the partition's bound
        rises early; among equal bounds (identical stages) the stage holding the fewest micro-batches first: its
        optimum, if it fits the others' tighter memory, answers them without a solve
        (:func:`torchpar.planner.sharding.ilp.solve`)."""
        bounds = [problem.lower_bound_s for problem in self.problems] if bounds is None else bounds
        return sorted(range(len(self.problems)), key=lambda i: (-bounds[i], self.in_flight[i]))

    @property
    def lower_bound_s(self) -> float:
        """No refinement of this partition has a smaller step (each stage at its proven bound)."""
        return self.step([problem.lower_bound_s for problem in self.problems])

    @property
    def probed_step_s(self) -> float:
        """The step of the layouts probing found (∞ if a stage has none yet)."""
        return self.step([problem.probed_s for problem in self.problems])


def _prepare(
    graph: Graph,
    layering: Layering,
    partition: StagePartition,
    cluster: ClusterSpec,
    num_micro_batches: int,
    trainable: set[str],
    optimizer_state_copies: float,
    remat: str,
    schedule: Schedule,
    virtual_stages: int,
    experts: str = "auto",
    context: str = "auto",
    cost: AnalyticStageCost | None = None,
) -> _Prepared:
    """``partition``'s stage problems; with the stage DP's ``cost``, each stage's on every logical mesh
    :func:`.stages.close_logical_meshes` offers (:class:`_MeshChoice`), else on its own."""
    from torchpar.planner.pipeline import stages as stages_mod

    stage_layers = [list(ids) for ids in partition.forward_stage_layer_ids]
    # a partition's shapes are pairs
    submeshes = cast(list[tuple[int, int]], [tuple(s) for s in partition.submesh_physical_shapes])
    logical = cast(list[tuple[int, int]], [tuple(s) for s in partition.submesh_logical_shapes])
    stage_graphs = slice_stages(graph, stage_of_nodes(graph, layering.layer_of, stage_layers))
    groups = len(submeshes) // virtual_stages  # interleaved 1F1B: stage s on the devices of group s mod G
    group_devices = stages_mod.assign_devices(submeshes[:groups], cluster.num_hosts, cluster.devices_per_host)
    devices = [list(group_devices[s % groups]) for s in range(len(submeshes))]
    # micro-batches each stage holds at once, as the stage DP counts them (1F1B: the stages from it to the last)
    in_flight = stages_mod.micro_batches_in_flight(len(stage_graphs), num_micro_batches, schedule, virtual_stages)
    if cost is None:
        meshes = [[mesh] for mesh in logical]
    else:
        budget = cluster.device_memory_bytes / virtual_stages
        meshes = [
            stages_mod.close_logical_meshes(choice, cost, budget, in_flight[index])
            for index, choice in enumerate(partition.stages)
        ]
    problems = [
        _MeshChoice(
            [
                prepare_stage(
                    stage.graph,
                    StageProblem(
                        kind="shard",
                        cluster=cluster,
                        trainable=frozenset(trainable & set(stage.params)),
                        optimizer_state_copies=optimizer_state_copies,
                        submesh=submeshes[index],
                        remat=remat,
                        in_flight=in_flight[index],
                        experts=experts,
                        context=context,
                        num_micro_batches=num_micro_batches,
                        per_micro_batch=True,
                    ),
                    mesh_shape,
                )
                for mesh_shape in meshes[index]
            ]
        )
        for index, stage in enumerate(stage_graphs)
    ]

    def step(latencies: list[float]) -> float:
        return stages_mod.pipeline_latency(latencies, num_micro_batches, schedule, virtual_stages)

    return _Prepared(partition, stage_graphs, stage_layers, submeshes, devices, problems, step, list(in_flight))


@dataclass
class _MeshChoice:
    """One stage's sharding problems on the logical meshes the ILP prices for it, the screened one first: the stage
    takes the cheapest solution. Probed and solved as a :class:`torchpar.planner.intra_op.PreparedStage` is (its bound:
    the least alternative's)."""

    alternatives: list[PreparedStage]

    @property
    def build_s(self) -> float:
        return sum(problem.build_s for problem in self.alternatives)

    @property
    def lower_bound_s(self) -> float:
        return min(problem.lower_bound_s for problem in self.alternatives)

    @property
    def probed_s(self) -> float:
        return min(problem.probed_s for problem in self.alternatives)

    def probe(self, memory_budget: float, time_limit_s: float) -> None:
        """Probe every alternative; those with no layout that fits are dropped (the first one's error is raised
        when none fits)."""
        fitting, errors = [], []
        for problem in self.alternatives:
            try:
                problem.probe(memory_budget, time_limit_s)
                fitting.append(problem)
            except ValueError as error:
                errors.append(error)
        if not fitting:
            raise errors[0]
        self.alternatives = fitting

    def solve(
        self, memory_budget: float, time_limit_s: float, give_up: Callable[[float], bool] | None = None
    ) -> IntraOpResult:
        """The cheapest alternative's result. Alternatives already solved (by a probe) are taken first; another one is
        solved only while its bound can beat the best so far, and stops as soon as its proven bound cannot. ``give_up``
        as :meth:`torchpar.planner.intra_op.PreparedStage.solve`'s: :class:`.sharding.ilp.AboveCutoff` (the least bound
        proven) when every alternative's bound was given up."""
        best: IntraOpResult | None = None
        failure: ValueError | SolveTimeout | None = None
        bounds: list[float] = []
        for problem in sorted(self.alternatives, key=lambda p: (p.final is None, p.lower_bound_s)):
            least = math.inf if best is None else best.stage.estimated_cost_s
            if problem.lower_bound_s >= least:
                continue

            def stop(bound_s: float, least: float = least) -> bool:
                return bound_s >= least or (give_up is not None and give_up(bound_s))

            try:
                result = problem.solve(memory_budget, time_limit_s, give_up=stop)
            except AboveCutoff as stopped:
                bounds.append(stopped.bound_s)
                continue
            except (ValueError, SolveTimeout) as error:
                failure = failure or error
                continue
            if result.stage.estimated_cost_s < least:
                best = result
        if best is None and bounds:
            raise AboveCutoff(min(bounds))
        if best is None and failure is not None:
            raise failure
        if best is None:  # every alternative's bound is infinite: none was worth solving
            meshes = ", ".join("x".join(map(str, p.mesh.shape)) for p in self.alternatives)
            raise ValueError(
                f"no logical mesh of this stage ({meshes}) has a finite lower bound on its cost: every op's cheapest "
                "strategy is infinite (an op no mesh can run); give the stage more devices or fewer layers"
            )
        return best


def _refine(
    prepared: _Prepared, memory_budget: float, time_limit_s: float, beat_s: float = math.inf, loses_ties: bool = True
) -> _Refined:
    """The prepared partition priced by the sharding ILP, stage by stage. ``beat_s``: the best step found so far;
    raises :class:`_CannotWin` as soon as this partition's step is provably above it (or equal to it, if
    ``loses_ties``) — a bound made of the solved stages' estimates and the unsolved stages' lower bounds
    (:attr:`torchpar.planner.intra_op.PreparedStage.lower_bound_s`: every op at its cheapest strategy, no resharding),
    which the step formula (non-decreasing in every stage's time) keeps a bound. Exact: a pruned partition could not
    have won. Stages are solved slowest bound first, so that the bound rises early."""
    problems, step = prepared.problems, prepared.step
    bounds = [problem.lower_bound_s for problem in problems]

    def cannot_win(value: float) -> bool:
        return value > beat_s or (loses_ties and value == beat_s)

    if cannot_win(step(bounds)):
        raise _CannotWin(step(bounds))
    results: list[IntraOpResult | None] = [None] * len(problems)
    order = prepared.solve_order(bounds)
    for count, index in enumerate(order, start=1):

        def give_up(bound_s: float, index: int = index) -> bool:  # this stage at bound_s loses the partition
            return cannot_win(step([bound_s if i == index else b for i, b in enumerate(bounds)]))

        try:
            result = problems[index].solve(
                memory_budget, time_limit_s, give_up=give_up if math.isfinite(beat_s) else None
            )
        except AboveCutoff as stopped:
            bounds[index] = stopped.bound_s
            raise _CannotWin(step(bounds)) from None
        result.stage.layers = prepared.stage_layers[index]
        result.stage.submesh_shape = prepared.submeshes[index]
        result.stage.device_ids = prepared.devices[index]
        results[index] = result
        bounds[index] = result.stage.estimated_cost_s
        if count < len(problems) and cannot_win(step(bounds)):
            raise _CannotWin(step(bounds))
    solved = cast(list[IntraOpResult], results)  # every stage solved above (or _CannotWin raised)
    plans = [r.stage for r in solved]
    return _Refined(
        prepared.partition,
        prepared.stage_graphs,
        prepared.devices,
        solved,
        plans,
        step([p.estimated_cost_s for p in plans]),
        [r.solver_stats() for r in solved],
    )


def _layer_stats(graph: Graph, layering: Layering) -> list[dict]:
    """Per layer: forward FLOPs, entering activation bytes, and the modules whose ops it holds (block level)."""
    modules: list[dict[str, None]] = [{} for _ in range(layering.num_layers)]
    for node in graph.nodes:
        layer = layering.layer_of.get(node.name)
        if layer is not None and node.module_path:
            modules[layer][".".join(node.module_path.split(".")[:3])] = None
    return [
        {"flops": float(f), "activation_bytes": float(b), "modules": list(m)}
        for f, b, m in zip(layering.flops, layering.boundary_bytes, modules)
    ]


def stage_graphs_for(graph: Graph, plan: Plan) -> list[StageGraph]:
    """The stage graphs of a saved pipeline ``plan`` for ``graph`` (the model captured on one micro-batch of the
    batch the plan was made for): every node's layer from ``plan.layer_of_node``, each stage's layers from
    ``plan.stages``. Raises ``ValueError`` if the graph is not the one the plan was made for."""
    if not plan.layer_of_node:
        raise ValueError(
            "this pipeline plan has no node → layer map (layer_of_node); it was saved by an older "
            "torchpar: plan it again"
        )
    names = {n.name for n in graph.nodes}
    missing = sorted(names - set(plan.layer_of_node))
    extra = sorted(set(plan.layer_of_node) - names)
    if missing or extra:
        raise ValueError(
            f"the plan was made for another graph: {len(missing)} op(s) of this model are not in it "
            f"({missing[:5]}) and {len(extra)} of its ops are not in this model ({extra[:5]}); "
            "compile with the model, batch size (÷ num_micro_batches) and loss the plan was made for"
        )
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

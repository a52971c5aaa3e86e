"""The planner's one door: a captured training graph and a method → the plan and the graphs its executor runs.

Every method comes through :func:`plan_training`: ``None`` (one device), a one-stage sharding method
(DataParallel, ZeRO-2/3, Megatron, ShardParallel), ``PipeshardParallel``, or a saved :class:`Plan` (checked
against the cluster and taken as it is). What comes back, a :class:`TrainingPlan`, has the same shape for all of
them (a one-stage plan is a pipeline of one stage, the whole graph), so nothing above the runtime asks which
kind it holds. For other batch shapes (an epoch's smaller last batch) the same plan is cut
again by :meth:`TrainingPlan.stage_graphs_for`; the plan itself never changes after planning.

The graph is captured on one micro-batch (``num_micro_batches > 1``: pipelines and gradient accumulation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torchpar.hardware import ClusterSpec
from torchpar.ir.graph import Graph
from torchpar.methods import PipeshardParallel
from torchpar.planner.for_method import check_plan_fits, plan_for_method, single_device_plan
from torchpar.planner.pipeline.pipeline_plan import plan_pipeline, stage_graphs_for, stage_graphs_on_new_shapes
from torchpar.planner.pipeline.slicing import StageGraph
from torchpar.planner.plan import Plan
from torchpar.planner.profiling import StageTimer, profile_one_stage


@dataclass
class TrainingPlan:
    """A plan and the stage graphs its executor builds the stages from.

    Invariant: ``stage_graphs`` cut ``graph`` into ``plan.stages`` in order (``len(stage_graphs) ==
    len(plan.stages)`` for pipelines); a one-stage plan's list is empty, its one stage being the whole graph, which
    the executor compiles per batch signature."""

    plan: Plan
    graph: Graph
    """The training graph planned (captured on one micro-batch of the example batch)."""
    stage_graphs: list[StageGraph]
    trainable: frozenset[str]
    """The parameters the optimizer updates (the stages' programs differentiate only these)."""

    def stage_graphs_for(self, graph: Graph) -> list[StageGraph] | None:
        """The plan's stages cut out of ``graph``, the model captured on other batch shapes (one micro-batch of
        them): what the executor compiles for those shapes. ``None`` when nothing new is needed: ``graph`` is the
        planned one, or the plan has one stage. Raises ``ValueError`` naming both shapes' graphs when the plan's
        layers do not cut ``graph`` into its stages."""
        if not self.plan.is_pipeline or graph is self.graph:
            return None
        try:
            return stage_graphs_on_new_shapes(graph, self.graph, self.plan)
        except ValueError as error:
            raise ValueError(
                f"the pipeline plan cannot cut the model captured on these batch shapes into its "
                f"{len(self.plan.stages)} stages ({error}); keep the example batch's shapes"
            ) from None


def plan_training(
    graph: Graph,
    method: object,
    cluster: ClusterSpec,
    *,
    trainable: set[str],
    optimizer_state_copies: float,
    remat: str | None = None,
    explain: bool = False,
    stage_timer: StageTimer | None = None,
    beat_s: float = math.inf,
) -> TrainingPlan:
    """The plan ``method`` gives ``graph`` on ``cluster`` (see the module docstring for the methods).

    ``trainable``: the parameters the optimizer updates; ``optimizer_state_copies``: optimizer tensors per
    parameter (Adam 2, SGD with momentum 1). ``remat``: the activation checkpointing to price (``None`` is
    ``"none"``; ``"auto"`` lets the planner choose); a saved plan keeps its own unless ``remat`` names one.
    ``explain``: also count collective bytes and price the other one-stage methods (for reports; a few more
    solves). ``stage_timer`` (measured profiling): time the candidates on real devices — a pipeline's refined
    partitions, choosing the fastest measured; a one-stage plan's single stage, reported beside its estimate.
    ``beat_s`` (pipelines): a step reached elsewhere; :class:`.remat_choice.NoFasterPlan` when no plan can beat it.
    Raises ``ValueError`` when no plan fits the memory budget or a saved plan does not fit the cluster."""
    if isinstance(method, Plan):
        check_plan_fits(method, cluster)
        if remat not in (None, "auto"):
            method.remat = remat
        stages = stage_graphs_for(graph, method) if method.is_pipeline else []
        return TrainingPlan(method, graph, stages, frozenset(trainable))
    remat = remat or "none"
    if isinstance(method, PipeshardParallel):
        pipeline = plan_pipeline(
            graph,
            method,
            cluster,
            trainable=trainable,
            optimizer_state_copies=optimizer_state_copies,
            remat=remat,
            stage_timer=stage_timer,
            beat_s=beat_s,
        )
        if explain:
            pipeline.explain()
        return TrainingPlan(pipeline.plan, graph, pipeline.stages, frozenset(trainable))
    if method is None:
        plan = single_device_plan(
            graph, cluster, remat, trainable=trainable, optimizer_state_copies=optimizer_state_copies
        )
    else:
        plan = plan_for_method(
            graph,
            method,
            cluster,
            trainable=trainable,
            optimizer_state_copies=optimizer_state_copies,
            explain=explain,
            remat=remat,
        )
    if stage_timer is not None:
        profile_one_stage(plan, graph, stage_timer)
    return TrainingPlan(plan, graph, [], frozenset(trainable))

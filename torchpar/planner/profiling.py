"""Measured profiling (``profile=True``): candidate plans ranked by timed stages, link constants fitted to timed
collectives.

The planner prices plans analytically (3·FLOPs at the device's peak, alpha-beta collectives). With profiling on,
the runtime compiles and times what the planner proposes on the devices the plan would run on, and the planner
decides by those timings. The timing itself belongs to the runtime (:mod:`torchpar.runtime.measure.profiler`); it is
passed in here as a :class:`StageTimer`, so the planner imports nothing of the runtime.

Stage ranking
-------------
A candidate pipeline of ``S`` stages on ``M`` micro-batches is estimated to take

    T = Σ_i t_i + (M − 1) · max_i t_i                    (:func:`torchpar.planner.pipeline.stages.pipeline_latency`)

(1F1B and GPipe; interleaved 1F1B and ZB-H1 have their own formulas there, used alike) with ``t_i`` the per-micro-batch
forward + backward time of stage ``i``. :func:`measured_step` puts the measured ``t̂_i`` (median over repeats of the
compiled stage's forward and backward on one micro-batch, compilation excluded) in place of the estimate, and
:func:`rank_candidates` picks the candidate with the least measured ``T̂``. The optimizer update (once per step, the
same parameters whatever the partition) and the activation transfers between stages are in neither ``T`` nor ``T̂``.

Link fitting
------------
The cost model prices an all-reduce of ``B`` bytes over a mesh axis of ``n`` devices as
``AR(B) = α + 2β·(n−1)/n·B`` (:mod:`.sharding.cost_model`). Given timed all-reduces ``(B_k, τ_k)`` on that axis,
:func:`fit_alpha_beta` solves the least-squares line ``τ = α + β·x`` with ``x_k = 2(n−1)/n·B_k``:

    β = Σ (x_k − x̄)(τ_k − τ̄) / Σ (x_k − x̄)²,     α = τ̄ − β·x̄,

clamped to ``α, β ≥ 0`` (a negative intercept re-fits ``β`` through the origin: ``β = Σ x_k τ_k / Σ x_k²``).
:func:`calibrated_cluster` replaces the in-host constants of each axis with the fitted ones; the inter-host
constants stay as given (one process measures only the links between its own devices).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Protocol

from torchpar.hardware import ClusterSpec
from torchpar.ir.graph import Graph
from torchpar.planner.pipeline.slicing import StageGraph, slice_stages
from torchpar.planner.pipeline.stages import Schedule, pipeline_latency
from torchpar.planner.plan import Plan, StagePlan


@dataclass(frozen=True)
class StageTiming:
    """One compiled stage, timed on its devices: per micro-batch forward and backward seconds (medians),
    the seconds its compilation took (0 when read from the profile cache) and whether it came from the cache."""

    forward_s: float
    backward_s: float
    compile_s: float = 0.0
    cached: bool = False

    @property
    def step_s(self) -> float:
        """Forward + backward of one micro-batch: the ``t̂_i`` of the module docstring."""
        return self.forward_s + self.backward_s

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


class StageTimer(Protocol):
    """Compiles ``stage`` (a stage graph with micro-batch shapes) as ``plan`` places it, with activation
    checkpointing ``remat``, and times it."""

    def __call__(self, stage: StageGraph, plan: StagePlan, remat: str) -> StageTiming: ...


@dataclass(frozen=True)
class LinkFit:
    """Fitted constants of one mesh axis: latency ``alpha`` (s), inverse bandwidth ``beta`` (s/byte), and the
    timed points ``(bytes, seconds)`` they were fitted to, on ``devices`` devices."""

    axis: int
    devices: int
    alpha: float
    beta: float
    points: tuple[tuple[float, float], ...]

    def to_dict(self) -> dict[str, object]:
        return {
            "axis": self.axis,
            "devices": self.devices,
            "alpha": self.alpha,
            "beta": self.beta,
            "points": [list(p) for p in self.points],
        }


def fit_alpha_beta(points: Sequence[tuple[float, float]], devices: int) -> tuple[float, float]:
    """``(α, β)`` of the all-reduce line through timed ``points`` ``(bytes, seconds)`` on ``devices`` devices (the
    module docstring's least squares). Needs two distinct sizes and ``devices ≥ 2``."""
    if devices < 2:
        raise ValueError(f"an all-reduce over {devices} device has no link to fit")
    if len({b for b, _ in points}) < 2:
        raise ValueError(f"fitting α and β needs timings at two sizes or more, got {list(points)}")
    xs = [2.0 * (devices - 1) / devices * b for b, _ in points]
    ts = [float(t) for _, t in points]
    x_mean, t_mean = sum(xs) / len(xs), sum(ts) / len(ts)
    beta = sum((x - x_mean) * (t - t_mean) for x, t in zip(xs, ts)) / sum((x - x_mean) ** 2 for x in xs)
    alpha = t_mean - beta * x_mean
    if alpha < 0:
        alpha, beta = 0.0, sum(x * t for x, t in zip(xs, ts)) / sum(x * x for x in xs)
    return max(alpha, 0.0), max(beta, 0.0)


def calibrated_cluster(cluster: ClusterSpec, fits: Sequence[LinkFit]) -> ClusterSpec:
    """``cluster`` with the in-host ``alpha``/``beta`` of every fitted axis replaced by the fit."""
    alpha, beta = list(cluster.alpha), list(cluster.beta)
    for fit in fits:
        alpha[fit.axis], beta[fit.axis] = fit.alpha, fit.beta
    return replace(cluster, alpha=(alpha[0], alpha[1]), beta=(beta[0], beta[1]))


def measured_step(
    timings: Sequence[StageTiming], num_micro_batches: int, schedule: Schedule = "1f1b", virtual_stages: int = 1
) -> float:
    """The step of ``schedule`` on the stages' measured per-micro-batch times
    (:func:`torchpar.planner.pipeline.stages.pipeline_latency`: ``T̂ = Σ t̂ + (M − 1)·max t̂`` under 1F1B and GPipe)."""
    return pipeline_latency([t.step_s for t in timings], num_micro_batches, schedule, virtual_stages)


@dataclass
class RankedCandidate:
    """One candidate plan with its estimate and its measurement."""

    index: int
    estimated_step_s: float
    timings: list[StageTiming]
    measured_step_s: float

    def to_dict(self) -> dict[str, object]:
        return {
            "candidate": self.index,
            "estimated_step_s": self.estimated_step_s,
            "measured_step_s": self.measured_step_s,
            "stages": [t.to_dict() for t in self.timings],
        }


def rank_candidates(
    candidates: Sequence[tuple[float, Sequence[tuple[StageGraph, StagePlan]]]],
    timer: StageTimer,
    num_micro_batches: int,
    *,
    remat: str = "none",
    schedule: Schedule = "1f1b",
    virtual_stages: int = 1,
    on_stage: Callable[[], None] | None = None,
) -> list[RankedCandidate]:
    """Time every stage of every candidate (``(estimated step s, [(stage graph, stage plan), …])``) with ``timer``
    (activation checkpointing ``remat``) and return them fastest measured first by ``schedule``'s step formula (ties:
    the lower estimate first). A stage met twice (same graph, same plan: candidates often share stages) is timed once.
    ``on_stage`` is called after each stage timed (progress)."""
    seen: dict[tuple[int, int], StageTiming] = {}
    ranked = []
    for index, (estimate, stages) in enumerate(candidates):
        timings = []
        for graph, plan in stages:
            key = (id(graph), id(plan))
            if key not in seen:
                seen[key] = timer(graph, plan, remat)
                if on_stage is not None:
                    on_stage()
            timings.append(seen[key])
        ranked.append(
            RankedCandidate(
                index, float(estimate), timings, measured_step(timings, num_micro_batches, schedule, virtual_stages)
            )
        )
    return sorted(ranked, key=lambda r: (r.measured_step_s, r.estimated_step_s))


def record_profile(
    ranked: Sequence[RankedCandidate], chosen: RankedCandidate, stages: Sequence[StagePlan]
) -> dict[str, object]:
    """Write the chosen candidate's per-stage measurements into its ``stages`` (``StagePlan.measured_cost_s``) and
    return the record the plan keeps in ``plan.solver["profile"]`` (its ``links`` are filled by whoever timed
    them: ``torchpar.engine.profiled.Profiling.record_links``)."""
    for stage, timing in zip(stages, chosen.timings):
        stage.measured_cost_s = timing.step_s
    estimate_order = sorted(ranked, key=lambda r: r.estimated_step_s)
    return {
        "chosen": chosen.index,
        "measured_step_s": chosen.measured_step_s,
        "estimated_step_s": chosen.estimated_step_s,
        "changed_choice": estimate_order[0].index != chosen.index,
        "candidates": [r.to_dict() for r in ranked],
        "links": [],
        "cached_stages": sum(t.cached for r in ranked for t in r.timings),
        "timed_stages": sum(not t.cached for r in ranked for t in r.timings),
    }


def profile_one_stage(plan: Plan, graph: Graph, timer: StageTimer) -> None:
    """Time the single stage of a one-stage ``plan`` (one device, or a sharding method) on ``graph``, the whole
    training graph it was planned for, and record it (``StagePlan.measured_cost_s``, ``plan.solver["profile"]``).
    There is one candidate: the measurement is reported beside the estimate and chooses nothing."""
    (stage,) = slice_stages(graph, {node.name: 0 for node in graph.nodes})
    ranked = rank_candidates([(plan.estimated_step_s, [(stage, plan.stages[0])])], timer, 1, remat=plan.remat)
    plan.solver["profile"] = record_profile(ranked, ranked[0], plan.stages)

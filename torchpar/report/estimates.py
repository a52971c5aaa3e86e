"""The numbers a plan report shows, taken from the plan once, so every surface shows the same ones.

The HTML page (:mod:`torchpar.report.html`) and the PNG (:mod:`torchpar.report.png`) both read
:func:`plan_numbers`: the plan's step estimate (``Plan.estimated_step_s``), each stage's estimates
(``StagePlan.estimated_*``, per micro-batch for a pipeline's stages), the alternatives the planner priced on
the same model (``solver["runners_up"]``: chosen plan first), and what a run measured (``measured=``), shown
beside the estimates and never in their place. The stage DP's screening figures
(``solver["stage_partition"]``, ``runners_up[*]["screening_step_s"]``) come from a coarser model and are
always labelled as such.

A step estimate is rebuilt from the stage rows as a check: ``Σ tᵢ + (M − 1)·max tᵢ`` for a pipeline of
``M`` micro-batches (stage latencies ``tᵢ`` per micro-batch), the single stage's estimate otherwise.

Plain data in, plain data out: nothing here imports the planner or the runtime (the Plan is read as data).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from torchpar.methods import method_title
from torchpar.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from torchpar.planner.pipeline.stages import Schedule
    from torchpar.planner.plan import Plan, StagePlan

PIPELINE = "pipeshard"
"""``PipeshardParallel.name``: the one method whose step is a pipeline of stages."""
MEMORY_PARTS = ("parameters", "gradients", "optimizer_state", "activations", "buffers")
"""The parts of ``StagePlan.memory_breakdown``, in the order the report stacks them."""
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
"""The kinds of ``StagePlan.communication_bytes``."""


def axes_crossing_hosts(submesh: Sequence[int], logical: Sequence[int]) -> tuple[bool, bool]:
    """Whether logical mesh axis 0 and axis 1 reach more than one host, for a logical mesh ``(a, b)`` laid
    row-major on a submesh of ``n`` hosts × ``D`` devices: axis 1 iff ``n > 1`` and ``b ∤ D``, axis 0 iff
    ``n > 1`` and ``a > 1`` (the planner's rule, ``torchpar.planner.mesh_links``, re-derived: the report
    reads the plan as data)."""
    hosts, per_host = int(submesh[0]), int(submesh[1])
    outer, inner = int(logical[0]), int(logical[1])
    if hosts <= 1:
        return (False, False)
    return (outer > 1, inner > 1 and per_host % inner != 0)


@dataclass(frozen=True)
class StageNumbers:
    """One stage as every surface shows it (seconds per micro-batch for a pipeline's stages)."""

    index: int
    layers: tuple[int, ...]
    submesh_shape: tuple[int, int]
    logical_mesh_shape: tuple[int, int]
    cost_s: float
    compute_s: float
    communication_s: float
    memory_bytes: float
    memory_breakdown: Mapping[str, float]
    """Per-device bytes by part (:data:`MEMORY_PARTS`); empty for plans saved without it."""
    communication_bytes: Mapping[str, float]
    """Bytes by collective kind (:data:`COLLECTIVES`); empty for plans saved without it."""
    crosses_hosts: tuple[bool, bool]
    measured_memory_bytes: float | None = None

    @property
    def caption(self) -> str:
        """``"stage 0: 1×2 submesh, mesh 2×1 · est. 356 ns, 20.6 MiB"``: the PNG's legend entry."""
        crossing = [str(a) for a, cross in enumerate(self.crosses_hosts) if cross]
        hosts = f" (axis {', '.join(crossing)} crosses hosts)" if crossing else ""
        return (
            f"stage {self.index}: {mesh_text(self.submesh_shape)} submesh, mesh {mesh_text(self.logical_mesh_shape)}"
            f"{hosts} · est. {format_seconds(self.cost_s)}, {format_bytes(self.memory_bytes)}"
        )


@dataclass(frozen=True)
class Alternative:
    """One row of the runners-up table: the chosen plan (first) or a runner-up, priced by the plan's model."""

    rank: int
    """0 for the chosen plan, then 1, 2, … in the order the planner lists its runners-up."""
    step_s: float | None
    """The step estimate on the plan's own model; ``None`` if the planner found no plan for this partition, or
    the plan was saved by an older torchpar that priced runners-up by the stage DP only."""
    screening_step_s: float | None
    """The stage DP's screening figure (a coarser model); ``None`` if the plan does not carry it."""
    stages: tuple[Mapping[str, Any], ...]
    """``{"layers", "submesh_shape", "logical_mesh_shape", "estimated_cost_s", "estimated_memory_bytes"}``."""
    error: str | None = None
    at_least_s: float | None = None
    """A runner-up the planner stopped pricing once this lower bound on its step showed it could not win."""

    @property
    def chosen(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class PlanNumbers:
    """Everything numeric the report shows about a plan, and the words that say how it was estimated."""

    method: str
    title: str
    """:func:`method_title` of the method."""
    step_s: float
    """``Plan.estimated_step_s``: THE step estimate."""
    derived_step_s: float
    """The step rebuilt from the stage rows (module docstring); equals :attr:`step_s` when the plan is consistent."""
    step_formula: str
    estimate_model: str | None
    stages: tuple[StageNumbers, ...]
    alternatives: tuple[Alternative, ...]
    """Chosen plan first, then the runners-up (pipelines planned with ``stage_option="auto"``); else empty."""
    screening: Mapping[str, Any] | None
    """``solver["stage_partition"]``: the stage DP's own view of the chosen partition (coarser model)."""
    measured_step_s: float | None = None

    @property
    def step_equation(self) -> str:
        """``"step = Σ stage + (4−1)·max stage (1f1b)"``, ``"step = the stage's estimate"``."""
        formula = self.step_formula
        for prefix in ("one step = ", "step = "):
            formula = formula.removeprefix(prefix)
        return f"step = {formula}"

    @property
    def peak_memory_bytes(self) -> float:
        """The largest per-device memory estimate of any stage."""
        return max((s.memory_bytes for s in self.stages), default=0)

    @property
    def measured_peak_memory_bytes(self) -> float | None:
        measured = [s.measured_memory_bytes for s in self.stages if s.measured_memory_bytes is not None]
        return max(measured) if measured else None

    @property
    def pipeline(self) -> bool:
        return self.method == PIPELINE

    @property
    def headline(self) -> str:
        """The PNG's title and the header's one-line form."""
        measured = f" (measured {format_seconds(self.measured_step_s)})" if self.measured_step_s is not None else ""
        return (
            f"torchpar plan: {self.title}, {len(self.stages)} stage(s), estimated step "
            f"{format_seconds(self.step_s)}{measured}, est. memory {format_bytes(self.peak_memory_bytes)} per device"
        )


def plan_numbers(plan: Plan, measured: Mapping[str, Any] | None = None) -> PlanNumbers:
    """The numbers of ``plan``; ``measured`` as in :func:`check_measured`."""
    step_measured, memory_measured = check_measured(measured, len(plan.stages))
    stages = tuple(_stage_numbers(i, s, memory_measured.get(i)) for i, s in enumerate(plan.stages))
    solver = plan.solver or {}
    estimate = cast("Mapping[str, Any]", solver.get("estimate")) if isinstance(solver.get("estimate"), Mapping) else {}
    micro = max(int(plan.num_micro_batches), 1)
    if plan.method == PIPELINE and stages:
        from torchpar.planner.pipeline.schedules import device_groups
        from torchpar.planner.pipeline.stages import latency_formula, pipeline_latency

        virtual = len(plan.stages) // device_groups(plan.schedule, [s.devices() for s in plan.stages])
        schedule = cast("Schedule", plan.schedule)  # a pipeline's: one of the schedules
        derived = pipeline_latency([s.cost_s for s in stages], micro, schedule, virtual)
        formula = latency_formula(schedule, micro, virtual)
    else:
        derived = stages[0].cost_s if len(stages) == 1 else sum(s.cost_s for s in stages)
        formula = "one step = the stage's estimate" if len(stages) == 1 else "Σ stage"
    screening = solver.get("stage_partition") if isinstance(solver.get("stage_partition"), Mapping) else None
    return PlanNumbers(
        method=plan.method,
        title=method_title(plan.method),
        step_s=float(plan.estimated_step_s),
        derived_step_s=float(derived),
        step_formula=str(estimate.get("step_formula") or formula),
        estimate_model=estimate.get("model"),
        stages=stages,
        alternatives=_alternatives(plan, stages, screening),
        screening=screening,
        measured_step_s=step_measured,
    )


def check_measured(measured: Mapping[str, Any] | None, num_stages: int) -> tuple[float | None, dict[int, float]]:
    """``measured = {"step_s": seconds, "memory_bytes": {stage_index: peak bytes per device}}`` (either key may
    be left out; stage indices may be strings, as after a JSON round trip) → ``(step_s, {stage: bytes})``.
    Raises ``TypeError``/``ValueError`` naming the bad entry."""
    if measured is None:
        return None, {}
    if not isinstance(measured, Mapping):
        raise TypeError(
            f"measured must be a mapping like {{'step_s': 0.012, 'memory_bytes': {{0: 2**30}}}}, got "
            f"{type(measured).__name__}"
        )
    unknown = sorted(set(measured) - {"step_s", "memory_bytes"})
    if unknown:
        raise ValueError(f"measured has unknown key(s) {unknown}; expected 'step_s' and/or 'memory_bytes'")
    step = measured.get("step_s")
    if step is not None and (not isinstance(step, (int, float)) or isinstance(step, bool) or not step >= 0):
        raise ValueError(f"measured['step_s'] must be a number of seconds ≥ 0, got {step!r}")
    memory = measured.get("memory_bytes") or {}
    if not isinstance(memory, Mapping):
        raise TypeError(f"measured['memory_bytes'] must map a stage index to bytes, got {type(memory).__name__}")
    by_stage = {}
    for key, value in memory.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"measured['memory_bytes'] has key {key!r}; keys are stage indices") from None
        if not 0 <= index < num_stages:
            raise ValueError(f"measured['memory_bytes'] names stage {index}; the plan has {num_stages} stage(s)")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
            raise ValueError(f"measured['memory_bytes'][{key!r}] must be a byte count ≥ 0, got {value!r}")
        by_stage[index] = float(value)
    return (None if step is None else float(step)), by_stage


def _stage_numbers(index: int, stage: StagePlan, measured_memory: float | None) -> StageNumbers:
    submesh = (int(stage.submesh_shape[0]), int(stage.submesh_shape[1]))
    logical = (int(stage.logical_mesh_shape[0]), int(stage.logical_mesh_shape[1]))
    stored = list(getattr(stage, "crosses_hosts", None) or [])
    crossing = (bool(stored[0]), bool(stored[1])) if len(stored) == 2 else axes_crossing_hosts(submesh, logical)
    breakdown = getattr(stage, "memory_breakdown", None) or {}
    sent = getattr(stage, "communication_bytes", None) or {}
    return StageNumbers(
        index=index,
        layers=tuple(int(layer) for layer in stage.layers),
        submesh_shape=submesh,
        logical_mesh_shape=logical,
        cost_s=float(stage.estimated_cost_s),
        compute_s=float(stage.estimated_compute_s),
        communication_s=float(stage.estimated_communication_s),
        memory_bytes=stage.estimated_memory_bytes,
        memory_breakdown=dict(breakdown),
        communication_bytes=dict(sent),
        crosses_hosts=crossing,
        measured_memory_bytes=measured_memory,
    )


def _alternatives(
    plan: Plan, stages: tuple[StageNumbers, ...], screening: Mapping[str, Any] | None
) -> tuple[Alternative, ...]:
    rows = plan.solver.get("runners_up") if plan.solver else None
    if not isinstance(rows, list) or not rows:
        return ()
    chosen = Alternative(
        rank=0,
        step_s=float(plan.estimated_step_s),
        screening_step_s=_number(screening.get("estimated_step_s")) if screening else None,
        stages=tuple(
            {
                "layers": list(s.layers),
                "submesh_shape": list(s.submesh_shape),
                "logical_mesh_shape": list(s.logical_mesh_shape),
                "estimated_cost_s": s.cost_s,
                "estimated_memory_bytes": s.memory_bytes,
            }
            for s in stages
        ),
    )
    out = [chosen]
    for rank, row in enumerate(rows, start=1):
        if not isinstance(row, Mapping):
            continue
        if "screening_step_s" in row:
            step, screened = _number(row.get("estimated_step_s")), _number(row.get("screening_step_s"))
        else:  # saved by an older torchpar: the row holds the stage DP's screening figure only
            step, screened = None, _number(row.get("estimated_step_s"))
        out.append(
            Alternative(
                rank=rank,
                step_s=step,
                screening_step_s=screened,
                stages=tuple(s for s in row.get("stages", []) if isinstance(s, Mapping)),
                error=str(row["error"]) if row.get("error") else None,
                at_least_s=_number(row.get("step_at_least_s")),
            )
        )
    return tuple(out)


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def mesh_text(shape: Sequence[int]) -> str:
    """``(2, 4)`` → ``"2×4"``."""
    return "×".join(str(int(d)) for d in shape)

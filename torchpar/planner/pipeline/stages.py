"""Inter-operator parallelism: layers → pipeline stages on submeshes (Alpa §5).

The problem
-----------
Layers ``0..L−1`` (:mod:`.layers`), ``B`` micro-batches, a cluster of ``H`` hosts × ``D`` devices
(``N = H·D``). A stage is a contiguous layer range ``[k..i]`` on a submesh ``σ`` (:func:`submesh_shapes`)
with a logical mesh ``c`` (:func:`logical_mesh_shapes`). A :class:`StageCostModel` prices one
micro-batch's forward + backward of the stage: latency ``t(k,i,σ,c)``, per-device memory
``m + f(s)·a`` (static bytes ``m``; activation bytes ``a`` per micro-batch in flight; with ``s`` the
number of stages from this one to the last, ``f(s) = min(s, B)`` under 1F1B, ``f(s) = B`` under GPipe,
``f(s) = min(S, B)`` under ZB-H1, bounded by the most stages the DP considers).

    minimize   T = Σ_j t_j + (B − 1) · max_j t_j          (1F1B / GPipe pipeline latency)
    over       stages covering layers 0..L−1 in order, submeshes whose sizes sum to N, one c per stage
    subject to m_j + f(s_j)·a_j ≤ memory_budget  for every stage j

Other schedules (:func:`pipeline_latency`; :mod:`torchpar.planner.pipeline.schedules` derives and simulates them):
ZB-H1 with each stage's ``t`` split in equal forward, input- and weight-gradient thirds has
``T = Σ_j t_j / 3 + (B − 1/3) · max_j t_j`` (bubble ``(S−1)/(3B+S−1)`` on equal stages) — for a fixed ``t_max``
still increasing in ``Σ t``, so the DP below serves it unchanged. Interleaved 1F1B (``v`` stages per device
group, G groups) has ``T = Σ_j t_j / v + (vB − 1) · max_j t_j`` (bubble ``(G−1)/(vB+G−1)``); its stages come
from :mod:`.interleaved_stages` (the DP below puts one stage on each submesh), ``"uniform"`` or a
``ManualStageOption``.

The DP (:func:`stage_dp`)
-------------------------
The best feasible logical mesh does not depend on anything but the stage and ``s``:

    t*(k, i, σ, s) = min_c { t(k,i,σ,c) : m + f(s)·a ≤ budget }                  (:func:`_stage_table`)

For a fixed bound ``t_max`` on every stage's latency, with ``F(s, k, d)`` the least Σ t of ``s`` stages
covering layers ``k..L−1`` on exactly ``d`` devices:

    F(s, k, d) = min_{i ≥ k, σ: |σ| ≤ d, t*(k,i,σ,s) ≤ t_max}  t*(k,i,σ,s) + F(s−1, i+1, d−|σ|)
    F(0, L, 0) = 0,   F(0, k, d) = ∞ otherwise                                     (:func:`_suffix_dp`)

    T(t_max) = min_s F(s, 0, N) + (B − 1) · t_max ≥ the true T of its arg-min partition.

``t_max`` runs over the sorted distinct values of ``t*``; the optimum ``T*`` with slowest stage ``t⁰`` is
found at ``t_max = t⁰``. Early stop: once ``B · t_max ≥`` the best true ``T`` so far, no partition whose
slowest stage is ≥ ``t_max`` can beat it (its ``T ≥ B · max_j t_j``). The runners-up are the other
distinct partitions met on the way, ranked by their true ``T``.

Exact tiling: submeshes are ``(1, 2^k)`` with ``2^k`` dividing ``D`` and ``(n, D)`` for ``n = 1..H``. The
whole-host ones take whole hosts; the sub-host sizes divide each other and ``D``, so placed largest first
every host's free space stays a multiple of the next size. Any multiset of them whose sizes sum to ``N``
therefore tiles the cluster, and counting devices, as ``d`` does, is exact (:func:`assign_devices` finds
the placement). For ``D`` a power of two these are exactly Alpa's ``(1, 2^k)`` and ``(n, D)``.

Cost: ``O(L²·|σ|·|c|)`` cost-model calls, then per ``t_max`` ``O(S·L²·|σ|·N)`` numpy work, where ``S`` is
the number of distinct rows ``t*(·, s)``: stage counts ``s ≥ ŝ`` with identical rows (memory no longer
binds, or ``s ≥ B`` under 1F1B) share one level, solved layer by layer (:func:`_suffix_dp`).
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import numpy as np

from torchpar.planner.pipeline.stage_cost import AnalyticStageCost, StageCost, StageCostModel, stage_options
from torchpar.planner.pipeline.submeshes import _check_cluster, assign_devices, logical_mesh_shapes, submesh_shapes

log = logging.getLogger(__name__)

Shape = tuple[int, int]
Schedule = Literal["1f1b", "gpipe", "interleaved_1f1b", "zb_h1"]


# ---------------------------------------------------------------------------------------------- result


@dataclass(frozen=True)
class StageChoice:
    """One pipeline stage: layers ``first_layer..last_layer`` on ``submesh`` viewed as ``logical``."""

    first_layer: int
    last_layer: int
    submesh: Shape
    """Physical shape ``(hosts, devices per host)``."""
    logical: Shape
    """Logical mesh shape ``(axis 0, axis 1)``."""
    latency_s: float
    """One micro-batch's forward + backward."""
    memory_bytes: float
    """Peak per-device bytes with this stage's micro-batches in flight."""

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(range(self.first_layer, self.last_layer + 1))

    @property
    def num_devices(self) -> int:
        return self.submesh[0] * self.submesh[1]


@dataclass(frozen=True)
class StagePartition:
    """Stages in pipeline order and their estimated step time (:func:`pipeline_latency`: ``Σ t + (B−1)·max t``
    under 1F1B and GPipe)."""

    stages: tuple[StageChoice, ...]
    num_micro_batches: int
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    """Interleaved 1F1B: stages per device group (stage ``s`` on the submesh of stage ``s mod G``)."""

    @property
    def cost_s(self) -> float:
        return pipeline_latency(
            [s.latency_s for s in self.stages], self.num_micro_batches, self.schedule, self.virtual_stages
        )

    @property
    def forward_stage_layer_ids(self) -> tuple[tuple[int, ...], ...]:
        return tuple(s.layers for s in self.stages)

    @property
    def submesh_physical_shapes(self) -> tuple[Shape, ...]:
        return tuple(s.submesh for s in self.stages)

    @property
    def submesh_logical_shapes(self) -> tuple[Shape, ...]:
        return tuple(s.logical for s in self.stages)

    def to_dict(self) -> dict:
        return {
            "estimated_step_s": self.cost_s,
            "stages": [
                {
                    "layers": list(s.layers),
                    "submesh_shape": list(s.submesh),
                    "logical_mesh_shape": list(s.logical),
                    "estimated_cost_s": s.latency_s,
                    "estimated_memory_bytes": s.memory_bytes,
                }
                for s in self.stages
            ],
        }

    def __str__(self) -> str:
        parts = [
            f"L{s.first_layer}-{s.last_layer}@{s.submesh[0]}x{s.submesh[1]}/{s.logical[0]}x{s.logical[1]}"
            for s in self.stages
        ]
        return f"{self.cost_s * 1e3:.3f} ms [{' | '.join(parts)}]"


@dataclass(frozen=True)
class StagePlanResult:
    """What :func:`stage_dp` found: the best partition, the runners-up and how long the search took."""

    best: StagePartition
    runners_up: tuple[StagePartition, ...]
    dp_s: float
    """Seconds in the DP (cost-model calls included)."""
    num_t_max_tried: int
    num_t_max_candidates: int
    table_s: float = 0.0
    """Of ``dp_s``, building the stage table (the cost model priced for every layer range × submesh × logical mesh)."""

    @property
    def stages(self) -> tuple[StageChoice, ...]:
        return self.best.stages

    @property
    def cost_s(self) -> float:
        return self.best.cost_s

    def summary(self) -> str:
        best = self.best
        latencies = [s.latency_s for s in best.stages]
        formula = latency_formula(best.schedule, best.num_micro_batches, best.virtual_stages)
        lines = [
            f"Stage DP: {len(best.stages)} stage(s), {best.num_micro_batches} micro-batch(es), est. step "
            f"{best.cost_s * 1e3:.3f} ms = {formula}"
            f" with Σ stage {sum(latencies) * 1e3:.3f} ms, max stage {max(latencies) * 1e3:.3f} ms; DP "
            f"{self.dp_s:.3f}s, t_max tried {self.num_t_max_tried}/{self.num_t_max_candidates}"
        ]
        for index, s in enumerate(best.stages):
            lines.append(
                f"  stage {index}: layers {s.first_layer}-{s.last_layer}, submesh {s.submesh}, logical "
                f"{s.logical}, {s.latency_s * 1e3:.3f} ms, {s.memory_bytes / 2**20:.1f} MiB/device"
            )
        for rank, other in enumerate(self.runners_up, 2):
            lines.append(f"  #{rank}: {other}")
        return "\n".join(lines)


def pipeline_latency(
    latencies: Sequence[float], num_micro_batches: int, schedule: Schedule = "1f1b", virtual_stages: int = 1
) -> float:
    """The step time of a pipeline with stage latencies ``t`` (one micro-batch's forward + backward each):
    ``Σ t + (B − 1)·max t`` under 1F1B and GPipe; ``Σ t / 3 + (B − 1/3)·max t`` under ZB-H1 (``t`` in equal
    thirds F, B, W); ``Σ t / v + (vB − 1)·max t`` under interleaved 1F1B with ``v`` stages per device group.
    On equal stages these are ``(B + S − 1)·t``, ``(3B + S − 1)·t/3``, ``(vB + G − 1)·t`` (``G = S/v``)."""
    total, slowest, B = float(sum(latencies)), float(max(latencies)), num_micro_batches
    if schedule == "zb_h1":
        return total / 3 + (B - 1 / 3) * slowest
    if schedule == "interleaved_1f1b":
        return total / virtual_stages + (virtual_stages * B - 1) * slowest
    return total + (B - 1) * slowest


def latency_formula(schedule: Schedule, num_micro_batches: int, virtual_stages: int = 1) -> str:
    """:func:`pipeline_latency`'s formula for ``schedule`` as text (``Plan.solver["estimate"]``, the report)."""
    B = num_micro_batches
    if schedule == "zb_h1":
        return f"Σ stage/3 + ({B}−⅓)·max stage (zb_h1; bubble (S−1)/(3·{B}+S−1) on equal stages)"
    if schedule == "interleaved_1f1b":
        v = virtual_stages
        return (
            f"Σ stage/{v} + ({v}·{B}−1)·max stage (interleaved_1f1b, {v} stages per device group; bubble "
            f"(G−1)/({v}·{B}+G−1) on G groups)"
        )
    return f"Σ stage + ({B}−1)·max stage ({schedule}; bubble (S−1)/({B}+S−1) on equal stages)"


# ------------------------------------------------------------------------------------------------- DP


def stage_dp(
    num_layers: int,
    cluster_hosts: int,
    devices_per_host: int,
    num_micro_batches: int,
    cost: StageCostModel,
    memory_budget: float | None,
    *,
    schedule: Schedule = "1f1b",
    num_runners_up: int = 3,
    search: Literal["auto", "scan", "bound"] = "auto",
    tolerance: float = 0.0,
) -> StagePlanResult:
    """Alpa's inter-op DP (module docstring): contiguous layer ranges × submeshes × logical meshes that tile
    the cluster, minimizing ``Σ t + (B−1)·max t`` subject to ``memory_budget`` bytes per device (``None``:
    no limit). ``ValueError`` naming the smallest budget that would fit if nothing fits. ``search``: how ``t_max``
    is searched — ``"scan"`` (every candidate in order, Alpa's early stop), ``"bound"`` (branch and bound,
    :func:`_bound_t_max`, within ``1 + tolerance`` of the scan's optimum), ``"auto"``: the scan up to
    :data:`SCAN_CANDIDATES` candidates, else the bound."""
    _check_cluster(cluster_hosts, devices_per_host)
    if num_layers < 1:
        raise ValueError(f"num_layers must be ≥ 1, got {num_layers}")
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be ≥ 1, got {num_micro_batches}")
    memory_budget = math.inf if memory_budget is None else memory_budget
    if not memory_budget > 0:
        raise ValueError(f"memory_budget must be positive, got {memory_budget}")
    t0 = time.perf_counter()
    submeshes = submesh_shapes(cluster_hosts, devices_per_host)
    num_devices = cluster_hosts * devices_per_host
    table = _stage_table(
        num_layers, submeshes, min(num_layers, num_devices), num_micro_batches, cost, memory_budget, schedule
    )
    table_s = time.perf_counter() - t0
    sizes = [h * d for h, d in submeshes]
    if not math.isfinite(_suffix_dp(table.latency, sizes, num_devices, np.add)[0]):
        need, _ = _suffix_dp(table.min_memory, sizes, num_devices, np.maximum)
        raise ValueError(
            f"no stage plan fits in {memory_budget / 2**30:.3f} GiB per device: the smallest needs "
            f"{need / 2**30:.3f} GiB ({need:.0f} bytes) per device; add devices, raise the budget or "
            "use fewer micro-batches in flight"
        )
    candidates = np.unique(table.latency[np.isfinite(table.latency)])
    found: dict[tuple, StagePartition] = {}

    def solve_at(t_max: float) -> tuple[float, StagePartition | None]:
        """``F(t_max)`` (the least Σ t with every stage ≤ ``t_max``) and its partition (``None``: no tiling)."""
        total, plan = _suffix_dp(np.where(table.latency <= t_max, table.latency, np.inf), sizes, num_devices, np.add)
        if not plan:
            return math.inf, None
        partition = _partition(plan, table, submeshes, num_micro_batches, schedule)
        found.setdefault(_key(partition), partition)
        return total, partition

    if search == "scan" or (search == "auto" and len(candidates) <= SCAN_CANDIDATES):
        tried = _scan_t_max(candidates, solve_at, num_micro_batches, num_runners_up)
    else:
        tried = _bound_t_max(candidates, solve_at, _latency_weights(schedule, num_micro_batches), tolerance)
    ranked = sorted(found.values(), key=lambda p: (p.cost_s, len(p.stages)))
    result = StagePlanResult(
        best=ranked[0],
        runners_up=tuple(ranked[1 : 1 + num_runners_up]),
        dp_s=time.perf_counter() - t0,
        table_s=table_s,
        num_t_max_tried=tried,
        num_t_max_candidates=len(candidates),
    )
    log.info("stage DP: %s in %.3fs (%d/%d t_max)", result.best, result.dp_s, tried, len(candidates))
    return result


SCAN_CANDIDATES = 256
"""``search="auto"``: up to this many distinct ``t_max`` the DP scans them in order (Alpa's search, exact, with its
runners-up); beyond it, the bounded search (:func:`_bound_t_max`)."""


def _scan_t_max(
    candidates: np.ndarray,
    solve_at: Callable[[float], tuple[float, StagePartition | None]],
    num_micro_batches: int,
    num_runners_up: int,
) -> int:
    """Alpa's search: every ``t_max`` in increasing order until ``B · t_max ≥`` the best true ``T`` (then a few more,
    for runners-up). Returns the number of DPs solved."""
    best, tried, extra = math.inf, 0, 0
    for t_max in candidates:
        if num_micro_batches * t_max >= best:  # no larger t_max can win (Alpa's early stop) …
            if extra >= num_runners_up:
                break
            extra += 1  # … but a few more t_max give runners-up to report
        tried += 1
        _, partition = solve_at(float(t_max))
        if partition is not None:  # else no tiling with every stage within t_max
            best = min(best, partition.cost_s)
    return tried


def _latency_weights(schedule: Schedule, num_micro_batches: int) -> tuple[float, float]:
    """``(α, β)`` with the schedule's step ``T = α·Σ t + β·max t`` (:func:`pipeline_latency`; one stage per group)."""
    if schedule == "zb_h1":
        return 1 / 3, num_micro_batches - 1 / 3
    return 1.0, num_micro_batches - 1.0


def _bound_t_max(
    candidates: np.ndarray,
    solve_at: Callable[[float], tuple[float, StagePartition | None]],
    weights: tuple[float, float],
    tolerance: float,
) -> int:
    """Branch and bound over ``t_max``: the best ``T`` within a factor ``1 + tolerance`` of the scan's with a few
    DPs instead of one per candidate. Returns the number of DPs solved.

    ``F(t)`` — the least ``Σ t`` over partitions with every stage ≤ ``t`` — does not increase with ``t``, so over the
    candidates ``c_a ≤ t ≤ c_b`` every partition whose slowest stage lies there has
    ``T ≥ LB(a, b) = max(α·F(c_b) + β·c_a, (α + β)·c_a)`` (its ``Σ t ≥ F(c_b)`` and ``≥`` its slowest stage
    ``≥ c_a``). The optimum's slowest stage ``t⁰`` is a candidate, so an interval with ``LB·(1 + tolerance) ≥``
    the best true ``T`` found so far (every DP's arg-min is priced by its true ``T``), or ``F(c_b) = ∞`` (no tiling
    below ``c_b``), cannot hold a partition better by more than the tolerance; the others are split at their
    middle candidate. ``tolerance = 0``: the scan's optimum."""
    alpha, beta = weights
    count = len(candidates)
    totals: dict[int, float] = {}
    best = math.inf

    def evaluate(index: int) -> float:
        nonlocal best
        if index not in totals:
            total, partition = solve_at(float(candidates[index]))
            totals[index] = total
            if partition is not None:
                best = min(best, partition.cost_s)
        return totals[index]

    evaluate(count - 1)
    intervals = [(0, count - 1)]
    while intervals:
        first, last = intervals.pop()
        total = evaluate(last)
        if not math.isfinite(total) or first >= last:
            continue
        low = float(candidates[first])
        if max(alpha * total + beta * low, (alpha + beta) * low) * (1 + tolerance) >= best:
            continue
        middle = (first + last) // 2
        evaluate(middle)
        intervals += [(middle + 1, last), (first, middle)]  # the lower half first: its t_max are the likelier optima
    return len(totals)


@dataclass
class _Table:
    latency: np.ndarray
    """[s−1, k, i, σ]: least latency of layers k..i on submesh σ among logical meshes that fit in memory
    with s stages from this one to the last (∞: none fits, or i < k)."""
    logical: np.ndarray
    """[s−1, k, i, σ]: index of that logical mesh in ``logical_mesh_shapes(σ)``."""
    memory: np.ndarray
    """[s−1, k, i, σ]: its peak per-device bytes."""
    min_memory: np.ndarray
    """[s−1, k, i, σ]: least peak bytes over all logical meshes (to report what would fit)."""


def micro_batches_in_flight(
    num_stages: int, num_micro_batches: int, schedule: Schedule, virtual_stages: int = 1
) -> list[int]:
    """Per stage position, the micro-batches whose activations it holds at its peak: GPipe all ``M``; 1F1B
    ``min(S − i, M)`` for stage ``i`` of ``S``; ZB-H1 ``min(S, M)`` (a W holds its micro-batch's residuals);
    interleaved 1F1B: each stage's peak in its instruction list."""
    return [int(n) for n in _in_flight(np.arange(num_stages, 0, -1), num_micro_batches, schedule, virtual_stages)]


def _in_flight(
    stages_after: np.ndarray, num_micro_batches: int, schedule: Schedule, virtual_stages: int = 1
) -> np.ndarray:
    if schedule == "gpipe":
        return np.full_like(stages_after, num_micro_batches)
    if schedule == "1f1b":
        return np.minimum(stages_after, num_micro_batches)
    if schedule == "zb_h1":  # S = the stages from the first position (the DP: the most stages it considers)
        return np.full_like(stages_after, min(int(stages_after.max()), num_micro_batches))
    if schedule == "interleaved_1f1b":
        from torchpar.planner.pipeline.schedules import interleaved_one_f_one_b, stage_in_flight

        num_stages = int(stages_after.max())
        if virtual_stages < 2 or num_stages % virtual_stages:
            raise ValueError(
                f"interleaved 1F1B prices {virtual_stages} stages per device group; {num_stages} stages do not split so"
            )
        peaks = stage_in_flight(
            interleaved_one_f_one_b(num_stages // virtual_stages, num_micro_batches, virtual_stages)
        )
        return np.array([peaks[num_stages - int(k)] for k in stages_after])
    raise ValueError(f"schedule must be one of '1f1b', 'gpipe', 'interleaved_1f1b', 'zb_h1', got {schedule!r}")


def _stage_table(
    num_layers: int,
    submeshes: Sequence[Shape],
    max_stages: int,
    num_micro_batches: int,
    cost: StageCostModel,
    memory_budget: float,
    schedule: Schedule,
    virtual_stages: int = 1,
) -> _Table:
    shape = (max_stages, num_layers, num_layers, len(submeshes))
    latency = np.full(shape, np.inf)
    logical = np.full(shape, -1, dtype=np.int64)
    memory = np.full(shape, np.inf)
    min_memory = np.full(shape, np.inf)
    in_flight = _in_flight(np.arange(1, max_stages + 1), num_micro_batches, schedule, virtual_stages)
    counts = np.arange(max_stages)
    for first, last in itertools.combinations_with_replacement(range(num_layers), 2):
        for index, submesh in enumerate(submeshes):
            # every option of every logical mesh at once: per stage count, the fastest that fits (the first such in
            # mesh and option order on ties), and the least peak of all
            options = [
                (choice, stage)
                for choice, mesh in enumerate(logical_mesh_shapes(submesh))
                for stage in stage_options(cost, first, last, submesh, mesh)
            ]
            if not options:
                continue
            choices = np.array([choice for choice, _ in options])
            latencies = np.array([stage.latency_s for _, stage in options])
            peak = (
                np.array([stage.memory_bytes for _, stage in options])[:, None]
                + np.array([stage.activation_bytes for _, stage in options])[:, None] * in_flight[None, :]
            )  # [option, s−1]
            cell = (slice(None), first, last, index)
            min_memory[cell] = peak.min(axis=0)
            fitting = np.where(peak <= memory_budget, latencies[:, None], np.inf)
            best = fitting.argmin(axis=0)
            found = np.isfinite(fitting[best, counts])
            latency[cell] = np.where(found, latencies[best], np.inf)
            logical[cell] = np.where(found, choices[best], -1)
            memory[cell] = np.where(found, peak[best, counts], np.inf)
    return _Table(latency, logical, memory, min_memory)


def _suffix_dp(
    weight: np.ndarray, sizes: Sequence[int], num_devices: int, combine: Callable[[np.ndarray, np.ndarray], np.ndarray]
) -> tuple[float, list[tuple[int, int, int]]]:
    """``F(s, k, d) = min_{i, σ} combine(weight[s−1, k, i, σ], F(s−1, i+1, d−|σ|))``, ``F(0, L, 0) = 0``.

    Returns (min_s F(s, 0, N), the arg-min stages as ``(first layer, last layer, submesh index)``; ties go to the
    least ``(i, σ)`` in that order).

    Stage counts with identical weights are merged: if ``weight[s−1] = weight[ŝ−1]`` for all ``s ≥ ŝ`` (memory
    stops depending on the stages after a stage once it fits with them all, e.g. at ``s ≥ B`` under 1F1B,
    or at once when memory never binds), level ``ŝ`` stands for "ŝ or more stages":
    ``F(ŝ, k, d) = min_{i, σ} combine(w, min(F(ŝ−1, i+1, ·), F(ŝ, i+1, ·)))``, solved for ``k = L−1 … 0``.

    Cost: each level is a min over ``(i, σ)`` taken one layer ``i`` at a time over the submeshes with a finite weight
    (``O(L·|σ|·N)`` memory, not ``O(L²·|σ|·N)``); only the values are kept, and the arg-min of the few cells on the
    optimal chain is recomputed from them at the end.
    """
    max_stages, num_layers, _, num_submeshes = weight.shape
    top = max_stages  # ŝ
    while top > 1 and np.array_equal(weight[top - 1], weight[top - 2]):
        top -= 1
    finite = np.isfinite(weight)
    value = np.full((num_layers + 1, num_devices + 1), np.inf)
    value[num_layers, 0] = 0.0
    successors: list[np.ndarray] = []  # [s−1]: F(s−1, ·, ·), what level s reads
    best, best_level = math.inf, 0
    for s in range(1, top):
        successors.append(value)
        shifted = _shift(value[1:], sizes, num_devices)  # [i, σ, d] = F(s−1, i+1, d−|σ|)
        new = np.full((num_layers + 1, num_devices + 1), np.inf)
        for i in range(num_layers):  # stages k..i, k ≤ i
            used = finite[s - 1, : i + 1, i].any(axis=0)
            if used.any():
                reach = combine(weight[s - 1, : i + 1, i][:, used, None], shifted[i, used][None]).min(axis=1)
                np.minimum(new[: i + 1], reach, out=new[: i + 1])
        value = new
        if value[0, num_devices] < best:
            best, best_level = float(value[0, num_devices]), s
    # level ŝ, absorbing: its successor is level ŝ−1 or ŝ itself, so solve it layer by layer from the end
    below = value
    level = np.full((num_layers + 1, num_devices + 1), np.inf)
    after = below[1:].copy()  # [i, d]: min(F(ŝ−1, i+1, d), F(ŝ, i+1, d)), row i final once level[i+1] is
    for k in range(num_layers - 1, -1, -1):
        if k + 1 < num_layers:
            after[k] = np.minimum(below[k + 1], level[k + 1])
        used = finite[top - 1, k, k:].any(axis=0)
        if used.any():
            shifted = _shift(after[k:], [size for size, u in zip(sizes, used) if u], num_devices)  # [i−k, σ, d]
            level[k] = combine(weight[top - 1, k, k:][:, used, None], shifted).min(axis=(0, 1))
    if level[0, num_devices] < best:
        best, best_level = float(level[0, num_devices]), top
    if not math.isfinite(best):
        return best, []

    def arg_min(s: int, first: int, devices: int) -> tuple[int, int]:
        """``(last layer, submesh index)`` of the first minimal ``(i, σ)`` of cell ``(s, first, devices)``."""
        successor = after if s == top else successors[s - 1][1:]  # [i, d]
        options = np.full((num_layers - first, num_submeshes), np.inf)
        for index, size in enumerate(sizes):
            if size <= devices:
                options[:, index] = combine(weight[s - 1, first, first:, index], successor[first:, devices - size])
        last, index = divmod(int(options.argmin()), num_submeshes)
        return first + last, index

    stages, first, devices, s = [], 0, num_devices, best_level
    while s > 0:
        last, index = arg_min(s, first, devices)
        stages.append((first, last, index))
        at_top = s == top
        first, devices = last + 1, devices - sizes[index]
        s = s if at_top and first < num_layers and level[first, devices] < below[first, devices] else s - 1
    assert first == num_layers and devices == 0, "the arg-min chain covers every layer and device"
    return best, stages


def _shift(after: np.ndarray, sizes: Sequence[int], num_devices: int) -> np.ndarray:
    """``[i, σ, d] = after[i, d − |σ|]`` (∞ where ``d < |σ|``)."""
    shifted = np.full((after.shape[0], len(sizes), num_devices + 1), np.inf)
    for index, size in enumerate(sizes):
        if size <= num_devices:
            shifted[:, index, size:] = after[:, : num_devices + 1 - size]
    return shifted


def _partition(
    plan: list[tuple[int, int, int]],
    table: _Table,
    submeshes: Sequence[Shape],
    num_micro_batches: int,
    schedule: Schedule,
) -> StagePartition:
    stages = []
    for position, (first, last, index) in enumerate(plan):
        cell = (len(plan) - position - 1, first, last, index)
        stages.append(
            StageChoice(
                first_layer=first,
                last_layer=last,
                submesh=submeshes[index],
                logical=logical_mesh_shapes(submeshes[index])[int(table.logical[cell])],
                latency_s=float(table.latency[cell]),
                memory_bytes=float(table.memory[cell]),
            )
        )
    return StagePartition(stages=tuple(stages), num_micro_batches=num_micro_batches, schedule=schedule)


def _key(partition: StagePartition) -> tuple:
    return tuple((s.first_layer, s.last_layer, s.submesh, s.logical) for s in partition.stages)


# ----------------------------------------------------------------------------------- uniform and manual


def uniform_stages(
    num_layers: int,
    num_stages: int | None,
    cluster_hosts: int,
    devices_per_host: int,
    *,
    cost: StageCostModel | None = None,
    num_micro_batches: int = 1,
    memory_budget: float = math.inf,
    schedule: Schedule = "1f1b",
    warn_over_budget: bool = True,
    virtual_stages: int = 1,
) -> StagePartition:
    """Equal layer counts (the first ``L mod S`` stages get one more) on equal submeshes.

    ``num_stages=None``: the most stages (≤ ``num_layers``) that split the cluster into equal submeshes.
    ``virtual_stages=v`` (interleaved 1F1B): ``num_stages`` (or that most, ≤ ``num_layers / v``) device groups
    with ``v`` stages each, ``v·num_stages`` stages in all, stage ``s`` on the submesh of group ``s mod G``.
    With ``cost``, each stage's logical mesh is the fastest that fits ``memory_budget`` (else the smallest,
    with a warning unless ``warn_over_budget`` is false: a reference point the planner only compares with) and
    latencies are filled in; without it, the logical mesh is the physical shape.
    """
    _check_cluster(cluster_hosts, devices_per_host)
    num_devices = cluster_hosts * devices_per_host
    v = virtual_stages
    if num_stages is None:
        num_stages = next(
            (
                s
                for s in range(min(num_layers // v, num_devices), 0, -1)
                if num_devices % s == 0 and _uniform_submesh(num_devices // s, devices_per_host)
            ),
            0,
        )
    if not 1 <= num_stages * v <= num_layers:
        raise ValueError(
            f"{num_stages} device group(s) × {v} stage(s) each must be between 1 and the number of "
            f"layers ({num_layers})"
        )
    per_stage = num_devices // num_stages
    submesh = _uniform_submesh(per_stage, devices_per_host) if num_devices % num_stages == 0 else None
    if submesh is None:
        raise ValueError(
            f"{num_stages} uniform stages cannot split {cluster_hosts}×{devices_per_host} devices into "
            f"equal submeshes (1, k≤{devices_per_host}) or (n, {devices_per_host}); choose a number of "
            "stages that divides the devices"
        )
    total = num_stages * v
    counts = [num_layers // total + (1 if s < num_layers % total else 0) for s in range(total)]
    bounds = np.cumsum([0, *counts])
    return _evaluate(
        [(int(bounds[s]), int(bounds[s + 1]) - 1) for s in range(total)],
        [submesh] * total,
        None,
        cost,
        num_micro_batches,
        memory_budget,
        schedule,
        warn_over_budget,
        virtual_stages=v,
    )


def manual_stages(
    forward_stage_layer_ids: Sequence[Sequence[int]],
    submesh_physical_shapes: Sequence[Shape],
    submesh_logical_shapes: Sequence[Shape] | None,
    *,
    num_layers: int,
    cluster_hosts: int,
    devices_per_host: int,
    cost: StageCostModel | None = None,
    num_micro_batches: int = 1,
    memory_budget: float = math.inf,
    schedule: Schedule = "1f1b",
    virtual_stages: int = 1,
) -> StagePartition:
    """Validate a hand-written stage layout (``ManualStageOption``) and price it with ``cost`` if given.
    ``virtual_stages=v`` (interleaved 1F1B): the stages run on ``G = count / v`` device groups, stage ``s`` on
    the submesh of stage ``s mod G``, so the submeshes must repeat with period G and the first G tile the cluster.

    Checks: the layer ids of each stage are consecutive, stages are in order and cover ``0..num_layers−1``
    once; each submesh is ``(1, k≤D)`` or ``(n, D)`` and together they tile the cluster exactly; each
    logical mesh has its submesh's device count. ``submesh_logical_shapes=None`` picks the fastest
    logical mesh with ``cost`` (the physical shape without it).
    """
    _check_cluster(cluster_hosts, devices_per_host)
    stage_layers = [tuple(int(layer) for layer in ids) for ids in forward_stage_layer_ids]
    count = len(stage_layers)
    if (
        count == 0
        or len(submesh_physical_shapes) != count
        or (submesh_logical_shapes is not None and len(submesh_logical_shapes) != count)
    ):
        raise ValueError(
            f"need one submesh (and logical mesh) per stage: {count} stage(s), "
            f"{len(submesh_physical_shapes)} submesh(es), "
            f"{None if submesh_logical_shapes is None else len(submesh_logical_shapes)} logical mesh(es)"
        )
    for index, ids in enumerate(stage_layers):
        if not ids or list(ids) != list(range(ids[0], ids[0] + len(ids))):
            raise ValueError(f"stage {index}'s layer ids {list(ids)} are not a non-empty run of consecutive layers")
    if [layer for ids in stage_layers for layer in ids] != list(range(num_layers)):
        raise ValueError(
            f"forward_stage_layer_ids must cover layers 0..{num_layers - 1} in order, each once; got "
            f"{[list(ids) for ids in stage_layers]}"
        )
    submeshes = [tuple(int(x) for x in s) for s in submesh_physical_shapes]
    if count % virtual_stages:
        raise ValueError(f"{count} stages do not split into {virtual_stages} stages per device group")
    groups = count // virtual_stages
    if any(submeshes[s] != submeshes[s % groups] for s in range(count)):
        raise ValueError(
            f"interleaved stages: stage s runs on the submesh of stage s mod {groups}, so the "
            f"submeshes must repeat with period {groups}; got {submeshes}"
        )
    assign_devices(submeshes[:groups], cluster_hosts, devices_per_host)
    logical = None
    if submesh_logical_shapes is not None:
        logical = [tuple(int(x) for x in s) for s in submesh_logical_shapes]
        for index, (physical, mesh) in enumerate(zip(submeshes, logical)):
            if len(mesh) != 2 or min(mesh) < 1 or mesh[0] * mesh[1] != physical[0] * physical[1]:
                raise ValueError(
                    f"stage {index}: logical mesh {mesh} must be two positive ints whose product is the "
                    f"{physical[0] * physical[1]} devices of submesh {physical}"
                )
    return _evaluate(
        [(ids[0], ids[-1]) for ids in stage_layers],
        cast(list[Shape], submeshes),  # pairs: assign_devices checked them
        cast(list[Shape] | None, logical),  # pairs, as checked above
        cost,
        num_micro_batches,
        memory_budget,
        schedule,
        virtual_stages=virtual_stages,
    )


def _uniform_submesh(devices: int, per_host: int) -> Shape | None:
    if devices >= per_host:
        return (devices // per_host, per_host) if devices % per_host == 0 else None
    return (1, devices) if devices >= 1 else None


CLOSE_MESH_TOLERANCE = 0.05
"""How much slower (screened) than a stage's own logical mesh another may be for :func:`close_logical_meshes` to
offer it to the ILP: Mixtral-8×7B's two-layer (1, 8) stages screen (4, 2) 1.2 % faster than (1, 8), where the ILP
prices (4, 2) 4.5 % slower."""


def close_logical_meshes(
    stage: StageChoice,
    cost: StageCostModel,
    memory_budget: float,
    in_flight: int,
    tolerance: float = CLOSE_MESH_TOLERANCE,
) -> list[Shape]:
    """``stage``'s logical mesh, then every other one of its submesh that fits ``memory_budget`` with ``in_flight``
    micro-batches held and screens within ``1 + tolerance`` of the stage's latency, fastest first. The screening
    reads ``(a, b)`` as data × tensor parallelism while the ILP lays each op out freely, so its ranking of close
    meshes is within its error: the ILP prices each (as Alpa profiles every logical mesh of a stage)."""
    timed: dict[Shape, float] = {}
    for mesh in logical_mesh_shapes(stage.submesh):
        if mesh == tuple(stage.logical):
            continue
        for option in stage_options(cost, stage.first_layer, stage.last_layer, stage.submesh, mesh):
            if option.peak_bytes(in_flight) <= memory_budget and option.latency_s <= (1 + tolerance) * stage.latency_s:
                timed[mesh] = min(timed.get(mesh, math.inf), option.latency_s)
    return [cast(Shape, tuple(stage.logical)), *sorted(timed, key=timed.__getitem__)]


def _evaluate(
    ranges: list[tuple[int, int]],
    submeshes: list[Shape],
    logical: list[Shape] | None,
    cost: StageCostModel | None,
    num_micro_batches: int,
    memory_budget: float,
    schedule: Schedule,
    warn_over_budget: bool = True,
    virtual_stages: int = 1,
) -> StagePartition:
    groups = len(ranges) // virtual_stages
    if virtual_stages > 1 and num_micro_batches % groups:
        raise ValueError(
            f"interleaved 1F1B needs num_micro_batches ({num_micro_batches}) to be a multiple of the "
            f"number of device groups ({groups})"
        )
    in_flight = _in_flight(np.arange(len(ranges), 0, -1), num_micro_batches, schedule, virtual_stages)
    memory_budget = memory_budget / virtual_stages  # a device holds v stages: each gets its share
    stages = []
    for position, ((first, last), submesh) in enumerate(zip(ranges, submeshes)):
        meshes = [logical[position]] if logical is not None else list(logical_mesh_shapes(submesh))
        if cost is None:
            mesh = meshes[0] if logical is not None else submesh
            stages.append(StageChoice(first, last, submesh, mesh, 0.0, 0.0))
            continue
        priced = [(option, mesh) for mesh in meshes for option in stage_options(cost, first, last, submesh, mesh)]
        fitting = [(c, m) for c, m in priced if c.peak_bytes(int(in_flight[position])) <= memory_budget]
        if fitting:
            stage, mesh = min(fitting, key=lambda cm: cm[0].latency_s)
        else:
            stage, mesh = min(priced, key=lambda cm: cm[0].peak_bytes(int(in_flight[position])))
            (log.warning if warn_over_budget else log.info)(
                "stage %d (layers %d-%d on %s) needs %.3f GiB per device, over the %.3f GiB budget",
                position,
                first,
                last,
                submesh,
                stage.peak_bytes(int(in_flight[position])) / 2**30,
                memory_budget / 2**30,
            )
        stages.append(
            StageChoice(first, last, submesh, mesh, stage.latency_s, stage.peak_bytes(int(in_flight[position])))
        )
    return StagePartition(
        stages=tuple(stages), num_micro_batches=num_micro_batches, schedule=schedule, virtual_stages=virtual_stages
    )


__all__ = [
    "AnalyticStageCost",
    "StageChoice",
    "StageCost",
    "StageCostModel",
    "StagePartition",
    "StagePlanResult",
    "assign_devices",
    "close_logical_meshes",
    "logical_mesh_shapes",
    "manual_stages",
    "pipeline_latency",
    "stage_dp",
    "submesh_shapes",
    "uniform_stages",
]

"""The stage DP for interleaved 1F1B (Megatron-LM's virtual pipeline; :mod:`torchpar.planner.pipeline.schedules`).

The problem
-----------
Layers ``0..L−1``, ``B`` micro-batches, ``v`` stages per device group, a cluster of ``N = H·D`` devices.
The cluster is cut into ``G`` equal device groups, each a submesh ``σ_G`` (``(1, N/G)`` within a host,
``(N/(G·D), D)`` across hosts; ``B`` a multiple of ``G``, as the schedule needs). ``S = v·G`` stages of
contiguous layers run in order, stage ``p`` on group ``p mod G``, each with its own logical mesh ``c``.
A device holds ``v`` stages, so each gets ``budget / v`` bytes (the ILP prices every stage against the
same share: :func:`torchpar.planner.pipeline.pipeline_plan._refine`). With ``f_p`` the micro-batches stage position
``p`` holds at its peak under the schedule (:func:`torchpar.planner.pipeline.stages.micro_batches_in_flight`):

    minimize   T = Σ_p t_p / v + (vB − 1) · max_p t_p           (``pipeline_latency``)
    over       G, and stages p = 0..S−1 covering layers 0..L−1 in order, one c per stage
    subject to m_p + f_p · a_p ≤ budget / v  for every stage p

The DP (:func:`interleaved_stage_dp`)
-------------------------------------
Per ``G``: ``t*(p, k, i) = min_c { t(k, i, σ_G, c) : m + f_p·a ≤ budget/v }``. For a bound ``t_max`` on
every stage, with ``F(p, k)`` the least Σ t of stages ``p..S−1`` covering layers ``k..L−1``:

    F(p, k) = min_{i ≥ k, t*(p,k,i) ≤ t_max}  t*(p, k, i) + F(p+1, i+1),     F(S, L) = 0, F(S, k<L) = ∞

    T(t_max) = F(0, 0) / v + (vB − 1) · t_max  ≥  the true T of its arg-min partition.

``t_max`` runs over the sorted distinct ``t*``; at ``t_max = t⁰``, the slowest stage of the optimum, the
bound is tight, so the minimum over ``t_max`` is the optimum. Early stop: a partition whose slowest stage
is ``≥ t_max`` has ``T ≥ (1/v + vB − 1) · t_max`` (its Σ t holds at least that stage), so once that reaches
the best true ``T`` so far no larger ``t_max`` can win.

Cost: per ``G``, ``L²·|c|`` cost-model calls, then ``O(S·L²)`` numpy work per ``t_max``.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from torchpar.planner.pipeline.stage_cost import StageCostModel
from torchpar.planner.pipeline.stages import (
    StageChoice,
    StagePartition,
    StagePlanResult,
    _key,
    _stage_table,
    _Table,
    _uniform_submesh,
)
from torchpar.planner.pipeline.submeshes import _check_cluster, logical_mesh_shapes

log = logging.getLogger(__name__)


def interleaved_stage_dp(
    num_layers: int,
    cluster_hosts: int,
    devices_per_host: int,
    num_micro_batches: int,
    cost: StageCostModel,
    memory_budget: float | None,
    *,
    virtual_stages: int = 2,
    num_runners_up: int = 3,
) -> StagePlanResult:
    """The best interleaved-1F1B stage partition (module docstring): ``v·G`` stages on ``G`` equal device
    groups, minimizing ``Σ t / v + (vB − 1)·max t`` with each stage within ``memory_budget / v`` bytes per
    device (``None``: no limit). ``ValueError`` if no ``G`` is possible, or naming the smallest budget that
    would fit if nothing fits."""
    _check_cluster(cluster_hosts, devices_per_host)
    v, B = virtual_stages, num_micro_batches
    if v < 2:
        raise ValueError(f"interleaved 1F1B needs virtual_stages ≥ 2, got {v}")
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be ≥ 1, got {num_micro_batches}")
    budget = math.inf if memory_budget is None else float(memory_budget)
    if not budget > 0:
        raise ValueError(f"memory_budget must be positive, got {budget}")
    t0 = time.perf_counter()
    num_devices = cluster_hosts * devices_per_host
    layouts = [
        (groups, submesh)
        for groups in range(1, num_devices + 1)
        if num_devices % groups == 0
        and groups * v <= num_layers
        and B % groups == 0
        and (submesh := _uniform_submesh(num_devices // groups, devices_per_host)) is not None
    ]
    if not layouts:
        raise ValueError(
            f"interleaved 1F1B with {v} stages per device group: no number of equal device groups G "
            f"divides the {num_devices} devices and the {B} micro-batches with {v}·G ≤ {num_layers} "
            "layers; use fewer virtual_stages, more micro-batches or schedule='1f1b'"
        )
    found: dict[tuple, StagePartition] = {}
    best, tried, candidates_total, need = math.inf, 0, 0, math.inf
    for groups, submesh in layouts:
        table = _position_table(num_layers, groups * v, submesh, B, v, cost, budget / v)
        need = min(need, v * _minimax_memory(table.min_memory))
        candidates = np.unique(table.latency[np.isfinite(table.latency)])
        candidates_total += len(candidates)
        extra = 0
        for t_max in candidates:
            if (1 / v + v * B - 1) * t_max >= best:  # no larger t_max can win …
                if extra >= num_runners_up:
                    break
                extra += 1  # … but a few more give runners-up to report
            tried += 1
            plan = _exact_dp(np.where(table.latency <= t_max, table.latency, np.inf))
            if plan:
                partition = _partition(plan, table, submesh, B, v)
                found.setdefault(_key(partition), partition)
                best = min(best, partition.cost_s)
    if not found:
        raise ValueError(
            f"no interleaved stage plan fits in {budget / 2**30:.3f} GiB per device: the smallest "
            f"needs {need / 2**30:.3f} GiB ({need:.0f} bytes) per device; add devices, raise the "
            "budget, use fewer virtual_stages or fewer micro-batches in flight"
        )
    ranked = sorted(found.values(), key=lambda p: (p.cost_s, len(p.stages)))
    result = StagePlanResult(
        best=ranked[0],
        runners_up=tuple(ranked[1 : 1 + num_runners_up]),
        dp_s=time.perf_counter() - t0,
        num_t_max_tried=tried,
        num_t_max_candidates=candidates_total,
    )
    log.info(
        "interleaved stage DP (v=%d): %s in %.3fs (%d/%d t_max)", v, result.best, result.dp_s, tried, candidates_total
    )
    return result


def _position_table(
    num_layers: int,
    num_stages: int,
    submesh: tuple[int, int],
    num_micro_batches: int,
    virtual_stages: int,
    cost: StageCostModel,
    stage_budget: float,
) -> _Table:
    """:func:`~torchpar.planner.pipeline.stages._stage_table` on the one submesh, indexed ``[p, k, i]`` by stage
    position ``p`` (its rows count the stages from a stage to the last: position ``p`` of ``S`` is row ``S − p −
    1``)."""
    table = _stage_table(
        num_layers, [submesh], num_stages, num_micro_batches, cost, stage_budget, "interleaved_1f1b", virtual_stages
    )
    by_position = lambda a: a[::-1, :, :, 0]
    return _Table(
        by_position(table.latency), by_position(table.logical), by_position(table.memory), by_position(table.min_memory)
    )


def _exact_dp(weight: np.ndarray, combine=np.add) -> list[tuple[int, int]]:
    """Stages ``p = 0..S−1`` covering layers ``0..L−1`` in order minimizing ``combine``-folded ``weight[p, k, i]``
    (``F(p, k) = min_i combine(weight[p, k, i], F(p+1, i+1))``); their ``(first, last)`` layers, or ``[]``
    if every cover is ∞."""
    num_stages, num_layers, _ = weight.shape
    value = np.full(num_layers + 1, np.inf)
    value[num_layers] = 0.0
    choices = []
    for p in range(num_stages - 1, -1, -1):
        candidates = combine(weight[p], value[1:][None, :])  # [k, i]
        choice = candidates.argmin(axis=1)
        value = np.append(candidates[np.arange(num_layers), choice], np.inf)
        choices.append(choice)
    if not math.isfinite(value[0]):
        return []
    stages, first = [], 0
    for choice in reversed(choices):
        last = int(choice[first])
        stages.append((first, last))
        first = last + 1
    return stages


def _minimax_memory(min_memory: np.ndarray) -> float:
    """The least over covers of the largest stage peak: the per-stage share the cheapest cover needs."""
    plan = _exact_dp(min_memory, np.maximum)
    return max(float(min_memory[p, k, i]) for p, (k, i) in enumerate(plan)) if plan else math.inf


def _partition(
    plan: list[tuple[int, int]], table: _Table, submesh: tuple[int, int], num_micro_batches: int, virtual_stages: int
) -> StagePartition:
    meshes = logical_mesh_shapes(submesh)
    stages = tuple(
        StageChoice(
            first_layer=k,
            last_layer=i,
            submesh=submesh,
            logical=meshes[int(table.logical[p, k, i])],
            latency_s=float(table.latency[p, k, i]),
            memory_bytes=float(table.memory[p, k, i]),
        )
        for p, (k, i) in enumerate(plan)
    )
    return StagePartition(
        stages=stages, num_micro_batches=num_micro_batches, schedule="interleaved_1f1b", virtual_stages=virtual_stages
    )


__all__ = ["interleaved_stage_dp"]

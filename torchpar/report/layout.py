"""The layout a plan report draws, shared by the HTML page and the PNG: stage colours, the device grid (which
stage owns each cluster device, from the plan's ``device_ids``) and the step timeline (measured, simulated or
estimated from the plan's costs)."""

from __future__ import annotations

import colorsys
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from torchpar.cluster import current_cluster
from torchpar.hardware import ClusterSpec

if TYPE_CHECKING:
    from torchpar.planner.plan import Plan

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#86bcb6")
"""Stage colours (Tableau 10); stages past the tenth get golden-angle hues."""
IDLE_COLOR = "#e6e9ed"
AXIS_COLORS = ("#8250df", "#0969da")
"""Colours of a dim split over logical mesh axis 0 and axis 1 in the parameter table."""


def stage_color(stage: int) -> str:
    """The colour of ``stage`` as ``#rrggbb``."""
    if stage < len(PALETTE):
        return PALETTE[stage]
    r, g, b = colorsys.hls_to_rgb((stage * 0.381966) % 1.0, 0.55, 0.55)
    return f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}"


@dataclass(frozen=True)
class DeviceCell:
    """One device of the grid: global index (host-major), host, index on the host, and the stage using it
    with the device's coordinate in that stage's logical mesh (``None`` for an idle device)."""

    device: int
    host: int
    local: int
    stage: int | None
    mesh_coord: tuple[int, ...] | None
    """``(row, column)`` in the stage's logical mesh; ``(replica, row, column)`` with data replicas."""


@dataclass(frozen=True)
class DeviceGrid:
    num_hosts: int
    devices_per_host: int
    cells: tuple[DeviceCell, ...]
    stage_devices: tuple[tuple[int, ...], ...]
    notes: tuple[str, ...]


def grid_cluster(plan: Plan) -> ClusterSpec:
    """The cluster a report draws: the one the plan was made for, else the one from ``torchpar.init``."""
    return ClusterSpec(**plan.cluster) if plan.cluster else current_cluster()


def device_grid(plan: Plan, cluster: ClusterSpec | None = None) -> DeviceGrid:
    """Where each stage runs: the cluster devices each stage of the plan stores (``StagePlan.device_ids``:
    ``(1, k)`` takes ``k`` devices of one host, ``(h, D)`` ``h`` whole hosts). ``cluster`` defaults to the one
    the plan was made for (``plan.cluster``), else the one from ``torchpar.init``; if the plan needs more devices than
    it has, hosts × devices are inferred from the submeshes (with a note)."""
    notes: list[str] = []
    submeshes = [(int(s.submesh_shape[0]), int(s.submesh_shape[1])) for s in plan.stages]
    needed = sum(h * d for h, d in submeshes)
    cluster = cluster or grid_cluster(plan)
    hosts, per_host = cluster.num_hosts, cluster.devices_per_host
    if needed > hosts * per_host:
        per_host = max(d for _, d in submeshes)
        hosts = math.ceil(needed / per_host)
        notes.append(
            f"The plan uses {needed} devices but the cluster has {cluster.num_devices}; the grid shows "
            f"{hosts} host(s) × {per_host} device(s) inferred from the stages' submeshes."
        )
    stage_devices = _stage_devices(plan, submeshes, notes)
    owner: dict[int, tuple[int, tuple[int, ...]]] = {}
    stage: int | None  # a device's stage; None: idle
    for stage, (devices, plan_stage) in enumerate(zip(stage_devices, plan.stages)):
        columns = max(int(plan_stage.logical_mesh_shape[1]), 1)
        per_replica = max(int(plan_stage.logical_mesh_shape[0]), 1) * columns
        replicas = int(getattr(plan_stage, "data_replicas", 1))
        for k, device in enumerate(devices):
            local = (k % per_replica // columns, k % columns)
            owner[device] = (stage, (k // per_replica, *local) if replicas > 1 else local)
    cells = []
    for device in range(hosts * per_host):
        stage, coord = owner.get(device, (None, None))
        cells.append(
            DeviceCell(device=device, host=device // per_host, local=device % per_host, stage=stage, mesh_coord=coord)
        )
    return DeviceGrid(hosts, per_host, tuple(cells), tuple(tuple(d) for d in stage_devices), tuple(notes))


def _stage_devices(plan: Plan, submeshes: list[tuple[int, int]], notes: list[str]) -> list[list[int]]:
    """The cluster devices of each stage, as the plan stores them (``StagePlan.device_ids``); a plan saved
    without them is drawn on consecutive devices."""
    if all(stage.device_ids for stage in plan.stages):
        return [list(stage.device_ids) for stage in plan.stages]
    if len(submeshes) > 1:
        notes.append("The plan stores no device ids (saved by an older torchpar): stages drawn on consecutive devices.")
    result, start = [], 0
    for h, d in submeshes:
        result.append(list(range(start, start + h * d)))
        start += h * d
    return result


Block = tuple[str, "int | None", float, float]
"""``(op, micro_batch, start_s, end_s)``; op is ``forward``, ``backward`` or another compute op."""


@dataclass(frozen=True)
class TimelineView:
    """Compute blocks per stage with time starting at 0."""

    blocks: tuple[tuple[Block, ...], ...]
    makespan: float
    bubble_fraction: float
    source: str
    """``"estimated"`` (cost model), ``"simulated"`` (a ``schedules.Timeline`` passed in) or ``"measured"``."""
    relative: bool = False
    """True when the plan has no cost estimates, so every stage got unit time."""


def timeline_view(plan: Plan, timeline: object = None) -> TimelineView:
    """The step as stage × time blocks: ``timeline`` if given (per stage a list of ``(op, micro_batch,
    start_s, end_s)``, or an object with such ``.blocks``: ``schedules.Timeline``, the Ray runtime's
    ``StepTimeline``), else ``simulate(make_schedule(plan.schedule, S, M))`` with each stage's forward
    taking ⅓ and its backward ⅔ of its ``estimated_cost_s`` per micro-batch."""
    from torchpar.planner.pipeline import schedules

    if timeline is None:
        return _estimated_timeline(plan)
    source = "simulated" if isinstance(timeline, schedules.Timeline) else "measured"
    raw = cast("Sequence[Sequence[object]]", getattr(timeline, "blocks", timeline))  # per stage its blocks
    rows = schedules.device_groups(plan.schedule, [s.devices() for s in plan.stages])  # stages, or groups (interleaved)
    if len(raw) != rows:
        raise ValueError(f"the timeline has {len(raw)} stage(s) but the plan has {rows} (device groups)")
    stages = [[_as_block(b) for b in stage] for stage in raw]
    stages = [[b for b in stage if b[3] > b[2] or b[0] in schedules.COMPUTE_OPS] for stage in stages]
    origin = min((b[2] for stage in stages for b in stage), default=0.0)
    stages = [[(op, m, start - origin, end - origin) for op, m, start, end in stage] for stage in stages]
    return _view(stages, source)


def _estimated_timeline(plan: Plan) -> TimelineView:
    from torchpar.planner.pipeline.schedules import COMPUTE_OPS, SCHEDULES, device_groups, make_schedule, simulate

    num_stages, micro = len(plan.stages), max(int(plan.num_micro_batches), 1)
    name = plan.schedule if plan.schedule in SCHEDULES else "gpipe"  # one stage: every schedule is F0..B0..
    virtual = num_stages // device_groups(plan.schedule, [s.devices() for s in plan.stages])
    costs = [max(float(s.estimated_cost_s), 0.0) for s in plan.stages]
    relative = not any(costs)
    if relative:
        costs = [1.0] * num_stages
    simulated = simulate(
        make_schedule(name, num_stages, micro, virtual_stages=virtual),
        [c / 3 for c in costs],
        [2 * c / 3 for c in costs],
    )  # a split backward: B and W ⅓ each
    stages = [
        [(b.op, b.micro_batch, b.start, b.end) for b in stage if b.op in COMPUTE_OPS] for stage in simulated.blocks
    ]
    return _view(stages, "estimated", relative)


def _view(stages: list[list[Block]], source: str, relative: bool = False) -> TimelineView:
    makespan = max((b[3] for stage in stages for b in stage), default=0.0)
    busy = sum(b[3] - b[2] for stage in stages for b in stage)
    bubble = 1.0 - busy / (len(stages) * makespan) if makespan > 0 and stages else 0.0
    return TimelineView(tuple(tuple(s) for s in stages), makespan, max(bubble, 0.0), source, relative)


def _as_block(block: Any) -> Block:
    if hasattr(block, "op") and hasattr(block, "start"):
        return (str(block.op), block.micro_batch, float(block.start), float(block.end))
    try:
        op, micro_batch, start, end = block
        return (str(op), None if micro_batch is None else int(micro_batch), float(start), float(end))
    except (TypeError, ValueError) as error:
        raise ValueError(f"a timeline block is (op, micro_batch, start_s, end_s), got {block!r}") from error

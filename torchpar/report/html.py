"""One self-contained HTML page that shows a :class:`~torchpar.planner.plan.Plan`.

    plan.save_html("plan.html")                      # timeline estimated from the cost model
    plan.save_html("plan.html", timeline=measured)   # a measured step: per stage [(op, micro_batch, start_s, end_s)]

Sections, top to bottom: a header (method, devices, estimated step, bubble); the cluster as a grid of
hosts × devices coloured by stage; the stage table (layers, submesh, logical mesh, estimated compute /
communication / memory per device, measured time when a timeline is given); cost bars per stage (and
per layer FLOPs and entering activation bytes when ``layer_stats`` is given: a Plan does not carry them);
a sortable table of every parameter's spec; the pipeline timeline (stage × time, forward and backward
blocks); solver statistics; compile-phase timings.

The page uses inline CSS, JS and SVG only (no network, no CDN), and escapes every text it shows.
:func:`device_grid`, :func:`timeline_view` and :func:`stage_color` are the layout it shares with
:mod:`torchpar.report.png`.
"""

from __future__ import annotations

import colorsys
import datetime
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from torchpar.cluster import ClusterSpec, current_cluster
from torchpar.ir.layout import describe
from torchpar.planner.plan import Plan, Spec

PALETTE = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#86bcb6")
"""Stage colours (Tableau 10); stages past the tenth get golden-angle hues."""
IDLE_COLOR = "#e6e9ed"
AXIS_COLORS = ("#8250df", "#0969da")
"""Colours of a dim split over logical mesh axis 0 and axis 1 in the parameter table."""


# --- layout shared with png.py ----------------------------------------------------------------------

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
    mesh_coord: tuple[int, int] | None


@dataclass(frozen=True)
class DeviceGrid:
    num_hosts: int
    devices_per_host: int
    cells: tuple[DeviceCell, ...]
    stage_devices: tuple[tuple[int, ...], ...]
    notes: tuple[str, ...]


def device_grid(plan: Plan, cluster: ClusterSpec | None = None) -> DeviceGrid:
    """Where each stage runs. Stages are packed in order as the pipeline places them
    (:func:`torchpar.planner.stages.assign_devices`: ``(1, k)`` takes ``k`` devices of one host,
    ``(h, D)`` ``h`` whole hosts); a one-stage plan uses the first devices. ``cluster`` defaults to the one
    from ``torchpar.init``; if the plan needs more devices than it has, hosts × devices are inferred from
    the submeshes (with a note)."""
    notes: list[str] = []
    submeshes = [(int(s.submesh_shape[0]), int(s.submesh_shape[1])) for s in plan.stages]
    needed = sum(h * d for h, d in submeshes)
    cluster = cluster or current_cluster()
    hosts, per_host = cluster.num_hosts, cluster.devices_per_host
    if needed > hosts * per_host:
        per_host = max(d for _, d in submeshes)
        hosts = math.ceil(needed / per_host)
        notes.append(f"The plan uses {needed} devices but the cluster has {cluster.num_devices}; the grid shows "
                     f"{hosts} host(s) × {per_host} device(s) inferred from the stages' submeshes.")
    stage_devices = _stage_devices(submeshes, hosts, per_host, notes)
    owner: dict[int, tuple[int, tuple[int, int]]] = {}
    for stage, (devices, plan_stage) in enumerate(zip(stage_devices, plan.stages)):
        columns = max(int(plan_stage.logical_mesh_shape[1]), 1)
        for k, device in enumerate(devices):
            owner[device] = (stage, (k // columns, k % columns))
    cells = []
    for device in range(hosts * per_host):
        stage, coord = owner.get(device, (None, None))
        cells.append(DeviceCell(device=device, host=device // per_host, local=device % per_host, stage=stage,
                                mesh_coord=coord))
    return DeviceGrid(hosts, per_host, tuple(cells), tuple(tuple(d) for d in stage_devices), tuple(notes))


def _stage_devices(submeshes: list[tuple[int, int]], hosts: int, per_host: int, notes: list[str]) -> list[list[int]]:
    if len(submeshes) > 1 and sum(h * d for h, d in submeshes) == hosts * per_host:
        from torchpar.planner.stages import assign_devices

        try:
            return [list(d) for d in assign_devices(submeshes, hosts, per_host)]
        except ValueError as error:
            notes.append(f"Stages drawn on consecutive devices: {error}.")
    result, start = [], 0
    for h, d in submeshes:  # a one-stage plan runs on the first devices
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


def timeline_view(plan: Plan, timeline: Any = None) -> TimelineView:
    """The step as stage × time blocks: ``timeline`` if given (per stage a list of ``(op, micro_batch,
    start_s, end_s)``, or an object with such ``.blocks``: ``schedules.Timeline``, the Ray runtime's
    ``StepTimeline``), else ``simulate(make_schedule(plan.schedule, S, M))`` with each stage's forward
    taking ⅓ and its backward ⅔ of its ``estimated_cost_s`` per micro-batch."""
    from torchpar.runtime import schedules

    if timeline is None:
        return _estimated_timeline(plan)
    source = "simulated" if isinstance(timeline, schedules.Timeline) else "measured"
    raw = getattr(timeline, "blocks", timeline)
    if len(raw) != len(plan.stages):
        raise ValueError(f"the timeline has {len(raw)} stage(s) but the plan has {len(plan.stages)}")
    stages = [[_as_block(b) for b in stage] for stage in raw]
    stages = [[b for b in stage if b[3] > b[2] or b[0] in schedules.COMPUTE_OPS] for stage in stages]
    origin = min((b[2] for stage in stages for b in stage), default=0.0)
    stages = [[(op, m, start - origin, end - origin) for op, m, start, end in stage] for stage in stages]
    return _view(stages, source)


def _estimated_timeline(plan: Plan) -> TimelineView:
    from torchpar.runtime.schedules import COMPUTE_OPS, SCHEDULES, make_schedule, simulate

    num_stages, micro = len(plan.stages), max(int(plan.num_micro_batches), 1)
    name = plan.schedule if plan.schedule in SCHEDULES else "gpipe"  # one stage: every schedule is F0..B0..
    costs = [max(float(s.estimated_cost_s), 0.0) for s in plan.stages]
    relative = not any(costs)
    if relative:
        costs = [1.0] * num_stages
    simulated = simulate(make_schedule(name, num_stages, micro), [c / 3 for c in costs], [2 * c / 3 for c in costs])
    stages = [[(b.op, b.micro_batch, b.start, b.end) for b in stage if b.op in COMPUTE_OPS]
              for stage in simulated.blocks]
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


# --- the page ---------------------------------------------------------------------------------------

def save_html(plan: Plan, path: str | Path, *, timeline: Any = None, cluster: ClusterSpec | None = None,
              param_shapes: Mapping[str, Sequence[int]] | None = None, layer_stats: Any = None,
              title: str | None = None) -> Path:
    """Write :func:`render_html` to ``path`` (UTF-8) and return the path."""
    path = Path(path)
    path.write_text(render_html(plan, timeline=timeline, cluster=cluster, param_shapes=param_shapes,
                                layer_stats=layer_stats, title=title), encoding="utf-8")
    return path


def render_html(plan: Plan, *, timeline: Any = None, cluster: ClusterSpec | None = None,
                param_shapes: Mapping[str, Sequence[int]] | None = None, layer_stats: Any = None,
                title: str | None = None) -> str:
    """The report page as a string.

    ``timeline``: a measured step (see :func:`timeline_view`); ``cluster``: hosts × devices of the grid
    (default: ``torchpar.init``'s); ``param_shapes``: ``name → shape`` for the parameter table (e.g. from
    ``model.named_parameters()``); ``layer_stats``: per-layer forward FLOPs and entering activation bytes,
    a ``Layering`` (``.flops``, ``.boundary_bytes``) or a list of ``{"flops", "activation_bytes"}``.
    """
    grid = device_grid(plan, cluster)
    view = timeline_view(plan, timeline)
    measured = timeline is not None
    layers = _layer_rows(layer_stats)
    notes = list(grid.notes)
    if layers is None:
        notes.append("Per-layer FLOPs and activation bytes are not part of the plan; the bars show per-stage "
                     "estimates.")
    if view.relative:
        notes.append("The plan has no cost estimates: the timeline gives every stage unit time.")
    title = title or f"torchpar plan: {plan.method}"
    body = [
        f"<header><h1>{_e(title)}</h1><div class='sub'>{_e(_subtitle(plan, grid))}</div></header>",
        _cards(plan, grid, view),
        "".join(f"<p class='note'>{_e(n)}</p>" for n in notes),
        _section("Devices", "devices", _grid_html(plan, grid)),
        _section("Stages", "stages", _stage_table(plan, grid, view if measured else None)),
        _section("Cost per stage", "costs", _stage_bars(plan, cluster or current_cluster())
                 + (_layer_charts(plan, layers) if layers is not None else "")),
        _section("Parameters", "params", _param_table(plan, param_shapes)),
        _section("Pipeline timeline", "timeline", _timeline_svg(plan, view)),
        _section("Solver", "solver", _solver_html(plan.solver)),
        _section("Compile phases", "timings", _timings_html(plan.timings)),
        f"<footer>Generated by torchpar on {_e(datetime.datetime.now().strftime('%Y-%m-%d %H:%M'))}.</footer>",
    ]
    return (f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='viewport' content='width=device-width, initial-scale=1'><title>{_e(title)}</title>"
            f"<style>{_CSS}</style></head><body><main>{''.join(body)}</main><script>{_JS}</script></body></html>\n")


def _subtitle(plan: Plan, grid: DeviceGrid) -> str:
    return (f"{len(plan.stages)} stage(s) on {grid.num_hosts} host(s) × {grid.devices_per_host} device(s); "
            f"{plan.num_micro_batches} micro-batch(es), schedule {plan.schedule}")


def _cards(plan: Plan, grid: DeviceGrid, view: TimelineView) -> str:
    used = sum(len(d) for d in grid.stage_devices)
    params = len({name for stage in plan.stages for name in stage.params})
    items = [("method", plan.method), ("stages", str(len(plan.stages))),
             ("devices used", f"{used} of {grid.num_hosts * grid.devices_per_host}"),
             ("micro-batches", str(plan.num_micro_batches)), ("parameters", str(params)),
             ("estimated step", _fmt_s(plan.estimated_step_s)),
             (f"bubble ({view.source})", f"{100 * view.bubble_fraction:.1f}%")]
    return "<div class='cards'>" + "".join(
        f"<div class='card'><div class='k'>{_e(k)}</div><div class='v'>{_e(v)}</div></div>" for k, v in items
    ) + "</div>"


def _section(title: str, anchor: str, content: str) -> str:
    return f"<section id='{anchor}'><h2>{_e(title)}</h2>{content}</section>"


def _grid_html(plan: Plan, grid: DeviceGrid) -> str:
    rows = []
    for host in range(grid.num_hosts):
        cells = []
        for cell in grid.cells[host * grid.devices_per_host:(host + 1) * grid.devices_per_host]:
            if cell.stage is None:
                cells.append(f"<div class='device idle' data-device='{cell.device}' title='device {cell.device}: idle'>"
                             f"<b>d{cell.device}</b><span>idle</span></div>")
                continue
            color = stage_color(cell.stage)
            tip = (f"device {cell.device} (host {cell.host}, #{cell.local}): stage {cell.stage}, logical mesh "
                   f"coordinate {cell.mesh_coord}")
            cells.append(f"<div class='device' data-device='{cell.device}' data-stage='{cell.stage}' "
                         f"style='background:{color};color:{_text_on(color)}' title='{_e(tip)}'>"
                         f"<b>d{cell.device}</b><span>S{cell.stage} · {_e(_coord(cell.mesh_coord))}</span></div>")
        rows.append(f"<div class='host'><div class='hostlabel'>host {host}</div>{''.join(cells)}</div>")
    legend = "".join(f"<span><i class='swatch' style='background:{stage_color(i)}'></i>stage {i}: "
                     f"{_e(_mesh(s.submesh_shape))} submesh, logical mesh {_e(_mesh(s.logical_mesh_shape))}</span>"
                     for i, s in enumerate(plan.stages))
    legend += f"<span><i class='swatch' style='background:{IDLE_COLOR}'></i>idle</span>"
    return (f"<div class='grid'>{''.join(rows)}</div><div class='legend'>{legend}</div>"
            "<p class='sub'>Each cell is one device, labelled with its stage and its (row, column) in the "
            "stage's logical mesh.</p>")


def _stage_table(plan: Plan, grid: DeviceGrid, view: TimelineView | None) -> str:
    heads = ["stage", "layers", "submesh", "logical mesh", "devices", "params", "est. compute", "est. comm",
             "est. total", "est. memory / device"]
    if view is not None:
        heads += ["measured F+B / micro-batch", "measured ÷ est."]
    rows = []
    for index, stage in enumerate(plan.stages):
        cells = [
            (f"<i class='swatch' style='background:{stage_color(index)}'></i>{index}", index),
            (_e(_ranges(stage.layers)), stage.layers[0] if stage.layers else -1),
            (_e(_mesh(stage.submesh_shape)), None), (_e(_mesh(stage.logical_mesh_shape)), None),
            (_e(_ranges(grid.stage_devices[index])), None), (str(len(stage.params)), len(stage.params)),
            (_fmt_s(stage.estimated_compute_s), stage.estimated_compute_s),
            (_fmt_s(stage.estimated_communication_s), stage.estimated_communication_s),
            (_fmt_s(stage.estimated_cost_s), stage.estimated_cost_s),
            (_fmt_bytes(stage.estimated_memory_bytes), stage.estimated_memory_bytes)]
        if view is not None:
            blocks = [b for b in view.blocks[index] if b[0] in ("forward", "backward")]
            micro = len({b[1] for b in blocks}) or 1
            per_micro = sum(b[3] - b[2] for b in blocks) / micro
            ratio = per_micro / stage.estimated_cost_s if stage.estimated_cost_s > 0 else float("nan")
            cells += [(_fmt_s(per_micro), per_micro), (f"{ratio:.2f}×" if ratio == ratio else "–", ratio)]
        rows.append(cells)
    caption = ("<p class='sub'>Estimates come from the analytic cost model, per micro-batch; memory is per device."
               + (" Measured: forward + backward time per micro-batch in the given timeline." if view else "") + "</p>")
    return _table(heads, rows, numeric=set(range(5, len(heads))), css="stages") + caption


def _stage_bars(plan: Plan, cluster: ClusterSpec) -> str:
    longest = max((max(s.estimated_cost_s, s.estimated_compute_s + s.estimated_communication_s)
                   for s in plan.stages), default=0.0) or 1.0
    biggest = max((s.estimated_memory_bytes for s in plan.stages), default=0) or 1
    time_rows, memory_rows = [], []
    for index, stage in enumerate(plan.stages):
        color = stage_color(index)
        compute = 100 * stage.estimated_compute_s / longest
        comm = 100 * stage.estimated_communication_s / longest
        time_rows.append(
            f"<div class='barrow'><span class='barlabel'>stage {index}</span><div class='track'>"
            f"<div class='seg' style='width:{compute:.2f}%;background:{color}' title='compute "
            f"{_e(_fmt_s(stage.estimated_compute_s))}'></div><div class='seg comm' style='width:{comm:.2f}%' "
            f"title='communication {_e(_fmt_s(stage.estimated_communication_s))}'></div></div><span class='barvalue'>"
            f"{_e(_fmt_s(stage.estimated_compute_s))} + {_e(_fmt_s(stage.estimated_communication_s))}</span></div>")
        share = stage.estimated_memory_bytes / cluster.device_memory_bytes
        memory_rows.append(
            f"<div class='barrow'><span class='barlabel'>stage {index}</span><div class='track'>"
            f"<div class='seg' style='width:{100 * stage.estimated_memory_bytes / biggest:.2f}%;background:{color}'>"
            f"</div></div><span class='barvalue'>{_e(_fmt_bytes(stage.estimated_memory_bytes))} "
            f"({100 * share:.2g}% of {_e(_fmt_bytes(cluster.device_memory_bytes))})</span></div>")
    legend = ("<div class='legend'><span><i class='swatch' style='background:#888'></i>compute (stage colour)</span>"
              "<span><i class='swatch comm'></i>communication</span></div>")
    return (f"<h3>Estimated time per micro-batch</h3>{legend}{''.join(time_rows)}"
            f"<h3>Estimated memory per device</h3>{''.join(memory_rows)}")


def _layer_rows(layer_stats: Any) -> list[tuple[float, float]] | None:
    if layer_stats is None:
        return None
    if hasattr(layer_stats, "flops") and hasattr(layer_stats, "boundary_bytes"):
        return [(float(f), float(b)) for f, b in zip(layer_stats.flops, layer_stats.boundary_bytes)]
    return [(float(r.get("flops", 0.0)), float(r.get("activation_bytes", 0.0))) for r in layer_stats]


def _layer_charts(plan: Plan, layers: list[tuple[float, float]]) -> str:
    stage_of = {layer: index for index, stage in enumerate(plan.stages) for layer in stage.layers}
    colors = [stage_color(stage_of[i]) if i in stage_of else IDLE_COLOR for i in range(len(layers))]
    return (f"<h3>Forward FLOPs per layer</h3>{_columns([f for f, _ in layers], colors, _fmt_flops)}"
            f"<h3>Activation bytes entering each layer</h3>{_columns([b for _, b in layers], colors, _fmt_bytes)}")


def _columns(values: list[float], colors: list[str], fmt: Any) -> str:
    """An SVG column chart, one column per layer, coloured by stage."""
    width, height, left, bottom = 1000, 120, 70, 22
    top = max(values, default=0.0) or 1.0
    step = (width - left) / max(len(values), 1)
    parts = [f"<line x1='{left}' y1='{height - bottom}' x2='{width}' y2='{height - bottom}' class='axis'/>",
             f"<text x='{left - 6}' y='14' class='tick' text-anchor='end'>{_e(fmt(top))}</text>"]
    for i, (value, color) in enumerate(zip(values, colors)):
        h = (height - bottom - 8) * value / top
        x = left + i * step + step * 0.1
        parts.append(f"<rect class='layerbar' x='{x:.1f}' y='{height - bottom - h:.1f}' width='{step * 0.8:.1f}' "
                     f"height='{h:.1f}' fill='{color}'><title>layer {i}: {_e(fmt(value))}</title></rect>")
        if len(values) <= 48 or i % math.ceil(len(values) / 48) == 0:
            parts.append(f"<text x='{x + step * 0.4:.1f}' y='{height - 6}' class='tick' "
                         f"text-anchor='middle'>{i}</text>")
    return f"<svg viewBox='0 0 {width} {height}' class='chart' role='img'>{''.join(parts)}</svg>"


def _param_table(plan: Plan, shapes: Mapping[str, Sequence[int]] | None) -> str:
    """One row per (stage, parameter); shape columns only when ``shapes`` is given (a Plan holds specs only,
    whose length is the parameter's rank)."""
    with_shapes = bool(shapes)
    heads = ["stage", "parameter", "rank", "spec", "shards", "other layouts"]
    if with_shapes:
        heads[2:2] = ["shape"]
        heads[-1:-1] = ["elements / device"]
    rows = []
    for index, stage in enumerate(plan.stages):
        mesh = tuple(int(d) for d in stage.logical_mesh_shape)
        for name, spec in stage.params.items():
            shards = _shards(spec, mesh)
            other = []
            for what, layouts in (("grad", stage.grads), ("optimizer state", stage.optimizer_state),
                                  ("gathered at use", stage.params_at_use)):
                if name in layouts and layouts[name] != spec:
                    other.append(f"{what}: {describe(layouts[name])}")
            cells = [(f"<i class='swatch' style='background:{stage_color(index)}'></i>{index}", index),
                     (f"<code>{_e(name)}</code>", name), (str(len(spec)), len(spec)),
                     (_spec_chips(spec), describe(spec)), (str(shards), shards),
                     (_e("; ".join(other)), "; ".join(other))]
            if with_shapes:
                shape = list(shapes[name]) if name in shapes else None
                numel = math.prod(shape) if shape is not None else -1
                cells[2:2] = [(_e("×".join(map(str, shape)) if shape is not None else "?"), numel)]
                cells[-1:-1] = [(f"{math.ceil(numel / shards):,}" if numel >= 0 else "?", numel / shards)]
            rows.append(cells)
    numeric = {i for i, h in enumerate(heads) if h in ("rank", "shards", "elements / device")}
    legend = (f"<div class='legend'><span><b class='chip'>R</b> replicated dim</span><span><b class='chip' "
              f"style='background:{AXIS_COLORS[0]}'>S0</b> split over logical mesh axis 0</span><span><b class='chip' "
              f"style='background:{AXIS_COLORS[1]}'>S1</b> over axis 1</span><span>Click a header to sort.</span>"
              "</div>")
    return legend + _table(heads, rows, numeric=numeric, sortable=True, css="params", scroll=len(rows) > 20)


def _shards(spec: Spec, mesh: tuple[int, int]) -> int:
    return math.prod(mesh[a] for entry in spec if entry for a in entry if 0 <= a < len(mesh))


def _spec_chips(spec: Spec) -> str:
    if not spec:
        return "<span class='sub'>scalar</span>"
    chips = []
    for entry in spec:
        if not entry:
            chips.append("<b class='chip'>R</b>")
        else:
            color = AXIS_COLORS[entry[0]] if len(entry) == 1 and entry[0] in (0, 1) else "#bf3989"
            chips.append(f"<b class='chip' style='background:{color}'>S{_e(''.join(map(str, entry)))}</b>")
    return "".join(chips)


def _timeline_svg(plan: Plan, view: TimelineView) -> str:
    left, right, row_h, gap, top = 78, 20, 30, 8, 10
    width = 1100
    inner = width - left - right
    height = top + len(view.blocks) * (row_h + gap) + 30
    span = view.makespan or 1.0
    scale = inner / span
    parts = []
    for tick in _ticks(span):
        x = left + tick * scale
        parts.append(f"<line x1='{x:.1f}' y1='{top}' x2='{x:.1f}' y2='{height - 26}' class='gridline'/>"
                     f"<text x='{x:.1f}' y='{height - 10}' class='tick' text-anchor='middle'>"
                     f"{_e(_fmt_tick(tick, view.relative))}</text>")
    for stage, blocks in enumerate(view.blocks):
        y = top + stage * (row_h + gap)
        color = stage_color(stage)
        parts.append(f"<rect x='{left}' y='{y}' width='{inner}' height='{row_h}' class='lane'/>"
                     f"<text x='{left - 8}' y='{y + row_h / 2 + 4}' class='lanelabel' "
                     f"text-anchor='end'>stage {stage}</text>")
        for op, micro, start, end in blocks:
            x, w = left + start * scale, max((end - start) * scale, 1.0)
            kind = {"forward": "fwd", "backward": "bwd"}.get(op, "other")
            fill = _tint(color, 0.5) if kind == "fwd" else color if kind == "bwd" else "#999"
            label = f"{op[0].upper()}{'' if micro is None else micro}"
            tip = (f"stage {stage} {op} micro-batch {micro}: {_fmt_tick(start, view.relative)} – "
                   f"{_fmt_tick(end, view.relative)}")
            parts.append(f"<rect class='blk {kind}' data-stage='{stage}' "
                         f"data-micro-batch='{'' if micro is None else micro}' "
                         f"x='{x:.2f}' y='{y + 2}' width='{w:.2f}' height='{row_h - 4}' rx='3' fill='{fill}'>"
                         f"<title>{_e(tip)}</title></rect>")
            if w >= 8 * len(label) + 4:
                parts.append(f"<text x='{x + w / 2:.2f}' y='{y + row_h / 2 + 4}' class='blklabel' text-anchor='middle' "
                             f"fill='{_text_on(fill)}'>{_e(label)}</text>")
    what = {"estimated": f"estimated from the cost model (forward ⅓, backward ⅔ of each stage's cost), schedule "
                         f"{plan.schedule}", "simulated": "simulated", "measured": "measured"}[view.source]
    legend = (f"<div class='legend'><span><i class='swatch' style='background:{_tint(PALETTE[0], 0.5)}'></i>forward "
              f"(light)</span><span><i class='swatch' style='background:{PALETTE[0]}'></i>backward (stage colour)"
              "</span>"
              f"<span><i class='swatch' style='background:{IDLE_COLOR}'></i>idle (bubble)</span><span>labels: F/B + "
              f"micro-batch</span></div>")
    caption = (f"<p class='sub'>{_e(what)}; makespan {_e(_fmt_tick(view.makespan, view.relative))}, bubble "
               f"{100 * view.bubble_fraction:.1f}%.</p>")
    return (f"{legend}<svg viewBox='0 0 {width} {height}' class='chart timeline' role='img'>{''.join(parts)}</svg>"
            f"{caption}")


def _solver_html(solver: Mapping[str, Any]) -> str:
    if not solver:
        return "<p class='sub'>No solver statistics (a hand-made or single-device plan).</p>"
    scalar = lambda v: not isinstance(v, (Mapping, list, tuple))  # noqa: E731
    flat = {k: v for k, v in solver.items() if scalar(v)}
    per_stage = {k: v for k, v in solver.items() if isinstance(v, Mapping) and all(map(scalar, v.values()))}
    other = {k: v for k, v in solver.items() if k not in flat and k not in per_stage}
    out = []
    if flat:
        rows = [[(_e(k), None), (_e(_fmt_stat(k, v)), None)] for k, v in flat.items()]
        out.append(_table(["statistic", "value"], rows, numeric={1}, css="kv"))
    if per_stage:
        keys = list(dict.fromkeys(k for v in per_stage.values() for k in v))
        rows = [[(_e(key), None)] + [(_e(_fmt_stat(key, v.get(key, ""))), None) for v in per_stage.values()]
                for key in keys]
        out.append(_table(["statistic", *per_stage], rows, numeric=set(range(1, len(per_stage) + 1)), css="kv"))
    for name, value in other.items():
        items = value if isinstance(value, (list, tuple)) else [value]
        entries = "".join(f"<li>{_e(_describe(item))}</li>" for item in items) or "<li class='sub'>none</li>"
        out.append(f"<h3>{_e(name.replace('_', ' '))}</h3><ol class='mono'>{entries}</ol>")
    return "".join(out)


def _timings_html(timings: Mapping[str, float]) -> str:
    if not timings:
        return "<p class='sub'>No compile-phase timings recorded.</p>"
    longest = max(timings.values()) or 1.0
    rows = [f"<div class='barrow'><span class='barlabel'>{_e(phase)}</span><div class='track'><div class='seg' "
            f"style='width:{100 * seconds / longest:.2f}%;background:#57606a'></div></div>"
            f"<span class='barvalue'>{seconds:.3f} s</span></div>" for phase, seconds in timings.items()]
    return "".join(rows) + f"<p class='sub'>total {sum(timings.values()):.3f} s</p>"


# --- small helpers ----------------------------------------------------------------------------------

def _e(value: Any) -> str:
    return escape(str(value), quote=True)


Cell = tuple[str, Any]
"""A table cell: (inner HTML, sort key or ``None`` to sort by its text)."""


def _table(heads: list[str], rows: list[list[Cell]], *, numeric: set[int] = frozenset(), sortable: bool = False,
           css: str = "", scroll: bool = False) -> str:
    """A table; columns in ``numeric`` are right-aligned; ``sortable`` ones sort on a header click (inline JS)."""
    classes = " ".join(c for c in (css, "sortable" if sortable else "") if c)
    head = "".join(f"<th{' class=num' if i in numeric else ''}>{_e(h)}</th>" for i, h in enumerate(heads))
    body = []
    for cells in rows:
        tds = []
        for i, (inner, key) in enumerate(cells):
            attrs = (" class='num'" if i in numeric else "") + ("" if key is None else f" data-sort='{_e(key)}'")
            tds.append(f"<td{attrs}>{inner}</td>")
        body.append("<tr>" + "".join(tds) + "</tr>")
    wrap = "tablewrap scroll" if scroll else "tablewrap"
    return (f"<div class='{wrap}'><table class='{classes}'><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table></div>")


def _ranges(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` → ``0–2, 5``."""
    values = sorted(values)
    parts, start = [], None
    for i, v in enumerate(values):
        start = v if start is None else start
        if i + 1 == len(values) or values[i + 1] != v + 1:
            parts.append(str(v) if v == start else f"{start}–{v}")
            start = None
    return ", ".join(parts) or "–"


def _mesh(shape: Sequence[int]) -> str:
    return "×".join(str(int(d)) for d in shape)


def _coord(coord: tuple[int, int] | None) -> str:
    return "" if coord is None else f"({coord[0]},{coord[1]})"


def _fmt_s(seconds: float) -> str:
    seconds = float(seconds)
    if seconds == 0:
        return "0"
    if abs(seconds) >= 1:
        return f"{seconds:.3g} s"
    if abs(seconds) >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} µs"


def _fmt_bytes(count: float) -> str:
    count = float(count)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count:.0f} B"


def _fmt_flops(count: float) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(count) >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count:.0f} FLOP"


def _fmt_stat(key: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if key.endswith("_s"):
        return _fmt_s(value)
    if "bytes" in key:
        return _fmt_bytes(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"


def _describe(item: Any) -> str:
    """A stage partition (``{"estimated_step_s", "stages": [...]}``) on one line; other items as JSON."""
    if isinstance(item, Mapping) and isinstance(item.get("stages"), list):
        parts = [f"layers {_ranges(st.get('layers', []))} on {_mesh(st.get('submesh_shape', []))} (mesh "
                 f"{_mesh(st.get('logical_mesh_shape', []))}) {_fmt_s(st.get('estimated_cost_s', 0.0))}"
                 for st in item["stages"]]
        return f"step {_fmt_s(item.get('estimated_step_s', 0.0))}: " + " | ".join(parts)
    if isinstance(item, Mapping) and "description" in item:
        return str(item["description"])
    return item if isinstance(item, str) else json.dumps(item, default=str)


def _ticks(span: float) -> list[float]:
    raw = span / 8
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(int(span / step + 1e-9) + 1)]


def _fmt_tick(value: float, relative: bool) -> str:
    return f"{value:.3g}" if relative else _fmt_s(value)


def _tint(color: str, amount: float) -> str:
    """``color`` mixed with white by ``amount`` (0 = unchanged, 1 = white)."""
    r, g, b = (int(color[i:i + 2], 16) for i in (1, 3, 5))
    mix = lambda c: round(c + (255 - c) * amount)  # noqa: E731
    return f"#{mix(r):02x}{mix(g):02x}{mix(b):02x}"


def _text_on(color: str) -> str:
    r, g, b = (int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "#1f2328" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.6 else "#ffffff"


_CSS = """
:root{--fg:#1f2328;--muted:#59636e;--border:#d1d9e0;--panel:#f6f8fa}
*{box-sizing:border-box}
body{margin:0;color:var(--fg);background:#fff;font:14px/1.5 -apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,
"Helvetica Neue",Arial,sans-serif}
main{max-width:1180px;margin:0 auto;padding:28px 32px 48px}
h1{font-size:24px;margin:0 0 2px}
h2{font-size:18px;margin:36px 0 10px;padding-bottom:6px;border-bottom:1px solid var(--border)}
h3{font-size:14px;margin:18px 0 6px;color:var(--muted);font-weight:600}
.sub{color:var(--muted)}
.note{background:#fff8c5;border:1px solid #e6cf7a;border-radius:6px;padding:6px 12px;margin:8px 0}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:18px 0 6px}
.card{background:var(--panel);border:1px solid var(--border);border-radius:8px;padding:8px 14px;min-width:118px}
.card .k{font-size:11px;color:var(--muted);text-transform:uppercase;letter-spacing:.05em}
.card .v{font-size:18px;font-weight:600;font-variant-numeric:tabular-nums}
.tablewrap{overflow-x:auto}
.tablewrap.scroll{max-height:560px;overflow-y:auto;border:1px solid #eaeef2;border-radius:6px}
.tablewrap.scroll th{position:sticky;top:0;z-index:1}
table.kv{width:auto;min-width:420px}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
th,td{text-align:left;padding:5px 10px;border-bottom:1px solid #eaeef2;white-space:nowrap}
th{background:var(--panel);font-weight:600;font-size:13px}
th.num,td.num{text-align:right}
tbody tr:hover{background:#f6f8fa}
table.sortable th{cursor:pointer;user-select:none}
table.sortable th:hover{background:#eaeef2}
th[aria-sort=ascending]::after{content:" \\25B2";font-size:10px}
th[aria-sort=descending]::after{content:" \\25BC";font-size:10px}
code,.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
.swatch{display:inline-block;width:12px;height:12px;border-radius:3px;vertical-align:-1px;margin-right:6px}
.swatch.comm,.seg.comm{background:repeating-linear-gradient(45deg,#8c959f 0 4px,#d0d7de 4px 8px)}
.legend{display:flex;flex-wrap:wrap;gap:6px 18px;font-size:12.5px;color:var(--muted);margin:6px 0 10px}
.chip{display:inline-block;min-width:26px;text-align:center;margin-right:3px;padding:0 5px;border-radius:4px;
font:600 11.5px/18px ui-monospace,Menlo,Consolas,monospace;color:#fff;background:#8c959f}
.grid .host{display:flex;align-items:center;gap:6px;margin:6px 0}
.hostlabel{width:60px;font-size:12px;color:var(--muted)}
.device{width:76px;height:52px;border-radius:7px;display:flex;flex-direction:column;align-items:center;
justify-content:center;font-size:11px;line-height:1.3;box-shadow:inset 0 0 0 1px rgba(0,0,0,.08)}
.device b{font-size:13px}
.device.idle{background:#e6e9ed;color:var(--muted)}
.barrow{display:flex;align-items:center;gap:10px;margin:4px 0}
.barlabel{width:90px;font-size:12.5px;color:var(--muted)}
.track{flex:1;display:flex;height:16px;background:#f0f2f4;border-radius:4px;overflow:hidden}
.seg{height:100%}
.barvalue{width:300px;font-size:12.5px;font-variant-numeric:tabular-nums}
svg.chart{width:100%;height:auto;display:block}
svg text{font-family:inherit}
.tick{font-size:11px;fill:#59636e}
.axis{stroke:#8c959f}
.gridline{stroke:#eaeef2}
.lane{fill:#e6e9ed;opacity:.55}
.lanelabel{font-size:12px;fill:#1f2328}
.blklabel{font-size:11px;font-weight:600;pointer-events:none}
footer{margin-top:40px;font-size:12px;color:var(--muted)}
"""

_JS = """
(function () {
  function key(cell) {
    var v = cell.getAttribute("data-sort");
    if (v === null) { v = cell.textContent.trim(); }
    var n = Number(v);
    return v !== "" && !isNaN(n) ? n : v;
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    var heads = table.querySelectorAll("th");
    heads.forEach(function (th, col) {
      th.addEventListener("click", function () {
        var ascending = th.getAttribute("aria-sort") !== "ascending";
        heads.forEach(function (h) { h.removeAttribute("aria-sort"); });
        th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
        var body = table.tBodies[0];
        var rows = Array.prototype.slice.call(body.rows);
        rows.sort(function (a, b) {
          var x = key(a.cells[col]), y = key(b.cells[col]);
          var c = (typeof x === "number" && typeof y === "number") ? x - y
            : String(x).localeCompare(String(y), undefined, {numeric: true});
          return ascending ? c : -c;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  });
})();
"""

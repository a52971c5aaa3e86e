"""One self-contained HTML page that shows a :class:`~torchpar.planner.plan.Plan`.

    plan.save_html("plan.html")                      # timeline estimated from the cost model
    plan.save_html("plan.html", timeline=measured)   # a measured step: per stage [(op, micro_batch, start_s, end_s)]
    plan.save_html("plan.html", measured={"step_s": 0.041, "memory_bytes": {0: 6.1e9, 1: 5.8e9}})

Sections, top to bottom: a header (method, devices, the step estimate and what priced it, memory, bubble;
measured step and memory beside them when given); the cluster as a grid of hosts × devices coloured by stage;
the stage table (layers, submesh → logical mesh and the axes that cross hosts, estimated time, compute,
communication and memory per device, and measured columns when given); why this plan (runners-up or hand
plans and mesh shapes on the same cost model: :mod:`torchpar.report.alternatives`); cost per stage (time,
memory by part, collective bytes; layers and their modules for pipelines: :mod:`torchpar.report.costs`); the
ILP's strategy per anchor op (:mod:`torchpar.report.operators`); a sortable table of every parameter's spec;
the pipeline timeline; the cost constants; solver statistics; compile-phase timings.

Every number comes from :func:`torchpar.report.estimates.plan_numbers`, shared with the PNG, and is formatted by
:mod:`torchpar.units`; rows and cards carry the exact values as ``data-*`` attributes. The page uses inline CSS,
JS and SVG only (no network, no CDN), and escapes every text it shows. The layout it draws (device grid,
timeline, colours) is :mod:`torchpar.report.layout`; the stylesheet and script are :mod:`torchpar.report.assets`.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchpar.hardware import ClusterSpec
from torchpar.ir.layout import describe
from torchpar.report import costs
from torchpar.report.alternatives import why_html
from torchpar.report.assets import CSS, JS
from torchpar.report.estimates import PlanNumbers, mesh_text, plan_numbers
from torchpar.report.layout import (
    IDLE_COLOR,
    PALETTE,
    DeviceGrid,
    TimelineView,
    device_grid,
    grid_cluster,
    stage_color,
    timeline_view,
)
from torchpar.report.markup import (
    Cell,
    attrs,
    coord,
    e,
    ranges,
    ratio,
    shards,
    spec_chips,
    spec_legend,
    stage_cell,
    table,
    text_on,
    tint,
)
from torchpar.report.operators import strategies_html
from torchpar.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from torchpar.planner.plan import Plan

EXPLAINED_SOLVER_KEYS = (
    "estimate",
    "stage_partition",
    "runners_up",
    "mesh_shapes",
    "expert_layouts",
    "method_comparison",
    "profile",
)
"""``Plan.solver`` entries shown in their own sections rather than in the solver statistics."""


def save_html(
    plan: Plan,
    path: str | Path,
    *,
    timeline: object = None,
    measured: Mapping[str, Any] | None = None,
    cluster: ClusterSpec | None = None,
    param_shapes: Mapping[str, Sequence[int]] | None = None,
    layer_stats: Any = None,
    title: str | None = None,
) -> Path:
    """Write :func:`render_html` to ``path`` (UTF-8) and return the path."""
    path = Path(path)
    path.write_text(
        render_html(
            plan,
            timeline=timeline,
            measured=measured,
            cluster=cluster,
            param_shapes=param_shapes,
            layer_stats=layer_stats,
            title=title,
        ),
        encoding="utf-8",
    )
    return path


def render_html(
    plan: Plan,
    *,
    timeline: object = None,
    measured: Mapping[str, Any] | None = None,
    cluster: ClusterSpec | None = None,
    param_shapes: Mapping[str, Sequence[int]] | None = None,
    layer_stats: Any = None,
    title: str | None = None,
) -> str:
    """The report page as a string.

    ``timeline``: a measured step (see :func:`~torchpar.report.layout.timeline_view`); ``measured``: what a
    run measured, ``{"step_s": seconds, "memory_bytes": {stage_index: peak bytes per device}}`` (either key),
    shown beside the estimates; ``cluster``: hosts × devices of the grid (default: the plan's, else
    ``torchpar.init``'s); ``param_shapes``: ``name → shape`` for the parameter table (e.g. from
    ``model.named_parameters()``); ``layer_stats``: per-layer forward FLOPs and entering activation bytes,
    a ``Layering`` (``.flops``, ``.boundary_bytes``) or a list of ``{"flops", "activation_bytes", "modules"}``
    (default: ``plan.layers``).
    """
    numbers = plan_numbers(plan, measured)
    grid = device_grid(plan, cluster)
    view = timeline_view(plan, timeline)
    cluster = cluster or grid_cluster(plan)
    layers = costs.layer_rows(layer_stats if layer_stats is not None else (plan.layers or None))
    notes = list(grid.notes)
    if view.relative:
        notes.append("The plan has no cost estimates: the timeline gives every stage unit time.")
    if abs(numbers.derived_step_s - numbers.step_s) > 1e-6 * max(abs(numbers.step_s), 1e-30):
        notes.append(
            f"The stage estimates give a step of {format_seconds(numbers.derived_step_s)} "
            f"({numbers.step_formula}) but the plan's estimate is {format_seconds(numbers.step_s)}."
        )
    title = title or f"torchpar plan: {numbers.title}"
    sections = [
        ("Devices", "devices", _grid_html(plan, grid, numbers)),
        ("Stages", "stages", _stage_table(plan, grid, numbers, view if timeline is not None else None)),
        ("Why this plan", "why", why_html(plan, numbers)),
        (
            "Cost per stage",
            "costs",
            costs.time_bars(numbers)
            + costs.memory_html(numbers, cluster.device_memory_bytes)
            + costs.communication_html(numbers),
        ),
        ("Layers", "layers", costs.layers_html(plan, layers) if layers else None),
        ("Operator strategies", "strategies", strategies_html(plan)),
        ("Parameters", "params", _param_table(plan, param_shapes)),
        ("Pipeline timeline" if numbers.pipeline else "Step timeline", "timeline", _timeline_svg(plan, view, numbers)),
        ("Cost constants", "constants", costs.constants_html(plan.cluster or {})),
        ("Solver", "solver", _solver_html(plan.solver)),
        ("Compile phases", "timings", _timings_html(plan.timings)),
    ]
    sections = [s for s in sections if s[2] is not None]
    toc = "".join(f"<a href='#{anchor}'>{e(name)}</a>" for name, anchor, _ in sections)
    body = [
        (
            f"<header><h1>{e(title)}</h1><div class='sub'>{e(_subtitle(plan, grid, numbers))}</div>"
            f"<nav class='toc'>{toc}</nav></header>"
        ),
        _cards(plan, grid, view, numbers),
        _estimate_note(numbers),
        "".join(f"<p class='note'>{e(n)}</p>" for n in notes),
        *(f"<section id='{anchor}'><h2>{e(name)}</h2>{content}</section>" for name, anchor, content in sections),
        f"<footer>Generated by torchpar on {e(datetime.datetime.now().strftime('%Y-%m-%d %H:%M'))}.</footer>",
    ]
    return (
        f"<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<meta name='viewport' content='width=device-width, initial-scale=1'><title>{e(title)}</title>"
        f"<style>{CSS}</style></head><body><main>{''.join(body)}</main><script>{JS}</script></body></html>\n"
    )


# --- header ---------------------------------------------------------------------------------------------


def _subtitle(plan: Plan, grid: DeviceGrid, numbers: PlanNumbers) -> str:
    return (
        f"{numbers.title}: {len(plan.stages)} stage(s) on {grid.num_hosts} host(s) × {grid.devices_per_host} "
        f"device(s); {plan.num_micro_batches} micro-batch(es), schedule {plan.schedule}"
    )


def _cards(plan: Plan, grid: DeviceGrid, view: TimelineView, numbers: PlanNumbers) -> str:
    used = sum(len(d) for d in grid.stage_devices)
    params = len({name for stage in plan.stages for name in stage.params})
    items = [
        ("method", numbers.title, ""),
        ("devices used", f"{used} of {grid.num_hosts * grid.devices_per_host}", ""),
        ("parameters", str(params), ""),
        ("estimated step", format_seconds(numbers.step_s), attrs(data_step_s=numbers.step_s)),
    ]
    if numbers.measured_step_s is not None:
        value = f"{format_seconds(numbers.measured_step_s)} ({ratio(numbers.measured_step_s, numbers.step_s)} est.)"
        items.append(("measured step", value, attrs(data_measured_step_s=numbers.measured_step_s)))
    items.append(
        (
            "est. memory / device",
            format_bytes(numbers.peak_memory_bytes),
            attrs(data_memory_bytes=numbers.peak_memory_bytes),
        )
    )
    if numbers.measured_peak_memory_bytes is not None:
        items.append(
            (
                "measured peak memory",
                format_bytes(numbers.measured_peak_memory_bytes),
                attrs(data_measured_memory_bytes=numbers.measured_peak_memory_bytes),
            )
        )
    if numbers.pipeline:  # one stage has no pipeline bubble, estimated or measured
        items.append((f"bubble ({view.source})", f"{100 * view.bubble_fraction:.1f}%", ""))
    return (
        "<div class='cards'>"
        + "".join(
            f"<div class='card'{extra}><div class='k'>{e(k)}</div><div class='v'>{e(v)}</div></div>"
            for k, v, extra in items
        )
        + "</div>"
    )


def _estimate_note(numbers: PlanNumbers) -> str:
    model = numbers.estimate_model or "the analytic cost model"
    unit = "per micro-batch" if numbers.pipeline else "per step"
    text = (
        f"How this was estimated: each stage by {model}, {unit}; {numbers.step_equation}. "
        "Every time and memory figure on this page is this estimate unless labelled otherwise."
    )
    if numbers.screening and isinstance(numbers.screening.get("estimated_step_s"), (int, float)):
        text += (
            f" The stage DP screened partitions with a coarser model "
            f"({numbers.screening.get('model') or 'analytic'}): "
            f"{format_seconds(numbers.screening['estimated_step_s'])} for this one, not comparable."
        )
    return f"<p class='how'>{e(text)} <a href='#constants'>Cost constants</a>.</p>"


# --- devices and stages ---------------------------------------------------------------------------------


def _grid_html(plan: Plan, grid: DeviceGrid, numbers: PlanNumbers) -> str:
    rows = []
    for host in range(grid.num_hosts):
        cells = []
        for cell in grid.cells[host * grid.devices_per_host : (host + 1) * grid.devices_per_host]:
            if cell.stage is None:
                cells.append(
                    f"<div class='device idle' data-device='{cell.device}' title='device {cell.device}: idle'>"
                    f"<b>d{cell.device}</b><span>idle</span></div>"
                )
                continue
            color = stage_color(cell.stage)
            tip = (
                f"device {cell.device} (host {cell.host}, #{cell.local}): stage {cell.stage}, logical mesh "
                f"coordinate {cell.mesh_coord}"
            )
            cells.append(
                f"<div class='device' data-device='{cell.device}' data-stage='{cell.stage}' "
                f"style='background:{color};color:{text_on(color)}' title='{e(tip)}'>"
                f"<b>d{cell.device}</b><span>stage {cell.stage}</span>"
                f"<span>{e(coord(cell.mesh_coord))}</span></div>"
            )
        rows.append(f"<div class='host'><div class='hostlabel'>host {host}</div>{''.join(cells)}</div>")
    legend = "".join(
        f"<span><i class='swatch' style='background:{stage_color(s.index)}'></i>stage {s.index}: "
        f"{e(mesh_text(s.submesh_shape))} submesh, logical mesh {e(mesh_text(s.logical_mesh_shape))}"
        f"{e(_crossing_text(s.crosses_hosts))}</span>"
        for s in numbers.stages
    )
    legend += f"<span><i class='swatch' style='background:{IDLE_COLOR}'></i>idle</span>"
    return (
        f"<div class='grid'>{''.join(rows)}</div><div class='legend'>{legend}</div>"
        "<p class='sub'>Each cell is one device, labelled with its stage and its (row, column) in the stage's "
        "logical mesh (after its data replica, on a stage with data replicas): a collective over axis 0 runs "
        "within a column, over axis 1 within a row.</p>"
    )


def _crossing_text(crossing: Sequence[bool]) -> str:
    axes = [str(a) for a, c in enumerate(crossing) if c]
    return f" (axis {' and '.join(axes)} crosses hosts)" if axes else ""


def _stage_table(plan: Plan, grid: DeviceGrid, numbers: PlanNumbers, view: TimelineView | None) -> str:
    """Estimated columns, then measured ones (a timeline's F+B time per micro-batch, peak memory) beside them."""
    unit = "micro-batch" if numbers.pipeline else "step"
    memory_measured = any(s.measured_memory_bytes is not None for s in numbers.stages)
    profiled = view is None and any(stage.measured_cost_s is not None for stage in plan.stages)
    measured_heads = (
        (["F+B time", "÷ est."] if view is not None else [])
        + (["profiled F+B", "÷ est."] if profiled else [])
        + (["peak memory", "÷ est."] if memory_measured else [])
    )
    fixed = ["stage", "layers", "submesh → logical mesh", "devices", "params"]
    estimated = [f"time / {unit}", "compute", "comm", "memory / device"]
    head = (
        "<tr>"
        + "".join(f"<th rowspan='2'{' class=num' if h == 'params' else ''}>{e(h)}</th>" for h in fixed)
        + f"<th colspan='{len(estimated)}' class='group'>estimated</th>"
        + (f"<th colspan='{len(measured_heads)}' class='group measured'>measured</th>" if measured_heads else "")
        + "</tr><tr>"
        + "".join(f"<th class='num'>{e(h)}</th>" for h in estimated)
        + "".join(f"<th class='num measured'>{e(h)}</th>" for h in measured_heads)
        + "</tr>"
    )
    rows, row_attrs = [], []
    for s, stage in zip(numbers.stages, plan.stages):
        crossing = _crossing_text(s.crosses_hosts).strip(" ()")
        mesh = f"{e(mesh_text(s.submesh_shape))} → {e(mesh_text(s.logical_mesh_shape))}" + (
            f"<div class='badge'>{e(crossing)}</div>" if crossing else ""
        )
        cells: list[Cell] = [
            stage_cell(s.index),
            (e(ranges(s.layers)), s.layers[0] if s.layers else -1),
            (mesh, None),
            (e(ranges(grid.stage_devices[s.index])), None),
            (str(len(stage.params)), len(stage.params)),
            (f"<b>{e(format_seconds(s.cost_s))}</b>", s.cost_s),
            (e(format_seconds(s.compute_s)), s.compute_s),
            (e(format_seconds(s.communication_s)), s.communication_s),
            (e(format_bytes(s.memory_bytes)), s.memory_bytes),
        ]
        per_micro = None
        if view is not None and len(view.blocks) == len(numbers.stages):  # one row per stage (not interleaved)
            blocks = [
                b for b in view.blocks[s.index] if b[0] in ("forward", "backward", "backward_input", "backward_weight")
            ]
            busy = sum(b[3] - b[2] for b in blocks)
            # no block timed on this stage (a timeline of other stages, or one recorded without clocks): n/a, not 0 s
            per_micro = busy / len({b[1] for b in blocks}) if busy > 0 else None
            cells += [
                (e(format_seconds(per_micro)) if per_micro is not None else "n/a", per_micro),
                (ratio(per_micro, s.cost_s), None),
            ]
        elif profiled:
            per_micro = stage.measured_cost_s
            cells += [
                (e(format_seconds(per_micro)) if per_micro is not None else "–", per_micro),
                (ratio(per_micro, s.cost_s), None),
            ]
        if memory_measured:
            m = s.measured_memory_bytes
            cells += [(e(format_bytes(m)) if m is not None else "–", m), (ratio(m, s.memory_bytes), None)]
        rows.append(cells)
        row_attrs.append(
            attrs(
                data_stage=s.index,
                data_cost_s=s.cost_s,
                data_compute_s=s.compute_s,
                data_communication_s=s.communication_s,
                data_memory_bytes=s.memory_bytes,
                data_measured_time_s=per_micro,
                data_measured_memory_bytes=s.measured_memory_bytes,
            )
        )
    measured_step = (
        f" · measured step {e(format_seconds(numbers.measured_step_s))} "
        f"({ratio(numbers.measured_step_s, numbers.step_s)} est.)"
        if numbers.measured_step_s is not None
        else ""
    )
    foot = (
        f"<tr class='total'{attrs(data_derived_step_s=numbers.derived_step_s)}><td colspan='5'>"
        f"{e(numbers.step_equation)}</td><td class='num'><b>{e(format_seconds(numbers.derived_step_s))}</b></td>"
        f"<td colspan='{3 + len(measured_heads)}' class='sub'>plan estimate "
        f"{e(format_seconds(numbers.step_s))}{measured_step}</td></tr>"
    )
    numeric = set(range(4, 9 + len(measured_heads)))
    caption = (
        f"<p class='sub'>Estimated per {unit}, memory per device; measured figures sit beside the estimates"
        + (": F+B is forward + backward time per micro-batch in the given timeline" if view is not None else "")
        + (
            ": profiled F+B is the stage compiled and timed alone by profile=True (median forward + backward "
            f"per {unit})"
            if profiled
            else ""
        )
        + ".</p>"
    )
    return table([], rows, numeric=numeric, css="stages", row_attrs=row_attrs, head_html=head, foot_html=foot) + caption


# --- parameters -----------------------------------------------------------------------------------------


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
            pieces = shards(spec, mesh)
            other = []
            for what, layouts in (
                ("grad", stage.grads),
                ("optimizer state", stage.optimizer_state),
                ("gathered at use", stage.params_at_use),
            ):
                if name in layouts and layouts[name] != spec:
                    other.append(f"{what}: {describe(layouts[name])}")
            cells = [
                stage_cell(index),
                (f"<code>{e(name)}</code>", name),
                (str(len(spec)), len(spec)),
                (spec_chips(spec), describe(spec)),
                (str(pieces), pieces),
                (e("; ".join(other)), "; ".join(other)),
            ]
            if with_shapes:
                assert shapes is not None  # with_shapes
                shape = list(shapes[name]) if name in shapes else None
                numel = math.prod(shape) if shape is not None else -1
                cells[2:2] = [(e("×".join(map(str, shape)) if shape is not None else "?"), numel)]
                cells[-1:-1] = [(f"{math.ceil(numel / pieces):,}" if numel >= 0 else "?", numel / pieces)]
            rows.append(cells)
    numeric = {i for i, h in enumerate(heads) if h in ("rank", "shards", "elements / device")}
    return spec_legend("<span>Click a header to sort.</span>") + table(
        heads, rows, numeric=numeric, sortable=True, css="params", scroll=len(rows) > 20
    )


# --- timeline -------------------------------------------------------------------------------------------


def _timeline_svg(plan: Plan, view: TimelineView, numbers: PlanNumbers) -> str:
    left, right, row_h, gap, top = 78, 20, 30, 8, 22
    width = 1100
    inner = width - left - right
    height = top + len(view.blocks) * (row_h + gap) + 30
    marker = None if view.relative or numbers.step_s <= 0 else numbers.step_s
    span = max(view.makespan, marker or 0.0) or 1.0
    scale = inner / span
    parts = []
    for tick in _ticks(span):
        x = left + tick * scale
        parts.append(
            f"<line x1='{x:.1f}' y1='{top}' x2='{x:.1f}' y2='{height - 26}' class='gridline'/>"
            f"<text x='{x:.1f}' y='{height - 10}' class='tick' text-anchor='middle'>"
            f"{e(_fmt_tick(tick, view.relative))}</text>"
        )
    for stage, blocks in enumerate(view.blocks):
        y = top + stage * (row_h + gap)
        color = stage_color(stage)
        parts.append(
            f"<rect x='{left}' y='{y}' width='{inner}' height='{row_h}' class='lane'/>"
            f"<text x='{left - 8}' y='{y + row_h / 2 + 4}' class='lanelabel' "
            f"text-anchor='end'>stage {stage}</text>"
        )
        for op, micro, start, end in blocks:
            x, w = left + start * scale, max((end - start) * scale, 1.0)
            kind = "fwd" if op == "forward" else "bwd" if op.startswith("backward") else "other"
            fill = tint(color, 0.5) if kind == "fwd" else color if kind == "bwd" else "#999999"
            label = f"{'W' if op == 'backward_weight' else op[0].upper()}{'' if micro is None else micro}"
            tip = (
                f"stage {stage} {op} micro-batch {micro}: {_fmt_tick(start, view.relative)} – "
                f"{_fmt_tick(end, view.relative)}"
            )
            parts.append(
                f"<rect class='blk {kind}' data-stage='{stage}' "
                f"data-micro-batch='{e('' if micro is None else micro)}' "
                f"x='{x:.2f}' y='{y + 2}' width='{w:.2f}' height='{row_h - 4}' rx='3' fill='{fill}'>"
                f"<title>{e(tip)}</title></rect>"
            )
            if w >= 8 * len(label) + 4:
                parts.append(
                    f"<text x='{x + w / 2:.2f}' y='{y + row_h / 2 + 4}' class='blklabel' text-anchor='middle' "
                    f"fill='{text_on(fill)}'>{e(label)}</text>"
                )
    if marker is not None:
        x = left + marker * scale
        anchor = "end" if x > left + inner * 0.6 else "start"
        parts.append(
            f"<line x1='{x:.1f}' y1='{top - 6}' x2='{x:.1f}' y2='{height - 26}' class='estline'/>"
            f"<text x='{x + (-4 if anchor == 'end' else 4):.1f}' y='{top - 9}' class='estlabel' "
            f"text-anchor='{anchor}'>estimated step {e(format_seconds(marker))}</text>"
        )
    what = {
        "estimated": f"simulated from each stage's estimate (forward ⅓, backward ⅔), schedule {plan.schedule}",
        "simulated": "simulated",
        "measured": "measured",
    }[view.source]
    legend = (
        f"<div class='legend'><span><i class='swatch' style='background:{tint(PALETTE[0], 0.5)}'></i>forward "
        f"(light)</span><span><i class='swatch' style='background:{PALETTE[0]}'></i>backward (stage colour)"
        "</span>"
        f"<span><i class='swatch' style='background:{IDLE_COLOR}'></i>idle (bubble)</span><span>labels: F/B + "
        f"micro-batch</span><span><i class='swatch dashed'></i>the plan's step estimate</span></div>"
    )
    caption = (
        f"{what}; the blocks end at {_fmt_tick(view.makespan, view.relative)}, bubble {100 * view.bubble_fraction:.1f}%"
    )
    if marker is not None and view.source == "estimated" and abs(view.makespan - marker) > 1e-3 * marker:
        relation = "bounds this schedule from above" if view.makespan < marker else "is shorter than this schedule"
        caption += f". The plan's estimate, {format_seconds(marker)} ({numbers.step_equation}), {relation}"
    return (
        f"{legend}<svg viewBox='0 0 {width} {height}' class='chart timeline' role='img'"
        f"{attrs(data_makespan_s=view.makespan)}>{''.join(parts)}</svg><p class='sub'>{e(caption)}.</p>"
    )


def _ticks(span: float) -> list[float]:
    raw = span / 8
    magnitude = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    return [i * step for i in range(int(span / step + 1e-9) + 1)]


def _fmt_tick(value: float, relative: bool) -> str:
    return f"{value:.3g}" if relative else format_seconds(value)


# --- solver and compile phases --------------------------------------------------------------------------


def _profile_html(profile: Mapping[str, Any] | None) -> str:
    """Measured profiling (``plan.solver["profile"]``): each candidate measured and estimated, the link fits."""
    if not profile:
        return ""
    rows = [
        [
            (("→ " if row["candidate"] == profile["chosen"] else "") + e(str(row["candidate"])), None),
            (e(format_seconds(row["measured_step_s"])), row["measured_step_s"]),
            (e(format_seconds(row["estimated_step_s"])), row["estimated_step_s"]),
            (ratio(row["measured_step_s"], row["estimated_step_s"]), None),
        ]
        for row in profile.get("candidates", [])
    ]
    links = "".join(
        f"<li>axis {e(str(link['axis']))} over {e(str(link['devices']))} devices: α "
        f"{e(format_seconds(link['alpha']))}, β {link['beta']:.3g} s/byte</li>"
        for link in profile.get("links", [])
    )
    return (
        "<h3>measured profiling</h3>"
        + table(["candidate", "measured step", "estimated step", "measured ÷ est."], rows, numeric={1, 2, 3}, css="kv")
        + (
            f"<p class='sub'>Link constants fitted to timed all-reduces:</p><ul class='mono'>{links}</ul>"
            if links
            else ""
        )
    )


def _solver_html(solver: Mapping[str, Any]) -> str:
    profiled = _profile_html((solver or {}).get("profile"))
    solver = {k: v for k, v in (solver or {}).items() if k not in EXPLAINED_SOLVER_KEYS}
    if not solver:
        return profiled or "<p class='sub'>No solver statistics (a hand-made or single-device plan).</p>"
    scalar = lambda v: not isinstance(v, (Mapping, list, tuple))
    flat = {k: v for k, v in solver.items() if scalar(v)}
    per_stage = {k: v for k, v in solver.items() if isinstance(v, Mapping) and all(map(scalar, v.values()))}
    other = {k: v for k, v in solver.items() if k not in flat and k not in per_stage}
    out = []
    if flat:
        rows = [[(e(k), None), (e(_fmt_stat(k, v)), None)] for k, v in flat.items()]
        out.append(table(["statistic", "value"], rows, numeric={1}, css="kv"))
    if per_stage:
        keys = list(dict.fromkeys(k for v in per_stage.values() for k in v))
        rows = [
            [(e(key), None)] + [(e(_fmt_stat(key, v.get(key, ""))), None) for v in per_stage.values()] for key in keys
        ]
        out.append(table(["statistic", *per_stage], rows, numeric=set(range(1, len(per_stage) + 1)), css="kv"))
    for name, value in other.items():
        items = value if isinstance(value, (list, tuple)) else [value]
        entries = "".join(f"<li>{e(item)}</li>" for item in items) or "<li class='sub'>none</li>"
        out.append(f"<h3>{e(name.replace('_', ' '))}</h3><ol class='mono'>{entries}</ol>")
    return profiled + "".join(out)


def _fmt_stat(key: str, value: object) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if key.endswith("_s"):
        return format_seconds(value)
    if "bytes" in key:
        return format_bytes(value)
    if key == "gap":
        return f"{100 * value:.2g}%"
    return f"{value:,}" if isinstance(value, int) else f"{value:.4g}"


def _timings_html(timings: Mapping[str, float]) -> str:
    if not timings:
        return "<p class='sub'>No compile-phase timings recorded.</p>"
    longest = max(timings.values()) or 1.0
    rows = [
        f"<div class='barrow'><span class='barlabel'>{e(phase)}</span><div class='track'><div class='seg' "
        f"style='width:{100 * seconds / longest:.2f}%;background:#57606a'></div></div>"
        f"<span class='barvalue'>{e(format_seconds(seconds))}</span></div>"
        for phase, seconds in timings.items()
    ]
    return "".join(rows) + f"<p class='sub'>total {e(format_seconds(sum(timings.values())))}</p>"

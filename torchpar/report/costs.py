"""The report's cost sections: time and memory per stage, collectives per stage, layers, and the cost constants.

- Time: compute + communication bars per stage (``StagePlan.estimated_compute_s`` / ``_communication_s``).
- Memory: per stage a bar stacked by part (``StagePlan.memory_breakdown``: parameters, gradients, optimizer
  state, activations, buffers) and a table of the parts, the total (``estimated_memory_bytes``) and what a run
  measured, when given.
- Communication: bytes of the collectives one step (a pipeline's stage: one micro-batch) issues, by kind
  (``StagePlan.communication_bytes``), and which logical mesh axes cross hosts.
- Layers (pipelines): the modules each layer holds, its forward FLOPs and the activation bytes entering it.
- Cost constants (``Plan.cluster``): FLOP/s, memory, α/β of each link, the hardware preset.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from torchpar.report.estimates import (
    COLLECTIVES,
    MEMORY_PARTS,
    PlanNumbers,
    StageNumbers,
)
from torchpar.report.layout import IDLE_COLOR, stage_color
from torchpar.report.markup import attrs, bandwidth, e, ratio, stage_cell, swatch, table
from torchpar.units import format_bytes, format_flops, format_seconds

if TYPE_CHECKING:
    from torchpar.planner.plan import Plan

MEMORY_COLORS = {
    "parameters": "#0969da",
    "gradients": "#54aeff",
    "optimizer_state": "#8250df",
    "activations": "#2da44e",
    "buffers": "#bf8700",
    "gathered_parameters": "#cf222e",
    "transients": "#fb8f44",
    "other": "#8c959f",
}


# --- time -----------------------------------------------------------------------------------------------


def time_bars(numbers: PlanNumbers) -> str:
    unit = "micro-batch" if numbers.pipeline else "step"
    longest = max((max(s.cost_s, s.compute_s + s.communication_s) for s in numbers.stages), default=0.0) or 1.0
    rows = []
    for s in numbers.stages:
        compute, comm = 100 * s.compute_s / longest, 100 * s.communication_s / longest
        rows.append(
            f"<div class='barrow'{attrs(data_stage=s.index, data_cost_s=s.cost_s)}><span class='barlabel'>stage "
            f"{s.index}</span><div class='track'><div class='seg' style='width:{compute:.2f}%;background:"
            f"{stage_color(s.index)}' title='compute {e(format_seconds(s.compute_s))}'></div><div class='seg comm' "
            f"style='width:{comm:.2f}%' title='communication {e(format_seconds(s.communication_s))}'></div></div>"
            f"<span class='barvalue'>{e(format_seconds(s.cost_s))} = {e(format_seconds(s.compute_s))} compute + "
            f"{e(format_seconds(s.communication_s))} comm</span></div>"
        )
    legend = (
        "<div class='legend'><span><i class='swatch' style='background:#888'></i>compute (stage colour)</span>"
        "<span><i class='swatch comm'></i>communication</span></div>"
    )
    return f"<h3>Estimated time per {unit}</h3>{legend}{''.join(rows)}"


# --- memory ---------------------------------------------------------------------------------------------


def memory_html(numbers: PlanNumbers, device_memory_bytes: float) -> str:
    """Stacked bars (by part where the plan has a breakdown) and the table of parts."""
    biggest = (
        max(
            [s.memory_bytes for s in numbers.stages] + [s.measured_memory_bytes or 0 for s in numbers.stages], default=0
        )
        or 1
    )
    rows = []
    for s in numbers.stages:
        segments = "".join(
            f"<div class='seg' style='width:{100 * value / biggest:.2f}%;background:{_color(part)}' "
            f"title='{e(part.replace('_', ' '))} {e(format_bytes(value))}'></div>"
            for part, value in _parts(s)
            if value
        )
        marker = ""
        if s.measured_memory_bytes is not None:
            marker = (
                f"<div class='marker' style='left:{100 * s.measured_memory_bytes / biggest:.2f}%' "
                f"title='measured {e(format_bytes(s.measured_memory_bytes))}'></div>"
            )
        share = (
            f" ({100 * s.memory_bytes / device_memory_bytes:.2g}% of {format_bytes(device_memory_bytes)})"
            if device_memory_bytes
            else ""
        )
        measured = f"; measured {format_bytes(s.measured_memory_bytes)}" if s.measured_memory_bytes is not None else ""
        rows.append(
            f"<div class='barrow'{attrs(data_stage=s.index, data_memory_bytes=s.memory_bytes)}>"
            f"<span class='barlabel'>stage {s.index}</span><div class='track rel'>{segments}{marker}</div>"
            f"<span class='barvalue'>{e(format_bytes(s.memory_bytes) + share + measured)}</span></div>"
        )
    named = [*MEMORY_PARTS, *(p for s in numbers.stages for p, _ in _parts(s) if p not in (*MEMORY_PARTS, "other"))]
    parts = [p for p in dict.fromkeys((*named, "other")) if any(dict(_parts(s)).get(p) for s in numbers.stages)]
    legend = "".join(f"<span>{swatch(_color(p))}{e(p.replace('_', ' '))}</span>" for p in parts)
    if any(s.measured_memory_bytes is not None for s in numbers.stages):
        legend += "<span><i class='swatch markerswatch'></i>measured peak</span>"
    return f"<h3>Estimated memory per device</h3><div class='legend'>{legend}</div>{''.join(rows)}" + _memory_table(
        numbers, parts
    )


def _color(part: str) -> str:
    return MEMORY_COLORS.get(part, MEMORY_COLORS["other"])


def _parts(stage: StageNumbers) -> list[tuple[str, float]]:
    """The breakdown in stacking order, with ``other`` for what it leaves of the total (none: all ``other``)."""
    parts = [(p, float(stage.memory_breakdown.get(p, 0.0))) for p in MEMORY_PARTS]
    parts += [(p, float(v)) for p, v in stage.memory_breakdown.items() if p not in MEMORY_PARTS]
    rest = stage.memory_bytes - sum(v for _, v in parts)
    if rest > 0.01 * max(stage.memory_bytes, 1):
        parts.append(("other", rest))
    return [(p if p in MEMORY_COLORS else "other", v) for p, v in parts]


def _memory_table(numbers: PlanNumbers, parts: Sequence[str]) -> str:
    if not any(s.memory_breakdown for s in numbers.stages) and not any(
        s.measured_memory_bytes is not None for s in numbers.stages
    ):
        return ""
    measured = any(s.measured_memory_bytes is not None for s in numbers.stages)
    heads = ["stage", *(p.replace("_", " ") for p in parts), "est. total"] + (
        ["measured peak", "÷ est."] if measured else []
    )
    rows, row_attrs = [], []
    for s in numbers.stages:
        values = dict(_parts(s))
        cells = [stage_cell(s.index)] + [(format_bytes(values.get(p, 0.0)), values.get(p, 0.0)) for p in parts]
        cells.append((f"<b>{e(format_bytes(s.memory_bytes))}</b>", s.memory_bytes))
        if measured:
            m = s.measured_memory_bytes
            cells += [(format_bytes(m) if m is not None else "–", m), (ratio(m, s.memory_bytes), None)]
        rows.append(cells)
        row_attrs.append(
            attrs(
                data_stage=s.index, data_memory_bytes=s.memory_bytes, data_measured_memory_bytes=s.measured_memory_bytes
            )
        )
    return table(heads, rows, numeric=set(range(1, len(heads))), css="memory", row_attrs=row_attrs)


# --- communication --------------------------------------------------------------------------------------


def communication_html(numbers: PlanNumbers) -> str:
    """Collective bytes by kind per stage, with the estimated communication time and the axes crossing hosts."""
    if not any(s.communication_bytes for s in numbers.stages):
        return ""
    kinds = [k for k in COLLECTIVES if any(s.communication_bytes.get(k) for s in numbers.stages)] or ["all_reduce"]
    kinds += sorted({k for s in numbers.stages for k in s.communication_bytes} - set(COLLECTIVES))
    unit = "micro-batch" if numbers.pipeline else "step"
    heads = ["stage", *(k.replace("_", "-") for k in kinds), "total", f"est. comm time / {unit}", "axes crossing hosts"]
    rows, row_attrs = [], []
    for s in numbers.stages:
        sent = {k: float(s.communication_bytes.get(k, 0.0)) for k in kinds}
        crossing = ", ".join(f"axis {a}" for a, c in enumerate(s.crosses_hosts) if c) or "none"
        rows.append(
            [
                stage_cell(s.index),
                *((format_bytes(v) if v else "–", v) for v in sent.values()),
                (format_bytes(sum(sent.values())), sum(sent.values())),
                (format_seconds(s.communication_s), s.communication_s),
                (e(crossing), None),
            ]
        )
        row_attrs.append(attrs(data_stage=s.index, data_communication_bytes=sum(sent.values())))
    return (
        f"<h3>Collectives per {unit}</h3>"
        + table(heads, rows, numeric=set(range(1, len(kinds) + 3)), css="comm", row_attrs=row_attrs)
        + "<p class='sub'>Full-buffer sizes of the collectives the stage issues, as the cost model prices them "
        "(all-reduce 2β(n−1)/n·B + α; all-gather and reduce-scatter β(n−1)/n·B + α, per mesh axis; an axis "
        "crossing hosts is priced with the slower link).</p>"
    )


# --- layers ---------------------------------------------------------------------------------------------


class LayerRow(TypedDict):
    """One layer of the report's layer table and charts (:func:`layer_rows`)."""

    flops: float
    activation_bytes: float
    modules: list[str]


def layer_rows(layer_stats: Any) -> list[LayerRow] | None:
    """``layer_stats`` (a ``Layering`` with ``.flops``/``.boundary_bytes``, or ``Plan.layers``' dicts) as
    ``{"flops", "activation_bytes", "modules"}`` rows."""
    if layer_stats is None:
        return None
    if hasattr(layer_stats, "flops") and hasattr(layer_stats, "boundary_bytes"):
        return [
            {"flops": float(f), "activation_bytes": float(b), "modules": []}
            for f, b in zip(layer_stats.flops, layer_stats.boundary_bytes)
        ]
    return [
        {
            "flops": float(r.get("flops", 0.0)),
            "activation_bytes": float(r.get("activation_bytes", 0.0)),
            "modules": list(r.get("modules", []) or []),
        }
        for r in layer_stats
    ]


def layers_html(plan: Plan, layers: list[LayerRow]) -> str:
    """A table (layer, stage, modules, FLOPs, activation bytes) and two column charts coloured by stage."""
    stage_of = {layer: index for index, stage in enumerate(plan.stages) for layer in stage.layers}
    colors = [stage_color(stage_of[i]) if i in stage_of else IDLE_COLOR for i in range(len(layers))]
    out = ""
    if any(r["modules"] for r in layers):
        rows = [
            [
                (str(i), i),
                stage_cell(stage_of[i]) if i in stage_of else ("–", -1),
                (f"<code class='module'>{e(shorten_modules(r['modules']))}</code>", None),
                (format_flops(r["flops"]), r["flops"]),
                (format_bytes(r["activation_bytes"]), r["activation_bytes"]),
            ]
            for i, r in enumerate(layers)
        ]
        out += table(
            ["layer", "stage", "modules", "forward FLOPs", "activations entering"], rows, numeric={3, 4}, css="layers"
        )
    return (
        out + f"<h3>Forward FLOPs per layer</h3>{_columns([r['flops'] for r in layers], colors, format_flops)}"
        f"<h3>Activation bytes entering each layer</h3>"
        f"{_columns([r['activation_bytes'] for r in layers], colors, format_bytes)}"
    )


def shorten_modules(paths: Sequence[str]) -> str:
    """Module paths in a compact form: containers of listed modules dropped, siblings grouped, numbered runs
    collapsed — ``["transformer", "transformer.wte", "transformer.h.0", …, "transformer.h.3"]`` →
    ``"transformer.wte, transformer.h.0–3"``."""
    paths = [p for p in dict.fromkeys(paths) if p]
    kept = [p for p in paths if not any(q != p and q.startswith(p + ".") for q in paths)]
    groups: dict[str, list[str]] = {}
    for path in kept:
        parent, _, leaf = path.rpartition(".")
        groups.setdefault(parent, []).append(leaf)
    out = []
    for parent, leaves in groups.items():
        prefix = f"{parent}." if parent else ""
        numbers = [int(x) for x in leaves if x.isdigit()]
        names = [x for x in leaves if not x.isdigit()]
        items = [_run_text(run) for run in _runs(sorted(numbers))]
        if len(names) == 1 and not items:
            out.append(prefix + names[0])
        elif names:
            out.append(f"{prefix}{{{', '.join(names)}}}")
        out += [prefix + item for item in items]
    return ", ".join(out) or "–"


def _runs(values: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return runs


def _run_text(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}–{run[-1]}"


def _columns(values: list[float], colors: list[str], fmt: Callable[[float], str]) -> str:
    """An SVG column chart, one column per layer, coloured by stage."""
    width, height, left, bottom = 1000, 120, 70, 22
    top = max(values, default=0.0) or 1.0
    step = (width - left) / max(len(values), 1)
    parts = [
        f"<line x1='{left}' y1='{height - bottom}' x2='{width}' y2='{height - bottom}' class='axis'/>",
        f"<text x='{left - 6}' y='14' class='tick' text-anchor='end'>{e(fmt(top))}</text>",
    ]
    for i, (value, color) in enumerate(zip(values, colors)):
        h = (height - bottom - 8) * value / top
        x = left + i * step + step * 0.1
        parts.append(
            f"<rect class='layerbar' x='{x:.1f}' y='{height - bottom - h:.1f}' width='{step * 0.8:.1f}' "
            f"height='{h:.1f}' fill='{color}'><title>layer {i}: {e(fmt(value))}</title></rect>"
        )
        if len(values) <= 48 or i % math.ceil(len(values) / 48) == 0:
            parts.append(
                f"<text x='{x + step * 0.4:.1f}' y='{height - 6}' class='tick' text-anchor='middle'>{i}</text>"
            )
    return f"<svg viewBox='0 0 {width} {height}' class='chart' role='img'>{''.join(parts)}</svg>"


# --- cost constants -------------------------------------------------------------------------------------


def constants_html(cluster: Mapping[str, Any]) -> str:
    """``Plan.cluster`` as a box: what priced the estimates."""
    if not cluster:
        return "<p class='sub'>The plan does not record the cluster it was made for (saved by an older torchpar).</p>"
    items = [
        ("preset", cluster.get("preset") or "none (constants set by hand)"),
        ("hosts × devices", f"{cluster.get('num_hosts', '?')} × {cluster.get('devices_per_host', '?')}"),
    ]
    if "device_flops" in cluster:
        items.append(("device compute", format_flops(cluster["device_flops"]) + "/s"))
    if "device_memory_bytes" in cluster:
        items.append(("device memory", format_bytes(cluster["device_memory_bytes"])))
    alpha, beta = cluster.get("alpha"), cluster.get("beta")
    if alpha is not None and beta is not None:
        for axis in (0, 1):
            items.append(
                (f"in-host link, mesh axis {axis}", f"{format_seconds(alpha[axis])} latency, {bandwidth(beta[axis])}")
            )
    if "inter_host_alpha" in cluster and "inter_host_beta" in cluster:
        link = f"{format_seconds(cluster['inter_host_alpha'])} latency, {bandwidth(cluster['inter_host_beta'])}"
        items.append(("between hosts", link))
    body = "".join(
        f"<div class='kvrow'><span class='k'>{e(k)}</span><span class='v'>{e(v)}</span></div>" for k, v in items
    )
    return (
        f"<div class='box constants'>{body}</div><p class='sub'>Links as the α-β model prices them: latency α of "
        "one collective, bandwidth 1/β per device. A mesh axis whose devices sit on different hosts is priced with "
        "the slower of its in-host link and the link between hosts. Compute is priced at the device's peak FLOP/s.</p>"
    )

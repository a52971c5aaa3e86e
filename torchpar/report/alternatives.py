"""The report's "why this plan" section: the alternatives the planner priced, next to the plan it chose.

- Pipelines (``solver["runners_up"]``): the chosen stage partition first, then each runner-up, with the
  same columns: step estimate on the plan's own model, how much slower than the chosen one, the stage DP's screening
  figure (a coarser model, labelled as such), and each stage's layers, submesh → logical mesh, cost and memory.
- One-stage plans: ``solver["method_comparison"]`` (ShardParallel, DataParallel, ZeRO-2, Megatron planned
  on the same cost model; the plan's own method highlighted) and ``solver["mesh_shapes"]`` (each logical
  mesh ShardParallel tried).

Rows carry their exact numbers as ``data-*`` attributes (``data-step-s``, …) for tests and scripts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from torchpar.methods import method_title
from torchpar.report.estimates import (
    Alternative,
    PlanNumbers,
    axes_crossing_hosts,
    mesh_text,
)
from torchpar.report.markup import Cell, attrs, e, ranges, relative, table
from torchpar.units import format_bytes, format_seconds

if TYPE_CHECKING:
    from torchpar.planner.plan import Plan


def why_html(plan: Plan, numbers: PlanNumbers) -> str | None:
    """The section's content, or ``None`` when the plan carries no alternatives (hand plans, old plans)."""
    parts = []
    if numbers.alternatives:
        parts.append(runners_up_html(numbers))
    elif numbers.screening:
        parts.append(_screening_only(numbers))
    comparison = plan.solver.get("method_comparison") if plan.solver else None
    if isinstance(comparison, list) and comparison:
        parts.append(method_comparison_html(plan, numbers, comparison))
    meshes = plan.solver.get("mesh_shapes") if plan.solver else None
    if isinstance(meshes, list) and meshes:
        parts.append(mesh_shapes_html(plan, numbers, meshes))
    experts = plan.solver.get("expert_layouts") if plan.solver else None
    if isinstance(experts, list) and experts:
        parts.append(expert_layouts_html(experts))
    return "".join(parts) or None


# --- pipelines: runners-up ----------------------------------------------------------------------------


def runners_up_html(numbers: PlanNumbers) -> str:
    """Chosen plan first, then the runners-up, same columns."""
    chosen = numbers.alternatives[0]
    rows: list[list[Cell]] = []
    row_attrs: list[str] = []
    for alt in numbers.alternatives:
        label = "<b>chosen</b>" if alt.chosen else f"#{alt.rank}"
        if alt.step_s is not None:
            step = (format_seconds(alt.step_s), alt.step_s)
        elif alt.error:
            step = ("<span class='bad'>no plan</span>", float("inf"))
        elif alt.at_least_s is not None:
            step = (
                f"≥ {format_seconds(alt.at_least_s)} <span class='sub'>(bound: could not win, not solved)</span>",
                alt.at_least_s,
            )
        else:
            step = ("<span class='sub'>not priced</span>", float("inf"))
        screened = (
            (format_seconds(alt.screening_step_s), alt.screening_step_s)
            if alt.screening_step_s is not None
            else ("<span class='sub'>–</span>", None)
        )
        rows.append(
            [(label, alt.rank), step, (relative(alt.step_s, chosen.step_s), None), screened, (_stages_cell(alt), None)]
        )
        row_attrs.append(
            (" class='chosen'" if alt.chosen else "")
            + attrs(data_rank=alt.rank, data_step_s=alt.step_s, data_screening_step_s=alt.screening_step_s)
        )
    model = numbers.estimate_model or "the plan's cost model"
    screening_model = (numbers.screening or {}).get("model") or "the stage DP's analytic model"
    caption = (
        f"<p class='sub'>Each step is priced by the plan's own model ({e(model)}; {e(numbers.step_formula)}), "
        f"stage by stage, so the rows compare. The stage DP picked these candidates with a coarser screening "
        f"model ({e(screening_model)}); its figures, in the screening column, are not estimates of this plan "
        "and do not compare with the step column.</p>"
    )
    old = any(a.step_s is None and not a.error and a.at_least_s is None for a in numbers.alternatives[1:])
    if old:
        caption += (
            "<p class='note'>This plan was saved by an older torchpar: its runners-up were priced by the "
            "stage DP only (screening column).</p>"
        )
    heads = [
        "",
        "est. step",
        "vs chosen",
        "stage DP screening",
        "stages: layers · submesh → mesh · est. time / micro-batch · memory / device",
    ]
    return (
        "<h3>Runners-up: stage partitions on the same cost model</h3>"
        + table(heads, rows, numeric={1, 2, 3}, css="runners", row_attrs=row_attrs)
        + caption
    )


def _stages_cell(alt: Alternative) -> str:
    lines = []
    for st in alt.stages:
        cost, memory = st.get("estimated_cost_s"), st.get("estimated_memory_bytes")
        bits = [
            f"layers {ranges([int(x) for x in st.get('layers', [])])}",
            f"{mesh_text(st.get('submesh_shape', []))} → {mesh_text(st.get('logical_mesh_shape', []))}",
        ]
        if isinstance(cost, (int, float)):
            bits.append(format_seconds(cost))
        if isinstance(memory, (int, float)):
            bits.append(format_bytes(memory))
        lines.append(f"<li>{e(' · '.join(bits))}</li>")
    error = f"<div class='bad'>{e(alt.error.splitlines()[0])}</div>" if alt.error else ""
    return f"<ol class='stagelist'>{''.join(lines)}</ol>{error}"


def _screening_only(numbers: PlanNumbers) -> str:
    screened = numbers.screening or {}
    step = screened.get("estimated_step_s")
    text = format_seconds(step) if isinstance(step, (int, float)) else "–"
    return (
        f"<p class='sub'>Stage DP screening of this partition ({e(screened.get('model') or 'analytic model')}): "
        f"{e(text)}; not the plan's estimate ({e(format_seconds(numbers.step_s))}).</p>"
    )


# --- one-stage plans: hand plans and mesh shapes --------------------------------------------------------


def method_comparison_html(plan: Plan, numbers: PlanNumbers, comparison: Sequence[object]) -> str:
    """Each compared method on the same cost model, the plan's own method highlighted, with a verdict."""
    priced = [r for r in comparison if isinstance(r, Mapping) and isinstance(r.get("estimated_step_s"), (int, float))]
    longest = max((r["estimated_step_s"] for r in priced), default=0.0) or 1.0
    rows: list[list[Cell]] = []
    row_attrs: list[str] = []
    for row in comparison:
        if not isinstance(row, Mapping):
            continue
        own = row.get("method") == plan.method
        mesh = mesh_text(row.get("logical_mesh_shape", []))
        name = f"<b>{e(method_title(str(row.get('method'))))}</b>" if own else e(method_title(str(row.get("method"))))
        if "error" in row or not isinstance(row.get("estimated_step_s"), (int, float)):
            message = str(row.get("error", "not priced")).splitlines()[0]
            rows.append(
                [
                    (name, None),
                    (e(mesh), None),
                    (f"<span class='bad'>{e(message)}</span>", None),
                    ("", None),
                    ("", None),
                    ("", None),
                    ("", None),
                    ("", None),
                ]
            )
            row_attrs.append(attrs(data_method=row.get("method")))
            continue
        step = row["estimated_step_s"]
        bar = f"<div class='minibar'><div style='width:{100 * step / longest:.1f}%'></div></div>"
        rows.append(
            [
                (name, None),
                (e(mesh), None),
                (format_seconds(step), step),
                (relative(step, numbers.step_s), None),
                (format_seconds(row.get("estimated_compute_s", 0.0)), None),
                (format_seconds(row.get("estimated_communication_s", 0.0)), None),
                (format_bytes(row.get("estimated_memory_bytes", 0)), None),
                (bar, None),
            ]
        )
        row_attrs.append(
            (" class='chosen'" if own else "")
            + attrs(
                data_method=row.get("method"),
                data_step_s=float(step),
                data_memory_bytes=row.get("estimated_memory_bytes"),
            )
        )
    heads = ["method", "logical mesh", "est. step", "vs this plan", "compute", "communication", "memory / device", ""]
    return (
        "<h3>Auto vs hand plans on the same cost model</h3>"
        + table(heads, rows, numeric={2, 3, 4, 5, 6}, css="methods", row_attrs=row_attrs)
        + _verdict(plan, numbers, priced)
        + "<p class='sub'>Every method is planned for the same model, batch and cluster and priced by the same "
        "cost model; the hand plans use their default mesh"
        + (", ShardParallel the best of the meshes below" if plan.solver.get("mesh_shapes") else "")
        + ".</p>"
    )


def _verdict(plan: Plan, numbers: PlanNumbers, priced: list[Mapping[str, Any]]) -> str:
    others = [r for r in priced if r.get("method") != plan.method]
    if not others:
        return ""
    best = min(others, key=lambda r: r["estimated_step_s"])
    step = best["estimated_step_s"]
    if numbers.step_s <= step:
        gain = 100 * (step - numbers.step_s) / step if step else 0.0
        text = (
            f"{numbers.title} saves {gain:.1f}% of the step time of the best hand plan, "
            f"{method_title(best['method'])} ({format_seconds(numbers.step_s)} vs {format_seconds(step)})."
        )
    else:
        text = (
            f"{method_title(best['method'])} is estimated faster than this plan ({format_seconds(step)} vs "
            f"{format_seconds(numbers.step_s)})."
        )
    return f"<p class='verdict'>{e(text)}</p>"


def mesh_shapes_html(plan: Plan, numbers: PlanNumbers, meshes: Sequence[object]) -> str:
    """Every logical mesh ShardParallel tried, with the hosts each axis spans on the plan's submesh."""
    submesh = numbers.stages[0].submesh_shape if numbers.stages else (1, 1)
    chosen_step = next(
        (r.get("estimated_step_s") for r in meshes if isinstance(r, Mapping) and r.get("chosen")), numbers.step_s
    )
    rows: list[list[Cell]] = []
    row_attrs: list[str] = []
    for row in meshes:
        if not isinstance(row, Mapping):
            continue
        shape = [int(d) for d in row.get("logical_mesh_shape", [])]
        crossing = ""
        if len(shape) == 2 and shape[0] * shape[1] == submesh[0] * submesh[1]:
            crossing = ", ".join(f"axis {a}" for a, c in enumerate(axes_crossing_hosts(submesh, shape)) if c) or "no"
        if "error" in row:
            rows.append(
                [
                    (e(mesh_text(shape)), None),
                    (e(crossing), None),
                    (f"<span class='bad'>{e(str(row['error']).splitlines()[0])}</span>", None),
                    ("", None),
                    ("", None),
                    ("", None),
                ]
            )
            row_attrs.append(attrs(data_mesh=mesh_text(shape)))
            continue
        step = cast(float, row.get("estimated_step_s"))  # a row without an error was priced
        rows.append(
            [
                (e(mesh_text(shape)), None),
                (e(crossing), None),
                (format_seconds(step), step),
                (relative(step, chosen_step), None),
                (format_bytes(row.get("estimated_memory_bytes", 0)), None),
                ("<b>chosen</b>" if row.get("chosen") else "", None),
            ]
        )
        row_attrs.append(
            (" class='chosen'" if row.get("chosen") else "")
            + attrs(data_mesh=mesh_text(shape), data_step_s=float(step))
        )
    return (
        "<h3>Logical mesh shapes tried</h3>"
        + table(
            ["logical mesh", "crosses hosts", "est. step", "vs chosen", "memory / device", ""],
            rows,
            numeric={2, 3, 4},
            css="meshes",
            row_attrs=row_attrs,
        )
        + f"<p class='sub'>The same devices ({e(mesh_text(submesh))} submesh) laid out as each logical mesh; the "
        "sharding ILP solved each.</p>"
    )


def expert_layouts_html(experts: Sequence[object]) -> str:
    """The grouped matmuls' layout families priced on the plan's logical mesh (``plan.solver["expert_layouts"]``)."""
    chosen_step = next((r.get("estimated_step_s") for r in experts if isinstance(r, Mapping) and r.get("chosen")), None)
    rows: list[list[Cell]] = []
    row_attrs: list[str] = []
    for row in experts:
        if not isinstance(row, Mapping):
            continue
        family = str(row.get("experts", ""))
        label = f"{e(family)} <span class='sub'>{e(str(row.get('meaning', '')))}</span>"
        if "error" in row:
            rows.append(
                [
                    (label, None),
                    (f"<span class='bad'>{e(str(row['error']).splitlines()[0])}</span>", None),
                    ("", None),
                    ("", None),
                    ("", None),
                ]
            )
            row_attrs.append(attrs(data_experts=family))
            continue
        step = cast(float, row.get("estimated_step_s"))  # a row without an error was priced
        rows.append(
            [
                (label, None),
                (format_seconds(step), step),
                (relative(step, chosen_step), None),
                (format_bytes(row.get("estimated_memory_bytes", 0)), None),
                ("<b>chosen</b>" if row.get("chosen") else "", None),
            ]
        )
        row_attrs.append(
            (" class='chosen'" if row.get("chosen") else "") + attrs(data_experts=family, data_step_s=float(step))
        )
    return (
        "<h3>Expert layouts priced</h3>"
        + table(
            ["experts", "est. step", "vs chosen", "memory / device", ""],
            rows,
            numeric={1, 2, 3},
            css="experts",
            row_attrs=row_attrs,
        )
        + "<p class='sub'>The same stage on the same logical mesh with its grouped matmuls restricted to each "
        "layout family (<code>ShardParallel(experts=...)</code>); the sharding ILP solved each.</p>"
    )

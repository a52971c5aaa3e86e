"""A PNG of a plan: the device grid coloured by stage above the pipeline timeline (matplotlib, Agg).

The layout (which device each stage uses, the blocks of the timeline) is :mod:`torchpar.report.layout`'s and
every number it prints is :func:`torchpar.report.estimates.plan_numbers`' (the title's step estimate, each
stage's estimated time and memory in the legend, the dashed line at the step estimate), so the picture and the
HTML page always agree. :func:`figure` returns the figure without writing it, to look at what it draws.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchpar.hardware import ClusterSpec
from torchpar.report.estimates import plan_numbers
from torchpar.report.layout import IDLE_COLOR, device_grid, stage_color, timeline_view
from torchpar.report.markup import text_on
from torchpar.units import format_seconds

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from torchpar.planner.plan import Plan


def save_png(
    plan: Plan,
    path: str | Path,
    *,
    timeline: object = None,
    measured: Mapping[str, Any] | None = None,
    cluster: ClusterSpec | None = None,
    dpi: int = 110,
) -> Path:
    """Write :func:`figure` to ``path``; ``timeline``, ``measured`` and ``cluster`` as in
    :func:`torchpar.report.html.render_html`."""
    import matplotlib.pyplot as plt

    fig = figure(plan, timeline=timeline, measured=measured, cluster=cluster)
    path = Path(path)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)
    return path


def figure(
    plan: Plan,
    *,
    timeline: object = None,
    measured: Mapping[str, Any] | None = None,
    cluster: ClusterSpec | None = None,
) -> Figure:
    """The matplotlib figure :func:`save_png` writes (close it with ``matplotlib.pyplot.close``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    numbers = plan_numbers(plan, measured)
    grid = device_grid(plan, cluster)
    view = timeline_view(plan, timeline)
    num_stages = len(view.blocks)
    grid_h = 0.8 + 0.55 * grid.num_hosts
    line_h = 0.9 + 0.45 * num_stages
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, grid_h + line_h + 0.9), height_ratios=(grid_h, line_h))
    fig.suptitle(numbers.headline, fontsize=11)

    for cell in grid.cells:
        color = IDLE_COLOR if cell.stage is None else stage_color(cell.stage)
        x, y = cell.local, grid.num_hosts - 1 - cell.host
        top.add_patch(Rectangle((x + 0.05, y + 0.08), 0.9, 0.84, facecolor=color, edgecolor="white"))
        label = f"d{cell.device}" + ("" if cell.stage is None else f"\nS{cell.stage}")
        top.text(
            x + 0.5,
            y + 0.5,
            label,
            ha="center",
            va="center",
            fontsize=8,
            color="#59636e" if cell.stage is None else text_on(color),
        )
    top.set_xlim(0, grid.devices_per_host)
    top.set_ylim(0, grid.num_hosts)
    top.set_yticks(
        [grid.num_hosts - 1 - h + 0.5 for h in range(grid.num_hosts)], [f"host {h}" for h in range(grid.num_hosts)]
    )
    top.set_xticks([])
    top.set_aspect("auto")
    top.set_frame_on(False)
    unit = "micro-batch" if numbers.pipeline else "step"
    top.set_title(
        f"devices (hosts × devices per host), coloured by stage; legend: est. time per {unit}, memory per device",
        fontsize=9.5,
        loc="left",
    )
    handles = [Patch(color=stage_color(s.index), label=s.caption) for s in numbers.stages]
    top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)

    marker = None if view.relative or numbers.step_s <= 0 else numbers.step_s
    span = max(view.makespan, marker or 0.0)
    scale, unit_name = (1.0, "") if view.relative else _time_unit(span)
    for stage, blocks in enumerate(view.blocks):
        y = num_stages - 1 - stage
        bottom.add_patch(Rectangle((0, y + 0.1), view.makespan * scale, 0.8, facecolor=IDLE_COLOR, alpha=0.5, lw=0))
        for op, micro, start, end in blocks:
            color = stage_color(stage)
            alpha = 0.5 if op == "forward" else 1.0
            bottom.add_patch(
                Rectangle(
                    (start * scale, y + 0.15),
                    (end - start) * scale,
                    0.7,
                    facecolor=color,
                    alpha=alpha,
                    edgecolor="white",
                    lw=0.8,
                )
            )
            if (end - start) / max(span, 1e-30) > 0.025:
                letter = "W" if op == "backward_weight" else op[0].upper()
                bottom.text(
                    (start + end) / 2 * scale,
                    y + 0.5,
                    f"{letter}{'' if micro is None else micro}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="#1f2328" if alpha < 1 else text_on(color),
                )
    if marker is not None:
        bottom.axvline(marker * scale, color="#cf222e", lw=1.2, ls="--")
        bottom.text(
            marker * scale,
            num_stages,
            f"estimated step {format_seconds(marker)} ",
            color="#cf222e",
            fontsize=8,
            ha="right",
            va="bottom",
        )
    bottom.set_xlim(0, max(span * scale, 1e-12))
    bottom.set_ylim(0, num_stages)
    bottom.set_yticks([num_stages - 1 - s + 0.5 for s in range(num_stages)], [f"stage {s}" for s in range(num_stages)])
    bottom.set_xlabel("time" + (f" ({unit_name})" if unit_name else " (relative)"))
    for side in ("top", "right", "left"):
        bottom.spines[side].set_visible(False)
    bottom.set_title(
        f"{'pipeline' if numbers.pipeline else 'step'} timeline ({view.source}, schedule {plan.schedule}): "
        f"light = forward, dark = backward; bubble {100 * view.bubble_fraction:.1f}%",
        fontsize=9.5,
        loc="left",
        pad=14,
    )
    fig.tight_layout()
    return fig


def _time_unit(span: float) -> tuple[float, str]:
    if span >= 1:
        return 1.0, "s"
    if span >= 1e-3:
        return 1e3, "ms"
    if span >= 1e-6:
        return 1e6, "µs"
    return 1e9, "ns"

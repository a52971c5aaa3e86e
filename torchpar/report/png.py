"""A PNG of a plan: the device grid coloured by stage above the pipeline timeline (matplotlib, Agg).

The layout (which device each stage uses, the blocks of the timeline) is :mod:`torchpar.report.html`'s,
so the picture and the HTML page always agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchpar.cluster import ClusterSpec
from torchpar.report.layout import IDLE_COLOR, device_grid, stage_color, timeline_view

if TYPE_CHECKING:
    from torchpar.planner.plan import Plan


def save_png(plan: Plan, path: str | Path, *, timeline: Any = None, cluster: ClusterSpec | None = None,
             dpi: int = 110) -> Path:
    """Write the figure to ``path``; ``timeline`` and ``cluster`` as in :func:`torchpar.report.html.render_html`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    grid = device_grid(plan, cluster)
    view = timeline_view(plan, timeline)
    num_stages = len(view.blocks)
    grid_h = 0.8 + 0.55 * grid.num_hosts
    line_h = 0.9 + 0.45 * num_stages
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, grid_h + line_h + 0.8),
                                      height_ratios=(grid_h, line_h))
    fig.suptitle(f"torchpar plan: {plan.method}, {len(plan.stages)} stage(s), {plan.num_micro_batches} "
                 f"micro-batch(es), estimated step {plan.estimated_step_s * 1e3:.3g} ms", fontsize=12)

    for cell in grid.cells:
        color = IDLE_COLOR if cell.stage is None else stage_color(cell.stage)
        x, y = cell.local, grid.num_hosts - 1 - cell.host
        top.add_patch(Rectangle((x + 0.05, y + 0.08), 0.9, 0.84, facecolor=color, edgecolor="white"))
        label = f"d{cell.device}" + ("" if cell.stage is None else f"\nS{cell.stage}")
        top.text(x + 0.5, y + 0.5, label, ha="center", va="center", fontsize=8,
                 color="#59636e" if cell.stage is None else _text_on(color))
    top.set_xlim(0, grid.devices_per_host)
    top.set_ylim(0, grid.num_hosts)
    top.set_yticks([grid.num_hosts - 1 - h + 0.5 for h in range(grid.num_hosts)],
                   [f"host {h}" for h in range(grid.num_hosts)])
    top.set_xticks([])
    top.set_aspect("auto")
    top.set_frame_on(False)
    top.set_title("devices (hosts × devices per host), coloured by stage", fontsize=10, loc="left")
    handles = [Patch(color=stage_color(i), label=f"stage {i}: {s.submesh_shape[0]}×{s.submesh_shape[1]}, mesh "
                     f"{s.logical_mesh_shape[0]}×{s.logical_mesh_shape[1]}") for i, s in enumerate(plan.stages)]
    top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)

    scale, unit = (1.0, "") if view.relative else _time_unit(view.makespan)
    for stage, blocks in enumerate(view.blocks):
        y = num_stages - 1 - stage
        bottom.add_patch(Rectangle((0, y + 0.1), view.makespan * scale, 0.8, facecolor=IDLE_COLOR, alpha=0.5, lw=0))
        for op, micro, start, end in blocks:
            color = stage_color(stage)
            alpha = 0.5 if op == "forward" else 1.0
            bottom.add_patch(Rectangle((start * scale, y + 0.15), (end - start) * scale, 0.7, facecolor=color,
                                       alpha=alpha, edgecolor="white", lw=0.8))
            width = (end - start) * scale / max(view.makespan * scale, 1e-12)
            if width > 0.025:
                bottom.text((start + end) / 2 * scale, y + 0.5, f"{op[0].upper()}{'' if micro is None else micro}",
                            ha="center", va="center", fontsize=7, color="#1f2328" if alpha < 1 else _text_on(color))
    bottom.set_xlim(0, max(view.makespan * scale, 1e-12))
    bottom.set_ylim(0, num_stages)
    bottom.set_yticks([num_stages - 1 - s + 0.5 for s in range(num_stages)], [f"stage {s}" for s in range(num_stages)])
    bottom.set_xlabel("time" + (f" ({unit})" if unit else " (relative)"))
    for side in ("top", "right", "left"):
        bottom.spines[side].set_visible(False)
    bottom.set_title(f"pipeline timeline ({view.source}, schedule {plan.schedule}): light = forward, dark = "
                     f"backward; bubble {100 * view.bubble_fraction:.1f}%", fontsize=10, loc="left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def _time_unit(span: float) -> tuple[float, str]:
    if span >= 1:
        return 1.0, "s"
    if span >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def _text_on(color: str) -> str:
    r, g, b = (int(color[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return "#1f2328" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.6 else "white"

"""Small HTML pieces of the plan report: escaping, tables, spec chips, swatches, colours, value ranges.

Every text a table shows goes through :func:`e`; numbers are formatted by :mod:`torchpar.units` by the callers.
"""

from __future__ import annotations

import math
from collections.abc import Container, Sequence
from html import escape

from torchpar.report.layout import AXIS_COLORS, stage_color

Cell = tuple[str, object]
"""A table cell: (inner HTML, sort key or ``None`` to sort by its text)."""


def e(value: object) -> str:
    """``value`` as HTML text, quotes escaped too (safe in attributes)."""
    return escape(str(value), quote=True)


def attrs(**values: object) -> str:
    """``data_step_s=0.1`` → `` data-step-s='0.1'``: exact values for tests and scripts (floats as ``repr``)."""
    return "".join(f" {k.replace('_', '-')}='{e(_exact(v))}'" for k, v in values.items() if v is not None)


def _exact(value: object) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def table(
    heads: Sequence[str],
    rows: Sequence[Sequence[Cell]],
    *,
    numeric: Container[int] = frozenset(),
    sortable: bool = False,
    css: str = "",
    scroll: bool = False,
    row_attrs: Sequence[str] | None = None,
    head_html: str | None = None,
    foot_html: str = "",
) -> str:
    """A table; columns in ``numeric`` are right-aligned; ``sortable`` ones sort on a header click (inline JS).
    ``row_attrs[i]`` is added to row ``i``'s ``<tr>``; ``head_html`` replaces the header row(s);
    ``foot_html`` is the ``<tfoot>``'s rows."""
    classes = " ".join(c for c in (css, "sortable" if sortable else "") if c)
    head = (
        head_html
        or "<tr>"
        + "".join(f"<th{' class=num' if i in numeric else ''}>{e(h)}</th>" for i, h in enumerate(heads))
        + "</tr>"
    )
    body = []
    for index, cells in enumerate(rows):
        tds = []
        for i, (inner, key) in enumerate(cells):
            cell_attrs = (" class='num'" if i in numeric else "") + ("" if key is None else f" data-sort='{e(key)}'")
            tds.append(f"<td{cell_attrs}>{inner}</td>")
        extra = row_attrs[index] if row_attrs else ""
        body.append(f"<tr{extra}>" + "".join(tds) + "</tr>")
    wrap = "tablewrap scroll" if scroll else "tablewrap"
    foot = f"<tfoot>{foot_html}</tfoot>" if foot_html else ""
    return (
        f"<div class='{wrap}'><table class='{classes}'><thead>{head}</thead>"
        f"<tbody>{''.join(body)}</tbody>{foot}</table></div>"
    )


def swatch(color: str, extra: str = "") -> str:
    return f"<i class='swatch{(' ' + extra) if extra else ''}' style='background:{color}'></i>"


def stage_cell(index: int) -> Cell:
    """A stage number with its colour."""
    return f"{swatch(stage_color(index))}{index}", index


def spec_chips(spec: Sequence[Sequence[int] | None] | None, *, batch_dim: bool = False) -> str:
    """One chip per dim: ``R`` (replicated) grey, ``S0``/``S1`` (split over logical mesh axis 0/1) coloured;
    ``batch_dim`` outlines a split dim 0 (where the batch is split)."""
    if spec is None:
        return "<span class='sub'>–</span>"
    if not spec:
        return "<span class='sub'>scalar</span>"
    chips = []
    for dim, entry in enumerate(spec):
        if not entry:
            chips.append("<b class='chip'>R</b>")
            continue
        color = AXIS_COLORS[entry[0]] if len(entry) == 1 and entry[0] in (0, 1) else "#bf3989"
        ring = " batch" if batch_dim and dim == 0 else ""
        chips.append(f"<b class='chip{ring}' style='background:{color}'>S{e(''.join(map(str, entry)))}</b>")
    return f"<span class='chips'>{''.join(chips)}</span>"


def spec_legend(extra: str = "") -> str:
    return (
        f"<div class='legend'><span><b class='chip'>R</b> replicated dim</span><span><b class='chip' "
        f"style='background:{AXIS_COLORS[0]}'>S0</b> dim split over logical mesh axis 0</span><span><b "
        f"class='chip' style='background:{AXIS_COLORS[1]}'>S1</b> over axis 1</span><span><b class='chip' "
        f"style='background:#bf3989'>S01</b> over both</span>{extra}</div>"
    )


def shards(spec: Sequence[Sequence[int] | None], mesh: Sequence[int]) -> int:
    """How many pieces ``spec`` cuts a tensor into on ``mesh``."""
    return math.prod(int(mesh[a]) for entry in spec if entry for a in entry if 0 <= a < len(mesh))


def ranges(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` → ``0–2, 5``."""
    values = sorted(values)
    parts, start = [], None
    for i, v in enumerate(values):
        start = v if start is None else start
        if i + 1 == len(values) or values[i + 1] != v + 1:
            parts.append(str(v) if v == start else f"{start}–{v}")
            start = None
    return ", ".join(parts) or "–"


def coord(value: tuple[int, ...] | None) -> str:
    """``(row,column)``, or ``(replica,row,column)`` on a stage with data replicas."""
    return "" if value is None else f"({','.join(map(str, value))})"


def tint(color: str, amount: float) -> str:
    """``color`` mixed with white by ``amount`` (0 = unchanged, 1 = white)."""
    r, g, b = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    mix = lambda c: round(c + (255 - c) * amount)
    return f"#{mix(r):02x}{mix(g):02x}{mix(b):02x}"


def text_on(color: str) -> str:
    """Dark or white text, whichever reads on ``color``."""
    r, g, b = (int(color[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return "#1f2328" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 0.6 else "#ffffff"


def ratio(value: float | None, reference: float | None) -> str:
    """``value / reference`` as ``"1.23×"`` (``"–"`` when either is missing or the reference is 0)."""
    if value is None or not reference:
        return "–"
    return f"{value / reference:.2f}×"


def relative(value: float | None, reference: float | None) -> str:
    """How much ``value`` exceeds ``reference``: ``"+0.4%"``, ``"+30%"``, ``"±0"`` (``"–"`` when missing)."""
    if value is None or not reference:
        return "–"
    diff = value / reference - 1
    if abs(diff) < 5e-4:
        return "±0"
    return f"{100 * diff:+.1f}%" if abs(diff) < 0.1 else f"{100 * diff:+.0f}%"


def bandwidth(beta: float) -> str:
    """Inverse bandwidth (s/byte) → ``"450 GB/s"`` (decimal, as links are quoted)."""
    if beta <= 0:
        return "∞"
    rate = (1.0 / beta) * (1 + 1e-9)  # 1/1e-9 is 999999999.99…
    for unit, size in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if rate >= size:
            return f"{rate / size:.3g} {unit}"
    return f"{rate:.3g} B/s"

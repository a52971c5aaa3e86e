"""The writers of a plan's reports, registered from the floor above.

:meth:`Plan.save_html <torchpar.planner.plan.Plan.save_html>` and ``save_png`` call the writer registered here
under ``"html"`` / ``"png"``, so the plan imports no report: data flows down, :mod:`torchpar.report` reads plans
and plans do not know their reports. ``torchpar/__init__.py`` registers :mod:`torchpar.report`'s writers (each
imported on first use); Python runs it before any ``torchpar.…`` module, so they are in place before any plan exists.
"""

from __future__ import annotations

from collections.abc import Callable

Writer = Callable[..., object]
"""``writer(plan, path, **options)``: writes one report of ``plan`` to ``path``."""

_writers: dict[str, Writer] = {}


def register(kind: str, writer: Writer) -> None:
    """Make ``writer`` the plan's ``kind`` report writer (``"html"``, ``"png"``), replacing any before it."""
    _writers[kind] = writer


def writer(kind: str) -> Writer:
    """The ``kind`` report writer; a ``RuntimeError`` if none is registered (``torchpar/__init__.py`` registers
    them)."""
    try:
        return _writers[kind]
    except KeyError:
        raise RuntimeError(
            f"no {kind!r} report writer is registered (registered: {sorted(_writers)}); "
            "torchpar/__init__.py registers torchpar.report's writers"
        ) from None

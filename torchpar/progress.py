"""A progress bar over the compile phases (capture, plan, XLA compile) that can take minutes on large models.

Shown on an interactive terminal only (tqdm's ``disable=None``: nothing is written when stderr is not a TTY,
as in CI logs). While a phase runs the bar is redrawn every :data:`TICK_S` seconds, so its elapsed time moves and
the terminal is never silent for long; code deep in a phase may say what it is doing with :func:`note` (e.g.
"measuring this machine's cost constants"). ``TORCHPAR_QUIET=1`` or ``TORCHPAR_PROGRESS=0`` turn it off,
``TORCHPAR_PROGRESS=1`` forces it on.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
from collections.abc import Iterator, Sequence

from tqdm.auto import tqdm

TICK_S = 1.0
"""Seconds between redraws of a running phase's bar."""

_CURRENT: contextvars.ContextVar[CompilePhases | None] = contextvars.ContextVar("torchpar_phases", default=None)


def _disabled() -> bool | None:
    """tqdm's ``disable``: ``None`` (on a TTY only), or forced by the environment."""
    if os.environ.get("TORCHPAR_QUIET", "") not in ("", "0"):
        return True
    setting = os.environ.get("TORCHPAR_PROGRESS", "")
    return None if setting == "" else setting == "0"


class CompilePhases:
    """``with phases.phase("capture"): ...`` advances one bar whose label names the running phase."""

    def __init__(self, names: Sequence[str], what: str):
        self._bar = tqdm(
            total=len(names) or None, desc=f"torchpar: {what}", unit="phase", leave=False, disable=_disabled()
        )
        self._name = ""
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if not self._bar.disable:
            self._ticker = threading.Thread(target=self._tick, daemon=True, name="torchpar-progress")
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            self._bar.refresh()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._name = name
        self._bar.set_postfix_str(name, refresh=True)
        token = _CURRENT.set(self)
        try:
            yield
        finally:
            _CURRENT.reset(token)
        self._bar.update(1)

    def note(self, text: str) -> None:
        """Show ``text`` beside the running phase's name."""
        self._bar.set_postfix_str(f"{self._name}: {text}" if self._name else text, refresh=True)

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        self._bar.close()


def note(text: str) -> None:
    """Say what the running compile phase is doing now (nothing when no phase runs in this context)."""
    phases = _CURRENT.get()
    if phases is not None:
        phases.note(text)

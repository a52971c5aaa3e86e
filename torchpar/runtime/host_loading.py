"""A process's own data loading for host-loaded training (``torchpar.HostData``), with prefetch.

The driver sends each process a :class:`~.batch_parts.HostRows` per step — the dataset indices of the rows its
devices hold, and the next steps' — and no batch bytes. :class:`HostLoader` loads a step's rows through the user's
data factory (``factory.load_leaves(indices, step) → list of host arrays``: the collated rows' leaves in the step's
call order) on a background thread, up to ``depth`` steps ahead, and turns them into the step's device arrays with
``prepare`` (the worker's placement of a batch signature it has compiled) on that thread too, so a step finds its
inputs already on its devices. A factory's exception is re-raised by the step that needed those rows, naming this
process's host (:class:`HostDataError`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

import numpy as np

from torchpar.runtime.batch_parts import HostRows

if TYPE_CHECKING:
    import jax

log = logging.getLogger(__name__)


class HostDataError(RuntimeError):
    """A host's data factory failed loading a step's rows."""


class DataFactory(Protocol):
    """What a process loads its rows with (``torchpar.HostData``)."""

    def load_leaves(self, indices: tuple[int, ...], step: int, /) -> list[np.ndarray]:
        """The collated rows ``indices`` of step ``step``: the leaves in the step's call order."""
        ...


Prepare = Callable[[Hashable, HostRows, list[np.ndarray]], "list[jax.Array] | None"]
"""``prepare(key, rows, leaves)``: loaded rows placed for compiled signature ``key``, ``None`` if not compiled."""

Loaded = tuple[HostRows, list[np.ndarray], "list[jax.Array] | None"]
"""``(loaded, leaves, prepared)``: what was loaded, its leaves, and the placed inputs or ``None``."""


class HostLoader:
    """Loads and places this process's rows of each host-loaded step, ``depth`` steps ahead (see the module
    docstring). ``prepare(key, rows, leaves) → inputs`` places loaded rows for a compiled
    signature ``key`` and returns ``None`` for one not compiled yet (the step then places them itself)."""

    def __init__(self, factory: DataFactory, host: int, depth: int, prepare: Prepare):
        self.factory, self.host, self.depth, self._prepare = factory, host, depth, prepare
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"torchpar-host{host}-data")
        self._pending: dict[int, Future[Loaded]] = {}
        self._lock = threading.Lock()

    def take(self, rows: HostRows) -> tuple[Loaded, float]:
        """The step's loaded rows — ``(loaded, leaves, prepared)``: what was loaded (a prefetch may have loaded
        other rows than ``rows`` names, e.g. all of them before the step's shapes compiled), the leaves, and the
        placed inputs or ``None`` — and the seconds the step waited for them; schedules the next steps' loading."""
        with self._lock:
            future = self._pending.pop(rows.step, None)
            if future is None:
                future = self._pool.submit(self._load, rows)
            for step, key, span, indices, batch_rows in rows.ahead[: self.depth]:
                if step not in self._pending:
                    ahead = HostRows(step=step, key=key, batch_rows=batch_rows, rows=span, indices=indices)
                    self._pending[step] = self._pool.submit(self._load, ahead)
        start = time.perf_counter()
        result = future.result()
        return result, time.perf_counter() - start

    def _load(self, rows: HostRows) -> Loaded:
        try:
            leaves = self.factory.load_leaves(rows.indices, rows.step)
        except Exception as error:
            raise HostDataError(
                f"host {self.host}: the data factory failed loading step {rows.step}'s rows "
                f"{rows.rows[0]}:{rows.rows[1]}: {type(error).__name__}: {error}"
            ) from error
        return rows, leaves, self._prepare(rows.key, rows, leaves)

    def close(self) -> None:
        """Drop the loads not taken yet and stop the thread."""
        with self._lock:
            for future in self._pending.values():
                future.cancel()
            self._pending.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

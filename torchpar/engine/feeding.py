"""Where a step's batch comes from: a batch the caller passes (driver-fed), one prefetched by
``engine.prefetch(loader)``, or the engine's host-loaded data (:class:`HostData`), which every process reads itself.

- **Driver-fed**: ``engine.step(batch)``; the executor sends each process only the slices its devices hold
  (:mod:`torchpar.runtime.batch_parts`).
- **Prefetched**: ``for batch in engine.prefetch(loader): engine.step(batch)`` — a background thread pulls the next
  batches from ``loader`` (collating them), converts them and places them (on the devices in this process, in Ray's
  object store for host actors) while the current step runs; a bounded queue (``depth``) holds them.
- **Host-loaded**: ``torchpar.compile(..., data=torchpar.HostData(dataset, batch_size=...))`` then
  ``engine.step()`` / ``for loss in engine.run(steps)``: the driver only walks the sampler (dataset indices) and
  sends each process the indices of its rows; each process collates its rows from its own copy of the dataset,
  ``depth`` steps ahead (:mod:`torchpar.runtime.host_loading`). The driver sends no batch bytes.

Why a map-style ``Dataset`` (not Ray Data): it is what a PyTorch user already has, indexing lets a host read
exactly its rows in the global order a ``DataLoader`` would give one process, and it needs nothing beyond torch on
the hosts. The dataset object is pickled to every host actor, so it should open its files lazily (paths, not
loaded arrays, in its state).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Container, Hashable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import numpy as np
import torch

from torchpar.engine import batches
from torchpar.engine.guard import leaf_names
from torchpar.engine.host_arrays import host_value
from torchpar.runtime.batch_parts import HostBatch

if TYPE_CHECKING:
    from torchpar.ir.index_inputs import IndexBound
    from torchpar.ir.integer_ranges import IntegerRanges
    from torchpar.runtime.executor import Executor, Prepared

log = logging.getLogger(__name__)

T = TypeVar("T")


class MapDataset(Protocol):
    """A map-style dataset: its length and the sample at each index (what :class:`HostData` reads)."""

    def __getitem__(self, index: int, /) -> object: ...

    def __len__(self) -> int: ...


PREFETCH_DEPTH = 2
"""Batches prepared ahead of the step (``engine.prefetch``) and steps loaded ahead by each host (host-loaded data)."""


@dataclasses.dataclass(frozen=True)
class HostData:
    """A map-style dataset every process loads its own rows of (see the module docstring).

    The global order is exactly what ``torch.utils.data.DataLoader(dataset, batch_size, shuffle=shuffle,
    drop_last=drop_last, generator=torch.Generator().manual_seed(seed))`` gives one process, epoch after epoch
    (an epoch's smaller last batch kept unless ``drop_last``). ``collate_fn`` (default: torch's
    ``default_collate``) must collate any subset of a batch's samples into that subset of the collated batch
    (true of stacking collators; a collator padding to the longest sample is not: pad to a fixed length), and the
    samples must collate to the same shapes beyond dim 0 in every batch."""

    dataset: MapDataset
    batch_size: int
    collate_fn: Callable[[list[Any]], object] | None = None
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False
    index_bounds: tuple[IndexBound, ...] = ()
    """Set by the engine: the index-range checks of the batch leaves (``compile(check_inputs=True)``)."""
    integer_ranges: IntegerRanges | None = None
    """Set by the engine: the check of the step's int64 arithmetic (:mod:`torchpar.ir.integer_ranges`), or ``None``."""
    leaf_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (hasattr(self.dataset, "__getitem__") and hasattr(self.dataset, "__len__")):
            raise TypeError(
                f"HostData needs a map-style dataset (with __len__ and __getitem__), got a "
                f"{type(self.dataset).__name__}"
            )
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an int ≥ 1, got {self.batch_size!r}")
        if len(self.dataset) == 0 or (self.drop_last and len(self.dataset) < self.batch_size):
            raise ValueError(
                f"the dataset of {len(self.dataset)} samples gives no batch of {self.batch_size}"
                + (" with drop_last=True" if self.drop_last else "")
            )

    def index_loader(self) -> torch.utils.data.DataLoader[int]:
        """The ``DataLoader`` above over the dataset's indices: each pass over it is the next epoch's batches."""
        return torch.utils.data.DataLoader(
            range(len(self.dataset)),  # type: ignore[arg-type]  # torch's stubs want a Dataset; any sequence works
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
            generator=torch.Generator().manual_seed(self.seed),
            collate_fn=lambda indices: tuple(int(i) for i in indices),
        )

    def epoch_batches(self, epoch: int) -> list[tuple[int, ...]]:
        """The dataset indices of each batch of epoch ``epoch`` (0-based), as the ``DataLoader`` above yields them."""
        loader = self.index_loader()
        for _ in range(epoch):
            for _ in loader:
                pass
        return list(loader)

    def collate(self, indices: Iterable[int]) -> object:
        """The batch of samples ``indices``, collated; an exception names the dataset index that raised."""
        samples = []
        for index in indices:
            try:
                samples.append(self.dataset[index])
            except Exception as error:
                raise type(error)(f"dataset[{index}] raised {type(error).__name__}: {error}") from error
        collate = self.collate_fn or torch.utils.data.default_collate
        return collate(samples)

    def load_leaves(self, indices: Iterable[int], step: int) -> list[np.ndarray]:
        """The collated rows ``indices`` as the host arrays a step takes (its call leaves, index ranges checked):
        what each process runs for its rows (:class:`torchpar.runtime.host_loading.HostLoader`)."""
        batch = self.collate(indices)
        leaves = batches.call_leaves(batch)
        raw = [leaf.detach().cpu().numpy() if leaf.dtype != torch.bfloat16 else None for leaf in leaves]
        names = list(self.leaf_names) or [f"leaf {i}" for i in range(len(raw))]
        if self.index_bounds:
            from torchpar.ir.index_inputs import check_index_inputs

            check_index_inputs(self.index_bounds, raw, names)
        hosted = [host_value(r if r is not None else leaf) for r, leaf in zip(raw, leaves)]
        if self.integer_ranges is not None:
            self.integer_ranges.check(raw, names)
        return hosted


class HostFeed:
    """The driver's cursor over host-loaded data: which epoch and batch come next, each step's
    :class:`~torchpar.runtime.batch_parts.HostBatch` (indices only) and the batch *template* the engine compiles and
    measures with (the example batch cut to the step's rows: a partial last batch's shapes)."""

    def __init__(self, data: HostData, depth: int):
        self.data, self.depth = data, depth
        self._loader = data.index_loader()
        self._epochs: dict[int, list[tuple[int, ...]]] = {}
        self._next_epoch = 0
        self.example = data.collate(self._batches(0)[0])
        self.epoch, self.position, self.steps = 0, 0, 0

    def _batches(self, epoch: int) -> list[tuple[int, ...]]:
        """Epoch ``epoch``'s batches: the index loader passed over once per epoch, in order (epochs only advance)."""
        while self._next_epoch <= epoch:
            self._epochs[self._next_epoch] = list(self._loader)
            self._next_epoch += 1
            self._epochs = {e: b for e, b in self._epochs.items() if e >= epoch - 1}
        return self._epochs[epoch]

    def _upcoming(self, count: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """``(epoch, position, indices)`` of the next ``count`` batches from the cursor."""
        out: list[tuple[int, int, tuple[int, ...]]] = []
        epoch, position = self.epoch, self.position
        while len(out) < count:
            epoch_batches = self._batches(epoch)
            if position >= len(epoch_batches):
                epoch, position = epoch + 1, 0
                continue
            out.append((epoch, position, epoch_batches[position]))
            position += 1
        return out

    def template(self, rows: int) -> object:
        """The example batch with ``rows`` rows (a prefix: host-loaded batches never exceed the batch size)."""
        return batches.take_rows(self.example, rows)

    def next(self) -> tuple[object, HostBatch]:
        """The next step's template batch and its HostBatch; the cursor moves past it (epochs roll over)."""
        upcoming = self._upcoming(1 + self.depth)
        epoch, position, indices = upcoming[0]
        ahead = tuple(
            (self.steps + k, batches.signature(self.template(len(i))), i)
            for k, (_, _, i) in enumerate(upcoming[1:], start=1)
        )
        self.epoch, self.position = epoch, position + 1
        step = HostBatch(step=self.steps, indices=indices, ahead=ahead)
        self.steps += 1
        return self.template(len(indices)), step

    def checked(self, checks: tuple[Iterable[IndexBound], IntegerRanges | None], names: Iterable[str]) -> HostData:
        """The data as the processes get it: with the checks of the step's batch leaves (``checks``: the index
        bounds and the integer-arithmetic check, :meth:`torchpar.engine.guard.StepGuard.input_checks`)."""
        bounds, ranges = checks
        return dataclasses.replace(
            self.data, index_bounds=tuple(bounds), integer_ranges=ranges, leaf_names=tuple(names)
        )

    def cursor(self) -> dict[str, int]:
        """Where the data stands, for a checkpoint: the next batch (``epoch``, ``position`` in it), the steps taken,
        and what fixes the order (dataset size, batch size, shuffle, seed, drop_last) — the sampler's state is the
        seeded generator walked epoch by epoch, so these recreate it."""
        return {"epoch": self.epoch, "position": self.position, "steps": self.steps, **self._order()}

    def _order(self) -> dict[str, int]:
        data = self.data
        return {
            "samples": len(data.dataset),
            "batch_size": data.batch_size,
            "shuffle": data.shuffle,
            "seed": data.seed,
            "drop_last": data.drop_last,
        }

    def restore(self, cursor: Mapping[str, int]) -> None:
        """Continue from a :meth:`cursor` saved by another run over the same data: the next step loads the batch
        after the saved one, in the same order (checked first: :meth:`check`)."""
        self.check(cursor)
        self.epoch, self.position, self.steps = int(cursor["epoch"]), int(cursor["position"]), int(cursor["steps"])
        self._batches(self.epoch)

    def check(self, cursor: Mapping[str, int]) -> None:
        """Raises ``ValueError`` naming what differs when ``cursor`` was saved over data whose order is not this
        one's (another dataset size, batch size, shuffle, seed or drop_last)."""
        saved = {key: cursor.get(key) for key in self._order()}
        if saved != self._order():
            differs = ", ".join(
                f"{key} {saved[key]!r} in the checkpoint, {value!r} here"
                for key, value in self._order().items()
                if saved[key] != value
            )
            raise ValueError(
                f"the checkpoint's data cursor was saved over other data ({differs}): the order would "
                "not continue; compile with the same HostData settings, or load without data="
            )

    def steps_in_epochs(self, epochs: int) -> int:
        """Steps from the cursor to the end of the epoch ``epochs - 1`` epochs after the current one."""
        current = len(self._batches(self.epoch)) - self.position
        return current + sum(len(self._batches(self.epoch + e)) for e in range(1, epochs))


@dataclasses.dataclass(frozen=True)
class Prefetched:
    """A batch from ``engine.prefetch``: the batch, its payloads made ready for ``executor`` (``None`` when its
    shapes were not compiled yet), and the seconds the consumer waited for it."""

    batch: object
    ready: Prepared | None
    executor: Executor
    wait_s: float


class Prefetcher(Iterator[Prefetched]):
    """Iterates ``loader`` on a background thread, each batch handed to ``prepare`` (conversion and placement)
    there; at most ``depth`` batches wait in the queue. The loader's exceptions are raised by ``next``."""

    _END = object()

    def __init__(
        self, loader: Iterable[object], prepare: Callable[[object], tuple[Prepared | None, Executor]], depth: int
    ):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be an int ≥ 1, got {depth!r}")
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._fill, args=(iter(loader), prepare), daemon=True, name="torchpar-prefetch"
        )
        self._thread.start()

    def _fill(self, source: Iterator[object], prepare: Callable[[object], tuple[Prepared | None, Executor]]) -> None:
        try:
            for batch in source:
                if not self._put((batch, *prepare(batch))):
                    return
            self._put(self._END)
        except BaseException as error:  # handed to the consumer, raised by next()
            self._put(error)

    def _put(self, item: object) -> bool:
        """Queue ``item`` unless the consumer stopped (then ``False``)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> Prefetched:
        start = time.perf_counter()
        item = self._queue.get()
        waited = time.perf_counter() - start
        if item is self._END:
            self._stop.set()
            raise StopIteration
        if isinstance(item, BaseException):
            self._stop.set()
            raise item
        batch, ready, executor = cast("tuple[object, Prepared | None, Executor]", item)  # what _fill queued
        return Prefetched(batch, ready, executor, waited)

    def close(self) -> None:
        """Stop pulling batches (the thread ends after the batch it is preparing)."""
        self._stop.set()

    def __del__(self) -> None:
        self._stop.set()


class StepInputs:
    """The engine's source of each step's inputs: ``take`` says what the step trains on, ``leaves`` what the
    executor gets (converting a batch, or attaching the host-loaded data to the executor's processes first);
    ``host_leaves(key, batch)`` is the engine's conversion, ``checks(key)`` its input checks (index bounds, integer
    arithmetic)."""

    def __init__(
        self,
        feed: HostFeed | None,
        host_leaves: Callable[[Hashable, object], list[np.ndarray]],
        checks: Callable[[Hashable], tuple[list[IndexBound], IntegerRanges | None]],
    ):
        self.feed, self._host_leaves, self._checks = feed, host_leaves, checks
        self._attached_to: Executor | None = None

    def take(
        self, batch: object, executor: Executor
    ) -> tuple[object, HostBatch | tuple[Prepared, Executor] | None, float]:
        """What ``engine.step(batch)`` trains on: ``(batch, fed, waited)`` — the batch (for host-loaded data, the
        template of the next step's shapes), what the executor takes instead of converting it (the host-loaded
        step's :class:`HostBatch`, or a prefetched batch's payloads with the executor they were made for) or
        ``None``, and the seconds already waited for it."""
        if batch is None:
            if self.feed is None:
                raise TypeError(
                    "engine.step() without a batch needs compile(..., data=torchpar.HostData(...)); "
                    "otherwise pass the batch: engine.step(batch)"
                )
            template, host_batch = self.feed.next()
            return template, host_batch, 0.0
        if isinstance(batch, Prefetched):
            return batch.batch, (batch.ready, batch.executor) if batch.ready is not None else None, batch.wait_s
        return batch, None, 0.0

    def leaves(
        self,
        signature: batches.Signature,
        batch: object,
        fed: HostBatch | Prepared | tuple[Prepared, Executor] | None,
        executor: Executor,
    ) -> tuple[list[np.ndarray] | HostBatch | Prepared, float]:
        """What ``executor.step`` takes for the step and the seconds spent converting it (a driver-fed batch, or one
        prefetched for an executor since replaced by a recompile)."""
        if isinstance(fed, tuple):
            ready, made_for = fed
            fed = ready if made_for is executor else None
        if isinstance(fed, HostBatch):
            assert self.feed is not None, "a HostBatch comes from the host-loaded feed"
            if self._attached_to is not executor:
                executor.attach_data(self.feed.checked(self._checks(signature), leaf_names(batch)), self.feed.depth)
                self._attached_to = executor
            return fed, 0.0
        if fed is not None:
            return fed, 0.0
        start = time.perf_counter()
        return self._host_leaves(signature, batch), time.perf_counter() - start

    def cursor(self) -> dict[str, int] | None:
        """Host-loaded data's position for a checkpoint (:meth:`HostFeed.cursor`), ``None`` without it."""
        return self.feed.cursor() if self.feed is not None else None

    def check_cursor(self, cursor: Mapping[str, int] | None) -> None:
        """Before a checkpoint loads: its cursor must continue this engine's data (:meth:`HostFeed.check`)."""
        if self.feed is not None and cursor is not None:
            self.feed.check(cursor)

    def restore_cursor(self, cursor: Mapping[str, int] | None) -> None:
        """After ``engine.load``: host-loaded data continues from the checkpoint's cursor (the hosts' loaders are
        attached again, so nothing loaded ahead of the old position is used)."""
        if self.feed is None:
            return
        if cursor is None:
            log.warning(
                "torchpar: the checkpoint holds no data cursor (saved without host-loaded data); the data "
                "continues from where this engine's stands (epoch %d, batch %d)",
                self.feed.epoch,
                self.feed.position,
            )
            return
        self.feed.restore(cursor)
        self._attached_to = None

    def run(self, step: Callable[[], T], steps: int | None, epochs: int | None) -> Iterator[T]:
        """``step()`` run ``steps`` times (or to the end of ``epochs`` epochs), lazily, yielding what it returns;
        checked at once."""
        if self.feed is None or (steps is None) == (epochs is None):
            raise TypeError(
                "run(steps) / run(epochs=...) needs compile(..., data=torchpar.HostData(...)) and one of "
                "steps, epochs; with batches of your own, call engine.step(batch)"
            )
        count = steps if steps is not None else self.feed.steps_in_epochs(cast(int, epochs))  # one of the two
        return (step() for _ in range(count))

    def prefetch(
        self,
        loader: Iterable[object],
        executor: Callable[[], Executor],
        compiled: Container[batches.Signature],
        depth: int,
    ) -> Prefetcher:
        """``engine.prefetch``: on the prefetch thread each batch's payloads are made for the current executor if its
        signature is compiled (``compiled``: the compiled signatures), else left to the step to convert."""

        def prepare(batch: object) -> tuple[Prepared | None, Executor]:
            signature, made_for = batches.signature(batch), executor()
            if signature not in compiled:
                return None, made_for
            return made_for.prepare(signature, self._host_leaves(signature, batch)), made_for

        return Prefetcher(loader, prepare, depth)


def example_and_feed(example_batch: object, data: HostData | None) -> tuple[object, HostFeed | None]:
    """``compile``'s example batch and host-loaded feed: ``data``'s first batch is the example when none is given."""
    if data is not None and not isinstance(data, HostData):
        raise TypeError(f"data must be a torchpar.HostData, got {type(data).__name__}")
    feed = HostFeed(data, depth=PREFETCH_DEPTH) if data is not None else None
    if example_batch is None:
        if feed is None:
            raise TypeError(
                "compile needs example_batch= (a batch as the training loop passes it) or data="
                "torchpar.HostData(...) (its first batch is the example)"
            )
        example_batch = feed.example
    return example_batch, feed

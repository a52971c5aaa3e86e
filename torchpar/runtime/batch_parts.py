"""Each process's part of a batch: only the slices its devices hold travel to it, and it builds the global arrays
from them.

A one-stage step places every batch leaf on its compiled input sharding. In a multi-controller system a process
holds only its own devices' shards, so it needs only the *box* of the leaf those shards cover
(:func:`local_box`: the bounding box, per dim ``(start, stop)``, of its devices' indices — a data-parallel host's
rows; the whole leaf where the leaf is replicated). Each worker reports its boxes when a batch signature compiles;
the driver then sends every process a :class:`LeafPiece` per leaf — the box and the data inside it — instead of
the whole batch, and the process places its devices' slices from it (:func:`place`). A pipeline process receives
only the leaves its stages read (:func:`pipeline_leaves`).

Host-loaded data (:class:`HostRows`) sends no batch bytes at all: the process loads the rows of the global batch
its boxes cover (:func:`rows_of`) from its own copy of the dataset and cuts its pieces from them.

Plain data and JAX; no torch (the dataset's own code runs inside the user's data factory).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np

if TYPE_CHECKING:
    import jax

Index = tuple[tuple[int, int], ...]
"""A box: ``(start, stop)`` per dim, in global coordinates (:mod:`.arrays`)."""


@dataclass(frozen=True)
class HostBatch:
    """A host-loaded step as the driver describes it: its number, the dataset indices of the global batch's rows,
    and the next steps' ``(step, signature key, indices)`` for the processes to prefetch. No batch data."""

    step: int
    indices: tuple[int, ...]
    ahead: tuple[tuple[int, Hashable, tuple[int, ...]], ...] = ()


@dataclass(frozen=True)
class LeafPiece:
    """One batch leaf's part for one process: the leaf's global ``shape``, the ``box`` of it this process needs,
    and the ``data`` inside that box (``data.shape`` is the box's extent)."""

    shape: tuple[int, ...]
    box: Index
    data: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


@dataclass(frozen=True)
class HostRows:
    """A host-loaded step's instructions for one process (no batch bytes): the dataset indices of the global batch's
    rows ``rows[0]:rows[1]`` (the rows this process's boxes cover), the global batch size, and the step's batch
    signature key. ``ahead`` are the next steps' ``(step, key, rows, indices, batch_rows)`` for prefetching."""

    step: int
    key: Hashable
    batch_rows: int
    rows: tuple[int, int]
    indices: tuple[int, ...]
    ahead: tuple[tuple[int, Hashable, tuple[int, int], tuple[int, ...], int], ...] = field(default=())


@dataclass(frozen=True)
class Ahead:
    """A step's inputs a process already placed on its devices (``place_ahead`` under ``token``): a prefetched
    driver-fed batch on host actors."""

    token: int


def local_box(sharding: jax.sharding.Sharding, shape: Sequence[int]) -> Index:
    """The bounding box of what this process's devices hold of an array of ``shape`` laid out as ``sharding``
    (the whole array when the sharding is fully addressable)."""
    from torchpar.runtime.arrays import normalize

    whole = tuple((0, size) for size in shape)
    if sharding.is_fully_addressable or not shape:
        return whole
    indices = [
        normalize(cast("tuple[slice, ...]", index), shape)  # JAX gives every device of a sharding its index
        for index in sharding.addressable_devices_indices_map(tuple(shape)).values()
    ]
    return tuple((min(i[d][0] for i in indices), max(i[d][1] for i in indices)) for d in range(len(shape)))


def cut(leaf: np.ndarray, box: Index) -> LeafPiece:
    """The piece of a whole ``leaf`` inside ``box`` (a view, not a copy, where numpy allows)."""
    from torchpar.runtime.arrays import relative

    whole = tuple((0, size) for size in leaf.shape)
    return LeafPiece(tuple(leaf.shape), box, leaf[relative(box, whole)])


def place(piece: LeafPiece, sharding: jax.sharding.Sharding) -> jax.Array:
    """The global array of ``piece.shape`` laid out as ``sharding``, each of this process's devices given its slice
    of ``piece.data`` (which must cover them: :func:`local_box`)."""
    import jax

    from torchpar.runtime.arrays import normalize, relative

    whole = tuple((0, size) for size in piece.shape)
    if sharding.is_fully_addressable and piece.box == whole:
        return jax.device_put(piece.data, sharding)

    def slice_for(index: tuple[slice, ...] | None) -> np.ndarray:
        assert index is not None  # JAX gives every device of a sharding its index
        return piece.data[relative(normalize(index, piece.shape), piece.box)]

    return jax.make_array_from_callback(piece.shape, sharding, slice_for)


def rows_of(boxes: Sequence[Index]) -> tuple[int, int]:
    """The rows (dim 0) of the global batch that ``boxes`` (one per leaf) cover together: ``(start, stop)``."""
    spans = [box[0] for box in boxes if box]
    if not spans:
        raise ValueError("no batch leaf has a dim 0 to split into rows")
    return min(start for start, _ in spans), max(stop for _, stop in spans)


def pieces_from_rows(
    leaves: Sequence[np.ndarray], rows: tuple[int, int], boxes: Sequence[Index], batch_rows: int
) -> list[LeafPiece]:
    """Each leaf's piece from the rows ``rows`` of the global batch (``leaves``: those rows of every leaf, loaded
    by this process), cut to the leaf's box."""
    from torchpar.runtime.arrays import relative

    pieces = []
    for leaf, box in zip(leaves, boxes):
        shape = (batch_rows, *leaf.shape[1:])
        held = ((rows[0], rows[1]), *((0, size) for size in leaf.shape[1:]))
        pieces.append(LeafPiece(shape, box, leaf[relative(box, held)]))
    return pieces


def pipeline_leaves(batch_inputs_by_stage: dict[int, Sequence[int]], stages: Sequence[int]) -> set[int]:
    """The batch leaves a pipeline process needs: those the stages it runs read (the first stage's inputs, the
    last stage's labels)."""
    return {int(i) for s in stages for i in batch_inputs_by_stage.get(s, ())}

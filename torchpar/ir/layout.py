"""Layouts on a 2-D logical mesh: the sharding spec type every floor shares (plain data, no torch, no jax).

A spec has one entry per tensor dim: ``None`` (replicated along that dim) or a tuple of the logical
mesh axes (0 and/or 1, in major-to-minor order) the dim is split over. Every mesh axis splits at
most one dim. The JSON form (``docs/api.md``, ``Plan``) uses lists: ``[[1], None]``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

Spec = tuple[tuple[int, ...] | None, ...]
JsonSpec = list[list[int] | None]
"""The same spec as stored in a plan's JSON (:func:`to_json` / :func:`from_json` convert)."""
MeshShape = tuple[int, int]


def replicated(rank: int) -> Spec:
    return (None,) * rank


def make_spec(rank: int, splits: dict[int, Sequence[int]]) -> Spec:
    """A spec of ``rank`` dims with ``splits[dim] = mesh axes``; raises on an axis used twice."""
    used = [axis for axes in splits.values() for axis in axes]
    if len(used) != len(set(used)):
        raise ValueError(f"a mesh axis splits two dims in {splits}")
    return tuple(tuple(splits[d]) if splits.get(d) else None for d in range(rank))


def dim_shards(spec: Spec, mesh: MeshShape) -> list[int]:
    """How many pieces each dim is cut into."""
    return [math.prod(mesh[a] for a in entry) if entry else 1 for entry in spec]


def num_shards(spec: Spec, mesh: MeshShape) -> int:
    return math.prod(dim_shards(spec, mesh))


def is_valid(spec: Spec, shape: Sequence[int], mesh: MeshShape) -> bool:
    """Every split dim divides evenly and no axis is used twice."""
    if len(spec) != len(shape):
        return False
    used = [axis for entry in spec if entry for axis in entry]
    if len(used) != len(set(used)):
        return False
    return all(size % pieces == 0 for size, pieces in zip(shape, dim_shards(spec, mesh)))


def to_json(spec: Spec) -> list[list[int] | None]:
    return [list(entry) if entry else None for entry in spec]


def from_json(data: Iterable[list[int] | None]) -> Spec:
    return tuple(tuple(entry) if entry else None for entry in data)


class Multi(tuple):
    """The specs of a multi-output op's results (``None`` for non-tensor results)."""


def describe(spec: Spec | Iterable[Sequence[int] | None]) -> str:
    """The one text form of a spec (tuple or JSON form): per dim ``R`` (replicated) or ``S`` + its mesh axes,
    space-separated — ``[[1], None]`` is ``S1 R``; a scalar is ``scalar``."""
    return " ".join("R" if not entry else "S" + "".join(str(a) for a in entry) for entry in spec) or "scalar"

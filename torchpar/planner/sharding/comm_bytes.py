"""Bytes a solved stage moves, by collective kind, under the same model that priced it.

The ILP prices each collective as ``α + β·V`` with ``V`` the bytes one device sends on the ring
(:mod:`.cost_model`: ``2(n−1)/n·B`` for an all-reduce, ``(n−1)/n·B`` for an all-gather or reduce-scatter,
``(n−1)/n·B/n`` for an all-to-all, summed over the axes it runs on). Every cost in a solver graph is a
sum of such terms, so building the graph again on a mesh with ``α = 0``, ``β = 1``, no compute cost, and every
collective kind but one priced at zero turns the objective of the same choice into ``Σ V`` of that kind:

    bytes_kind(choice) = evaluate(build(mesh_kind), choice)

Strategy lists depend only on the mesh shape, so the choice's indices mean the same strategies in every
rebuild. One rebuild per kind; used where a plan is explained (:func:`torchpar.plan`), not on the compile path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torchpar.planner.sharding.cost_model import LogicalMesh
from torchpar.planner.sharding.ilp import evaluate
from torchpar.planner.sharding.solver_graph import SolverGraph

COLLECTIVE_KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(kw_only=True, frozen=True)
class _OneKindBytesMesh(LogicalMesh):
    """A mesh whose "seconds" are the bytes one device sends in collectives of ``kind`` (all else costs 0)."""

    kind: str = "all_reduce"

    def all_reduce(self, nbytes: float, axes: Sequence[int]) -> float:
        return super().all_reduce(nbytes, axes) if self.kind == "all_reduce" else 0.0

    def all_gather(self, nbytes: float, axes: Sequence[int]) -> float:
        return super().all_gather(nbytes, axes) if self.kind == "all_gather" else 0.0

    def reduce_scatter(self, nbytes: float, axes: Sequence[int]) -> float:
        return LogicalMesh.all_gather(self, nbytes, axes) if self.kind == "reduce_scatter" else 0.0

    def all_to_all(self, nbytes: float, axes: Sequence[int]) -> float:
        return super().all_to_all(nbytes, axes) if self.kind == "all_to_all" else 0.0


def collective_bytes(
    build: Callable[[LogicalMesh], SolverGraph], shape: tuple[int, int], choice: list[int]
) -> dict[str, float]:
    """Per-device bytes sent per step by kind (:data:`COLLECTIVE_KINDS`) for ``choice`` on the solver graph that
    ``build(mesh)`` makes on a logical mesh of ``shape``."""
    result = {}
    for kind in COLLECTIVE_KINDS:
        mesh = _OneKindBytesMesh(shape=shape, alpha=(0.0, 0.0), beta=(1.0, 1.0), device_flops=math.inf, kind=kind)
        result[kind] = float(evaluate(build(mesh), choice))
    return result

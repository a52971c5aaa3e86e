r"""The sharding ILP folded by its share classes: one variable set per class of identical repeated-layer roots.

The ILP (:mod:`.ilp`) ties the roots of one share class — the same op at the same position of identical repeated
blocks, ``x_v = x_w`` — to one choice. Tied roots need not be separate variables: with ``q(v)`` the class of root
``v`` (a class of its own for an unshared root) and ``x_v = x_{q(v)}``, every term of the ILP is linear in the
class indicators, so the problem on classes

    cost      c_Q[k]    = Σ_{v∈Q} c_v[k]  +  Σ_{(u,v): q(u)=q(v)=Q} R_uv[k,k]
    memory    m_Q[k]    = Σ_{v∈Q} m_v[k]  +  Σ_{(u,v): q(u)=q(v)=Q} G_uv[k,k]
    transient r_Q[k]    = max_{v∈Q} r_v[k]
    edges     R_PQ[k,l] = Σ_{(u,v): q(u)=P, q(v)=Q} R_uv[k,l]   (and G likewise), P ≠ Q

has the same feasible choices, the same objective and the same memory for every choice: it is the same problem,
exactly, with one class's variables where there were ``|Q|`` tied copies. A model of L identical layers shrinks
about L-fold (Llama-3 70B's 80 layers in one stage: from ~10⁵ variables to ~10³), which is what lets CP-SAT prove
optimality on a deep stage within its time limit instead of searching the tied copies' symmetric space.

Roots of one share key whose strategy lists differ (not the same op after all) are not tied, as before.
``allowed`` restrictions fold to the intersection over a class's members (a choice is admissible for the class
only if admissible for every member it stands for).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from torchpar.planner.sharding.solver_graph import Root, SolverGraph


@dataclass(frozen=True)
class FoldedProblem:
    """The ILP on share classes: ``graph`` has one root per class, ``class_of[v]`` is the folded root that
    original root ``v`` became, ``allowed`` the folded restrictions (``None`` when there were none)."""

    graph: SolverGraph
    class_of: tuple[int, ...]
    allowed: dict[int, set[int]] | None

    def unfold(self, choice: list[int]) -> list[int]:
        """The original roots' choice from the folded roots' ``choice``."""
        return [choice[q] for q in self.class_of]

    def fold_choice(self, choice: Sequence[int]) -> list[int]:
        """The folded roots' choice from a choice of the original roots (each class takes its first member's)."""
        folded = [-1] * len(self.graph.roots)
        for v, q in enumerate(self.class_of):
            if folded[q] < 0:
                folded[q] = choice[v]
        return folded


def fold_share_classes(graph: SolverGraph, allowed: dict[int, set[int]] | None = None) -> FoldedProblem:
    """The folded problem of ``graph`` (see the module docstring); a graph without share classes folds to itself."""
    class_of = _classes(graph)
    if len(set(class_of)) == len(class_of):
        return FoldedProblem(graph, tuple(class_of), allowed)
    members: dict[int, list[int]] = defaultdict(list)
    for v, q in enumerate(class_of):
        members[q].append(v)
    roots = [_folded_root([graph.roots[v] for v in members[q]]) for q in range(len(members))]
    edges = _fold_edges(graph.edges, class_of, roots, "cost")
    memory_edges = _fold_edges(graph.memory_edges, class_of, roots, "memory")
    folded = SolverGraph(
        graph.mesh,
        roots,
        edges,
        {},
        {},
        graph.num_micro_batches,
        graph.recomputed,
        memory_edges,
    )
    return FoldedProblem(folded, tuple(class_of), _fold_allowed(allowed, class_of))


def _classes(graph: SolverGraph) -> list[int]:
    """``class_of[v]``: roots of one share key with the first member's strategy names share an index; numbered in
    order of first appearance."""
    first_of_key: dict[str, int] = {}
    class_of: list[int] = []
    count = 0
    for v, root in enumerate(graph.roots):
        key = root.share_key
        if key is not None and key in first_of_key:
            leader = first_of_key[key]
            if [s.name for s in graph.roots[leader].strategies] == [s.name for s in root.strategies]:
                class_of.append(class_of[leader])
                continue
        elif key is not None:
            first_of_key[key] = v
        class_of.append(count)
        count += 1
    return class_of


def _folded_root(members: list[Root]) -> Root:
    first = members[0]
    if len(members) == 1:
        return Root(
            first.name,
            first.kind,
            first.label,
            first.strategies,
            first.cost.copy(),
            first.memory.copy(),
            transient=first.transient,
        )
    transients = [m.transient for m in members if m.transient is not None]
    return Root(
        first.name,
        first.kind,
        first.label,
        first.strategies,
        np.sum([m.cost for m in members], axis=0),
        np.sum([m.memory for m in members], axis=0),
        transient=np.max(transients, axis=0) if transients else None,
    )


def _fold_edges(
    edges: dict[tuple[int, int], np.ndarray], class_of: list[int], roots: list[Root], diagonal_to: str
) -> dict[tuple[int, int], np.ndarray]:
    """Edges summed per pair of classes (oriented as first met); an edge inside one class adds its diagonal to that
    class's ``diagonal_to`` vector (``"cost"`` or ``"memory"``: both ends take the same strategy)."""
    folded: dict[tuple[int, int], np.ndarray] = {}
    for (u, v), matrix in edges.items():
        p, q = class_of[u], class_of[v]
        shape = (len(roots[p].strategies), len(roots[q].strategies))
        full = np.broadcast_to(np.asarray(matrix, np.float64), shape)
        if p == q:
            vector = getattr(roots[p], diagonal_to)
            vector += np.diagonal(full)
        elif (q, p) in folded:
            folded[(q, p)] = folded[(q, p)] + full.T
        elif (p, q) in folded:
            folded[(p, q)] = folded[(p, q)] + full
        else:
            folded[(p, q)] = np.array(full)
    return folded


def _fold_allowed(allowed: dict[int, set[int]] | None, class_of: list[int]) -> dict[int, set[int]] | None:
    if allowed is None:
        return None
    folded: dict[int, set[int]] = {}
    for v, keep in allowed.items():
        q = class_of[v]
        folded[q] = folded[q] & set(keep) if q in folded else set(keep)
    return folded

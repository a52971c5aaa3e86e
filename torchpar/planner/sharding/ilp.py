r"""The intra-operator sharding ILP (Alpa §4), solved with OR-Tools CP-SAT.

Given the solver graph (roots ``v`` with strategies ``k ∈ K_v``; per-strategy cost ``c_v[k]`` =
compute + the collectives the strategy and its merged followers cause; per-strategy memory
``m_v[k]``; edges ``(u, v)`` with resharding costs ``R_uv[k, l]``) it solves

    minimize    Σ_v Σ_k c_v[k]·x_v[k]  +  Σ_(u,v) Σ_(k,l) R_uv[k,l]·y_uv[k,l]
    subject to  Σ_k x_v[k] = 1                              for every root v        (one choice)
                y_uv[k,l] ≥ x_u[k] + x_v[l] − 1              for R_uv[k,l] > 0 or G_uv[k,l] > 0
                Σ_v Σ_k m_v[k]·x_v[k] + Σ_(u,v) Σ_(k,l) G_uv[k,l]·y_uv[k,l] + t ≤ M         (memory)
                t ≥ Σ_k r_v[k]·x_v[k]                        for every root v with transients
                x_v = x_w                                   for v, w of one share class (repeated layers)
                x, y ∈ {0, 1}

``G_uv[k, l]`` is the memory of a parameter stored as ``k`` and gathered whole(r) for ``v``'s use ``l`` (the
gathered copy is live until the backward reads it). The edge variables linearize the product ``x_u[k]·x_v[l]``.
Because every ``R, G ≥ 0``, the problem minimizes and the memory constraint is an upper bound, the one-sided
constraint is exact: ``y`` is 1 where both ends are chosen and may as well be 0 elsewhere, and pairs with
``R = G = 0`` need no variable at all (Alpa's one-hot ``e`` with equality constraints gives the
same optimum with ``|K_u|·|K_v|`` variables per edge). When every root has one admissible strategy
(a 1×1 mesh, or a hand plan that pins everything) the choice is forced: :func:`_forced_choice` evaluates
it directly, without CP-SAT (so one device never needs OR-Tools). The memory constraint is taken at the training
step's peak — the forward/backward boundary, where the parameters, gradients, optimizer state and every
activation saved for the backward pass are live — plus ``t``, the largest transient ``r_v[k]`` of a chosen
strategy (bytes an op holds only while it runs, e.g. an expert exchange's buffers: one op runs at a time, so the
largest, not the sum). A parameter and its update share a layout by construction: one root holds the parameter,
its gradient and its optimizer state.

Builders: :func:`_one_choice` (first family), :func:`_edges` (second), :func:`_memory` (third); the fourth family is
not built but folded: the roots of one share class become one root before CP-SAT sees the problem
(:mod:`.share_classes`, exact). Costs are scaled to integer nanoseconds for CP-SAT.

CP-SAT runs the two search workers of :data:`SUBSOLVERS`: one on the full LP relaxation (``max_lp``, which proves
the lower bounds on these problems) and one searching by unsatisfiable cores of the objective (``core``, which
finds and improves layouts). CP-SAT's own two-worker portfolio stalls at 2–3 % optimality gaps for the whole time
limit on MoE stages that this pair solves to optimality in under a second.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, overload

import numpy as np

from torchpar.planner.sharding.share_classes import FoldedProblem, fold_share_classes
from torchpar.planner.sharding.solver_graph import SolverGraph

if TYPE_CHECKING:  # OR-Tools is imported where a problem is solved (one device never needs it)
    from ortools.sat.python.cp_model import CpModel, IntVar, LinearExpr

log = logging.getLogger(__name__)

_SCALE = 1e9  # seconds → integer nanoseconds


class MemoryBudgetError(ValueError):
    """No plan fits the memory budget; the message states the smallest feasible budget."""


@dataclass
class Solution:
    """The chosen strategy index of every root and the solver's statistics."""

    choice: list[int]
    objective_s: float
    bound_s: float
    status: str
    num_variables: int
    num_constraints: int
    solve_s: float
    memory_bytes: float
    objective_terms: int = 0
    """Terms of the integer objective CP-SAT minimized (each cost rounded to the nanosecond)."""

    @property
    def lower_bound_s(self) -> float:
        """A proven lower bound of the ILP's optimum in seconds: CP-SAT's bound less the rounding of its terms
        (half a nanosecond each), so no layout of the stage costs less than this."""
        return self.bound_s - 0.5 * self.objective_terms / _SCALE

    @property
    def gap(self) -> float:
        return 0.0 if self.objective_s <= 0 else max(0.0, (self.objective_s - self.bound_s) / self.objective_s)

    def stats(self) -> dict[str, float | int | str]:
        return {
            "status": self.status,
            "objective_s": self.objective_s,
            "bound_s": self.bound_s,
            "gap": self.gap,
            "variables": self.num_variables,
            "constraints": self.num_constraints,
            "solve_s": self.solve_s,
            "peak_memory_bytes": self.memory_bytes,
        }


SUBSOLVERS = ("max_lp", "core")
"""CP-SAT's full-problem workers, one thread each (see the module docstring)."""


@overload
def solve(
    graph: SolverGraph,
    *,
    memory_budget: float | None = ...,
    time_limit_s: float = ...,
    workers: int = ...,
    allowed: dict[int, set[int]] | None = ...,
    relative_gap: float = ...,
    none_if_unsolved: Literal[False] = ...,
    give_up: Callable[[float], bool] | None = ...,
    hint: Sequence[int] | None = ...,
) -> Solution: ...
@overload
def solve(
    graph: SolverGraph,
    *,
    memory_budget: float | None = ...,
    time_limit_s: float = ...,
    workers: int = ...,
    allowed: dict[int, set[int]] | None = ...,
    relative_gap: float = ...,
    none_if_unsolved: bool,
    give_up: Callable[[float], bool] | None = ...,
    hint: Sequence[int] | None = ...,
) -> Solution | None: ...
def solve(
    graph: SolverGraph,
    *,
    memory_budget: float | None = None,
    time_limit_s: float = 30.0,
    workers: int = len(SUBSOLVERS),
    allowed: dict[int, set[int]] | None = None,
    relative_gap: float = 1e-4,
    none_if_unsolved: bool = False,
    give_up: Callable[[float], bool] | None = None,
    hint: Sequence[int] | None = None,
) -> Solution | None:
    """Solve the ILP on ``graph``; raises :class:`MemoryBudgetError` if no layout fits ``memory_budget``.
    ``none_if_unsolved``: return ``None`` instead of raising when the time limit passes before any solution.
    ``give_up``: called with every lower bound CP-SAT proves (seconds, as :attr:`Solution.lower_bound_s`); once it
    returns true the search stops and :class:`AboveCutoff` is raised with that bound (a caller that only needs to
    know whether the optimum can be below some threshold need not solve to the end). It does not change the search:
    a solve it never stops returns what it would have returned without it.

    ``allowed`` restricts roots to some strategy indices (hand plans are restrictions of the same ILP,
    so the automatic plan is never worse than them by the cost model). The solver stops once the
    optimality gap is at most ``relative_gap`` (reported in the solution). ``hint``: a choice per root to start the
    search from (e.g. the layout a shorter solve of the same problem found); it changes how fast CP-SAT finds and
    proves the optimum, not the optimum.
    """
    start = time.perf_counter()
    forced = _forced_choice(graph, allowed)
    if forced is not None:
        return _forced_solution(graph, forced, memory_budget, time.perf_counter() - start)
    if memory_budget is not None and allowed is None and minimum_memory(graph) > memory_budget:
        _raise_over_budget(graph, memory_budget)  # infeasible for sure: do not let CP-SAT prove it
    key, shape_key = problem_keys(graph, memory_budget, allowed, time_limit_s, (workers, relative_gap))
    cached = _SOLVED.get(key)
    if cached is not None:  # the same problem (an identical stage: same layers, mesh, budget) solved before
        SOLVE_COUNTS["reused"] += 1
        return dataclasses.replace(
            cached, choice=list(cached.choice), status=f"{cached.status} (reused)", solve_s=time.perf_counter() - start
        )
    folded = fold_share_classes(graph, allowed)
    looser = _looser_optimum(shape_key, graph, folded, memory_budget)
    if looser is not None:  # the optimum of a problem whose feasible set holds this one's, and it fits here
        SOLVE_COUNTS["reused_roomier"] += 1
        return dataclasses.replace(
            looser,
            choice=list(looser.choice),
            memory_bytes=memory_of(graph, looser.choice),
            status=f"{looser.status} (reused: roomier problem)",
            solve_s=time.perf_counter() - start,
        )
    solution = _solve_cp_sat(
        folded.graph,
        memory_budget,
        time_limit_s,
        workers,
        folded.allowed,
        relative_gap,
        start,
        none_if_unsolved,
        give_up,
        folded.fold_choice(hint) if hint is not None else None,
    )
    SOLVE_COUNTS["solved"] += 1
    if solution is None:
        return None
    if folded.graph is not graph:
        choice = folded.unfold(solution.choice)
        solution = dataclasses.replace(
            solution, choice=choice, objective_s=evaluate(graph, choice), memory_bytes=memory_of(graph, choice)
        )
    if len(_SOLVED) >= SOLUTION_CACHE_SIZE:
        _SOLVED.pop(next(iter(_SOLVED)))
    _SOLVED[key] = solution
    if solution.status == "OPTIMAL":
        _remember_optimum(shape_key, graph, memory_budget, solution)
    return solution


class SolveTimeout(RuntimeError):
    """CP-SAT found no layout within its time limit (neither one that fits nor a proof that none does)."""


class AboveCutoff(Exception):
    """The caller's ``give_up`` accepted a lower bound CP-SAT proved: no layout costs less than ``bound_s`` seconds."""

    def __init__(self, bound_s: float):
        super().__init__(f"every layout costs at least {bound_s:.6g} s")
        self.bound_s = bound_s


SOLUTION_CACHE_SIZE = 512
"""Solved problems kept in this process (:func:`problem_keys`' whole key → :class:`Solution`), oldest dropped first."""
_SOLVED: dict[str, Solution] = {}
SOLVE_COUNTS: dict[str, int] = {"solved": 0, "reused": 0, "reused_roomier": 0, "given_up": 0}
"""CP-SAT solves run to the end, answers reused from identical problems (``reused``) and from the optimum of a problem
whose memory is nowhere tighter (``reused_roomier``, :func:`_looser_optimum`), and solves stopped by their
``give_up``, in this process (``plan.solver["ilp_problems"]`` reads them)."""


@dataclass(frozen=True)
class _MemoryRows:
    """The memory side of a solved problem: every root's ``memory`` and ``transient`` row, the gathered-memory
    matrices, and the budget (``inf``: none)."""

    memory: tuple[np.ndarray, ...]
    transient: tuple[np.ndarray | None, ...]
    gathered: dict[tuple[int, int], np.ndarray]
    budget: float

    def no_tighter_than(self, graph: SolverGraph, budget: float) -> bool:
        """Whether every layout that fits ``graph`` under ``budget`` also fits this problem, in the ILP's own KiB
        rounding: no coefficient here is above ``graph``'s (a missing transient row or gathered matrix is zeros) and
        the budget is no smaller. Both sides round each coefficient up and the budget down, which keeps the order."""
        if budget > self.budget:
            return False
        for mine, root in zip(self.memory, graph.roots):
            if not np.all(mine <= root.memory):
                return False
        for mine_t, root in zip(self.transient, graph.roots):
            if mine_t is not None and not np.all(mine_t <= (0.0 if root.transient is None else root.transient)):
                return False
        return all(np.all(matrix <= graph.memory_edges.get(pair, 0.0)) for pair, matrix in self.gathered.items())

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays held."""
        held = [*self.memory, *(t for t in self.transient if t is not None), *self.gathered.values()]
        return sum(array.nbytes for array in held)


_OPTIMA: dict[str, list[tuple[_MemoryRows, Solution]]] = defaultdict(list)
"""Optimal solutions by :func:`problem_keys`' shape key (the costs, edges, restrictions and settings), each with its
problem's memory side (:func:`_looser_optimum`); at most :data:`SOLUTION_CACHE_SIZE` in all and
:data:`OPTIMA_BYTES` of memory rows, oldest dropped first."""
OPTIMA_BYTES = 256 * 2**20
"""The memory rows :data:`_OPTIMA` holds at most, in bytes (a stage of thousands of roots holds a few MB)."""
_optima_bytes = [0]


def forget_solutions() -> None:
    """Empty both solution caches (:data:`_SOLVED`, :data:`_OPTIMA`): the next solve of any problem runs CP-SAT."""
    _SOLVED.clear()
    _OPTIMA.clear()
    _optima_bytes[0] = 0


def _remember_optimum(shape_key: str, graph: SolverGraph, budget: float | None, solution: Solution) -> None:
    rows = _MemoryRows(
        tuple(root.memory.copy() for root in graph.roots),
        tuple(None if root.transient is None else root.transient.copy() for root in graph.roots),
        {pair: np.asarray(matrix, np.float64).copy() for pair, matrix in graph.memory_edges.items()},
        math.inf if budget is None else budget,
    )
    while _OPTIMA and (
        sum(map(len, _OPTIMA.values())) >= SOLUTION_CACHE_SIZE or _optima_bytes[0] + rows.nbytes > OPTIMA_BYTES
    ):
        oldest = next(iter(_OPTIMA))
        dropped, _ = _OPTIMA[oldest].pop(0)
        _optima_bytes[0] -= dropped.nbytes
        if not _OPTIMA[oldest]:
            del _OPTIMA[oldest]
    _OPTIMA[shape_key].append((rows, solution))
    _optima_bytes[0] += rows.nbytes


def _looser_optimum(shape_key: str, graph: SolverGraph, folded: FoldedProblem, budget: float | None) -> Solution | None:
    r"""An optimal solution of a problem ``P₁`` solved before that answers this one, ``P₂``, exactly, or ``None``.

    ``P₁`` and ``P₂`` have the same objective (costs, resharding edges), restrictions and solver settings, and ``P₁``'s
    memory is nowhere tighter: every memory coefficient ``m₁ ≤ m₂`` (roots, transients, gathered copies) and budget
    ``M₁ ≥ M₂``. For any layout ``x`` the ILP's memory row is a sum of non-negative multiples of those coefficients
    and a maximum of transients, both non-decreasing in each, so ``mem₂(x) ≤ M₂ ⟹ mem₁(x) ≤ mem₂(x) ≤ M₂ ≤ M₁``: the
    feasible set ``F₂ ⊆ F₁``. If ``P₁``'s optimum ``x₁`` (within the relative gap) lies in ``F₂`` — checked in the
    KiB-rounded row CP-SAT would see for ``P₂`` — then ``c(x₁) ≤ (1 + gap)·min_{F₁} c ≤ (1 + gap)·min_{F₂} c`` and
    ``P₁``'s proven bound ``≤ min_{F₁} c ≤ min_{F₂} c`` still holds: ``x₁`` is an optimal answer to ``P₂`` with that
    bound. (A pipeline's identical stages are such pairs: the same layers, the later stage holding fewer micro-batches
    in flight.)"""
    limit = math.inf if budget is None else budget
    for rows, solution in _OPTIMA.get(shape_key, ()):
        if not rows.no_tighter_than(graph, limit):
            continue
        if budget is None or _memory_kib(folded.graph, folded.fold_choice(solution.choice)) <= int(budget // 1024):
            return solution
    return None


def _memory_kib(graph: SolverGraph, choice: list[int]) -> int:
    """The left side of :func:`_memory`'s row for ``choice``, as CP-SAT counts it: every term rounded up to KiB."""
    total = sum(_kib(root.memory[k]) for root, k in zip(graph.roots, choice))
    total += sum(_kib(matrix[choice[u], choice[v]]) for (u, v), matrix in graph.memory_edges.items())
    transients = [_kib(root.transient[k]) for root, k in zip(graph.roots, choice) if root.transient is not None]
    return total + max(transients, default=0)


def _kib(value: float) -> int:
    """Bytes as the ILP's memory row counts them: KiB, rounded up (0 for none)."""
    return int(np.ceil(float(value) / 1024)) if value > 0 else 0


def problem_keys(
    graph: SolverGraph,
    memory_budget: float | None,
    allowed: dict[int, set[int]] | None,
    time_limit_s: float,
    settings: tuple,
) -> tuple[str, str]:
    """Two digests of what the ILP reads, made in one pass. The whole key: per root its strategy names, costs and
    memory, the share classes (as root positions), every edge's resharding matrix, the memory budget, the
    restrictions, ``time_limit_s`` and the other solver ``settings`` — and nothing it does not: two stages of
    identical layers on one logical mesh (which differ only in their op and parameter names) have the same key, and
    the same optimal choice by root position. The shape key: the same without the memory side (memory and transient
    rows, gathered copies, budget) and the time limit (an optimal answer does not depend on it)."""
    whole = hashlib.blake2b(digest_size=20)
    shape = hashlib.blake2b(digest_size=20)

    def add(*parts: object, memory: bool = False) -> None:
        for part in parts:
            data = part.tobytes() if isinstance(part, np.ndarray) else repr(part).encode()
            whole.update(data)
            if not memory:
                shape.update(data)

    classes: dict[str, list[int]] = defaultdict(list)
    for v, root in enumerate(graph.roots):
        add(v, tuple(s.name for s in root.strategies), np.asarray(root.cost, np.float64))
        add(np.asarray(root.memory, np.float64), memory=True)
        if root.transient is not None:
            add("transient", v, np.asarray(root.transient, np.float64), memory=True)
        if root.share_key is not None:
            classes[root.share_key].append(v)
    add(sorted(tuple(members) for members in classes.values()))
    for u, v in sorted(graph.edges):
        add((u, v), np.asarray(graph.edges[(u, v)], np.float64))
    for u, v in sorted(graph.memory_edges):
        add("memory", (u, v), np.asarray(graph.memory_edges[(u, v)], np.float64), memory=True)
    add(memory_budget, time_limit_s, memory=True)
    add(sorted((v, sorted(keep)) for v, keep in (allowed or {}).items()), settings)
    return whole.hexdigest(), shape.hexdigest()


def _solve_cp_sat(
    graph: SolverGraph,
    memory_budget: float | None,
    time_limit_s: float,
    workers: int,
    allowed: dict[int, set[int]] | None,
    relative_gap: float,
    start: float,
    none_if_unsolved: bool = False,
    give_up: Callable[[float], bool] | None = None,
    hint: Sequence[int] | None = None,
) -> Solution | None:
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    x = _one_choice(model, graph)
    objective = [
        int(round(c * _SCALE)) * var for root, vars_ in zip(graph.roots, x) for c, var in zip(root.cost, vars_) if c > 0
    ]
    edge_terms, memory_terms = _edges(model, graph, x)
    objective += edge_terms
    if memory_budget is not None:
        _memory(model, graph, x, memory_budget, memory_terms)
    for v, keep in (allowed or {}).items():
        for k, var in enumerate(x[v]):
            if k not in keep:
                model.add(var == 0)
    model.minimize(sum(objective))
    for vars_, k in zip(x, hint or ()):
        model.add_hint(vars_[k], True)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    solver.parameters.subsolvers.extend(SUBSOLVERS)
    solver.parameters.relative_gap_limit = relative_gap
    given_up: list[float] = []
    if give_up is not None:
        rounding = 0.5 * len(objective) / _SCALE  # as Solution.lower_bound_s

        def on_bound(bound: float) -> None:
            if not given_up and give_up(bound / _SCALE - rounding):
                given_up.append(bound / _SCALE - rounding)
                solver.stop_search()

        solver.best_bound_callback = on_bound
    status = solver.solve(model)
    elapsed = time.perf_counter() - start
    if given_up and status != cp_model.OPTIMAL:
        SOLVE_COUNTS["given_up"] += 1
        raise AboveCutoff(given_up[0])
    proto = model.proto
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.INFEASIBLE and memory_budget is not None:
            _raise_over_budget(graph, memory_budget)
        if none_if_unsolved and status == cp_model.UNKNOWN:
            return None
        raise SolveTimeout(
            f"the sharding ILP ended with status {solver.status_name(status)} after {elapsed:.1f}s "
            f"(time limit {time_limit_s:g} s) with no layout found; raise the time limit"
        )
    choice = [next(k for k, var in enumerate(vars_) if solver.value(var)) for vars_ in x]
    memory = memory_of(graph, choice)
    solution = Solution(
        choice=choice,
        objective_s=evaluate(graph, choice),
        bound_s=solver.best_objective_bound / _SCALE,
        status=solver.status_name(status),
        num_variables=len(proto.variables),
        num_constraints=len(proto.constraints),
        solve_s=elapsed,
        memory_bytes=memory,
        objective_terms=len(objective),
    )
    log.info(
        "sharding ILP: %s, objective %.3g s, gap %.2g, %d vars, %d constraints, %.2fs",
        solution.status,
        solution.objective_s,
        solution.gap,
        solution.num_variables,
        solution.num_constraints,
        elapsed,
    )
    return solution


def _raise_over_budget(graph: SolverGraph, memory_budget: float) -> None:
    smallest = minimum_memory(graph)
    raise MemoryBudgetError(
        f"no sharding plan fits the memory budget of {memory_budget / 2**20:.1f} MiB per device; the "
        f"smallest feasible budget is {'at least ' if graph.memory_edges else ''}{smallest / 2**20:.1f} MiB. Use more "
        "devices, a smaller batch, or PipeshardParallel."
    )


def _forced_choice(graph: SolverGraph, allowed: dict[int, set[int]] | None) -> list[int] | None:
    """The only admissible strategy of every root, or ``None`` if some root has a real choice."""
    choice = []
    for v, root in enumerate(graph.roots):
        admissible = [k for k in range(len(root.strategies)) if allowed is None or v not in allowed or k in allowed[v]]
        if len(admissible) != 1:
            return None
        choice.append(admissible[0])
    return choice


def _forced_solution(graph: SolverGraph, choice: list[int], memory_budget: float | None, elapsed: float) -> Solution:
    """The solution of a problem whose choice is forced (see the module docstring); checks the memory budget."""
    memory = memory_of(graph, choice)
    if memory_budget is not None and memory > memory_budget:
        raise MemoryBudgetError(
            f"no sharding plan fits the memory budget of {memory_budget / 2**20:.1f} MiB per device; the only "
            f"plan on this mesh needs {memory / 2**20:.1f} MiB. Use more devices, a smaller batch, or "
            "PipeshardParallel."
        )
    objective = evaluate(graph, choice)
    return Solution(
        choice=choice,
        objective_s=objective,
        bound_s=objective,
        status="FORCED",
        num_variables=0,
        num_constraints=0,
        solve_s=elapsed,
        memory_bytes=memory,
    )


def _one_choice(model: CpModel, graph: SolverGraph) -> list[list[IntVar]]:
    """x_v[k] with Σ_k x_v[k] = 1."""
    x = []
    for v, root in enumerate(graph.roots):
        vars_ = [model.new_bool_var(f"x{v}_{k}") for k in range(len(root.strategies))]
        model.add_exactly_one(vars_)
        x.append(vars_)
    return x


def _edges(model: CpModel, graph: SolverGraph, x: list[list[IntVar]]) -> tuple[list[LinearExpr], list[LinearExpr]]:
    """y_uv[g,h] ≥ X_u[g] + X_v[h] − 1 for R_uv[g,h] > 0 or G_uv[g,h] > 0; returns the objective terms and the
    memory terms (KiB).

    Strategies of ``u`` whose rows of ``R_uv`` and ``G_uv`` are identical form one group ``g`` with indicator
    ``X_u[g] = Σ_{k∈g} x_u[k]`` (likewise columns for ``v``): the linearization needs one variable per
    distinct (row, column) pair with a positive cost or memory, not per strategy pair.
    """
    terms: list[LinearExpr] = []
    memory_terms: list[LinearExpr] = []
    pairs = list(graph.edges) + [pair for pair in graph.memory_edges if pair not in graph.edges]
    for pair in pairs:
        u, v = pair
        shape = (len(graph.roots[u].strategies), len(graph.roots[v].strategies))
        cost = np.broadcast_to(np.asarray(graph.edges.get(pair, 0.0), np.float64), shape)
        has_memory = pair in graph.memory_edges  # most edges have no memory term: group them by cost alone
        gathered = np.broadcast_to(np.asarray(graph.memory_edges.get(pair, 0.0), np.float64), shape)
        by_row = np.concatenate([cost, gathered], axis=1) if has_memory else cost
        by_col = np.concatenate([cost, gathered]) if has_memory else cost
        row_groups, rows = _groups(model, by_row, x[u], f"r{u}_{v}")
        col_groups, cols = _groups(model, by_col.T, x[v], f"c{u}_{v}")
        picked = np.ix_([g[0] for g in rows], [h[0] for h in cols])
        reduced_cost, reduced_memory = cost[picked], gathered[picked]
        for g, h in zip(*np.nonzero((reduced_cost > 0) | (reduced_memory > 0))):
            scaled = int(round(reduced_cost[g, h] * _SCALE))
            kib = _kib(reduced_memory[g, h])
            if scaled <= 0 and kib <= 0:
                continue
            y = model.new_bool_var(f"y{u}_{v}_{g}_{h}")
            model.add_bool_or([row_groups[g].Not(), col_groups[h].Not(), y])
            if scaled > 0:
                terms.append(scaled * y)
            if kib > 0:
                memory_terms.append(kib * y)
    return terms, memory_terms


def _groups(model: CpModel, matrix: np.ndarray, x_row: list[IntVar], name: str) -> tuple[list[IntVar], list[list[int]]]:
    """Indicators of the groups of identical rows of ``matrix`` (one per group) and the groups."""
    _, inverse = np.unique(matrix, axis=0, return_inverse=True)
    members: dict[int, list[int]] = defaultdict(list)
    for k, label in enumerate(np.asarray(inverse).reshape(-1)):
        members[int(label)].append(k)
    groups = [members[g] for g in sorted(members)]
    indicators = []
    for index, group in enumerate(groups):
        if len(group) == 1:
            indicators.append(x_row[group[0]])
            continue
        indicator = model.new_bool_var(f"{name}_{index}")
        model.add(indicator == sum(x_row[k] for k in group))
        indicators.append(indicator)
    return indicators, groups


def _memory(
    model: CpModel, graph: SolverGraph, x: list[list[IntVar]], budget: float, gathered: Sequence[LinearExpr] = ()
) -> None:
    """Σ_v Σ_k m_v[k]·x_v[k] + Σ G·y + t ≤ M with t ≥ Σ_k r_v[k]·x_v[k] for every root with transients (``t``: the
    largest transient of the chosen strategies); in KiB, to keep coefficients small; ``gathered``: the G·y terms."""
    terms = [_kib(m) * var for root, vars_ in zip(graph.roots, x) for m, var in zip(root.memory, vars_) if m > 0]
    transient_roots = [(root.transient, vars_) for root, vars_ in zip(graph.roots, x) if root.transient is not None]
    if transient_roots:
        largest = _kib(max(float(transient.max()) for transient, _ in transient_roots))
        peak = model.new_int_var(0, largest, "transient_peak")
        for transient, vars_ in transient_roots:
            model.add(peak >= sum(_kib(r) * var for r, var in zip(transient, vars_) if r > 0))
        terms.append(peak)
    model.add(sum(terms) + sum(gathered) <= int(budget // 1024))


def memory_of(graph: SolverGraph, choice: list[int]) -> float:
    """Per-device bytes of ``choice``: every root's memory, the parameters gathered for their use and the largest
    transient of the chosen strategies."""
    return (
        float(sum(root.memory[k] for root, k in zip(graph.roots, choice)))
        + gathered_memory(graph, choice)
        + transient_peak(graph, choice)
    )


def transient_peak(graph: SolverGraph, choice: list[int]) -> float:
    """The largest bytes one chosen strategy holds only while it runs (0 without transients)."""
    return max(
        (float(root.transient[k]) for root, k in zip(graph.roots, choice) if root.transient is not None), default=0.0
    )


def gathered_memory(graph: SolverGraph, choice: list[int]) -> float:
    """Bytes of the parameters ``choice`` gathers into larger layouts for their use (``G`` of the chosen pairs)."""
    return float(sum(matrix[choice[u], choice[v]] for (u, v), matrix in graph.memory_edges.items()))


def evaluate(graph: SolverGraph, choice: list[int]) -> float:
    """The objective of a given choice, in seconds (node costs plus edge resharding)."""
    total = sum(float(root.cost[k]) for root, k in zip(graph.roots, choice))
    total += sum(float(matrix[choice[u], choice[v]]) for (u, v), matrix in graph.edges.items())
    return total


def minimum_memory(graph: SolverGraph) -> float:
    """A lower bound on the per-device memory of any plan: each root at its least-memory strategy, the roots of one
    share class (which take one choice together) at the strategy whose memory summed over them is least, no
    parameter gathered for its use (``G ≥ 0``; exact when the graph has no ``memory_edges``), and the largest of the
    roots' least transients."""
    classes: dict[str, list[int]] = defaultdict(list)
    total = max((float(root.transient.min()) for root in graph.roots if root.transient is not None), default=0.0)
    for v, root in enumerate(graph.roots):
        if root.share_key is None:
            total += float(root.memory.min())
        else:
            classes[root.share_key].append(v)
    for members in classes.values():
        sizes = {len(graph.roots[v].memory) for v in members}
        if len(sizes) == 1:
            total += float(np.sum([graph.roots[v].memory for v in members], axis=0).min())
        else:  # not the same op after all: bound each member alone
            total += float(sum(graph.roots[v].memory.min() for v in members))
    return total

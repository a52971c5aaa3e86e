"""The sharding ILP folded by its share classes (torchpar/planner/sharding/share_classes.py): the same problem as the
ILP with ``x_v = x_w`` for tied roots — every tied choice costs and weighs the same folded and unfolded, the solver's
optimum is the brute-force optimum over tied choices (memory budget, transients, gathered memory and restrictions
included), and a model of repeated layers folds to about one layer's roots."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from torchpar.capture.export import capture_train_step
from torchpar.cluster import ClusterSpec
from torchpar.harness import zoo
from torchpar.planner.intra_op import StageProblem, prepare_stage
from torchpar.planner.sharding import ilp
from torchpar.planner.sharding.cost_model import LogicalMesh
from torchpar.planner.sharding.ilp import MemoryBudgetError, evaluate, forget_solutions, memory_of, solve
from torchpar.planner.sharding.share_classes import fold_share_classes
from torchpar.planner.sharding.solver_graph import Root, SolverGraph
from torchpar.planner.sharding.strategies import Strategy


def _kib(rng: np.random.Generator, low: int, high: int, shape: tuple[int, ...] = (3,)) -> np.ndarray:
    """Whole KiB (the ILP counts memory in KiB, so a budget between two choices' bytes separates them exactly)."""
    return rng.integers(low, high, shape).astype(np.float64) * 1024


def _random_graph(seed: int) -> SolverGraph:
    """Seven roots of three strategies: two share classes of two roots each (one holding an edge inside the class),
    edges between and within classes, gathered-memory edges, transients on some roots."""
    rng = np.random.default_rng(seed)
    keys = ["a", None, "a", "b", "b", None, None]
    roots = []
    for v, key in enumerate(keys):
        strategies = [Strategy(name=f"s{k}", out_spec=(None,)) for k in range(3)]
        transient = _kib(rng, 0, 5000) if v in (1, 3, 4) else None
        roots.append(Root(f"r{v}", "anchor", f"r{v}", strategies, rng.uniform(0, 10, 3), _kib(rng, 1, 10000),
                          share_key=key, transient=transient))
    pairs = [(0, 1), (1, 2), (0, 2), (2, 3), (3, 4), (0, 3), (4, 5), (1, 6), (5, 6), (2, 4)]
    edges = {pair: rng.uniform(0, 4, (3, 3)) * (rng.uniform(size=(3, 3)) < 0.7) for pair in pairs}
    memory_edges = {pair: _kib(rng, 0, 3000, (3, 3)) for pair in [(0, 1), (3, 4), (2, 6)]}
    return SolverGraph(LogicalMesh(shape=(2, 2)), roots, edges, {}, {}, memory_edges=memory_edges)


def _tied_choices(graph: SolverGraph):
    """Every choice in which the roots of one share key take one strategy."""
    classes = sorted({root.share_key or f"#{v}" for v, root in enumerate(graph.roots)})
    for picks in itertools.product(range(3), repeat=len(classes)):
        pick = dict(zip(classes, picks))
        yield [pick[root.share_key or f"#{v}"] for v, root in enumerate(graph.roots)]


@pytest.mark.parametrize("seed", range(4))
def test_every_tied_choice_costs_and_weighs_the_same_folded(seed):
    graph = _random_graph(seed)
    folded = fold_share_classes(graph)
    assert len(folded.graph.roots) == 5  # 7 roots, two classes of two
    for choice in _tied_choices(graph):
        class_choice = [0] * len(folded.graph.roots)
        for v, q in enumerate(folded.class_of):
            class_choice[q] = choice[v]
        assert folded.unfold(class_choice) == choice
        assert evaluate(folded.graph, class_choice) == pytest.approx(evaluate(graph, choice), rel=1e-12)
        assert memory_of(folded.graph, class_choice) == pytest.approx(memory_of(graph, choice), rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_the_folded_solve_finds_the_brute_force_optimum_over_tied_choices(seed):
    graph = _random_graph(seed)
    choices = list(_tied_choices(graph))
    budget = float(np.median([memory_of(graph, c) for c in choices]))
    allowed = {2: {0, 1}, 5: {1, 2}}  # a restriction on one member of class "a" holds for the whole class
    admissible = [c for c in choices if memory_of(graph, c) <= budget and c[2] in allowed[2] and c[5] in allowed[5]]
    best = min(evaluate(graph, c) for c in admissible)
    solution = solve(graph, memory_budget=budget, allowed=allowed, relative_gap=0.0)
    assert solution.status == "OPTIMAL"
    assert solution.objective_s == pytest.approx(best, rel=1e-6)  # costs are rounded to the nanosecond for CP-SAT
    assert solution.choice[0] == solution.choice[2] and solution.choice[3] == solution.choice[4]
    assert solution.memory_bytes == pytest.approx(memory_of(graph, solution.choice)) and solution.memory_bytes <= budget
    smallest = min(memory_of(graph, c) for c in choices)
    with pytest.raises(MemoryBudgetError):
        solve(graph, memory_budget=smallest * 0.999)


def test_roots_of_one_key_that_are_not_the_same_op_stay_apart():
    graph = _random_graph(0)
    graph.roots[2].strategies = [Strategy(name=f"other{k}", out_spec=(None,)) for k in range(3)]
    folded = fold_share_classes(graph)
    assert len(folded.graph.roots) == 6 and folded.class_of[0] != folded.class_of[2]


def test_a_model_of_repeated_layers_folds_to_about_one_layer():
    """GPT-2 of 6 blocks on (2, 4): the blocks' roots fold 6 → 1; the folded plan is the plan of the tied problem."""
    torch.manual_seed(0)
    model, batch = zoo.build("gpt2", {"n_layer": 6, "n_embd": 64, "n_head": 4, "vocab_size": 64}, batch_size=8,
                             seq_len=8)
    graph = capture_train_step(model, batch).graph
    problem = StageProblem(kind="shard", cluster=ClusterSpec(num_hosts=1, devices_per_host=8),
                           trainable={n for n, _ in model.named_parameters()}, optimizer_state_copies=2.0)
    solver_graph = prepare_stage(graph, problem, (2, 4)).solver_graph
    shared = [root for root in solver_graph.roots if root.share_key is not None]
    folded = fold_share_classes(solver_graph)
    assert len(shared) >= 6 * 10
    assert len(folded.graph.roots) == len(solver_graph.roots) - len(shared) + len(shared) // 6
    solution = solve(solver_graph)
    assert solution.status == "OPTIMAL"
    assert solution.objective_s == pytest.approx(evaluate(solver_graph, solution.choice))
    for key in {root.share_key for root in shared}:
        assert len({solution.choice[v] for v, root in enumerate(solver_graph.roots) if root.share_key == key}) == 1


@pytest.mark.parametrize("seed", range(2))
def test_a_hint_changes_nothing_but_where_the_search_starts(seed):
    """``solve(hint=...)``: a tied choice given as the start (folded to its classes) — the worst admissible one — ends
    at the same optimum as a solve without it."""
    graph = _random_graph(seed)
    choices = list(_tied_choices(graph))
    worst = max(choices, key=lambda c: evaluate(graph, c))
    plain = solve(graph, relative_gap=0.0, time_limit_s=10.0)
    forget_solutions()  # CP-SAT solves again, from the hint
    hinted = solve(graph, relative_gap=0.0, time_limit_s=10.0, hint=worst)
    assert hinted.status == "OPTIMAL" and hinted.objective_s == pytest.approx(plain.objective_s, rel=1e-9)
    assert fold_share_classes(graph).fold_choice(worst) == [worst[v] for v in (0, 1, 3, 5, 6)]


def _roomier_pair(seed: int) -> tuple[SolverGraph, SolverGraph]:
    """A problem and a copy of it whose every memory coefficient is as large or larger (roots, transients, gathered
    copies: as a pipeline's earlier stage of the same layers, holding more micro-batches in flight, is to a later one);
    the costs, edges and share classes are the same."""
    rng = np.random.default_rng(1000 + seed)
    roomy = _random_graph(seed)
    tight = _random_graph(seed)
    for root in tight.roots:
        root.memory = root.memory + _kib(rng, 0, 4000) * (rng.uniform(size=3) < 0.5)
        if root.transient is not None:
            root.transient = root.transient + _kib(rng, 0, 2000)
    tight.memory_edges = {pair: m + _kib(rng, 0, 1000, (3, 3)) for pair, m in tight.memory_edges.items()}
    return roomy, tight


@pytest.mark.parametrize("seed", range(12))
def test_a_tighter_problem_answered_from_a_roomier_optimum_is_its_own_optimum(seed):
    """The roomier problem solved first; the tighter one (a budget that keeps some layouts) is then answered from the
    roomier optimum when that fits it — and either way the answer is the tighter problem's brute-force optimum. The
    reverse (the roomier problem after the tighter one) always runs CP-SAT."""
    roomy, tight = _roomier_pair(seed)
    choices = list(_tied_choices(tight))
    budget = float(np.quantile([memory_of(tight, c) for c in choices], [0.3, 0.6, 0.9][seed % 3]))
    best = min(evaluate(tight, c) for c in choices if memory_of(tight, c) <= budget)
    forget_solutions()
    first = solve(roomy, memory_budget=budget, relative_gap=0.0)
    counts = dict(ilp.SOLVE_COUNTS)
    answer = solve(tight, memory_budget=budget, relative_gap=0.0)
    reused = ilp.SOLVE_COUNTS["reused_roomier"] - counts["reused_roomier"]
    assert reused == (answer.status == "OPTIMAL (reused: roomier problem)")
    # whole KiB everywhere: the ILP's rounded memory row is exact, so the roomier optimum is taken iff it fits
    assert reused == (memory_of(tight, first.choice) <= budget)
    if reused:
        assert answer.choice == first.choice
    assert answer.objective_s == pytest.approx(best, rel=1e-6)
    assert answer.memory_bytes == pytest.approx(memory_of(tight, answer.choice)) and answer.memory_bytes <= budget
    assert answer.lower_bound_s <= best + 1e-9
    counts = dict(ilp.SOLVE_COUNTS)
    solve(roomy, memory_budget=budget * 1.01, relative_gap=0.0)  # roomier than any problem solved: no answer kept
    assert ilp.SOLVE_COUNTS["solved"] == counts["solved"] + 1
    forget_solutions()  # the other way round: the tighter optimum never answers the roomier problem
    solve(tight, memory_budget=budget, relative_gap=0.0)
    counts = dict(ilp.SOLVE_COUNTS)
    roomy_answer = solve(roomy, memory_budget=budget, relative_gap=0.0)
    assert ilp.SOLVE_COUNTS["solved"] == counts["solved"] + 1
    roomy_best = min(evaluate(roomy, c) for c in _tied_choices(roomy) if memory_of(roomy, c) <= budget)
    assert roomy_answer.objective_s == pytest.approx(roomy_best, rel=1e-6)


def test_no_roomier_answer_across_costs_restrictions_or_settings():
    """Only the memory side may differ: another cost, restriction or relative gap is another problem."""
    roomy, tight = _roomier_pair(0)
    forget_solutions()
    solve(roomy, relative_gap=0.0)
    variants: list[dict] = [{"allowed": {0: {1, 2}}, "relative_gap": 0.0}, {"relative_gap": 1e-3}]
    for variant in variants:
        counts = dict(ilp.SOLVE_COUNTS)
        solve(tight, **variant)
        assert ilp.SOLVE_COUNTS["solved"] == counts["solved"] + 1
    tight.roots[1].cost = tight.roots[1].cost + 1e-3
    counts = dict(ilp.SOLVE_COUNTS)
    solve(tight, relative_gap=0.0)
    assert ilp.SOLVE_COUNTS["solved"] == counts["solved"] + 1


def test_the_kept_optima_stay_within_their_byte_cap(monkeypatch):
    """The optima kept for roomier answers are dropped oldest first once their memory rows would pass
    ``OPTIMA_BYTES``: a problem whose optimum was dropped is solved again, the newest still answers."""
    graphs = [_roomier_pair(seed)[0] for seed in range(3)]
    forget_solutions()
    solve(graphs[0], relative_gap=0.0)
    (held,) = [rows for entries in ilp._OPTIMA.values() for rows, _ in entries]
    monkeypatch.setattr(ilp, "OPTIMA_BYTES", 2 * held.nbytes)  # every graph here holds as many bytes
    for graph in graphs[1:]:
        solve(graph, relative_gap=0.0)
    kept = [rows for entries in ilp._OPTIMA.values() for rows, _ in entries]
    assert len(kept) == 2 and ilp._optima_bytes[0] == sum(rows.nbytes for rows in kept) <= ilp.OPTIMA_BYTES
    ilp._SOLVED.clear()  # only the roomier answers remain
    counts = dict(ilp.SOLVE_COUNTS)
    solve(graphs[2], memory_budget=1e12, relative_gap=0.0)
    assert ilp.SOLVE_COUNTS["reused_roomier"] == counts["reused_roomier"] + 1
    solve(graphs[0], memory_budget=1e12, relative_gap=0.0)
    assert ilp.SOLVE_COUNTS["solved"] == counts["solved"] + 1
    forget_solutions()
    assert ilp._optima_bytes[0] == 0

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
from torchpar.planner.sharding.cost_model import LogicalMesh
from torchpar.planner.sharding.ilp import MemoryBudgetError, evaluate, memory_of, solve
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
    hinted = solve(graph, relative_gap=0.0, time_limit_s=11.0, hint=worst)  # another limit: not the cached answer
    assert hinted.status == "OPTIMAL" and hinted.objective_s == pytest.approx(plain.objective_s, rel=1e-9)
    assert fold_share_classes(graph).fold_choice(worst) == [worst[v] for v in (0, 1, 3, 5, 6)]

"""The sharding ILP on small graphs: the plans it must find, and its objective in closed form."""

from __future__ import annotations

import pytest
import torch

import torchpar
from torchpar.capture.export import capture_train_step
from torchpar.cluster import ClusterSpec
from torchpar.harness import zoo
from torchpar.planner.intra_op import StageProblem, plan_stage
from torchpar.planner.sharding.cost_model import LogicalMesh
from torchpar.planner.sharding.ilp import MemoryBudgetError, evaluate, solve
from torchpar.planner.sharding.solver_graph import build_solver_graph

CLUSTER = ClusterSpec(num_hosts=1, devices_per_host=8)
ADAM_STATE = 2.0


def _mlp_graph(width: int, batch: int, depth: int = 6):
    torch.manual_seed(0)
    model = zoo.MLP(width=width, depth=depth)
    batch_tensors = (torch.randn(batch, width), torch.randn(batch, width))
    graph = capture_train_step(model, batch_tensors).graph
    return graph, {n for n, _ in model.named_parameters()}


def _plan(graph, trainable, kind="shard", mesh=(1, 4), memory_budget=None):
    problem = StageProblem(kind=kind, cluster=CLUSTER, trainable=trainable, optimizer_state_copies=ADAM_STATE)
    return plan_stage(graph, problem, mesh, memory_budget)


def test_wide_mlp_gets_megatron_and_objective_is_closed_form():
    width, batch = 256, 32
    graph, trainable = _mlp_graph(width, batch)
    result = _plan(graph, trainable)
    params = result.stage.params
    for i in range(6):  # torch Linear weight [out, in]: column split = [[1], None], row split = [None, [1]]
        assert params[f"layers.{i}.weight"] == ([[1], None] if i % 2 == 0 else [None, [1]]), params
    mesh = LogicalMesh(shape=(1, 4), alpha=CLUSTER.alpha, beta=CLUSTER.beta, device_flops=CLUSTER.device_flops)
    compute = 6 * mesh.compute(3 * 2 * batch * width * width, 4)
    communication = 5 * mesh.all_reduce(batch * width * 4, [1])  # 3 forward + 2 backward
    assert result.solution.objective_s == pytest.approx(compute + communication, rel=1e-9)
    assert result.communication_s == pytest.approx(communication, rel=1e-9)
    assert result.solution.status == "OPTIMAL"


def test_narrow_mlp_with_big_batch_is_data_parallel():
    width, batch = 32, 256
    graph, trainable = _mlp_graph(width, batch)
    result = _plan(graph, trainable)
    assert all(spec == [None, None] for spec in result.stage.params.values())
    mesh = LogicalMesh(shape=(1, 4), alpha=CLUSTER.alpha, beta=CLUSTER.beta, device_flops=CLUSTER.device_flops)
    compute = 6 * mesh.compute(3 * 2 * batch * width * width, 4)
    gradient_sync = 6 * mesh.all_reduce(width * width * 4, [1])
    loss_mean = mesh.all_reduce(4, [1])  # the scalar loss summed over batch shards
    assert result.solution.objective_s == pytest.approx(compute + gradient_sync + loss_mean, rel=1e-9)


def test_hand_plans_are_never_cheaper_than_auto():
    graph, trainable = _mlp_graph(128, 64)
    for mesh in [(1, 4), (2, 2), (2, 4)]:
        auto = _plan(graph, trainable, mesh=mesh).stage.estimated_cost_s
        for kind in ["data_parallel", "zero2", "zero3", "megatron"]:
            hand = _plan(graph, trainable, kind=kind, mesh=mesh).stage.estimated_cost_s
            assert auto <= hand * (1 + 1e-6), (mesh, kind, auto, hand)


def test_gpt2_block_gets_megatron_attention_and_mlp():
    torch.manual_seed(0)
    model, batch = zoo.build("gpt2", {"n_layer": 1, "n_embd": 256, "n_head": 4, "vocab_size": 64}, batch_size=1,
                             seq_len=8)
    graph = capture_train_step(model, batch).graph
    result = _plan(graph, {n for n, _ in model.named_parameters()})
    params = result.stage.params
    # GPT-2's Conv1D stores weights as [in, out]: a column split is [None, [1]], a row split [[1], None]
    assert params["transformer.h.0.attn.c_attn.weight"] == [None, [1]]
    assert params["transformer.h.0.mlp.c_fc.weight"] == [None, [1]]
    assert params["transformer.h.0.attn.c_proj.weight"] == [[1], None]
    assert params["transformer.h.0.mlp.c_proj.weight"] == [[1], None]


def test_memory_budget_too_small_states_the_smallest_feasible_budget():
    graph, trainable = _mlp_graph(256, 32)
    with pytest.raises(MemoryBudgetError, match=r"smallest feasible budget is (at least )?\d+\.\d MiB"):
        _plan(graph, trainable, memory_budget=64 * 1024)


def test_repeated_blocks_share_one_choice():
    torch.manual_seed(0)
    model, batch = zoo.build("gpt2", {"n_layer": 3}, batch_size=4, seq_len=16)
    graph = capture_train_step(model, batch).graph
    mesh = LogicalMesh(shape=(2, 2))
    solver_graph = build_solver_graph(graph, mesh, trainable={n for n, _ in model.named_parameters()},
                                      optimizer_state_copies=ADAM_STATE)
    shared = [r for r in solver_graph.roots if r.share_key]
    assert shared, "transformer blocks h.0..h.2 must form share classes"
    solution = solve(solver_graph)
    by_key: dict[str, set[str]] = {}
    for root, k in zip(solver_graph.roots, solution.choice):
        if root.share_key:
            by_key.setdefault(root.share_key, set()).add(root.strategies[k].name)
    assert all(len(names) == 1 for names in by_key.values())
    assert evaluate(solver_graph, solution.choice) == pytest.approx(solution.objective_s)


def test_a_one_device_mesh_is_planned_without_the_solver(monkeypatch):
    """On a 1×1 mesh every root has one strategy: the plan is evaluated directly, OR-Tools is never imported."""
    import sys

    graph, trainable = _mlp_graph(64, 8, depth=3)
    monkeypatch.setitem(sys.modules, "ortools", None)  # any `import ortools...` now fails
    monkeypatch.setitem(sys.modules, "ortools.sat.python", None)
    result = _plan(graph, trainable, mesh=(1, 1))
    assert result.solution.status == "FORCED" and result.solution.num_variables == 0
    assert result.solution.objective_s == pytest.approx(evaluate(result.solver_graph, result.solution.choice))
    assert all(all(entry is None for entry in spec) for spec in result.stage.params.values())
    with pytest.raises(MemoryBudgetError, match="only plan on this mesh needs"):
        _plan(graph, trainable, mesh=(1, 1), memory_budget=1024)


def test_an_identical_problem_is_answered_from_the_first_solve():
    """Two solver graphs that differ only in names (the same model captured twice: identical stages of a pipeline
    look so) have one problem key, and the second solve reuses the first's choice; another budget is another
    problem of the same shape."""
    from torchpar.planner.sharding import ilp

    first_graph, trainable = _mlp_graph(256, 32)
    second_graph, _ = _mlp_graph(256, 32)
    mesh = LogicalMesh(shape=(1, 4))
    build = lambda g: build_solver_graph(g, mesh, trainable=trainable, optimizer_state_copies=ADAM_STATE)  # noqa: E731
    first, second = build(first_graph), build(second_graph)
    keys = lambda g, budget: ilp.problem_keys(g, budget, None, 10.0, ())  # noqa: E731
    assert keys(first, 1e9) == keys(second, 1e9)
    assert keys(first, 1e9)[0] != keys(first, 2e9)[0]
    assert keys(first, 1e9)[1] == keys(first, 2e9)[1], "the shape key leaves the memory side out"
    ilp.forget_solutions()
    counts = dict(ilp.SOLVE_COUNTS)
    solved = solve(first, memory_budget=1e9)
    reused = solve(second, memory_budget=1e9)
    assert ilp.SOLVE_COUNTS["solved"] == counts["solved"] + 1 and ilp.SOLVE_COUNTS["reused"] == counts["reused"] + 1
    assert reused.choice == solved.choice and reused.objective_s == solved.objective_s
    assert reused.status.endswith("(reused)")


def test_a_solve_given_up_above_a_cutoff_proves_its_bound():
    """``give_up`` sees the bounds CP-SAT proves: one it never accepts leaves the solve as it was; one that accepts any
    bound either stops the search (:class:`AboveCutoff` with a bound no layout beats) or sees the solve end first."""
    from torchpar.planner.sharding import ilp

    graph, trainable = _mlp_graph(256, 32)
    solver_graph = build_solver_graph(graph, LogicalMesh(shape=(2, 4)), trainable=trainable,
                                      optimizer_state_copies=ADAM_STATE)
    ilp.forget_solutions()
    plain = solve(solver_graph, memory_budget=1e9)
    ilp.forget_solutions()
    seen: list[float] = []
    never = solve(solver_graph, memory_budget=1e9, give_up=lambda bound: seen.append(bound) or False)
    assert never.objective_s == pytest.approx(plain.objective_s) and never.status == plain.status == "OPTIMAL"
    assert seen and max(seen) <= plain.objective_s + 1e-12
    ilp.forget_solutions()
    try:
        early = solve(solver_graph, memory_budget=1e9, give_up=lambda bound: True)
    except ilp.AboveCutoff as stopped:
        assert stopped.bound_s <= plain.objective_s + 1e-12
    else:
        assert early.objective_s == pytest.approx(plain.objective_s) and early.status == "OPTIMAL"


def test_a_planner_defect_names_the_op_its_shapes_and_the_line(monkeypatch):
    """A planner helper broken on purpose for one op (as ``linalg_vector_norm``'s ``ord`` once was read as its dims):
    the error names the op, its shapes and the model's line, not a bare ``TypeError``."""
    from torchpar.planner.sharding import solver_graph

    add_node = solver_graph._Builder._add_node

    def broken(self, node):
        if node.target == "aten.tanh.default":
            raise TypeError("'float' object is not iterable")
        return add_node(self, node)

    monkeypatch.setattr(solver_graph._Builder, "_add_node", broken)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.tanh(self.fc(x)).mean()

    model = Net()
    with pytest.raises(solver_graph.PlannerOpError, match=r"failed on aten.tanh.default \(float32\[8, 8\] → "
                                                          r"float32\[8, 8\]\) at .*test_ilp.py:\d+.*TypeError"):
        torchpar.plan(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(8, 8),
                      method=torchpar.ShardParallel(mesh_shape=(1, 2)))

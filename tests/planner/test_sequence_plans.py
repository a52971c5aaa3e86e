"""The planner trades memory for communication with the sequence splits by itself (no option asked for them): a
GPT (2 layers, width 4,096, 32 heads, batch 2 × 2,048) on one host of 8 A100s, planned from the meta device.
With memory to spare the ILP picks Megatron's tensor parallelism; under 93 % of that plan's memory some row-split
layers reduce-scatter their tokens instead of all-reducing (Megatron's sequence parallelism: less memory, more
communication); under 82 % the attentions split their sequence (context parallelism). Every plan fits its budget."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import transformers

import torchpar


@pytest.fixture(scope="module")
def plan_under():
    torchpar.init(cluster="local", num_devices=8, preset="a100-80g")
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=50304, n_positions=2048, n_embd=4096, n_layer=2, n_head=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0))
        ids = torch.randint(0, 50304, (2, 2048))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def plan(budget: float | None):
        method = torchpar.ShardParallel(mesh_shape=(1, 8), memory_budget=None if budget is None else int(budget))
        stage = torchpar.plan(model, optimizer, example_batch={"input_ids": ids, "labels": ids}, method=method,
                              explain=False).stages[0]
        return stage, Counter(label.rpartition(": ")[2] for label in stage.strategies.values())

    yield plan
    torchpar.init(cluster="local", num_devices=8)


def test_tighter_budgets_bring_sequence_then_context_parallelism(plan_under):
    free, free_strategies = plan_under(None)
    assert free_strategies["k@1"] == 4 and not [s for s in free_strategies if ">m@" in s or s.startswith("seq@")]
    for share, wanted in ((0.93, ">m@1"), (0.82, "seq@1")):
        stage, strategies = plan_under(share * free.estimated_memory_bytes)
        assert stage.estimated_memory_bytes <= share * free.estimated_memory_bytes
        assert [s for s in strategies if wanted in s], (share, strategies)


def test_data_parallel_and_zero_never_take_a_rows_scattered_matmul():
    """A ``…>m@A`` matmul splits its contracted dim (then scatters the rows): not a data-parallel layout, though every
    axis it uses splits its output. (A profiled DataParallel plan once chose it: other arithmetic, other losses.)"""
    from torchpar.capture.export import capture_train_step
    from torchpar.cluster import ClusterSpec
    from torchpar.planner.intra_op import StageProblem, _restrictions, prepare_stage

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    graph = capture_train_step(model, torch.randn(16, 32), lambda out, _: out.square().mean()).graph
    for kind in ("data_parallel", "zero2", "zero3"):
        problem = StageProblem(kind=kind, cluster=ClusterSpec(devices_per_host=4), optimizer_state_copies=1.0,
                               trainable={i.target for i in graph.inputs if i.kind == "param"})
        stage = prepare_stage(graph, problem, (1, 4))
        roots = stage.solver_graph.roots
        assert any(">m@" in s.name for root in roots for s in root.strategies)  # offered to the ILP at large
        allowed = _restrictions(kind, stage.solver_graph, stage.batch_axes)
        assert not [roots[v].strategies[k].name for v, ks in allowed.items() for k in ks
                    if ">m@" in roots[v].strategies[k].name]

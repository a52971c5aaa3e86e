"""Plans for mixture-of-experts models: the grouped matmul is an anchor of the sharding ILP with expert-parallel
strategies beside replicated / row / hidden-dim splits, priced by the all-to-all cost model; the cost model (not a
rule) decides where the experts go; a dense-dispatch (einsum) MoE layer keeps its expert split."""

from __future__ import annotations

import pytest
import torch
import transformers

import torchpar
from tests.models.routed_experts import RoutedExperts
from torchpar.harness import zoo
from torchpar.planner.sharding.cost_model import LogicalMesh
from torchpar.planner.sharding.strategies import anchor_einsum, einsum_strategies, expert_strategies
from torchpar.report.html import render_html


@pytest.fixture(autouse=True)
def session_cluster():
    """Each test sets its cluster; the session's local cluster of 8 devices is restored after."""
    yield
    torchpar.init(cluster="local", num_devices=8)


def _mixtral(experts: int, hidden: int, tokens: tuple[int, int], device: str = "meta"):
    with torch.device(device):
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=1024, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=2,
            num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=tokens[1],
            num_local_experts=experts, num_experts_per_tok=2, output_router_logits=True))
        ids = torch.randint(0, 1024, tokens)
    return model, {"input_ids": ids, "labels": ids}


def _grouped(plan) -> dict[str, str]:
    return {node: label.rpartition(": ")[2] for stage in plan.stages for node, label in stage.strategies.items()
            if "grouped_mm" in label}


def test_strategies_of_a_grouped_matmul():
    """Shapes of the tiny Mixtral's gate/up projection: 512 rows × 64 → 256 over 8 experts, on a 2×2 mesh."""
    mesh = LogicalMesh(shape=(2, 2))
    shapes = [(512, 64), (8, 64, 256), (8,)]
    einsum = anchor_einsum("transformers.grouped_mm_fallback.default", (), [2, 3, 1], 2)
    flops = 2.0 * 512 * 64 * 256
    plain = einsum_strategies(einsum, shapes, (512, 256), flops, 512 * 256 * 4, [512 * 64 * 4, 8 * 64 * 256 * 4, 32],
                              [True, True, False], mesh, weight_operands=[False, True, False])
    split = expert_strategies(shapes, flops, 4, [True, True, False], mesh, weight_operands=[False, True, False])
    names = {s.name for s in split}
    assert names == {"experts@0,s@0", "experts@0,s@01", "experts@0,s@0,n@1", "experts@1,s@1", "experts@1,s@10",
                     "experts@1,s@1,n@0", "experts@01,s@01"}
    by_name = {s.name: s for s in split}
    rows = next(s for s in plain if s.name == "s@01")
    # an expert split computes a balanced router's share of the rows, like the row split ...
    assert by_name["experts@01,s@01"].compute_s == pytest.approx(rows.compute_s)
    # ... and needs no weight-gradient all-reduce, which the row split (every expert on every device) does
    assert not any("all-reduce" in c for c in by_name["experts@01,s@01"].collectives)
    assert any("all-reduce" in c for c in rows.collectives)
    # data parallelism beside the experts reduces their gradients over the other axis
    assert any("bwd all-reduce" in c and "(1,)" in c for c in by_name["experts@0,s@01"].collectives)
    # every expert layout splits the expert dim of the weight and the rows of the input
    for strategy in split:
        x_spec, w_spec, offs_spec = strategy.in_specs
        assert w_spec[0] and x_spec[0] and set(w_spec[0]) <= set(x_spec[0]) and offs_spec == (None,)


def test_the_cost_model_splits_64_experts_over_4_devices():
    """64 experts of 1024 → 1024 and 8,192 tokens (top-2) on one host of 4 A100s: gathering the experts' weights
    or replicating them costs more than exchanging tokens; every grouped matmul splits its experts."""
    torchpar.init(cluster="local", num_hosts=1, devices_per_host=4, preset="a100-80g")
    model, batch = _mixtral(64, 1024, (8, 1024))
    plan = torchpar.plan(model, torch.optim.AdamW(model.parameters()), example_batch=batch,
                         method=torchpar.ShardParallel(mesh_shape=(1, 4)), explain=False, mixed_precision="bf16")
    strategies = _grouped(plan)
    assert len(strategies) == 4 and all(s.startswith("experts@1") for s in strategies.values()), strategies
    experts = {n: s for n, s in plan.stages[0].params.items() if ".experts." in n}
    assert len(experts) == 4 and all(spec[0] == [1] for spec in experts.values()), experts
    assert "experts: 4 grouped matmul(s), experts split over mesh axis 1" in plan.summary()
    # the token rows travel to and from their experts' devices by all-to-all, not gathered whole: in each layer
    # hidden[perm // 2] (sorting the rows by expert) and out[inv_perm] (putting them back); the routing weights
    # ([16384] floats) and the inverse permutation (ints) may run whole
    gathers = {n: s.rpartition(": ")[2] for n, s in plan.stages[0].strategies.items() if "aten.index.Tensor" in s}
    assert sum(s == "rows@1,exchange" for s in gathers.values()) == 4, gathers
    assert "routing: 4 gather(s)/put(s) by a whole index keep their rows split" in plan.summary()


def test_a_put_by_a_whole_index_keeps_its_rows_split():
    """A routed-experts model that is not HF (``tests/models/routed_experts.py``: rows sorted by ``argsort``, put back
    by ``index_put``) at 4,096 rows of 64 on 4 devices: its gather and its put move rows by all-to-all instead of
    running on whole arrays (at the runtime test's 64 rows of 8 a collective's latency decides, and the put may
    run whole)."""
    torchpar.init(cluster="local", num_devices=4)
    torch.manual_seed(0)
    model = RoutedExperts(experts=8, width=64, hidden=128)
    batch = (torch.randn(4096, 64), torch.randn(4096, 64))
    plan = torchpar.plan(model, torch.optim.AdamW(model.parameters()), example_batch=batch, explain=False,
                         method=torchpar.ShardParallel(mesh_shape=(1, 4), experts="split"))
    moves = {s.partition(": ")[0]: s.rpartition(": ")[2] for s in plan.stages[0].strategies.values()
             if "aten.index" in s}
    assert moves == {"aten.index.Tensor": "rows@1,exchange", "aten.index_put.default": "rows@1,exchange"}, moves


def test_the_exchange_buffers_are_a_transient_the_peak_adds_once():
    """An expert split's exchange buffers, ``(L + P·T + L + P·L)·(K + N)`` bytes, are held only while its op runs:
    the plan's memory adds the largest chosen op's once (``transients``), not every layer's, and a budget holds
    it: under one that the first plan exceeds only by half its transient, the ILP finds another that fits whole."""
    mesh = LogicalMesh(shape=(1, 4))
    split = {s.name: s for s in expert_strategies([(512, 64), (8, 64, 256), (8,)], 1.0, 4, [True, True, False],
                                                  mesh)}["experts@1,s@1"]
    rows = 128 + 4 * 64 + 128 + 4 * 128  # L = 128, P = 4, T = 2·L/P = 64: both exchange paths' rows
    assert split.transient_bytes == rows * (64 + 256) * 4
    torchpar.init(cluster="local", num_devices=4)
    model, batch = _mixtral(8, 64, (8, 32), device="cpu")
    method = torchpar.ShardParallel(mesh_shape=(1, 4), experts="split")
    stage = torchpar.plan(model, torch.optim.AdamW(model.parameters()), example_batch=batch, explain=False,
                          method=method).stages[0]
    transients = stage.memory_breakdown["transients"]
    assert transients > 0 and stage.estimated_memory_bytes == pytest.approx(sum(stage.memory_breakdown.values()), 1)
    budget = int(stage.estimated_memory_bytes - transients / 2)
    tight = torchpar.ShardParallel(mesh_shape=(1, 4), experts="split", memory_budget=budget)
    refit = torchpar.plan(model, torch.optim.AdamW(model.parameters()), example_batch=batch, explain=False,
                          method=tight).stages[0]
    assert refit.memory_breakdown["transients"] > 0 and refit.estimated_memory_bytes <= budget


def test_asking_for_split_experts_is_a_restriction_of_the_same_search():
    """A tiny model on fake CPU devices: the automatic plan never costs more than the one that must split the
    experts (it searched those layouts too), and here it is cheaper (a collective's latency outweighs the bytes)."""
    torchpar.init(cluster="local", num_devices=4)
    model, batch = _mixtral(8, 64, (8, 32), device="cpu")
    auto, split = (torchpar.plan(model, torch.optim.AdamW(model.parameters()), example_batch=batch, explain=False,
                                 method=torchpar.ShardParallel(mesh_shape=(1, 4), experts=experts))
                   for experts in ("auto", "split"))
    assert all(s.startswith("experts@") for s in _grouped(split).values())
    assert auto.estimated_step_s <= split.estimated_step_s
    with pytest.raises(ValueError, match="experts must be one of"):
        torchpar.ShardParallel(experts="everywhere")


def test_a_dense_einsum_moe_layer_splits_its_experts():
    """The zoo's dense-dispatch MoE layer (every expert on every token, expert-stacked weights, einsum combine):
    its batched matmuls split the expert dim, so each device holds and computes 2 of the 8 experts and the expert
    weights and their gradients never move (no collective carries an expert-weight shape, whole or split); the
    combine over experts is an all-reduce of the output, and nothing is exchanged all-to-all."""
    from torchpar.report.hlo import collectives

    torchpar.init(cluster="local", num_devices=8)
    torch.manual_seed(0)
    model, batch = zoo.build("moe", {"experts": 8, "width": 64, "hidden": 256}, batch_size=8, seq_len=32)
    engine = torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), example_batch=batch,
                              method=torchpar.ShardParallel(mesh_shape=(1, 4)))
    engine.step(batch)
    params = engine.plan.stages[0].params
    assert params["w_in_EDF"][0] == [1] and params["w_out_EFD"][0] == [1], params
    found = collectives(engine.hlo_text()[0])
    expert_shapes = {(8, 64, 256), (8, 256, 64), (2, 64, 256), (2, 256, 64)}
    assert not [c.line for c in found if any(shape in expert_shapes for _, shape in c.shapes)]
    assert [c.kind for c in found].count("all-to-all") == 0
    assert any(c.kind == "all-reduce" and any(shape == (256, 64, 1) for _, shape in c.shapes) for c in found)


def test_the_summary_says_which_expert_layouts_lost_and_by_how_much():
    """``torchpar.plan`` (explain) prices the stage with its grouped matmuls forced to each other layout family on
    the chosen logical mesh; the summary names them with their estimates, each no faster than the chosen one and
    equal to the plan that forces that family (``ShardParallel(experts=...)``)."""
    torchpar.init(cluster="local", num_devices=4)
    model, batch = _mixtral(8, 64, (8, 32), device="cpu")
    plan = torchpar.plan(model, torch.optim.AdamW(model.parameters()), example_batch=batch,
                         method=torchpar.ShardParallel())
    rows = plan.solver["expert_layouts"]
    chosen = [row for row in rows if row.get("chosen")]
    others = {row["experts"]: row for row in rows if not row.get("chosen")}
    assert chosen and all(row["estimated_step_s"] == plan.estimated_step_s for row in chosen)
    assert {row["experts"] for row in rows} >= {"split", "tensor", "replicated"}
    mesh = tuple(plan.stages[0].logical_mesh_shape)
    for family, row in others.items():
        assert row["estimated_step_s"] >= plan.estimated_step_s
        assert f"expert layout {family} (" in plan.summary()
    runner_up = min(others, key=lambda family: others[family]["estimated_step_s"])
    # the tuning guide's words: a near tie between splitting the experts and splitting their hidden dims here
    assert {runner_up, *(row["experts"] for row in chosen)} == {"split", "tensor"}
    assert others[runner_up]["estimated_step_s"] < 1.05 * plan.estimated_step_s
    forced = torchpar.plan(model, torch.optim.AdamW(model.parameters()), example_batch=batch, explain=False,
                           method=torchpar.ShardParallel(mesh_shape=mesh, experts=runner_up))
    assert others[runner_up]["estimated_step_s"] == pytest.approx(forced.estimated_step_s, rel=1e-6)
    summary = plan.summary()
    assert "(chosen)" in next(line for line in summary.splitlines() if line.startswith("  expert layout "))
    html = render_html(plan)
    assert "Expert layouts priced" in html and html.count("data-experts=") == len(rows)

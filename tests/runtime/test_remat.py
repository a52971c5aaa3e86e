"""Activation checkpointing per layer (``compile(..., remat=...)``; ``jaxbackend/remat.py``,
``torchpar/planner/remat.py``).

Claims: the losses are those without remat (the same executable arithmetic, recomputed: equal to 1e-6
relative, in practice bit-equal), dropout included (a recomputed dropout draws the same mask); XLA's temporary
memory of the compiled step (``engine.memory_stats()``, XLA's own memory analysis) drops by ≥ 40% with
``"layers"`` and less with ``"selective"`` on a GPT-2 whose activations dominate its temporaries; the option
reaches sharded one-stage steps and pipeline stages; the plan records it, prices it (activation memory down,
compute up) and, with ``remat="auto"``, picks it only when the memory budget needs it."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import transformers

import torchpar
from torchpar.planner.remat import layer_groups, layer_of

LOSS_RTOL = 1e-6
STEPS = 3


def _gpt2(dropout: float = 0.0, layers: int = 4, batch: int = 4, seq: int = 128) -> tuple[torch.nn.Module, dict]:
    """A GPT-2 whose activations (batch × seq tokens through ``layers`` layers) outweigh its parameters and their
    optimizer temporaries, so that what remat saves is visible in the step's temporary memory."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=128, n_head=4, vocab_size=256, n_positions=seq,
                                     resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    ids = torch.randint(0, 256, (batch, seq))
    return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


class Stack(torch.nn.Module):
    """Four residual MLP blocks (layers ``blocks.0`` … ``blocks.3``), dropout in each, and an MSE loss: a small
    graph that plans and compiles quickly under every method."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(*[Block(32) for _ in range(4)])

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.blocks(x), y)


def _stack() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    return Stack(), (torch.randn(16, 32), torch.randn(16, 32))


def _train(model: torch.nn.Module, batch, remat: str, method=None, steps: int = STEPS) -> tuple[list, dict]:
    """Per-step losses and XLA's memory analysis of the step, for a fresh copy of ``model``."""
    fresh = copy.deepcopy(model)
    with torchpar.compile(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3), example_batch=batch, method=method,
                          remat=remat) as engine:
        assert engine.plan.remat == remat
        losses = [engine.step(batch).item() for _ in range(steps)]
        return losses, engine.memory_stats()


@pytest.fixture(scope="module")
def one_device_runs():
    model, batch = _gpt2()
    return {remat: _train(model, batch, remat) for remat in ("none", "layers", "selective")}


def test_losses_are_those_without_remat(one_device_runs):
    reference = one_device_runs["none"][0]
    for remat in ("layers", "selective"):
        assert one_device_runs[remat][0] == pytest.approx(reference, rel=LOSS_RTOL), remat


def test_layers_cut_the_steps_temporary_memory(one_device_runs):
    """Measured: 4 layers, 4 × 128 tokens: 'layers' keeps ~45% of the temporaries, 'selective' ~55%."""
    temp = {remat: stats[0]["temp_bytes"] for remat, (_, stats) in one_device_runs.items()}
    assert temp["layers"] <= 0.6 * temp["none"], temp
    assert temp["layers"] < temp["selective"] < temp["none"], temp


def test_dropout_recomputes_the_same_masks():
    model, batch = _gpt2(dropout=0.1, layers=2, batch=2, seq=32)
    without, _ = _train(model, batch, "none")
    with_remat, _ = _train(model, batch, "layers")
    assert with_remat == pytest.approx(without, rel=LOSS_RTOL)


def test_recomputed_dropout_draws_its_masks_in_the_backward():
    """A recomputed dropout's random bits depend on the step's key only, so XLA would draw every layer's mask
    during the forward and keep them all (measured: 4 layers, 4 × 128 tokens, 'layers' kept 58% of the
    temporaries with dropout against 32% without the key tied to the cotangent); the key is tied like the float
    residuals (``jaxbackend.remat._depend``)."""
    model, batch = _gpt2(dropout=0.1)
    temp = {remat: _train(model, batch, remat, steps=1)[1][0]["temp_bytes"] for remat in ("none", "layers")}
    assert temp["layers"] <= 0.45 * temp["none"], temp


@pytest.mark.parametrize("method", [
    pytest.param(torchpar.DataParallel(mesh_shape=(1, 2)), id="dp-shard_map"),
    pytest.param(torchpar.MegatronParallel(mesh_shape=(1, 2)), id="megatron-gspmd"),
    pytest.param(torchpar.PipeshardParallel(
        num_micro_batches=2, layer_option=torchpar.AutoLayerOption(layer_num=4),
        stage_option=torchpar.ManualStageOption(forward_stage_layer_ids=((0, 1), (2, 3)),
                                                submesh_physical_shapes=((1, 4), (1, 4)),
                                                submesh_logical_shapes=((1, 4), (1, 4)))), id="pipeline-2stages"),
])
def test_sharded_and_pipelined_steps_take_remat(method):
    model, batch = _stack()
    without, _ = _train(model, batch, "none", method=method, steps=2)
    with_remat, _ = _train(model, batch, "layers", method=method, steps=2)
    assert with_remat == pytest.approx(without, rel=LOSS_RTOL)


def test_the_plan_records_remat():
    model, batch = _gpt2(layers=2, batch=2, seq=16)
    plan = torchpar.plan(model, torch.optim.AdamW(model.parameters()), example_batch=batch, remat="selective",
                         explain=False)
    assert plan.remat == "selective"
    assert "remat: selective" in plan.summary()
    assert torchpar.Plan.from_json(plan.to_json()).remat == "selective"
    bad = plan.to_dict() | {"remat": "everything"}
    with pytest.raises(ValueError, match="remat"):
        torchpar.Plan.from_dict(bad)
    with pytest.raises(ValueError, match="remat must be one of"):
        torchpar.compile(model, torch.optim.AdamW(model.parameters()), example_batch=batch, remat="everything")


def test_layers_are_the_numbered_children():
    assert layer_of("transformer.h.0.attn.c_proj") == "transformer.h.0"
    assert layer_of(".layers.11.mlp") == "layers.11"
    assert layer_of("3") == "3"
    assert layer_of("encoder.layer.2") == "encoder.layer.2"
    assert layer_of("transformer.ln_f") is None
    assert layer_of("block10x.fc") is None
    assert layer_of("") is None
    from torchpar.capture.export import capture_train_step

    model, batch = _gpt2(layers=2, batch=1, seq=8)
    groups = layer_groups(capture_train_step(model, batch).graph)
    assert len(groups) == 2 and all(len(group) > 10 for group in groups)


def test_a_model_without_layers_says_nothing_is_recomputed(caplog):
    model = torch.nn.Linear(4, 4)
    batch = torch.randn(2, 4)
    with caplog.at_level(logging.WARNING, logger="torchpar"):
        with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                              loss_fn=lambda out, _: out.square().mean(), remat="layers") as engine:
            engine.step(batch)
    assert "found no layers" in caplog.text


def _plans_by_remat(model, batch, method, **options) -> dict[str, torchpar.Plan]:
    optimizer = torch.optim.AdamW(model.parameters())
    return {remat: torchpar.plan(model, optimizer, example_batch=batch, method=method, explain=False, remat=remat,
                                 **options) for remat in ("none", "selective", "layers")}


@pytest.fixture(scope="module")
def one_device_shard_plans() -> dict[str, torchpar.Plan]:
    """The plans of :func:`_gpt2` under ShardParallel on one device for each remat option (read, never changed)."""
    return _plans_by_remat(*_gpt2(), torchpar.ShardParallel(mesh_shape=(1, 1)))


def test_the_plan_prices_what_remat_keeps_and_recomputes(one_device_shard_plans):
    model, batch = _gpt2()
    plans = one_device_shard_plans
    activations = {r: p.stages[0].memory_breakdown["activations"] for r, p in plans.items()}
    steps = {r: p.estimated_step_s for r, p in plans.items()}
    # measured: selective ×0.66, layers ×0.35 of none (XLA's temporaries of the same steps: ×0.52 and ×0.45)
    assert activations["layers"] < 0.6 * activations["none"] and activations["layers"] < activations["selective"]
    assert activations["selective"] < activations["none"], activations
    assert steps["none"] < steps["selective"] < steps["layers"] <= 1.34 * steps["none"], steps  # ≤ one more forward
    single = _plans_by_remat(model, batch, None)  # the single-device plan reads the same model
    assert single["layers"].stages[0].estimated_memory_bytes < single["none"].stages[0].estimated_memory_bytes


def test_auto_recomputes_only_when_the_memory_budget_needs_it(one_device_runs, one_device_shard_plans):
    """Budgets between the plans' estimates: generous → no remat; only 'selective' and 'layers' fit → the faster,
    'selective'; only 'layers' fits → 'layers', and it trains with the losses of no remat."""
    model, batch = _gpt2()
    need = {r: p.stages[0].estimated_memory_bytes for r, p in one_device_shard_plans.items()}
    optimizer = torch.optim.AdamW(model.parameters())

    def auto(budget):
        method = torchpar.ShardParallel(mesh_shape=(1, 1), memory_budget=budget)
        return torchpar.plan(model, optimizer, example_batch=batch, method=method, explain=False, remat="auto")

    generous = auto(None)
    assert generous.remat == "none" and generous.solver["remat"]["chosen"] == "none"
    assert "recomputing would only add compute" in generous.summary()
    assert auto(int((need["selective"] + need["none"]) / 2)).remat == "selective"
    tight = int((need["layers"] + need["selective"]) / 2)
    plan = auto(tight)
    assert plan.remat == "layers"
    rows = {row["remat"]: row for row in plan.solver["remat"]["candidates"]}
    assert not rows["none"]["fits"] and not rows["selective"]["fits"] and rows["layers"]["fits"]
    assert "remat: auto → layers: without remat nothing fits" in plan.summary()
    with pytest.raises(ValueError, match=r"no plan fits .* with any activation checkpointing(?s:.*)remat='layers'"):
        auto(int(need["layers"] / 2))
    fresh = copy.deepcopy(model)
    with torchpar.compile(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-3), example_batch=batch, remat="auto",
                          method=torchpar.ShardParallel(mesh_shape=(1, 1), memory_budget=tight)) as engine:
        assert engine.plan.remat == "layers"
        losses = [engine.step(batch).item() for _ in range(STEPS)]
    assert losses == pytest.approx(one_device_runs["none"][0], rel=LOSS_RTOL)


def candidates_of(plan) -> list[str]:
    return [row["remat"] for row in plan.solver["remat"]["candidates"]]


def test_auto_in_a_pipeline_plans_each_option_and_keeps_the_fastest_that_fits(monkeypatch):
    """Each option is planned, or bounded: an option whose candidates' proven lower bounds cannot beat the best plan
    so far is not solved to the end, and the choice is the one planning every option to the end makes."""
    from torchpar.planner.pipeline import pipeline_plan

    model, batch = _stack()
    method = torchpar.PipeshardParallel(num_micro_batches=2, layer_option=torchpar.AutoLayerOption(layer_num=4))

    def auto():
        return torchpar.plan(model, torch.optim.AdamW(model.parameters()), example_batch=batch, method=method,
                             explain=False, remat="auto")

    plan = auto()
    candidates = plan.solver["remat"]["candidates"]
    assert [row["remat"] for row in candidates] == ["none", "selective", "layers"]
    assert plan.remat == "none"  # everything fits: recomputing only adds compute
    # planned least screened step first: with everything fitting, "none" (no recomputed FLOPs) screens fastest and
    # bounds the others from the start (the fixed order planned "selective" first)
    assert plan.solver["remat_order"][0] == "none" and sorted(plan.solver["remat_order"]) == sorted(candidates_of(plan))
    for row in candidates:
        assert row["fits"] or (row["pruned"] and row["step_at_least_s"] >= plan.estimated_step_s), row
        if row.get("pruned"):
            assert f"{row['remat']:<10} not planned to the end: its step is at least" in plan.summary()
    monkeypatch.setattr(pipeline_plan, "PRUNE_CANDIDATES", False)  # every option and candidate solved to the end
    every = auto()
    assert every.remat == plan.remat and every.estimated_step_s == pytest.approx(plan.estimated_step_s, rel=1e-9)
    rows = every.solver["remat"]["candidates"]
    assert all(r["fits"] for r in rows) and rows[0]["estimated_step_s"] < rows[2]["estimated_step_s"]

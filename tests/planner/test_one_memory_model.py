"""One memory model: a stage partition the stage DP accepts under a budget always has a sharding the per-stage ILP
can fit in it.

The DP prices a stage with :class:`torchpar.planner.pipeline.stage_cost.AnalyticStageCost` (state, kept activations, the
stage's inputs per micro-batch in flight, the recomputed layer's peak; for a stage with experts, its other weights
replicated too); the ILP prices every root's strategy on the stage graph. Checked for 20 seeded combinations of
model × mixed precision × remat × micro-batches × cluster × budget, and 4 of a tiny Mixtral: every stage of the DP's
best partition is solved by the ILP under the same budget. (On GPT-3 39B's stages, (1, 8) and (1, 4) meshes, the
DP's figure is the ILP's smallest feasible memory to the byte; on these tiny models, whose heads and rows do not
divide 8 devices, the two differ: see the issue note.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import torchpar
from torchpar.capture.export import capture_train_step
from torchpar.capture.precision import autocast_dtype
from torchpar.cluster import ClusterSpec
from torchpar.planner.pipeline import layers as layers_mod
from torchpar.planner.pipeline import stages as stages_mod
from torchpar.planner.intra_op import StageProblem, plan_stage
from torchpar.planner.pipeline.slicing import slice_stages, stage_of_nodes

COMBINATIONS = 20


@pytest.fixture(scope="module", autouse=True)
def session_cluster():
    """The session's local cluster of 8 devices, whatever an earlier module of this worker left."""
    torchpar.init(cluster="local", num_devices=8)


def _gpt2() -> tuple[torch.nn.Module, dict]:
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=32)
    ids = torch.randint(0, 256, (16, 32))
    return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


def _llama() -> tuple[torch.nn.Module, dict]:
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=32)
    ids = torch.randint(0, 256, (16, 32))
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def _mixtral() -> tuple[torch.nn.Module, dict]:
    config = transformers.MixtralConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                        max_position_embeddings=32, num_local_experts=8, num_experts_per_tok=2)
    ids = torch.randint(0, 256, (16, 32))
    return transformers.MixtralForCausalLM(config), {"input_ids": ids, "labels": ids}


MODELS = {"gpt2": _gpt2, "llama": _llama, "mixtral": _mixtral}


def _combinations(models: tuple[str, ...] = ("gpt2", "llama"), count: int = COMBINATIONS,
                  seed: int = 11) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [dict(model=str(rng.choice(list(models))), mixed=rng.choice([None, "bf16"]),
                 remat=str(rng.choice(["none", "layers", "selective"])), micro_batches=int(rng.choice([2, 4])),
                 hosts=int(rng.choice([1, 2])), budget_scale=float(rng.uniform(0.15, 1.2)), layers=int(rng.choice([2, 4])))
            for _ in range(count)]


@pytest.fixture(scope="module")
def graphs():
    """The training graph of one micro-batch per (model, mixed precision, micro-batches), captured once."""
    cache: dict = {}

    def get(model: str, mixed: str | None, micro_batches: int):
        key = (model, mixed, micro_batches)
        if key not in cache:
            torch.manual_seed(0)
            module, batch = MODELS[model]()
            batch = {k: v[: v.shape[0] // micro_batches] for k, v in batch.items()}
            cache[key] = capture_train_step(module, batch, None, autocast=autocast_dtype(mixed)).graph
        return cache[key]

    return get


@pytest.mark.parametrize("case", _combinations() + _combinations(("mixtral",), count=4, seed=12),
                         ids=lambda c: "-".join(str(v) for v in c.values()))
def test_a_partition_the_stage_dp_accepts_has_a_sharding_that_fits(case, graphs):
    graph = graphs(case["model"], case["mixed"], case["micro_batches"])
    hosts, per_host = case["hosts"], 8 // case["hosts"]
    unlimited = ClusterSpec(num_hosts=hosts, devices_per_host=per_host)
    layering = layers_mod.cluster_layers(graph, case["layers"], 0.5)
    trainable = {i.target for i in graph.inputs if i.kind == "param"}
    cost = stages_mod.AnalyticStageCost(layering, graph, unlimited, case["micro_batches"], 2.0, remat=case["remat"])
    # a budget between "nothing fits" and "everything fits": a share of the whole model's state on one device
    whole = cost(0, layering.num_layers - 1, (1, 1), (1, 1)).peak_bytes(1)
    budget = case["budget_scale"] * whole
    try:
        partition = stages_mod.stage_dp(layering.num_layers, hosts, per_host, case["micro_batches"], cost,
                                        budget).best
    except ValueError as error:  # nothing fits: the DP says so, and names the smallest budget that would
        assert "smallest" in str(error)
        return
    stage_layers = [list(ids) for ids in partition.forward_stage_layer_ids]
    stage_graphs = slice_stages(graph, stage_of_nodes(graph, layering.layer_of, stage_layers))
    in_flight = stages_mod.micro_batches_in_flight(len(stage_graphs), case["micro_batches"], "1f1b")
    cluster = ClusterSpec(num_hosts=hosts, devices_per_host=per_host, device_memory_bytes=int(budget))
    for index, (stage, choice) in enumerate(zip(stage_graphs, partition.stages)):
        problem = StageProblem(kind="shard", cluster=cluster, trainable=trainable & set(stage.params),
                               optimizer_state_copies=2.0, submesh=tuple(choice.submesh), remat=case["remat"],
                               in_flight=in_flight[index])
        result = plan_stage(stage.graph, problem, tuple(choice.logical), budget, time_limit_s=10)
        assert result.stage.estimated_memory_bytes <= budget * (1 + 1e-9), f"stage {index}"

"""Every method on the Ray runtime, with meshes that span host actors (one JAX multi-controller system).

Losses and SGD parameters are compared with PyTorch eager on the whole batch. What ran where is asserted
from the actors' own accounts (``engine.describe_workers``): their processes, devices, the HLO they
compiled and its device assignment — not from the driver, which holds no device of the plan.
"""

from __future__ import annotations

import pytest
import torch

import torchpar
from tests.runtime.ray_helpers import crossing_collectives, gpt2, qwen2, ray_cluster, train_against_pytorch
from torchpar.report.hlo import collectives
from torchpar.runtime.ray.host_actor import ACTOR_GC_THRESHOLD

ONE_STAGE_METHODS = {
    "data_parallel": (torchpar.DataParallel, "all-reduce"),
    # over gloo a reduce-scatter is intermittently wrong (jaxbackend.collectives): ZeRO-2 all-reduces and slices
    "zero2": (torchpar.Zero2Parallel, "all-reduce"),
    "zero3": (torchpar.Zero3Parallel, "all-reduce"),  # its all-gathers' backward likewise
    "shard": (torchpar.ShardParallel, None),
    # a data replica on each host actor: the replicas' gradient sum crosses the hosts
    "data_replicas": (lambda: torchpar.ShardParallel(mesh_shape=(2, 1, 2)), "all-reduce"),
}


@pytest.fixture(scope="module")
def two_hosts_of_two():
    with ray_cluster(num_hosts=2, devices_per_host=2) as cluster:
        yield cluster


@pytest.mark.parametrize("method", list(ONE_STAGE_METHODS))
def test_one_stage_methods_run_on_both_host_actors(two_hosts_of_two, method):
    torch.manual_seed(0)
    model, batch = gpt2(num_layers=2)
    method_cls, gradient_collective = ONE_STAGE_METHODS[method]
    engine = train_against_pytorch(model, batch, method_cls(), steps=5)
    with engine:
        stage = engine.plan.stages[0]
        assert stage.num_devices == 4 and stage.submesh_shape == (2, 2)
        workers = engine.describe_workers(programs=True)
        assert [w["process_index"] for w in workers] == [0, 1]
        assert all(w["process_count"] == 2 and w["steps_run"] == 5 for w in workers)
        assert len({w["pid"] for w in workers}) == 2
        assert all(w["niceness"] == 0 for w in workers)  # embedded Ray: host actors at the driver's priority
        assert all(tuple(w["gc_threshold"]) == ACTOR_GC_THRESHOLD for w in workers)  # the actor's collector settled
        for w in workers:  # each actor holds its share of the state on its own two devices
            assert len(w["local_devices"]) == 2
            assert w["devices_holding_state"] and set(w["devices_holding_state"]) <= set(w["local_devices"])
            crossing = crossing_collectives(w)
            assert crossing, f"no collective of host {w['rank']}'s program spans both hosts"
            if gradient_collective:  # the gradient reduction itself crosses the host boundary
                assert any(c.kind == gradient_collective and c.elements > 1 for c in crossing), \
                    sorted({c.kind for c in crossing})
            assert not [c for c in collectives(w["programs"][0]["hlo"]) if c.kind == "reduce-scatter"]
        assert engine.spmd_mode == ("shard_map" if method in ("data_parallel", "zero2", "zero3") else "gspmd")
        stats = engine.memory_stats()  # read by the lead actor: a one-stage plan is stage 0
        assert list(stats) == [0] and stats[0]["argument_bytes"] > 0


def _mixtral(layers: int) -> torch.nn.Module:
    """A tiny HF Mixtral (8 experts, top-2, router loss), seed 0."""
    import transformers

    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=8, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.02))


def test_experts_split_across_host_actors(two_hosts_of_two):
    """HF Mixtral with its experts split over a mesh axis that spans both host actors: the tokens' all-to-all
    crosses the hosts, and SGD matches PyTorch (losses and every parameter)."""
    model = _mixtral(layers=2)
    ids = torch.randint(0, 128, (8, 16))
    engine = train_against_pytorch(model, {"input_ids": ids, "labels": ids},
                                   torchpar.ShardParallel(mesh_shape=(1, 4), experts="split"), steps=3)
    with engine:
        stage = engine.plan.stages[0]
        assert all(spec[0] == [1] for name, spec in stage.params.items() if ".experts." in name)
        for w in engine.describe_workers(programs=True):
            assert any(c.kind == "all-to-all" for c in crossing_collectives(w)), f"host {w['rank']}"


def test_zero_over_a_moe_model_exchanges_its_tokens_across_host_actors(two_hosts_of_two):
    """ZeRO-2 on HF Mixtral over both host actors (every op split by batch rows): the routing's gathers and puts keep
    the tokens split, moving the rows other devices need by all-to-all across the hosts, and SGD matches PyTorch."""
    model = _mixtral(layers=1)
    ids = torch.randint(0, 128, (8, 32))
    engine = train_against_pytorch(model, {"input_ids": ids, "labels": ids}, torchpar.Zero2Parallel(mesh_shape=(1, 4)),
                                   steps=2)
    with engine:
        strategies = engine.plan.stages[0].strategies
        assert sum(label.endswith(",exchange") for label in strategies.values()) >= 2, strategies
        for w in engine.describe_workers(programs=True):
            assert any(c.kind == "all-to-all" for c in crossing_collectives(w)), f"host {w['rank']}"


class _DropoutLayers(torch.nn.Module):
    """Linear+ReLU+dropout layers, a pipeline boundary after each: every stage reads the step's PRNG key."""

    def __init__(self, width: int = 16, depth: int = 4):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x, y):
        for index, layer in enumerate(self.layers):
            x = torch.nn.functional.dropout(torch.relu(layer(x)), p=0.1, training=self.training)
            if index < len(self.layers) - 1:
                x = torchpar.mark_pipeline_boundary(x)
        return torch.nn.functional.mse_loss(x, y)


def test_memory_stats_and_hlo_of_one_device_stages_on_host_actors(two_hosts_of_two):
    # stages 1 and 3 run on their actor's second device, not the one the actor's step key is made on
    torch.manual_seed(0)
    model = _DropoutLayers()
    batch = (torch.randn(8, 16), torch.randn(8, 16))
    one_device = ((1, 1),) * 4
    option = torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,), (2,), (3,)),
                                        submesh_physical_shapes=one_device, submesh_logical_shapes=one_device)
    method = torchpar.PipeshardParallel(num_micro_batches=2, layer_option="manual", stage_option=option)
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.05), example_batch=batch,
                          method=method) as engine:
        engine.step(batch)
        stats = engine.memory_stats()
        assert list(stats) == [0, 1, 2, 3]
        assert all(stage["forward_argument_bytes"] >= (16 * 16 + 16) * 4 for stage in stats.values())
        assert len(engine.hlo_text()) == 4


@pytest.fixture(scope="module")
def two_hosts_of_four():
    with ray_cluster(num_hosts=2, devices_per_host=4) as cluster:
        yield cluster


AUTO_CASES = [("gpt2", "1f1b"), ("qwen2", "gpipe")]  # each family and schedule once on Ray (test_pipeline: the matrix)


@pytest.mark.parametrize("family,schedule", AUTO_CASES, ids=[f"{f}-{s}" for f, s in AUTO_CASES])
def test_automatic_pipeline_plans_train_whatever_stages_the_dp_picks(two_hosts_of_four, family, schedule):
    torch.manual_seed(0)
    model, batch = {"gpt2": gpt2, "qwen2": qwen2}[family](num_layers=4)
    method = torchpar.PipeshardParallel(num_micro_batches=2, layer_option=torchpar.AutoLayerOption(layer_num=4),
                                        stage_option="auto", schedule=schedule)
    with train_against_pytorch(model, batch, method, steps=4) as engine:
        stages = engine.plan.stages
        workers = engine.describe_workers()
        for s, stage in enumerate(stages):
            hosts = {d // 4 for d in stage.device_ids}
            runners = [w["rank"] for w in workers if s in w["stages"]]
            assert len(runners) == len(hosts), (s, stage.device_ids, runners)  # one actor per host of the stage
        assert all(w["steps_run"] == 4 for w in workers)


SPANNING = {  # 4x1 first: the Ray instance it starts (4 CPUs) is kept for 3x2 (tests/runtime/ray_helpers.py)
    # 4 hosts × 1: both stages span two hosts, and the activations change layout between them
    "4x1": (4, 1, ((2, 1), (2, 1)), ((1, 2), (2, 1))),
    # 3 hosts × 2: stage 1 is a 2×2 mesh over hosts 1 and 2 (activations go from one process to two)
    "3x2": (3, 2, ((1, 2), (2, 2)), ((1, 2), (2, 2))),
}


@pytest.mark.parametrize("layout", list(SPANNING))
def test_manual_stages_on_submeshes_spanning_hosts(layout):
    hosts, per_host, physical, logical = SPANNING[layout]
    with ray_cluster(num_hosts=hosts, devices_per_host=per_host):
        torch.manual_seed(0)
        model, batch = gpt2(num_layers=4)  # tied embedding: its gradient is summed across the two stages
        option = torchpar.ManualStageOption(forward_stage_layer_ids=((0, 1), (2, 3)), submesh_physical_shapes=physical,
                                            submesh_logical_shapes=logical)
        method = torchpar.PipeshardParallel(num_micro_batches=2, layer_option=torchpar.AutoLayerOption(layer_num=4),
                                            stage_option=option)
        with train_against_pytorch(model, batch, method, steps=4, grad_clip_norm=0.5) as engine:
            workers = engine.describe_workers(programs=True)
            last = len(engine.plan.stages) - 1
            runners = [w for w in workers if last in w["stages"]]
            assert len(runners) == 2 and len({w["pid"] for w in runners}) == 2
            stage = engine.plan.stages[last]
            if any(entry and 0 in entry for spec in [*stage.params.values(), *stage.inputs.values()] for entry in spec):
                # the stage splits something over mesh axis 0, i.e. across its two hosts
                assert any(crossing_collectives(w, last) for w in runners), "no collective of the stage crossed hosts"

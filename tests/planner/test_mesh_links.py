"""Host-aware pricing: which logical mesh axes cross hosts, the constants they are priced with, the hardware
presets, and the plans that follow (tensor parallelism stays inside hosts when the network is slow)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

import torchpar
from torchpar.capture.export import capture_train_step
from torchpar.cluster import ClusterSpec
from torchpar.hardware import PRESETS
from torchpar.planner.for_method import plan_for_method
from torchpar.planner.mesh_links import axes_crossing_hosts, stage_mesh, submesh_of
from torchpar.planner.pipeline.pipeline_plan import plan_pipeline
from torchpar.planner.plan import Plan


@pytest.mark.parametrize("submesh, logical, crossing", [
    ((1, 8), (1, 8), (False, False)),   # one host: nothing crosses
    ((1, 8), (2, 4), (False, False)),
    ((2, 4), (1, 8), (False, True)),    # 8-way tensor parallel over two hosts of 4
    ((2, 4), (2, 4), (True, False)),    # data parallel across hosts, tensor parallel inside
    ((2, 4), (4, 2), (True, False)),
    ((2, 4), (8, 1), (True, False)),
    ((4, 2), (2, 4), (True, True)),     # axis 1 spans two hosts of 2
    ((2, 6), (3, 4), (True, True)),     # 4 does not divide 6: some axis-1 groups straddle the host boundary
])
def test_axes_crossing_hosts(submesh, logical, crossing):
    assert axes_crossing_hosts(submesh, logical) == crossing


def test_a_logical_mesh_must_hold_the_submesh_devices():
    with pytest.raises(ValueError, match="does not have the 8 devices"):
        axes_crossing_hosts((2, 4), (2, 2))


def test_crossing_axes_take_the_slower_link():
    cluster = ClusterSpec(num_hosts=2, devices_per_host=4, alpha=(2e-5, 1e-5), beta=(2e-10, 1e-10),
                          inter_host_alpha=5e-5, inter_host_beta=1e-8)
    inside = stage_mesh((2, 2), cluster, (1, 4))
    assert inside.alpha == (2e-5, 1e-5) and inside.beta == (2e-10, 1e-10)
    spanning = stage_mesh((1, 8), cluster, (2, 4))
    assert spanning.beta == (2e-10, 1e-8) and spanning.alpha == (2e-5, 5e-5)
    # the same all-reduce costs ~100× more once its axis leaves the host
    nbytes = 64 << 20
    assert spanning.all_reduce(nbytes, [1]) > 50 * stage_mesh((2, 4), cluster, (2, 4)).all_reduce(nbytes, [1])
    assert submesh_of(8, 4) == (2, 4) and submesh_of(4, 4) == (1, 4) and submesh_of(2, 4) == (1, 2)


def test_presets_and_their_plan_record():
    h100 = ClusterSpec.from_preset("h100-nvlink", num_hosts=2, devices_per_host=8)
    assert h100.preset == "h100-nvlink" and h100.device_flops == PRESETS["h100-nvlink"].device_flops
    assert ClusterSpec.from_preset("h100-sxm").preset == "h100-nvlink"  # a former name
    assert h100.inter_host_beta >= 5 * max(h100.beta), "InfiniBand per GPU is ~9× slower than NVLink 4"
    assert ClusterSpec.from_preset("v100-16g", num_hosts=8, devices_per_host=8).device_memory_bytes == 16 << 30
    assert ClusterSpec.from_preset("a100-40g").device_memory_bytes == 40 << 30
    with pytest.raises(ValueError, match="unknown hardware preset 'h200'.*h100-nvlink"):
        ClusterSpec.from_preset("h200")
    constants = h100.cost_constants()
    assert ClusterSpec(**constants) == h100, "a plan's cluster record rebuilds the cluster it was priced on"
    with pytest.raises(TypeError, match="unknown option"):
        torchpar.init(cluster="local", num_devices=8, inter_host_bandwith=1e-9)


# ---- plans ------------------------------------------------------------------------------------------

def _gpt2_graph(micro_batch: int):
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=12, n_embd=64, n_head=4, vocab_size=128, n_positions=128)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (micro_batch, 128))
    graph = capture_train_step(model, {"input_ids": ids, "labels": ids}).graph
    return graph, {n for n, _ in model.named_parameters()}


@pytest.fixture(scope="module")
def gpt2_micro_batch():
    return _gpt2_graph(micro_batch=2)


@pytest.mark.parametrize("slowdown", [10, 100])
def test_tensor_parallelism_stays_inside_hosts_when_the_network_is_slow(gpt2_micro_batch, slowdown):
    """The README's plan (GPT-2, 12 layers, 2 hosts × 4 devices, 4 micro-batches of 2): NVLink-like links
    inside a host and a network ``slowdown``× slower between hosts; memory is plentiful."""
    graph, params = gpt2_micro_batch
    fast_alpha, fast_beta = 1e-5, 1 / 400e9
    cluster = ClusterSpec(num_hosts=2, devices_per_host=4, alpha=(fast_alpha,) * 2, beta=(fast_beta,) * 2,
                          inter_host_alpha=3 * fast_alpha, inter_host_beta=slowdown * fast_beta,
                          device_flops=5e10, device_memory_bytes=64 << 30)
    method = torchpar.PipeshardParallel(num_micro_batches=4, layer_option=torchpar.AutoLayerOption(layer_num=4))
    plan = plan_pipeline(graph, method, cluster, trainable=params, optimizer_state_copies=2).plan
    assert len(plan.stages) >= 2, plan.summary()
    for stage in plan.stages:
        assert stage.crosses_hosts == [False, False], plan.summary()
        hosts = {d // cluster.devices_per_host for d in stage.devices()}
        assert len(hosts) == 1, f"stage on devices {stage.devices()} spans hosts"
    assert plan.stages[0].memory_breakdown["parameters"] > 0


def test_the_plan_is_priced_by_one_model_everywhere(gpt2_micro_batch):
    """The plan's step estimate follows from its stages' estimates; every runner-up the summary lists was priced
    by the same model (the ILP), and none beats the plan; the DP's screening figures are labelled as such."""
    graph, params = gpt2_micro_batch
    cluster = ClusterSpec(num_hosts=2, devices_per_host=4)
    method = torchpar.PipeshardParallel(num_micro_batches=4, layer_option=torchpar.AutoLayerOption(layer_num=4))
    plan = plan_pipeline(graph, method, cluster, trainable=params, optimizer_state_copies=2).plan
    latencies = [s.estimated_cost_s for s in plan.stages]
    assert math.isclose(plan.estimated_step_s, sum(latencies) + 3 * max(latencies), rel_tol=1e-12)
    for stage in plan.stages:
        assert math.isclose(sum(stage.memory_breakdown.values()), stage.estimated_memory_bytes, rel_tol=1e-6)
    runners_up = plan.solver["runners_up"]
    # each runner-up priced by the same model, or left unsolved once its proven bound showed it could not win
    assert runners_up and all(r.get("estimated_step_s", r.get("step_at_least_s")) >= plan.estimated_step_s
                              for r in runners_up)
    assert plan.solver["estimate"]["model"] in runners_up[0]["model"]
    assert "screening" in plan.solver["stage_partition"]["model"]
    again = Plan.from_json(plan.to_json())
    assert again.cluster == cluster.cost_constants() and again.stages[0].crosses_hosts == plan.stages[0].crosses_hosts
    assert "runner-up: est. step" in plan.summary()


def test_shard_parallel_keeps_tensor_parallel_axis_inside_hosts(gpt2_micro_batch):
    """A one-stage plan over 2 hosts × 4: with a slow network the chosen mesh puts the tensor-parallel axis
    (axis 1) inside hosts; every mesh shape tried is recorded with its estimate."""
    graph, params = gpt2_micro_batch
    cluster = ClusterSpec(num_hosts=2, devices_per_host=4, alpha=(1e-5, 1e-5), beta=(1 / 400e9,) * 2,
                          inter_host_alpha=3e-5, inter_host_beta=100 / 400e9)
    plan = plan_for_method(graph, torchpar.ShardParallel(), cluster, trainable=params, optimizer_state_copies=2)
    stage = plan.stages[0]
    assert stage.crosses_hosts[1] is False, plan.summary()
    tried = {tuple(t["logical_mesh_shape"]): t for t in plan.solver["mesh_shapes"]}
    assert set(tried) == {(1, 8), (2, 4), (4, 2), (8, 1)}
    assert tried[tuple(stage.logical_mesh_shape)]["chosen"]
    assert all(t.get("estimated_step_s", math.inf) >= plan.estimated_step_s for t in tried.values())


def test_the_preset_of_a_gpu_is_found_from_its_device_kind():
    from torchpar.hardware import detect, preset

    assert detect("NVIDIA H100 80GB HBM3") == "h100-nvlink"
    assert detect("NVIDIA A100-SXM4-40GB") == "a100-40g"
    assert detect("NVIDIA A100-SXM4-80GB") == "a100-80g"
    assert detect("Tesla V100-SXM2-16GB") == "v100-16g"
    assert detect("Tesla V100-SXM2-32GB") is None  # 32 GB: no preset says so
    assert detect("NVIDIA H100 PCIe") is None and detect("NVIDIA GeForce RTX 4090") is None
    v100 = preset("v100-16g")
    assert v100.peak_flops["bf16"] is None and v100.device_flops == v100.peak_flops["fp16"] == 125e12
    h100 = preset("h100-sxm")  # a former name
    assert h100.name == "h100-nvlink" and h100.peak_flops["tf32"] == h100.peak_flops["bf16"] / 2

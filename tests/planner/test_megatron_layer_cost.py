"""The stage cost model pinned on a layer whose costs can be written by hand: one Megatron GPT layer as a pipeline
stage on 8 hosts × 8 A100s (the ``a100-80g`` preset), ``num_micro_batches`` micro-batches per step.

Megatron-LM's layout of the layer (Shoeybi et al. 2019) on a (data 8 across hosts) × (tensor 8 inside a host) mesh:
the QKV and first MLP weights split by output columns, the attention projection and second MLP weights by input
rows, over the in-host axis; the batch split over the hosts. Per micro-batch it all-reduces the layer's activations
four times over NVLink (after the attention projection and the MLP, forward; before the QKV and the first MLP's input
gradients, backward); once per step it all-reduces each weight's gradient shard over the network. With ``AR(n, α, β,
bytes) = α + 2·(n−1)/n·β·bytes`` the stage's communication per micro-batch is

    4 · AR(8, α_host, β_host, rows/8 · seq · hidden · 4)  +  AR(8, α_net, β_net, P / 8) / num_micro_batches

(``P``: the layer's parameter bytes). The ILP must find that layout by itself and price it within 10 % of the
formula; the same formula with the axes swapped (tensor parallelism over the network) is several times dearer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchpar.capture.export import capture_train_step
from torchpar.cluster import ClusterSpec
from torchpar.planner.intra_op import StageProblem, prepare_stage

HIDDEN, HEADS, SEQ, ROWS, MICRO_BATCHES = 4096, 32, 2048, 16, 64
HOSTS, PER_HOST = 8, 8
FP32 = 4


class MegatronLayer(torch.nn.Module):
    """A GPT layer (pre-LayerNorm attention and MLP blocks) whose loss is the mean square of its output. Its QKV
    projection's columns are laid out head by head, as Megatron-LM's are; GPT-2's ``c_attn`` (all q columns, then k,
    then v) cannot be split by heads without moving a third of its output between the GPUs in every micro-batch."""

    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(HIDDEN), torch.nn.LayerNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = torch.nn.Linear(HIDDEN, HIDDEN)
        self.fc_1 = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc_2 = torch.nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        rows, seq, _ = x.shape
        # head by head (Megatron's layout): a split of the QKV columns over the GPUs gives each whole heads' q, k, v
        q, k, v = self.qkv(self.ln_1(x)).view(rows, seq, HEADS, 3, HIDDEN // HEADS).permute(3, 0, 2, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(rows, seq, HIDDEN)
        x = x + self.proj(attended)
        x = x + self.fc_2(F.gelu(self.fc_1(self.ln_2(x))))
        return x.pow(2).mean()


def _all_reduce(n: int, alpha: float, beta: float, nbytes: float) -> float:
    return alpha + 2.0 * beta * (n - 1) / n * nbytes


def _hand_communication_s(cluster: ClusterSpec, parameter_bytes: float, tensor_in_host: bool) -> float:
    """The module docstring's formula; ``tensor_in_host=False``: tensor parallelism across hosts, data inside."""
    host, net = (cluster.alpha[1], cluster.beta[1]), (cluster.inter_host_alpha, cluster.inter_host_beta)
    tensor, data = (host, net) if tensor_in_host else (net, host)
    activation = ROWS // HOSTS * SEQ * HIDDEN * FP32
    return (4 * _all_reduce(PER_HOST, *tensor, activation)
            + _all_reduce(HOSTS, *data, parameter_bytes / PER_HOST) / MICRO_BATCHES)


@pytest.fixture(scope="module")
def solved():
    with torch.device("meta"):
        layer = MegatronLayer()
        x = torch.empty(ROWS, SEQ, HIDDEN)
    graph = capture_train_step(layer, (x,)).graph
    params = {name for name, _ in layer.named_parameters()}
    cluster = ClusterSpec.from_preset("a100-80g", num_hosts=HOSTS, devices_per_host=PER_HOST)
    problem = StageProblem(kind="shard", cluster=cluster, trainable=params, optimizer_state_copies=2,
                           submesh=(HOSTS, PER_HOST), num_micro_batches=MICRO_BATCHES, per_micro_batch=True)
    stage = prepare_stage(graph, problem, (HOSTS, PER_HOST)).solve(memory_budget=cluster.device_memory_bytes,
                                                                   time_limit_s=60)
    parameter_bytes = sum(p.numel() * FP32 for p in layer.parameters())
    return stage.stage, cluster, parameter_bytes


def test_the_ilp_finds_megatrons_layout_with_tensor_parallelism_inside_hosts(solved):
    stage, cluster, _ = solved
    assert stage.crosses_hosts == [True, False]  # axis 0 spans the hosts, axis 1 the GPUs of one host
    in_host = [1]
    assert stage.params["qkv.weight"] == [in_host, None] and stage.params["fc_1.weight"] == [in_host, None]
    assert stage.params["proj.weight"] == [None, in_host] and stage.params["fc_2.weight"] == [None, in_host]
    (x,) = stage.inputs.values()
    assert x[0] == [0] and not any(x[1:]), "the batch rows are split over the hosts"


def test_its_communication_is_the_hand_formula_within_ten_percent(solved):
    stage, cluster, parameter_bytes = solved
    hand = _hand_communication_s(cluster, parameter_bytes, tensor_in_host=True)
    assert stage.estimated_communication_s == pytest.approx(hand, rel=0.10), (stage.estimated_communication_s, hand)
    # tensor parallelism over the network would cost several times more: the ILP chose the cheaper side
    assert _hand_communication_s(cluster, parameter_bytes, tensor_in_host=False) > 3 * hand


def test_the_gradient_sync_is_paid_once_per_step_not_per_micro_batch(solved):
    """Per micro-batch the estimate carries 1/num_micro_batches of the weight gradients' all-reduce: priced per
    micro-batch, the network all-reduce of the layer's 100 MB of gradient shards alone would exceed it."""
    stage, cluster, parameter_bytes = solved
    sync = _all_reduce(HOSTS, cluster.inter_host_alpha, cluster.inter_host_beta, parameter_bytes / PER_HOST)
    assert stage.estimated_communication_s < sync
    compute = 3 * stage.estimated_compute_s  # sanity: the step is dominated by compute, as Megatron's is
    assert stage.estimated_cost_s == pytest.approx(stage.estimated_compute_s + stage.estimated_communication_s)
    assert compute > stage.estimated_communication_s

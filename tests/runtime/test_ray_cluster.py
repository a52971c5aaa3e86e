"""A real multi-node Ray cluster on this machine (a head and worker nodes, each its own raylet, via
``ray.cluster_utils.Cluster``), joined with ``torchpar.init(cluster="ray", address=...)``: hosts are the
cluster's nodes, GPU counts come from the nodes' resources, and actors are placed one per node."""

from __future__ import annotations

import pytest
import torch

import torchpar
from tests.runtime.ray_helpers import gpt2, train_against_pytorch


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster

    torchpar.shutdown()
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    try:
        yield nodes
    finally:
        torchpar.shutdown()
        nodes.shutdown()
        torchpar.init(cluster="local", num_devices=8)


def test_training_across_two_ray_nodes_joined_by_address_and_choosing_a_subset(cluster):
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    spec = torchpar.init(cluster="ray", address=cluster.address, devices_per_host=2)
    assert (spec.num_hosts, spec.devices_per_host, spec.accelerator) == (2, 2, "cpu")
    torch.manual_seed(0)
    model, batch = gpt2(num_layers=2)
    with train_against_pytorch(model, batch, torchpar.DataParallel(), steps=3) as engine:
        actors = engine.executor.infos  # what each actor reported about itself when it started
        assert len({a["node_id"] for a in actors}) == 2, "one host actor per Ray node"
        workers = engine.describe_workers()
        assert [w["process_index"] for w in workers] == [0, 1] and all(w["steps_run"] == 3 for w in workers)
    # num_hosts selects a subset of the nodes; more hosts than nodes is an error
    spec = torchpar.init(cluster="ray", address=cluster.address, num_hosts=1, devices_per_host=2)
    assert (spec.num_hosts, spec.devices_per_host) == (1, 2)
    with pytest.raises(ValueError, match="asked for 3 host"):
        torchpar.init(cluster="ray", address=cluster.address, num_hosts=3)


def test_gpu_nodes_are_hosts_and_their_actors_are_given_the_gpus(cluster):
    """Nodes that declare GPUs (a fake count here: JAX on this machine has only its CPU backend) become the
    hosts; each actor requests its host's GPUs from Ray and is placed on that node."""
    for _ in range(2):
        cluster.add_node(num_cpus=1, num_gpus=1)
    cluster.wait_for_nodes()
    spec = torchpar.init(cluster="ray", address=cluster.address)
    assert (spec.num_hosts, spec.devices_per_host, spec.accelerator) == (2, 1, "gpu")
    torch.manual_seed(0)
    model, batch = gpt2(num_layers=2)
    with train_against_pytorch(model, batch, torchpar.DataParallel(), steps=2) as engine:
        actors = engine.executor.infos
        gpu_nodes = {n.node_id for n in cluster.list_all_nodes() if n is not cluster.head_node}
        assert {a["node_id"] for a in actors} == gpu_nodes
        assert all(len(a["gpu_ids"]) == 1 and a["cuda_visible_devices"] == a["gpu_ids"][0] for a in actors)
        assert all(a["platform"] == "cpu" for a in actors)  # no GPU backend in this JAX: it ran on CPU devices


def test_actors_the_cluster_cannot_place_are_an_error_within_the_timeout(cluster):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    worker_node = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    torchpar.init(cluster="ray", address=cluster.address, devices_per_host=1, timeout_s=5)

    @ray.remote(num_cpus=1)
    class Squatter:
        def ping(self):
            return True

    squatter = Squatter.options(scheduling_strategy=NodeAffinitySchedulingStrategy(worker_node.node_id, soft=False)).remote()
    assert ray.get(squatter.ping.remote(), timeout=60)  # the worker node's only CPU is taken
    torch.manual_seed(0)
    model, batch = gpt2(num_layers=1)
    with pytest.raises(RuntimeError, match=r"could not place the actor\(s\) of host 1 \(node "):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                         method=torchpar.DataParallel())
    from torchpar.runtime.executor import open_executors

    assert not open_executors()

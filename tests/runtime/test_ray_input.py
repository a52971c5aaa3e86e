"""Data at cluster scale, on 2 simulated Ray hosts × 2 devices: a driver-fed DataParallel step sends each host actor
only its rows (≤ 55% of the batch, as the worker counts the bytes it received) and trains as the local runtime
does; a pipeline host receives only the leaves its stage reads; host-loaded data (``torchpar.HostData``) follows
the one-process ``DataLoader`` order over 2 epochs with the driver sending no batch bytes; a host whose data
factory raises is named with the dataset index."""

from __future__ import annotations

import pytest
import torch

import torchpar
from tests.runtime.input_cases import (BATCH, SEED, Classifier, Points, driver_fed_losses, example, host_loaded, loader, step_fn,
                                       two_stage_pipeline)
from tests.runtime.ray_helpers import ray_cluster


@pytest.fixture(scope="module")
def local_reference():
    """The local runtime's DataParallel losses on 4 devices (2 epochs, last batch kept)."""
    torchpar.init(cluster="local", num_devices=4)
    try:
        return driver_fed_losses(torchpar.DataParallel(), Points(), drop_last=False)
    finally:
        torchpar.init(cluster="local", num_devices=8)


@pytest.fixture(scope="module")
def two_hosts_of_two(local_reference):  # the reference first: it runs on the local runtime
    with ray_cluster(num_hosts=2, devices_per_host=2) as cluster:
        yield cluster


def test_each_host_receives_only_its_rows_and_trains_as_before(two_hosts_of_two, local_reference):
    dataset = Points()
    model = Classifier()
    losses, shares = [], []
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=example(dataset),
                          step_fn=step_fn, method=torchpar.DataParallel()) as engine:
        batches = loader(dataset, drop_last=False)
        for _ in range(2):
            for x, y in batches:
                losses.append(engine.step((x, y)).item())
                whole = x.numel() * 4 + y.numel() * 4  # int64 labels travel as int32
                shares.append([received / whole for received in engine.executor.last_input_bytes])
    assert max(abs(a - b) for a, b in zip(losses, local_reference)) <= 1e-6  # gloo sums in another order
    with host_loaded(torchpar.DataParallel(), dataset, drop_last=False) as engine:
        assert list(engine.run(epochs=2)) == losses  # the input path changes no bit
    full = [s for s, (x, _) in zip(shares, [b for _ in range(2) for b in batches]) if len(x) == 16]
    assert all(len(s) == 2 and max(s) <= 0.55 for s in full), shares


def test_host_loaded_data_sends_no_batch_bytes_and_follows_the_dataloader_order(two_hosts_of_two, local_reference):
    with host_loaded(torchpar.DataParallel(), Points(), drop_last=False) as engine:
        losses = []
        for loss in engine.run(epochs=2):
            losses.append(loss)
            assert engine.executor.last_input_bytes == [0, 0]
    assert len(losses) == len(local_reference) == 14
    assert max(abs(a - b) for a, b in zip(losses, local_reference)) <= 1e-6


def test_a_pipeline_host_receives_only_the_leaves_its_stage_reads(two_hosts_of_two):
    dataset = Points(64)
    model = Classifier()
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=example(dataset),
                          step_fn=step_fn, method=two_stage_pipeline(2)) as engine:
        x, y = next(iter(loader(dataset, drop_last=True)))
        engine.step((x, y))
        assert engine.executor.last_input_bytes == [x.numel() * 4, y.numel() * 4]  # features to stage 0, labels to 1
    reference = driver_fed_losses(two_stage_pipeline(2), dataset, drop_last=True)
    with host_loaded(two_stage_pipeline(2), dataset, drop_last=True) as engine:
        assert list(engine.run(epochs=2)) == reference


def test_a_failing_data_factory_names_the_host_and_the_dataset_index(two_hosts_of_two):
    broken = torchpar.HostData(Points(), batch_size=BATCH, seed=SEED).epoch_batches(0)[3][0]  # not in the example
    engine = host_loaded(torchpar.DataParallel(), Points(broken=broken), drop_last=False)
    try:
        with pytest.raises(torchpar.HostFailure, match=rf"host 0 .*HostDataError: host 0: .*dataset\[{broken}\] "
                                                       rf"raised FileNotFoundError: shard-{broken}"):
            list(engine.run(epochs=1))
    finally:
        engine.close()


@pytest.mark.parametrize("method", ["data_parallel"])  # a pipeline's parts wait in the object store: no new path
def test_prefetched_batches_on_host_actors_train_as_the_loader_fed_directly(two_hosts_of_two, method):
    dataset = Points()
    make = {"data_parallel": torchpar.DataParallel, "pipeline": lambda: two_stage_pipeline(2)}[method]
    reference = driver_fed_losses(make(), dataset, drop_last=False, epochs=1)
    model = Classifier()
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=example(dataset),
                          step_fn=step_fn, method=make()) as engine:
        # one-stage plans: each actor places the next batch on its devices beside the running step (place_ahead)
        assert [engine.step(batch).item() for batch in engine.prefetch(loader(dataset, drop_last=False))] == reference

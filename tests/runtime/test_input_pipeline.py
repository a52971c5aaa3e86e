"""Where a step's batch comes from, in one process: ``engine.prefetch(loader)`` trains exactly as the loader fed
directly, host-loaded data (``torchpar.HostData``) follows the ``DataLoader`` order over epochs with the last
batch dropped or kept, and the step's data wait is measured. The same on 2 Ray hosts: ``test_ray_input.py``."""

from __future__ import annotations

import time

import pytest
import torch

import torchpar
from tests.runtime.input_cases import (BATCH, Classifier, Points, driver_fed_losses, example, host_loaded, loader,
                                       step_fn, two_stage_pipeline)

METHODS = {"one_device": lambda: None, "data_parallel": lambda: torchpar.DataParallel(mesh_shape=(1, 4)),
           "pipeline": lambda: two_stage_pipeline(2)}


@pytest.fixture(scope="module", autouse=True)
def four_devices():
    torchpar.init(cluster="local", num_devices=4)
    yield
    torchpar.init(cluster="local", num_devices=8)


@pytest.mark.parametrize("method, drop_last", [("one_device", True), ("one_device", False), ("data_parallel", False),
                                               ("pipeline", True)])
def test_host_loaded_data_follows_the_dataloader_order_over_two_epochs(method, drop_last):
    dataset = Points()
    reference = driver_fed_losses(METHODS[method](), dataset, drop_last)
    with host_loaded(METHODS[method](), dataset, drop_last) as engine:
        losses = list(engine.run(epochs=2))
        assert engine.executor.last_input_bytes == [0]  # the driver sent no batch bytes
    assert len(losses) == len(reference) == (12 if drop_last else 14)
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= 1e-6


def test_step_and_run_walk_the_epochs_and_refuse_without_data():
    dataset = Points()
    with host_loaded(None, dataset, drop_last=False) as engine:
        first = [engine.step() for _ in range(3)]
        rest = list(engine.run(epochs=1))  # to the end of the current epoch
        assert len(first) + len(rest) == 7
        assert len(list(engine.run(steps=2))) == 2
        with pytest.raises(TypeError, match="steps, epochs"):
            engine.run()
    model = Classifier()
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=example(dataset),
                          step_fn=step_fn) as engine:
        with pytest.raises(TypeError, match=r"HostData"):
            engine.step()
    with pytest.raises(TypeError, match="example_batch"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), step_fn=step_fn)


@pytest.mark.parametrize("method", ["one_device", "data_parallel"])  # a pipeline's: tests/runtime/test_ray_input.py
def test_prefetched_batches_train_exactly_as_the_loader_fed_directly(method):
    dataset = Points()
    reference = driver_fed_losses(METHODS[method](), dataset, drop_last=False, epochs=1)
    model = Classifier()
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=example(dataset),
                          step_fn=step_fn, method=METHODS[method]()) as engine:
        losses = [engine.step(batch) for batch in engine.prefetch(loader(dataset, drop_last=False), depth=2)]
    assert losses == reference  # bit for bit, the smaller last batch included


def test_a_loader_error_is_raised_by_the_prefetching_loop():
    dataset = Points(broken=37)
    model = Classifier()
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=example(Points()),
                          step_fn=step_fn) as engine:
        with pytest.raises(FileNotFoundError, match="shard-37"):
            for batch in engine.prefetch(torch.utils.data.DataLoader(dataset, batch_size=BATCH)):
                engine.step(batch)


def test_the_step_reports_the_time_it_waited_for_a_slow_loader():
    dataset = Points()

    def slow(samples):
        time.sleep(0.05)
        return torch.utils.data.default_collate(samples)

    model = Classifier()
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=example(dataset),
                          step_fn=step_fn) as engine:
        waits = []
        for batch in engine.prefetch(torch.utils.data.DataLoader(dataset, batch_size=BATCH, collate_fn=slow)):
            engine.step(batch)
            waits.append(engine.last_metrics.data_wait_s)
    # the step is far faster than the 50 ms collate: after the first batches it waits for nearly all of it
    assert max(waits[2:]) >= 0.02, waits

"""Where a step's batch comes from, in one process: ``engine.prefetch(loader)`` trains exactly as the loader fed
directly, host-loaded data (``torchpar.HostData``) follows the ``DataLoader`` order over epochs with the last
batch dropped or kept, a checkpoint resumes it where it stood, a dataset of paths pickles only its paths, and the
step's data wait is measured. The same on 2 Ray hosts: ``test_ray_input.py``."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import torchpar
from tests.runtime.input_cases import (BATCH, SEED, Classifier, Points, driver_fed_losses, example, host_loaded,
                                       loader, step_fn, two_stage_pipeline)

ROOT = Path(__file__).resolve().parents[2]

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
        first = [engine.step().item() for _ in range(3)]
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
        losses = [engine.step(batch).item() for batch in engine.prefetch(loader(dataset, drop_last=False), depth=2)]
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


class SmallCNN(torch.nn.Module):
    """A CNN with BatchNorm (running statistics updated in training mode), not a transformer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4 * 8 * 8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.conv(x))).flatten(1))


@pytest.mark.parametrize("method", ["one_device", "data_parallel"])
def test_a_batchnorm_cnn_trained_from_host_loaded_data_is_pytorchs_step(method):
    """Host-loaded batches of a CNN with BatchNorm train as ``loss.backward(); optimizer.step()`` in PyTorch on the
    same DataLoader order: losses, weights and BatchNorm's running statistics."""
    generator = torch.Generator().manual_seed(0)
    images = torch.utils.data.TensorDataset(torch.randn(48, 1, 8, 8, generator=generator),
                                            torch.randint(0, 3, (48,), generator=generator))
    cnn_step = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    eager = SmallCNN()
    optimizer = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    reference = []
    for batch in torch.utils.data.DataLoader(images, batch_size=BATCH, shuffle=True,
                                             generator=torch.Generator().manual_seed(5)):
        optimizer.zero_grad()
        loss = cnn_step(eager, batch)
        loss.backward()
        optimizer.step()
        reference.append(loss.item())
    model = SmallCNN()
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), step_fn=cnn_step,
                          data=torchpar.HostData(images, batch_size=BATCH, seed=5),
                          method=METHODS[method]()) as engine:
        losses = list(engine.run(epochs=1))
        engine.sync_to_torch()
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= 1e-5 and len(losses) == len(reference) == 3
    for name, value in eager.state_dict().items():
        assert torch.allclose(model.state_dict()[name].float(), value.float(), rtol=1e-4, atol=1e-6), name


RESUME = """
import json, sys
import torchpar
from tests.runtime.input_cases import Points, host_loaded
torchpar.init(cluster="local", num_devices=1)
with host_loaded(None, Points(), drop_last=False) as engine:
    engine.load(sys.argv[1])
    print(json.dumps([loss.item() for loss in engine.run(epochs=1)]))
"""


def test_a_host_loaded_run_resumed_in_a_new_process_continues_the_same_order(tmp_path):
    """Saved after epoch 1's batch 3 (the 11th step of 7 per epoch), resumed in a new process: the data continues
    with batch 4 of epoch 1 — the checkpoint holds the cursor — and the losses are the uninterrupted run's."""
    dataset = Points()
    reference = driver_fed_losses(None, dataset, drop_last=False)  # 2 epochs of 7 batches, one process
    with host_loaded(None, dataset, drop_last=False) as engine:
        before = list(engine.run(steps=11))
        engine.save(tmp_path / "ckpt")
    assert max(abs(a.item() - b) for a, b in zip(before, reference[:11])) <= 1e-6
    done = subprocess.run([sys.executable, "-c", RESUME, str(tmp_path / "ckpt")], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(resumed) == 3  # batches 4, 5 and 6 of epoch 1
    assert max(abs(a - b) for a, b in zip(resumed, reference[11:])) <= 1e-6
    model = Classifier()
    other_order = torchpar.HostData(dataset, batch_size=BATCH, seed=SEED + 1)
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), step_fn=step_fn,
                          data=other_order) as engine:
        with pytest.raises(ValueError, match=r"seed 3 in the checkpoint, 4 here"):
            engine.load(tmp_path / "ckpt")


class NpyShards(torch.utils.data.Dataset):
    """The documented pattern for host-loaded data (``docs/user_guide.md``, "Feeding data"): the dataset holds the
    paths of its files and opens each lazily (memory-mapped) in the process that reads it; what is pickled to every
    host is the paths, not the arrays."""

    def __init__(self, paths: list[str], rows_per_file: int):
        self.paths, self.rows_per_file = list(paths), rows_per_file
        self._open: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.paths) * self.rows_per_file

    def __getitem__(self, index: int):
        file, row = divmod(index, self.rows_per_file)
        if file not in self._open:
            self._open[file] = np.load(self.paths[file], mmap_mode="r")
        x = torch.from_numpy(np.array(self._open[file][row]))
        return x[:-1], x[-1].long()

    def __getstate__(self) -> dict:
        return {"paths": self.paths, "rows_per_file": self.rows_per_file, "_open": {}}


def test_a_dataset_of_paths_pickles_its_paths_and_trains_as_the_loader(tmp_path):
    generator = torch.Generator().manual_seed(0)
    paths = []
    for k in range(4):  # 4 files of 25 rows: 16 features and a class label in the last column
        rows = torch.cat([torch.randn(25, 16, generator=generator),
                          torch.randint(0, 4, (25, 1), generator=generator).float()], dim=1)
        paths.append(str(tmp_path / f"shard-{k}.npy"))
        np.save(paths[-1], rows.numpy())
    dataset = NpyShards(paths, rows_per_file=25)
    dataset[7]  # a file opened here stays out of what the hosts receive
    assert len(pickle.dumps(torchpar.HostData(dataset, batch_size=BATCH, seed=SEED))) < 2000
    reference = driver_fed_losses(None, dataset, drop_last=False)
    with host_loaded(None, dataset, drop_last=False) as engine:
        losses = list(engine.run(epochs=2))
    assert max(abs(a.item() - b) for a, b in zip(losses, reference)) <= 1e-6 and len(losses) == len(reference)

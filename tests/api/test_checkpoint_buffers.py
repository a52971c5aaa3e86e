"""Checkpoints hold every buffer and parameter exactly, whatever its shape and dtype (issue 27, item 6).

A CNN with ``BatchNorm2d`` (0-d ``int64`` ``num_batches_tracked``, ``running_mean``/``running_var``) trained with a
``step_fn`` and SGD with momentum is saved after 3 steps, loaded in a new process into a freshly compiled engine and
trained 3 more steps: its losses, parameters and buffers are bit for bit those of the uninterrupted 6-step run, on one
device and under ``DataParallel`` on 4 devices. A module with a 0-d float buffer, an ``int64`` vector, a ``bool``
vector and ``float16``/``bfloat16`` buffers (and parameters of each float dtype) round-trips exactly, through
``engine.load`` and through ``torchpar.load_checkpoint``.

The process that resumes imports this module for the model (:func:`build`, :func:`compile_cnn`, :func:`batch`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchpar

ROOT = Path(__file__).resolve().parents[2]
SAVE_AT = 3
STEPS = 6


class Block(nn.Module):
    """conv → bn → relu → conv → bn, plus the input (a residual add), → relu."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(h)))


class TinyResNet(nn.Module):
    """A stem (conv, bn, relu, max-pool), one residual block, global average pooling and a linear head."""

    def __init__(self, channels: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.block = Block(channels)
        self.head = nn.Linear(channels, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = F.max_pool2d(F.relu(self.bn(self.stem(images))), 2)
        h = self.block(h)
        return self.head(F.adaptive_avg_pool2d(h, 1).flatten(1))


def classification_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 3, 8, 8, generator=generator), torch.randint(0, 10, (8,), generator=generator)


def method(name: str) -> Any:
    if name == "data_parallel":  # the first 4 of the session's 8 devices
        return torchpar.DataParallel(mesh_shape=(1, 4))
    assert name == "one_device", name
    return None


def compile_cnn(name: str) -> Any:
    """The CNN and its optimizer in their initial state (the same in every process), compiled under ``name``."""
    torch.manual_seed(0)
    model = TinyResNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    return torchpar.compile(model, optimizer, example_batch=batch(0), step_fn=classification_step,
                            method=method(name))


RESUME = """
import json, sys
sys.path.insert(0, {root!r})
import torch
import torchpar
torchpar.init(cluster="local", num_devices=8)
from tests.api import test_checkpoint_buffers as cnn

with cnn.compile_cnn({name!r}) as engine:
    engine.load({checkpoint!r})
    losses = [engine.step(cnn.batch(step)).item() for step in range(cnn.SAVE_AT, cnn.STEPS)]
    torch.save(engine.export_torch_state_dict(), {state!r})
print("LOSSES", json.dumps(losses), flush=True)
"""


@pytest.fixture(scope="module", autouse=True)
def session_cluster():
    """The session's local cluster of 8 devices, whatever an earlier module of this worker left."""
    torchpar.init(cluster="local", num_devices=8)


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A temporary directory removed when the test ends, passed or failed."""
    with tempfile.TemporaryDirectory(prefix="torchpar-ckpt-buffers-") as directory:
        yield Path(directory)


def _assert_identical(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        assert actual[key].dtype == value.dtype and actual[key].shape == value.shape, \
            (key, actual[key].dtype, list(actual[key].shape), value.dtype, list(value.shape))
        assert torch.equal(actual[key], value), key


@pytest.mark.parametrize("name", ["one_device", "data_parallel"])
def test_a_batchnorm_cnn_resumes_bit_for_bit_in_a_new_process(name, workdir):
    checkpoint, state = workdir / "ckpt", workdir / "resumed.pt"
    with compile_cnn(name) as engine:  # the uninterrupted run, saved after SAVE_AT steps
        losses = [engine.step(batch(step)).item() for step in range(SAVE_AT)]
        engine.save(checkpoint)
        saved = engine.export_torch_state_dict()
        losses += [engine.step(batch(step)).item() for step in range(SAVE_AT, STEPS)]
        final = engine.export_torch_state_dict()
    assert saved["bn.num_batches_tracked"].shape == () and saved["bn.num_batches_tracked"].dtype == torch.int64
    assert int(saved["bn.num_batches_tracked"]) == SAVE_AT and int(final["block.bn2.num_batches_tracked"]) == STEPS
    assert not torch.equal(final["bn.running_var"], torch.ones(8))  # the running statistics were trained
    _assert_identical(torchpar.load_checkpoint(checkpoint), saved)  # the torch reader, no engine

    script = workdir / "resume.py"
    script.write_text(RESUME.format(root=str(ROOT), name=name, checkpoint=str(checkpoint), state=str(state)))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, f"the resumed run failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    line = next(line for line in result.stdout.splitlines() if line.startswith("LOSSES "))
    assert json.loads(line.removeprefix("LOSSES ")) == losses[SAVE_AT:]
    _assert_identical(torch.load(state, weights_only=True), final)


class Buffers(nn.Module):
    """A linear layer in ``dtype`` beside buffers of every awkward shape and dtype, most of them updated by each
    step (as BatchNorm updates its statistics)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.linear = nn.Linear(4, 4).to(dtype)
        self.register_buffer("scale", torch.tensor(0.75))  # 0-d float32
        self.register_buffer("counts", torch.tensor([0, 7, -3, 2**31 - 1], dtype=torch.int64))
        self.register_buffer("mask", torch.tensor([True, False, True, True]))
        self.register_buffer("fp16", torch.randn(4).to(torch.float16))
        self.register_buffer("bf16", torch.randn(4).to(torch.bfloat16))
        self.register_buffer("calls", torch.tensor(0, dtype=torch.int64))  # 0-d int64, like num_batches_tracked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.scale.mul_(0.5)  # buffers need no gradient: updated in place as BatchNorm's statistics are
        self.calls.add_(1)
        self.fp16.add_(0.125)
        self.bf16.mul_(1.5)
        h = self.linear(x)
        h = torch.where(self.mask, h, torch.zeros_like(h)) * self.scale.to(h.dtype)
        return h + self.fp16.to(h.dtype) + self.bf16.to(h.dtype) + (self.counts % 5).to(h.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_buffers_and_parameters_of_every_shape_and_dtype_round_trip_exactly(dtype, workdir):
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)).to(dtype)

    def compile_buffers():
        torch.manual_seed(0)
        model = Buffers(dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return torchpar.compile(model, optimizer, example_batch=x, step_fn=lambda m, b: m(b).float().square().mean())

    with compile_buffers() as engine:
        engine.step(x)
        engine.save(workdir / "ckpt")
        saved = engine.export_torch_state_dict()
        expected = [engine.step(x).item() for _ in range(2)]
        final = engine.export_torch_state_dict()
    assert {key: value.dtype for key, value in saved.items()} == {
        "linear.weight": dtype, "linear.bias": dtype, "scale": torch.float32, "counts": torch.int64,
        "mask": torch.bool, "fp16": torch.float16, "bf16": torch.bfloat16, "calls": torch.int64}
    assert saved["scale"].item() == 0.375 and saved["calls"].item() == 1
    assert saved["counts"].tolist() == [0, 7, -3, 2**31 - 1] and saved["mask"].tolist() == [True, False, True, True]
    _assert_identical(torchpar.load_checkpoint(workdir / "ckpt"), saved)
    with compile_buffers() as engine:
        engine.load(workdir / "ckpt")
        _assert_identical(engine.export_torch_state_dict(), saved)
        assert [engine.step(x).item() for _ in range(2)] == expected
        _assert_identical(engine.export_torch_state_dict(), final)


def test_the_reader_takes_an_earlier_torchpars_0d_pieces_and_refuses_pieces_of_another_shape(workdir):
    """Before this fix a 0-d tensor's piece was stored as shape ``[1]`` (``np.ascontiguousarray``): such a checkpoint
    still loads; a piece whose stored shape is not the index's otherwise is a damaged checkpoint, said so."""
    from safetensors.numpy import save_file

    from torchpar.runtime.checkpoint_io import ShardReader

    save_file({"buffer/n@": np.array([3], np.int32), "buffer/v@0": np.arange(3, dtype=np.int32)},
              str(workdir / "rank0-dev0.safetensors"))
    piece = {"file": "rank0-dev0.safetensors", "offsets": [], "shape": []}
    tensors = {"buffer/n": {"shape": [], "dtype": "int32", "pieces": [{**piece, "key": "buffer/n@"}]},
               "buffer/v": {"shape": [4], "dtype": "int32",
                            "pieces": [{**piece, "key": "buffer/v@0", "offsets": [0], "shape": [4]}]}}
    with ShardReader(str(workdir), tensors) as reader:
        value = reader.read("buffer/n")
        assert value.shape == () and value.dtype == np.int32 and int(value) == 3
        with pytest.raises(ValueError, match=r"buffer/v@0.* has shape \[3\], the checkpoint's index says \[4\]"):
            reader.read("buffer/v")


def test_shard_files_are_readable_as_the_umask_allows():
    """safetensors writes 0600; a checkpoint on a shared file system must be readable by the others the umask lets
    read it (0644 under the usual 022)."""
    import os
    import stat

    model = nn.Linear(4, 4)
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(2, 4),
                              step_fn=lambda m, b: m(b).sum())
    mask = os.umask(0o022)
    try:
        with engine, tempfile.TemporaryDirectory() as directory:
            path = Path(engine.save(os.path.join(directory, "checkpoint")))
            shards = list(path.glob("*.safetensors"))
            assert shards
            for shard in shards:
                assert stat.S_IMODE(shard.stat().st_mode) == 0o644, shard.name
    finally:
        os.umask(mask)

"""Sharded checkpoints (``engine.save`` / ``engine.load``, :mod:`torchpar.checkpoint`): a run killed after saving
resumes in a new process bit for bit under the same plan and to float rounding under another (one device, a
2-stage pipeline, and the pipeline's own checkpoint back under ZeRO-3); a save killed midway leaves the previous
checkpoint in place and its own half refused; exports
for torch (``export_torch_state_dict``, ``torchpar.load_checkpoint``) and HuggingFace (``save_pretrained``).

The interrupted run (ZeRO-3 on 4 devices, AdamW, a StepLR schedule: :mod:`tests.api.checkpoint_helpers`) runs in a
process of its own that trains 5 steps, saves, trains one more and dies (``os._exit``) inside a second save of the
same path, after two of its four shard files."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import torchpar
from tests.api import checkpoint_helpers as run
from torchpar.checkpoint import CheckpointError, read_index

ROOT = Path(__file__).resolve().parents[2]

KILLED_RUN = """
import json, os, sys
sys.path.insert(0, {root!r})
import torchpar
torchpar.init(cluster="local", num_devices=8)
from tests.api import checkpoint_helpers as run
from torchpar.runtime import checkpoint_io

engine, optimizer, scheduler = run.compile("zero3")
losses = run.train(engine, scheduler, range(run.SAVE_AT))
engine.save({path!r}, scheduler=scheduler)
print("LOSSES", json.dumps(losses), flush=True)

written = []
write_file = checkpoint_io._write_file
def write_then_die(*args):
    write_file(*args)
    written.append(args[0])
    if len(written) == 2:
        os._exit(9)
checkpoint_io._write_file = write_then_die
run.train(engine, scheduler, range(run.SAVE_AT, run.SAVE_AT + 1))
engine.save({path!r}, scheduler=scheduler)
print("the second save was not interrupted", flush=True)
"""


@pytest.fixture(scope="module", autouse=True)
def session_cluster():
    """The session's local cluster of 8 devices, whatever an earlier module of this worker left."""
    torchpar.init(cluster="local", num_devices=8)


@pytest.fixture(scope="module")
def reference() -> list[float]:
    """The uninterrupted run's losses."""
    engine, _, scheduler = run.compile("zero3")
    with engine:
        return run.train(engine, scheduler, range(run.STEPS))


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    directory = tmp_path_factory.mktemp("killed")
    path = directory / "ckpt"
    script = directory / "train_save_die.py"
    script.write_text(KILLED_RUN.format(root=str(ROOT), path=str(path)))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    return result, path


@pytest.fixture(scope="module")
def one_device():
    engine, optimizer, scheduler = run.compile("one_device")
    with engine:
        yield engine, optimizer, scheduler


def _saved_losses(result: subprocess.CompletedProcess) -> list[float]:
    assert result.returncode == 9, f"the run was not killed in its second save:\n{result.stdout}\n{result.stderr[-4000:]}"
    line = next(line for line in result.stdout.splitlines() if line.startswith("LOSSES "))
    return json.loads(line.removeprefix("LOSSES "))


def test_a_killed_run_resumes_bit_for_bit_in_a_new_process(reference, killed_run):
    result, path = killed_run
    assert _saved_losses(result) == reference[:run.SAVE_AT]
    engine, optimizer, scheduler = run.compile("zero3")
    with engine:
        engine.load(path, scheduler=scheduler)
        # the schedule and the optimizer's hyper-parameters continue from step 5 (StepLR halved lr at step 3)
        assert scheduler.last_epoch == run.SAVE_AT and optimizer.param_groups[0]["lr"] == 2e-3 * 0.5
        assert run.train(engine, scheduler, range(run.SAVE_AT, run.STEPS)) == reference[run.SAVE_AT:]


def test_a_save_killed_midway_leaves_the_previous_checkpoint_and_refuses_its_own_half(killed_run):
    result, path = killed_run
    _saved_losses(result)
    index = read_index(path)  # the first save, complete and in place
    assert index["steps_taken"] == run.SAVE_AT and index["complete"] is True
    assert len(index["files"]) == 4  # ZeRO-3 on 4 devices: one file per device
    partial = list(path.parent.glob(f".{path.name}.tmp-*"))
    assert len(partial) == 1, list(path.parent.iterdir())
    assert sorted(p.suffix for p in partial[0].iterdir()) == [".safetensors"] * 2  # two shards, no index
    with pytest.raises(CheckpointError, match="no index.json .* interrupted"):
        read_index(partial[0])


@pytest.mark.parametrize("name", ["one_device", "pipeline"])
def test_the_checkpoint_reshards_into_another_plan(reference, killed_run, name, one_device, tmp_path):
    _, path = killed_run
    if name == "one_device":
        engine, optimizer, scheduler = one_device
        engine.load(path, scheduler=scheduler)
        losses = run.train(engine, scheduler, range(run.SAVE_AT, run.STEPS))
    else:
        engine, optimizer, scheduler = run.compile(name)
        with engine:
            engine.load(path, scheduler=scheduler)
            losses = run.train(engine, scheduler, range(run.SAVE_AT, run.STEPS))
            # the pipeline writes its own checkpoint: the tied embedding once, though both stages hold it
            index = read_index(engine.save(tmp_path / "pipeline", scheduler=scheduler))
            assert sum(key == "param/transformer.wte.weight" for key in index["tensors"]) == 1
            stored = torchpar.load_checkpoint(tmp_path / "pipeline")
            exported = engine.export_torch_state_dict()
            assert list(stored) == list(exported)
            for key, value in exported.items():
                assert torch.equal(stored[key], value), key
            run.build()[0].load_state_dict(stored)  # strict: every key of the model's state dict
            # and back: the pipeline's checkpoint (after step 10) resumes under ZeRO-3 as the pipeline goes on
            pipeline_next = run.train(engine, scheduler, range(run.STEPS, run.STEPS + 2))
        zero3, _, zero3_scheduler = run.compile("zero3")
        with zero3:
            zero3.load(tmp_path / "pipeline", scheduler=zero3_scheduler)
            np.testing.assert_allclose(run.train(zero3, zero3_scheduler, range(run.STEPS, run.STEPS + 2)),
                                       pipeline_next, rtol=1e-5, atol=0)
    np.testing.assert_allclose(losses, reference[run.SAVE_AT:], rtol=1e-5, atol=0)


def test_exports_for_torch_and_huggingface(one_device, tmp_path):
    engine, _, _ = one_device
    engine.step(run.batch(0))
    state = engine.export_torch_state_dict()
    model = run.build()[0]
    assert list(state) == list(model.state_dict())
    assert state["lm_head.weight"] is state["transformer.wte.weight"]  # tied: one tensor under both names
    model.load_state_dict(state)
    engine.save_pretrained(tmp_path / "hf")
    assert {"config.json", "model.safetensors"} <= {p.name for p in (tmp_path / "hf").iterdir()}
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, state[key]), key


def test_a_save_replaces_the_previous_one_atomically_and_damage_is_refused(one_device, tmp_path):
    engine, _, _ = one_device
    path = tmp_path / "ckpt"
    first = read_index(engine.save(path))["steps_taken"]
    engine.step(run.batch(1))
    stale = tmp_path / f".ckpt.tmp-{socket.gethostname()}-999999999-0"  # a dead process's half-written save
    stale.mkdir()
    engine.save(path)
    assert read_index(path)["steps_taken"] == first + 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary or previous copy left

    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "todo.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a torchpar checkpoint: refusing"):
        engine.save(foreign)
    assert (foreign / "todo.txt").read_text() == "keep me"

    missing = Path(shutil.copytree(path, tmp_path / "missing"))
    next(missing.glob("*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="damaged: shard file .* is missing"):
        engine.load(missing)
    garbled = Path(shutil.copytree(path, tmp_path / "garbled"))
    shard = next(garbled.glob("*.safetensors"))
    shard.write_bytes(b"\xff" * 8 + shard.read_bytes()[8:])  # a header length past the file's end
    with pytest.raises(ValueError, match=f"shard file {shard} cannot be read .*damaged or truncated"):
        engine.load(garbled)
    reshaped = Path(shutil.copytree(path, tmp_path / "reshaped"))
    index = json.loads((reshaped / "index.json").read_text())
    index["tensors"]["param/transformer.wpe.weight"]["shape"] = [16, 64]
    (reshaped / "index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"transformer.wpe.weight is torch.float32\[16, 64\], the model's is"):
        engine.load(reshaped)
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        engine.load(tmp_path / "nowhere")


def _mlp(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16)).to(dtype)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


@pytest.mark.parametrize("dtype,mixed_precision", [(torch.bfloat16, None), (torch.float32, "fp16")],
                         ids=["bf16-parameters", "fp16-loss-scale"])
def test_low_precision_state_and_the_loss_scale_round_trip(dtype, mixed_precision, tmp_path):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).to(dtype)

    def compile_mlp():
        model, optimizer = _mlp(dtype)
        return torchpar.compile(model, optimizer, example_batch=x, mixed_precision=mixed_precision,
                                loss_fn=lambda out, batch: torch.nn.functional.mse_loss(out, batch))

    with compile_mlp() as engine:
        engine.step(x)
        if mixed_precision:
            engine._loss_scaler.scale = 1024.0  # as after a few overflows
        engine.save(tmp_path / "ckpt")
        expected = [engine.step(x).item() for _ in range(2)]
        scale = engine.loss_scale
    with compile_mlp() as engine:
        engine.load(tmp_path / "ckpt")
        assert [engine.step(x).item() for _ in range(2)] == expected
        assert engine.loss_scale == scale
        assert all(t.dtype == dtype for t in engine.export_torch_state_dict().values())

"""What the driver sends a host's worker (the execution spec, then each step's graph and leaves) is plain data:
unpickled in a fresh process it imports no torch. A Ray host actor that unpickled an fx ``immutable_list`` in a
captured graph's arguments imported all of torch (~1.2 CPU-s and ~300 MB per actor) to run JAX programs."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

import torchpar
from torchpar.harness import zoo
from torchpar.runtime.executor import Executor

UNPICKLE = (
    "import pickle, sys\n"
    "pickle.loads(sys.stdin.buffer.read())\n"
    "print(' '.join(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))\n"
)


@pytest.mark.parametrize("method", ["shard", "pipeshard"])
def test_a_workers_payloads_unpickle_without_torch(method, monkeypatch):
    sent: list[tuple] = []
    compile_step = Executor.compile

    def recording(self, *args, **kwargs):
        sent.append((args, kwargs))
        return compile_step(self, *args, **kwargs)

    monkeypatch.setattr(Executor, "compile", recording)
    model, batch = zoo.build("gpt2", {"n_layer": 2}, batch_size=4, seq_len=8)
    halves = ((1, 4), (1, 4))
    two_stages = torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)), submesh_physical_shapes=halves,
                                            submesh_logical_shapes=halves)
    chosen = (torchpar.ShardParallel() if method == "shard"
              else torchpar.PipeshardParallel(num_micro_batches=2, stage_option=two_stages))
    with torchpar.compile(model, torch.optim.AdamW(model.parameters()), example_batch=batch, method=chosen) as engine:
        assert engine.executor is not None and sent, "the step was compiled through the executor"
        payload = pickle.dumps((engine.executor.spec, sent))
    found = subprocess.run([sys.executable, "-c", UNPICKLE], input=payload, capture_output=True, timeout=120,
                           check=True).stdout.decode().split()
    assert found == [], f"unpickling the worker's payloads imported {found[:5]}"

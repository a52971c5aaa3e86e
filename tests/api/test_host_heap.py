"""The C heap of a process running XLA:CPU steps (``torchpar/host_heap.py``): after ``torchpar.init`` the
temporaries of an engine's step (an MLP on 4096 rows: 277 MB) no longer page-fault on every step, as they do with
malloc as the system set it (``TORCHPAR_HOST_HEAP=system``: 67,700 faults a step, every page); Ray host actors start
with the same settings; a wrong setting is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from torchpar import host_heap

PAGE = 4096

STEPS = """
import json, resource
import torch
import torchpar
torchpar.init(cluster="local", num_devices=1, compile_cache=False)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256))
x, y = torch.randn(4096, 256), torch.randn(4096, 256)
engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.01), example_batch=(x, y),
                          step_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
for _ in range(12):
    engine.step((x, y)).item()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    engine.step((x, y)).item()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10
print(json.dumps({"faults": faults, "temp_bytes": engine.memory_stats()[0]["temp_bytes"]}))
"""


def _faults_per_step(setting: str) -> tuple[float, int]:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS" and not k.startswith("MALLOC_")}
    env[host_heap.ENV] = setting
    result = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    return measured["faults"], measured["temp_bytes"]


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc is the one tuned")
def test_temporaries_are_not_faulted_in_every_step():
    kept, temp_bytes = _faults_per_step("keep")
    system, _ = _faults_per_step("system")
    pages = temp_bytes / PAGE
    assert temp_bytes >= 64 * 2**20, temp_bytes
    assert system >= 0.5 * pages, (system, pages)  # the cost this avoids: every page of the temporaries, each step
    # kept: the heap settles at a few buffers (a step may allocate the next buffer before the last is freed, and the
    # heap fragments), later on a loaded machine: CI measured 0.2 and 0.4 of the pages a step after 6 warm-up steps,
    # 0 on a quiet one. At most half the faults of the system's malloc, whose every step faults every page.
    assert kept <= 0.5 * system, (kept, system, pages)


def test_ray_host_actors_start_with_the_same_heap(monkeypatch):
    from torchpar.runtime.ray.host_actor import actor_environment

    monkeypatch.delenv(host_heap.ENV, raising=False)
    env = actor_environment(2)
    assert env["MALLOC_ARENA_MAX"] == "1" and env["MALLOC_MMAP_MAX_"] == "0"
    assert int(env["MALLOC_TRIM_THRESHOLD_"]) == host_heap.TRIM_THRESHOLD_BYTES
    monkeypatch.setenv(host_heap.ENV, "system")
    env = actor_environment(2)
    assert not any(k.startswith("MALLOC_") for k in env) and env[host_heap.ENV] == "system"


def test_a_wrong_setting_is_refused(monkeypatch):
    monkeypatch.setenv(host_heap.ENV, "sometimes")
    host_heap.keep_freed_memory.cache_clear()
    try:
        with pytest.raises(ValueError, match="TORCHPAR_HOST_HEAP must be 'keep' or 'system'"):
            host_heap.keep_freed_memory()
    finally:
        host_heap.keep_freed_memory.cache_clear()

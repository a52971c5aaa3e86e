"""A plan is the whole contract: a 2-stage GPT-2 pipeline plan saved to JSON, loaded in a new process and
compiled with ``method=plan`` (no planning) trains with the same losses as the engine that made it, on the
local and the Ray runtime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchpar
from tests.runtime.ray_helpers import gpt2

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
LAYERS = 2  # one GPT-2 block per stage: what is saved and replayed (stages, layers, shardings) is all there

REPLAY = """
import json, sys
sys.path.insert(0, {root!r})
import torch, torchpar
torchpar.init(cluster={runtime!r}, num_hosts=2, devices_per_host=4)
from tests.runtime.ray_helpers import gpt2
torch.manual_seed(0)
model, batch = gpt2(num_layers={layers})
plan = torchpar.Plan.from_json(open({path!r}).read())
with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), example_batch=batch,
                      method=plan) as engine:
    print("RESULT", json.dumps({{"losses": [engine.step(batch).item() for _ in range({steps})],
                      "stages": [s.device_ids for s in engine.plan.stages]}}))
torchpar.shutdown()
"""


@pytest.fixture(scope="module")
def saved_plan(tmp_path_factory):
    torchpar.init(cluster="local", num_hosts=2, devices_per_host=4)
    try:
        torch.manual_seed(0)
        model, batch = gpt2(num_layers=LAYERS)
        option = torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)),
                                            submesh_physical_shapes=((1, 4), (1, 4)),
                                            submesh_logical_shapes=((1, 4), (2, 2)))
        method = torchpar.PipeshardParallel(num_micro_batches=2,
                                            layer_option=torchpar.AutoLayerOption(layer_num=LAYERS),
                                            stage_option=option)
        with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), example_batch=batch,
                              method=method) as engine:
            losses = [engine.step(batch).item() for _ in range(STEPS)]
            path = tmp_path_factory.mktemp("plan") / "gpt2_pipeline.json"
            path.write_text(engine.plan.to_json())
            return path, losses, [s.device_ids for s in engine.plan.stages]
    finally:
        torchpar.init(cluster="local", num_devices=8)


@pytest.mark.parametrize("runtime", ["local", "ray"])
def test_a_saved_pipeline_plan_trains_the_same_in_a_new_process(saved_plan, runtime):
    path, losses, devices = saved_plan
    plan = torchpar.Plan.from_json(path.read_text())
    assert plan.is_pipeline and len(plan.stages) == 2 and plan.layer_of_node
    code = REPLAY.format(root=str(ROOT), runtime=runtime, path=str(path), steps=STEPS, layers=LAYERS)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))  # actors log to stdout too
    replayed = json.loads(line.removeprefix("RESULT "))
    assert replayed["stages"] == devices
    torch.testing.assert_close(replayed["losses"], losses, rtol=1e-6, atol=0)


def test_a_plan_for_another_model_is_refused(saved_plan):
    path, _, _ = saved_plan
    torchpar.init(cluster="local", num_hosts=2, devices_per_host=4)
    try:
        torch.manual_seed(0)
        model, batch = gpt2(num_layers=1)
        with pytest.raises(ValueError, match="the plan was made for another graph"):
            torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.05), example_batch=batch,
                             method=torchpar.Plan.from_json(path.read_text()))
    finally:
        torchpar.init(cluster="local", num_devices=8)

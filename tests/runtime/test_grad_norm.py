"""``engine.last_metrics.grad_norm``: the global L2 norm of the step's gradients before clipping — what
``torch.nn.utils.clip_grad_norm_`` returns — under every method, with and without clipping."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torchpar

STEPS = 3
RTOL = 1e-6
"""float32 sums of squares in another order (per shard, per stage): a few ulps of the norm."""


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 32)
        self.fc2 = torch.nn.Linear(32, 4)

    def forward(self, x, y):
        h = torchpar.mark_pipeline_boundary(torch.tanh(self.fc1(x)))
        return F.mse_loss(self.fc2(h), y)


def _pipeline() -> torchpar.PipeshardParallel:
    stages = torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)),
                                        submesh_physical_shapes=((1, 4), (1, 4)),
                                        submesh_logical_shapes=((1, 4), (1, 4)))
    return torchpar.PipeshardParallel(num_micro_batches=2, layer_option="manual", stage_option=stages)


METHODS = {
    "one-device": lambda: None,
    "dp": lambda: torchpar.DataParallel(mesh_shape=(1, 4)),
    "zero2": lambda: torchpar.Zero2Parallel(mesh_shape=(1, 4)),
    "megatron": lambda: torchpar.MegatronParallel(mesh_shape=(1, 4)),
    "pipeshard": _pipeline,
}
CASES = [(method, None) for method in METHODS] + [("dp", 0.05), ("pipeshard", 0.05), ("one-device", 0.05)]


@pytest.mark.parametrize("method, clip", CASES, ids=[f"{m}-clip{c}" for m, c in CASES])
def test_grad_norm_is_what_clip_grad_norm_returns(method, clip):
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    batch = (torch.randn(16, 8), torch.randn(16, 4))
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                              method=METHODS[method](), grad_clip_norm=clip)
    norms, expected = [], []
    with engine:
        for _ in range(STEPS):
            torch_optimizer.zero_grad()
            reference(*batch).backward()
            expected.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(),
                                                                 clip if clip is not None else float("inf"))))
            torch_optimizer.step()
            engine.step(batch)
            norms.append(engine.last_metrics.grad_norm)
    if clip is not None:
        assert all(n > clip for n in expected), "the case must clip"
    torch.testing.assert_close(norms, expected, rtol=RTOL, atol=0)

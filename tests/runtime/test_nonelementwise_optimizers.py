"""Adafactor and Muon, whose update reads a whole tensor (row and column means, RMS norms; Newton–Schulz matrix
products), train a small MLP on 4 devices as PyTorch trains it.

A per-device (``shard_map``) step updates each device's piece of a parameter from its pieces alone, which is wrong
for them: a plan that shards a parameter, its gradient or its optimizer state (ZeRO-3 all three, ZeRO-2 the
gradient and the state) runs under GSPMD instead, with a warning naming the optimizer and the parameters
(:meth:`torchpar.runtime.one_stage.programs.OneStageProgram._shard_map_layouts`); data parallelism replicates the
parameters, so its per-device step updates them whole and stays. ``spmd="shard_map"`` on a sharded plan is refused
with the same reason. Adafactor's factored state of a sharded matrix (torch's ``row_var`` (n, 1), ``col_var``
(1, m)) is placed whole along those dims. Losses, parameters and the optimizer state written back in torch's format
match PyTorch within 1e-5 over 4 steps.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F

import torchpar

STEPS = 4
RTOL, ATOL = 1e-5, 1e-6
"""float32 matmuls of the model in another order (XLA's, sharded) and Muon's bfloat16 iteration on gradients that
differ by those ulps."""


class MLP(torch.nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16, bias=bias)
        self.fc2 = torch.nn.Linear(16, 4, bias=bias)

    def forward(self, x, y):
        return F.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


OPTIMIZERS = {
    # biases: Adafactor's unfactored "variance" path; lr, weight_decay and d exercise its relative step and clipping
    "adafactor": (True, lambda ps: torch.optim.Adafactor(ps, lr=0.02, weight_decay=0.1, d=1.5)),
    # Muon takes matrices only
    "muon": (False, lambda ps: torch.optim.Muon(ps, lr=0.01, momentum=0.9, adjust_lr_fn="match_rms_adamw")),
}
METHODS = {
    "zero3": lambda: torchpar.Zero3Parallel(mesh_shape=(1, 4)),
    "zero2": lambda: torchpar.Zero2Parallel(mesh_shape=(1, 4)),
    "dp": lambda: torchpar.DataParallel(mesh_shape=(1, 4)),
}
CASES = [("adafactor", "zero3", "gspmd"), ("adafactor", "dp", "shard_map"), ("muon", "zero3", "gspmd"),
         ("muon", "zero2", "gspmd")]


@pytest.mark.parametrize("optimizer, method, spmd", CASES, ids=[f"{o}-{m}" for o, m, _ in CASES])
def test_trains_as_pytorch_on_four_devices(optimizer, method, spmd, caplog):
    bias, make_optimizer = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    model = MLP(bias)
    reference = copy.deepcopy(model)
    torch_optimizer = make_optimizer(list(reference.parameters()))
    ours = make_optimizer(list(model.parameters()))
    batch = (torch.randn(16, 8), torch.randn(16, 4))
    with caplog.at_level(logging.WARNING, logger="torchpar"):
        engine = torchpar.compile(model, ours, example_batch=batch, method=METHODS[method]())
    losses, expected = [], []
    with engine:
        for _ in range(STEPS):
            torch_optimizer.zero_grad()
            loss = reference(*batch)
            loss.backward()
            torch_optimizer.step()
            expected.append(loss.item())
            losses.append(engine.step(batch).item())
        assert engine.spmd_mode == spmd
        engine.sync_to_torch()
    fallback = [r.getMessage() for r in caplog.records if "not elementwise" in r.getMessage()]
    if spmd == "gspmd":
        name = "Adafactor" if optimizer == "adafactor" else "Muon"
        assert len(fallback) == 1 and f"optimizer {name}'s update is not elementwise" in fallback[0], fallback
        assert "fc1.weight" in fallback[0], fallback[0]
    else:
        assert not fallback
    torch.testing.assert_close(losses, expected, rtol=RTOL, atol=0)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=RTOL, atol=ATOL, msg=name)
    for p, q in zip(reference.parameters(), model.parameters()):
        theirs, mine = torch_optimizer.state[p], ours.state[q]
        assert list(mine) == list(theirs)
        for key, value in theirs.items():
            assert (mine[key].dtype, mine[key].shape) == (value.dtype, value.shape), key
            torch.testing.assert_close(mine[key], value, rtol=RTOL, atol=ATOL, msg=key)


def test_per_device_step_is_refused_for_a_sharded_muon():
    model = MLP(bias=False)
    optimizer = torch.optim.Muon(list(model.parameters()), lr=0.01)
    batch = (torch.randn(16, 8), torch.randn(16, 4))
    with pytest.raises(ValueError, match=r"spmd='shard_map' cannot run this plan:\s+optimizer Muon's update is not "
                                         r"elementwise.*sharded: fc1\.weight, fc2\.weight"):
        torchpar.compile(model, optimizer, example_batch=batch, method=torchpar.Zero3Parallel(mesh_shape=(1, 4)),
                         spmd="shard_map")

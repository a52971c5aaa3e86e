"""The compile phases' progress bar: redrawn while a long phase runs (no silence on a terminal), naming what deep
code is doing (``progress.note``), and off with ``TORCHPAR_QUIET=1``; ``torchpar.plan`` shows one too."""

from __future__ import annotations

import time

import torch

import torchpar
from torchpar import progress
def test_a_running_phase_is_redrawn_and_says_what_it_does(monkeypatch, capfd):
    monkeypatch.setenv("TORCHPAR_PROGRESS", "1")  # forced on without a TTY
    monkeypatch.setattr(progress, "TICK_S", 0.05)
    phases = progress.CompilePhases(("capture", "plan"), "compiling the training step")
    with phases.phase("plan"):
        progress.note("measuring the links")
        time.sleep(0.6)
    phases.close()
    progress.note("outside any phase: nowhere to show it")
    err = capfd.readouterr().err
    assert err.count("plan: measuring the links") >= 5  # redrawn every tick while the phase ran
    assert "outside any phase" not in err


def test_quiet_turns_it_off(monkeypatch, capfd):
    monkeypatch.setenv("TORCHPAR_PROGRESS", "1")
    monkeypatch.setenv("TORCHPAR_QUIET", "1")
    phases = progress.CompilePhases(("capture",), "compiling the training step")
    with phases.phase("capture"):
        pass
    phases.close()
    assert capfd.readouterr().err == ""


def test_planning_shows_its_phases(monkeypatch, capfd):
    monkeypatch.setenv("TORCHPAR_PROGRESS", "1")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    torchpar.plan(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(8, 8),
                  loss_fn=lambda out, batch: out.mean(), method=torchpar.DataParallel(mesh_shape=(1, 2)))
    err = capfd.readouterr().err
    assert "torchpar: planning the training step" in err and "capture" in err and "plan" in err

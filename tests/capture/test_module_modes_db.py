"""PyTorch's own module database (``torch.testing._internal.common_modules.module_db``), the modules whose train and
eval modes differ — batch and instance norms (running statistics used or updated), transformer layers and
MultiheadAttention (dropout, the fast path), RNNs (dropout between layers) — trained in the mode the test leaves
them in, beside PyTorch eager: the losses, parameters and buffers of two SGD steps within 1e-5, and the module's
``training`` flags untouched by ``compile``.

A module instance of the database is used when it has parameters to train and its call passes tensors only as
positional arguments (keyword options such as ``need_weights=False`` are bound into the ``step_fn``). Train mode is
compared for the modules that are deterministic there (no active dropout)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.testing._internal.common_modules import module_db

import torchpar
from torchpar.capture.semantics.grad_semantics import module_modes

TOL = 1e-5  # float32: losses over whole 3-d volumes and sequence sums after an SGD step; measured ≤ 2e-6
MODE_DEPENDENT = ("nn.BatchNorm1d", "nn.BatchNorm2d", "nn.BatchNorm3d", "nn.InstanceNorm1d", "nn.InstanceNorm2d",
                  "nn.InstanceNorm3d", "nn.TransformerEncoderLayer", "nn.TransformerDecoderLayer",
                  "nn.TransformerEncoder", "nn.MultiheadAttention", "nn.RNN", "nn.GRU", "nn.LSTM")


@pytest.fixture(scope="module", autouse=True)
def session_cluster():
    torchpar.init(cluster="local", num_devices=8)


def _has_active_dropout(module: torch.nn.Module) -> bool:
    rate = getattr(module, "dropout", 0)  # RNNs and MultiheadAttention keep a rate, not a Dropout module
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in module.modules()) or \
        (isinstance(rate, float) and rate > 0)


def _cases(training: bool):
    """(id, ModuleInfo, ModuleInput) — the first usable instance of each mode-dependent module."""
    cases = []
    for info in module_db:
        if info.name not in MODE_DEPENDENT:
            continue
        for number, module_input in enumerate(info.module_inputs_func(info, device="cpu", dtype=torch.float32,
                                                                      requires_grad=False, training=training)):
            forward = module_input.forward_input
            if not forward.args or not all(isinstance(a, torch.Tensor) for a in forward.args):
                continue
            if any(isinstance(v, torch.Tensor) for v in forward.kwargs.values()):
                continue
            torch.manual_seed(0)
            module = info.module_cls(*module_input.constructor_input.args, **module_input.constructor_input.kwargs)
            if not any(p.requires_grad for p in module.parameters()):
                continue
            if training and _has_active_dropout(module):
                continue
            cases.append(pytest.param(info, module_input, id=f"{info.name}-{number}"))
            break
    return cases


def _loss(outputs) -> torch.Tensor:
    first = outputs[0] if isinstance(outputs, tuple) else outputs
    return (first * first).mean()


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_mode_dependent_modules_train_in_their_mode(training):
    cases = _cases(training)
    assert len(cases) >= (10 if not training else 7), [c.id for c in cases]
    for case in cases:
        info, module_input = case.values
        torch.manual_seed(0)
        module = info.module_cls(*module_input.constructor_input.args, **module_input.constructor_input.kwargs)
        module.train(training)
        for buffer in module.buffers():  # running statistics away from 0 / 1, so using them (or not) shows
            if buffer.is_floating_point():
                buffer.uniform_(0.5, 1.5)
        reference = copy.deepcopy(module)
        modes = module_modes(module)
        args, options = tuple(module_input.forward_input.args), dict(module_input.forward_input.kwargs)

        def step_fn(model, batch, options=options):
            return _loss(model(*batch, **options))

        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        with torchpar.compile(module, torch.optim.SGD(module.parameters(), lr=0.1), example_batch=args,
                              step_fn=step_fn) as engine:
            assert module_modes(module) == modes, case.id
            for step in range(2):
                ref_opt.zero_grad()
                expected = step_fn(reference, args)
                expected.backward()
                ref_opt.step()
                assert engine.step(args) == pytest.approx(expected.item(), rel=TOL, abs=TOL), f"{case.id} step {step}"
            engine.sync_to_torch()
        for (name, want), got in zip(reference.state_dict().items(), module.state_dict().values()):
            torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, msg=f"{case.id}: {name}")
        assert module_modes(module) == modes, case.id

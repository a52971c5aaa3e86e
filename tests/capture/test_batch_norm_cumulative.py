"""``BatchNorm(momentum=None)`` (a cumulative moving average of the batch statistics) trains as PyTorch: its factor
``1 / num_batches_tracked`` is captured as a tensor (:mod:`torchpar.capture.semantics.batch_norm`), where PyTorch's own
forward takes ``float()`` of the buffer, which torch.export cannot trace."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from tests.capture.beside_pytorch import trained_beside_pytorch



def _net(dims: int) -> nn.Module:
    torch.manual_seed(0)
    if dims == 1:
        return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8, momentum=None), nn.ReLU(), nn.Linear(8, 1))
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=None), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 5 * 5, 1))


def _loss(outputs, batch):
    return outputs.pow(2).mean()


@pytest.mark.parametrize("dims", [1, 2])
@pytest.mark.parametrize("method", [None, "data_parallel", "pipeline"])
def test_a_cumulative_batch_norm_trains_and_tracks_as_pytorch(dims, method):
    model = _net(dims)
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    shape = (8, 6) if dims == 1 else (8, 3, 5, 5)
    batches = [torch.randn(*shape, generator=generator) for _ in range(3)]
    # the convolution's XLA arithmetic drifts 2e-6 from ATen's by the third step, with momentum=0.1 alike
    with trained_beside_pytorch(model, reference, batches, lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                                method=method, loss_fn=_loss,
                                rel=1e-6 if dims == 1 else 1e-5) as engine:
        norm, torch_norm = model[1], reference[1]
        assert int(norm.num_batches_tracked) == int(torch_norm.num_batches_tracked) == 3
        torch.testing.assert_close(norm.running_mean, torch_norm.running_mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(norm.running_var, torch_norm.running_var, rtol=1e-6, atol=1e-6)
        reference.eval()
        torch.testing.assert_close(engine.forward(batches[0]), reference(batches[0]), rtol=1e-5, atol=1e-6)


def _module_db_cumulative_norms() -> list:
    """PyTorch's own ``module_db`` instances of BatchNorm1d/2d/3d built with ``momentum=None``."""
    from torch.testing._internal.common_modules import module_db

    cases = []
    for info in module_db:
        if not info.name.startswith("nn.BatchNorm"):
            continue
        for number, sample in enumerate(info.module_inputs_func(info, device="cpu", dtype=torch.float32,
                                                                requires_grad=False, training=True)):
            args, kwargs = sample.constructor_input.args, sample.constructor_input.kwargs
            if (args[2] if len(args) > 2 else kwargs.get("momentum", 0.1)) is None:
                cases.append(pytest.param(info, sample, id=f"{info.name}-{number}"))
    return cases


@pytest.mark.parametrize("info, sample", _module_db_cumulative_norms())
def test_module_db_cumulative_batch_norms_train_as_pytorch(info, sample):
    torch.manual_seed(0)
    model = info.module_cls(*sample.constructor_input.args, **sample.constructor_input.kwargs)
    reference = copy.deepcopy(model)
    x = sample.forward_input.args[0]
    batches = [x * (k + 1) + k for k in range(3)]  # statistics that move from step to step
    with trained_beside_pytorch(model, reference, batches, lambda params: torch.optim.SGD(params, lr=0.1),
                                method=None, loss_fn=_loss):
        for buffer in ("running_mean", "running_var", "num_batches_tracked"):
            torch.testing.assert_close(getattr(model, buffer), getattr(reference, buffer), rtol=1e-6, atol=1e-6)

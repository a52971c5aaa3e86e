"""A model trained by torchpar beside a copy trained by PyTorch eager, step by step, with equal losses asserted (the
helper of the semantics tests that compare one construct under one device and DataParallel)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

import torchpar


def _two_stages() -> torchpar.PipeshardParallel:
    stages = torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)), submesh_physical_shapes=((1, 4),) * 2,
                                        submesh_logical_shapes=((1, 4),) * 2)
    return torchpar.PipeshardParallel(num_micro_batches=1, layer_option=torchpar.AutoLayerOption(layer_num=2),
                                      stage_option=stages)


METHODS: dict[str | None, Callable[[], Any]] = {None: lambda: None,
                                                 "data_parallel": lambda: torchpar.DataParallel(mesh_shape=(1, 4)),
                                                 "pipeline": _two_stages}


@contextlib.contextmanager
def trained_beside_pytorch(model: torch.nn.Module, reference: torch.nn.Module, batches: Sequence[Any],
                           make_optimizer: Callable[[Any], torch.optim.Optimizer], *, method: str | None,
                           loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
                           rel: float = 1e-6) -> Iterator[Any]:
    """Compile ``model`` under ``method`` (:data:`METHODS`: one device, ``DataParallel`` on 4 devices, or a pipeline
    of two stages on 4 devices each), then for each batch step it and ``reference`` (a copy, trained by PyTorch with
    the same optimizer) and assert the losses equal within ``rel``; yields the engine, still open, for checks of the
    state."""
    optimizer = make_optimizer(reference.parameters())
    method = METHODS[method]()
    with torchpar.compile(model, make_optimizer(model.parameters()), example_batch=batches[0], loss_fn=loss_fn,
                          method=method) as engine:
        for batch in batches:
            optimizer.zero_grad()
            expected = reference(batch) if loss_fn is None else loss_fn(reference(batch), batch)
            expected.backward()
            optimizer.step()
            assert engine.step(batch).item() == pytest.approx(expected.item(), rel=rel)
        yield engine


def assert_same_parameters(model: torch.nn.Module, reference: torch.nn.Module, tolerance: float = 1e-6) -> None:
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)


def assert_trains_as_pytorch(model: torch.nn.Module, reference: torch.nn.Module, batches: Sequence[Any],
                             make_optimizer: Callable[[Any], torch.optim.Optimizer], *, method: str | None,
                             rel: float = 1e-6) -> None:
    """:func:`trained_beside_pytorch` to the end, then the parameters compared (within 1e-6)."""
    with trained_beside_pytorch(model, reference, batches, make_optimizer, method=method, rel=rel):
        pass
    assert_same_parameters(model, reference)

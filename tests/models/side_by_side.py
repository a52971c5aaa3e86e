"""An HF causal-LM trained the same way by PyTorch eager and by torchpar: AdamW, ``model(**batch).loss``, the losses
of each step (the helpers the parallel-training tests compare)."""

from __future__ import annotations

from typing import Any, Callable

import torch

import torchpar


def pytorch_losses(make: Callable[[], torch.nn.Module], batch: dict, steps: int, lr: float = 1e-3) -> list[float]:
    """The losses of ``steps`` AdamW steps of PyTorch eager on a model from ``make()`` (seeded 0)."""
    torch.manual_seed(0)
    model = make()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def torchpar_losses(make: Callable[[], torch.nn.Module], batch: dict, method: Any, steps: int, lr: float = 1e-3,
                    **options: Any) -> tuple[list[float], Any]:
    """The losses of ``steps`` AdamW steps of torchpar under ``method`` on a model from ``make()`` (seeded 0), and
    the engine."""
    torch.manual_seed(0)
    model = make()
    engine = torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=lr), example_batch=batch,
                              method=method, **options)
    return [engine.step(batch).item() for _ in range(steps)], engine

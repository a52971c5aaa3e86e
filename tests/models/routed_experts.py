"""A mixture-of-experts model that is neither HF nor a transformer, for the grouped matmul's semantics tests."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch


class RoutedExperts(torch.nn.Module):
    """Not a transformer: BatchNorm (train mode), a top-1 router and two expert matmuls by ``torch._grouped_mm``
    (its shape function takes bf16 operands only), rows sorted by expert and put back with ``index_put``."""

    def __init__(self, experts: int = 4, width: int = 8, hidden: int = 16):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(width)
        self.router = torch.nn.Linear(width, experts)
        self.w1 = torch.nn.Parameter(torch.randn(experts, width, hidden) * 0.3)
        self.w2 = torch.nn.Parameter(torch.randn(experts, hidden, width) * 0.3)
        self.experts = experts

    def forward(self, x, y):
        h = self.norm(x)
        expert = self.router(h).argmax(-1)
        order = torch.argsort(expert, stable=True)
        counts = torch.histc(expert.float(), bins=self.experts, min=0, max=self.experts - 1)  # a static shape
        offs = torch.cumsum(counts, 0).to(torch.int32)
        bf16 = torch.bfloat16
        mid = torch._grouped_mm(h[order].to(bf16), self.w1.to(bf16), offs=offs).float()
        out = torch._grouped_mm(torch.relu(mid).to(bf16), self.w2.to(bf16), offs=offs).float()
        return torch.nn.functional.mse_loss(torch.empty_like(out).index_put((order,), out) + h, y)


def train_like_pytorch(method: Any, rows: int, steps: int = 4, lr: float = 1e-2,
                       inspect: Callable[[Any], None] | None = None, compile_options: dict | None = None,
                       **sizes: int) -> tuple[list[float], list[float], RoutedExperts, RoutedExperts]:
    """:class:`RoutedExperts` (seed 0; ``sizes``: its ``experts``/``width``/``hidden``) trained ``steps`` AdamW steps
    on one ``[rows, width]`` batch by PyTorch eager and by torchpar under ``method`` (and ``compile_options``).
    Returns ``(torchpar's losses, eager's losses, torchpar's model synced back, eager's model)``; ``inspect(engine)``
    runs before the engine closes."""
    import torchpar

    torch.manual_seed(0)
    model = RoutedExperts(**sizes)
    width = sizes.get("width", 8)
    x, y = torch.randn(rows, width), torch.randn(rows, width)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=lr)
    expected = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = reference(x, y)
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    with torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=lr), example_batch=(x, y),
                          method=method, **(compile_options or {})) as engine:
        losses = [float(engine.step((x, y))) for _ in range(steps)]
        engine.sync_to_torch()
        if inspect is not None:
            inspect(engine)
    return losses, expected, model, reference

"""Capturing a model prints nothing that is not the user's: torch's own deprecation warnings raised inside the
export and decomposition torchpar runs are filtered at that call, and only there."""

from __future__ import annotations

import warnings

import torch

from torchpar.capture.export import capture_train_step


class _Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        warnings.warn("the user's own warning", UserWarning, stacklevel=1)
        return ((self.lin(x) - y) ** 2).mean()


def test_a_capture_warns_only_what_the_model_warns():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        capture_train_step(_Regression(), (torch.randn(2, 4), torch.randn(2, 4)))
    messages = {str(w.message) for w in caught}
    assert not any("LeafSpec" in m for m in messages), messages
    assert "the user's own warning" in messages  # the user's warnings are not filtered

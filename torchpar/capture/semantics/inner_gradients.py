"""A gradient taken inside the training step — ``torch.autograd.grad(..., create_graph=True)`` for a gradient
penalty (WGAN-GP, R1), an input-gradient regulariser, a MAML inner step, ``torch.func.grad`` / ``vjp``, or a
``.backward()`` in ``forward`` — refused while the step is captured, naming the call's line.

torch.export traces the forward only: the autograd engine run inside it either fails in torch's internals ("a fake
tensor in the exported program constant's list") or leaves the inner gradient's ops in the graph in a form whose
derivative torchpar has not been shown to match PyTorch's. Until double backward is supported, every such call stops
the capture at once with :class:`~torchpar.capture.errors.CaptureError`. ``torch.autograd.grad`` and
``Tensor.backward`` both run the engine through ``torch.autograd._engine_run_backward`` (looked up at each call), so a
``grad`` imported by name before the capture is caught too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NoReturn

import torch.autograd

from torchpar.capture.errors import CaptureError
from torchpar.capture.semantics.grad_semantics import user_line


@contextlib.contextmanager
def refusing_inner_gradients(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, running the autograd engine raises :class:`CaptureError` naming the user's line."""
    original = torch.autograd._engine_run_backward

    def refuse(*args: object, **kwargs: object) -> NoReturn:
        raise CaptureError(
            f"{type(model).__name__}'s step takes a gradient inside itself\n  at {user_line()}\n"
            "Why: torchpar captures the step's forward with torch.export and differentiates it once (jax.grad); a "
            "gradient computed inside the step (torch.autograd.grad with create_graph=True for a gradient penalty, "
            "R1 or an input-gradient term; torch.func.grad / vjp; a .backward() in forward) would need "
            "differentiating twice, which torchpar does not support yet.\n"
            "Fix: train this step in PyTorch, or drop the term (a penalty computed from the outputs alone, such as "
            "weight clipping between steps, captures fine)."
        )

    torch.autograd._engine_run_backward = refuse
    try:
        yield
    finally:
        torch.autograd._engine_run_backward = original

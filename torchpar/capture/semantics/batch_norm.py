"""``BatchNorm(momentum=None)``: the cumulative moving average, captured with its factor as a tensor.

PyTorch's ``_BatchNorm.forward`` computes that average's factor as ``1.0 / float(self.num_batches_tracked)``: a
Python float of a buffer's value, which ``torch.export`` cannot trace (a data-dependent value). While a training step
is captured, each such module in train mode runs :func:`_cumulative_forward` instead — the same arithmetic with
``1 / num_batches_tracked`` kept a 0-d tensor:

    num_batches_tracked += 1;  f = 1 / num_batches_tracked
    y = batch_norm(x, momentum=0) over the batch's statistics (the running buffers passed, left unchanged)
    running_mean = (1 − f)·running_mean + f·mean(x);  running_var = (1 − f)·running_var + f·var_unbiased(x)

over every dim but the channels (dim 1), which is what ATen's batch-norm kernel writes into the running buffers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import MethodType

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm


def _cumulative_forward(self: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
    # tracking its statistics (:func:`_cumulative`): the running buffers are there
    assert self.running_mean is not None and self.running_var is not None and self.num_batches_tracked is not None
    self._check_input_dim(input)
    self.num_batches_tracked.add_(1)
    # the running buffers passed with a factor of 0 (left as they are): the same batch-norm op, and so the same
    # lowering, as an exponential average's; the cumulative update follows
    output = F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, True, 0.0, self.eps)
    with torch.no_grad():
        dims = [0, *range(2, input.dim())]
        factor = (1.0 / self.num_batches_tracked).to(self.running_mean.dtype)
        mean = input.mean(dims).to(self.running_mean.dtype)
        var = input.var(dims, correction=1).to(self.running_var.dtype)
        self.running_mean.mul_(1 - factor).add_(mean * factor)
        self.running_var.mul_(1 - factor).add_(var * factor)
    return output


def _cumulative(module: torch.nn.Module) -> bool:
    return (
        isinstance(module, _BatchNorm)
        and module.momentum is None
        and module.training
        and module.track_running_stats
        and module.num_batches_tracked is not None
        and "forward" not in vars(module)
    )  # a forward of the user's own stays


@contextlib.contextmanager
def cumulative_batch_norms(root: torch.nn.Module) -> Iterator[int]:
    """Within the block, every ``BatchNorm(momentum=None)`` of ``root`` in train mode (tracking its statistics)
    runs :func:`_cumulative_forward`; yields how many. Restored on exit."""
    patched = [module for module in root.modules() if _cumulative(module)]
    for module in patched:
        module.forward = MethodType(_cumulative_forward, module)
    try:
        yield len(patched)
    finally:
        for module in patched:
            del module.forward

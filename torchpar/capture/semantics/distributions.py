"""``torch.distributions`` inside a captured step: argument validation off while the step is captured.

A distribution built with validation on (PyTorch's default, ``Distribution(validate_args=None)`` under ``__debug__``)
checks its parameters' *values* against their constraints (``Normal``'s scale > 0) with a Python ``bool`` of a tensor,
which torch.export cannot trace (a data-dependent guard); the compiled step could not raise on a value anyway. So
while the step is captured the default is off: a VAE's ``Normal(mu, sigma).rsample()`` or an RL policy's
``Categorical(logits=...)`` captures as the computation it is. A distribution given ``validate_args=True``
explicitly keeps it (and fails to capture, naming the line). The samplers (``normal_``, ``uniform_``,
``exponential_``) are lowered with torchpar's per-step PRNG key: their statistics are PyTorch's, their bits are not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.distributions import Distribution


@contextlib.contextmanager
def unvalidated_distributions() -> Iterator[None]:
    """Within the block, distributions built without ``validate_args`` do not validate their arguments."""
    default = Distribution._validate_args
    Distribution.set_default_validate_args(False)
    try:
        yield
    finally:
        Distribution.set_default_validate_args(default)

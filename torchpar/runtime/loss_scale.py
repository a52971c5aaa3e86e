"""Dynamic loss scaling for fp16 training, with ``torch.amp.GradScaler``'s rules.

The scale ``S`` (float32) multiplies the loss before the backward; the gradients are multiplied by ``1/S``
(computed in float64, rounded to float32, as GradScaler's ``unscale_``) before clipping and the update. After
each step (``_amp_update_scale_``)::

    gradients held an inf/nan:  the update was skipped;  S ← S·backoff_factor;  tracker ← 0
    otherwise:                  tracker ← tracker + 1;   if tracker == growth_interval: S ← S·growth_factor,
                                                                                        tracker ← 0

(the growth is kept only if ``S·growth_factor`` is finite). Defaults are GradScaler's: ``S₀ = 2¹⁶``, growth 2,
backoff ½, interval 2000. The scale lives on the host: each step reads it as a runtime scalar (no recompile)
and the executable reports whether the step was finite.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping

import numpy as np

log = logging.getLogger(__name__)


@dataclasses.dataclass
class LossScaler:
    """The scale and growth tracker of a dynamic loss scale (see the module docstring)."""

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_tracker: int = 0

    def __post_init__(self) -> None:
        if not self.scale > 0 or not np.isfinite(self.scale):
            raise ValueError(f"the initial loss scale must be positive and finite, got {self.scale}")
        if not self.growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0.0 < self.backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.growth_interval < 1:
            raise ValueError(f"growth_interval must be ≥ 1, got {self.growth_interval}")
        self.scale = float(np.float32(self.scale))

    def step_input(self) -> np.ndarray:
        """``[S, 1/S]`` as float32, the step's loss-scale scalar."""
        inverse = np.float32(1.0 / np.float64(self.scale))
        return np.array([self.scale, inverse], dtype=np.float32)

    def update(self, finite: bool) -> None:
        """Back off after a non-finite step, grow after ``growth_interval`` finite ones in a row."""
        if not finite:
            self.scale = float(np.float32(self.scale) * np.float32(self.backoff_factor))
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            grown = np.float32(self.scale) * np.float32(self.growth_factor)
            if np.isfinite(grown):
                self.scale = float(grown)
            self.growth_tracker = 0

    def state_dict(self) -> dict[str, float | int]:
        """GradScaler's state-dict keys (``scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``,
        ``_growth_tracker``)."""
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self.growth_tracker,
        }

    def load_state_dict(self, state: Mapping[str, float | int]) -> None:
        self.scale = float(state["scale"])
        self.growth_factor = float(state["growth_factor"])
        self.backoff_factor = float(state["backoff_factor"])
        self.growth_interval = int(state["growth_interval"])
        self.growth_tracker = int(state["_growth_tracker"])

    def after_step(self, step: int, finite: bool, loss: float) -> bool:
        """:meth:`update` after step ``step``; whether it overflowed: its gradients were not finite but its loss was
        (expected now and then under fp16 scaling: the update was skipped, the scale backs off, training goes on)."""
        self.update(finite)
        overflowed = not finite and bool(np.isfinite(loss))
        if overflowed:
            log.info("torchpar: step %d overflowed in fp16; update skipped, loss scale now %g", step, self.scale)
        return overflowed

"""A measured pipeline step: each stage's compute blocks, as ``engine.last_timeline`` returns them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTimeline:
    """Compute blocks ``(op, micro_batch, start_s, end_s)`` of each stage in the last step, in seconds since
    the driver issued it, and the step's wall time ``makespan`` (s). Drawn by ``plan.save_html(...,
    timeline=engine.last_timeline)``."""

    blocks: list[list[tuple[str, int, float, float]]]
    makespan: float

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the stages' time between the first and the last compute block of the step."""
        starts = [b[2] for stage in self.blocks for b in stage]
        ends = [b[3] for stage in self.blocks for b in stage]
        if not starts:
            return 0.0
        span = max(ends) - min(starts)
        busy = sum(b[3] - b[2] for stage in self.blocks for b in stage)
        return 1.0 - busy / (span * len(self.blocks)) if span > 0 else 0.0

"""A measured pipeline step: each stage's compute blocks and where the rest of its time went, as
``engine.last_timeline`` returns them.

Every stage thread records, besides its compute blocks, spans of the other things it does
(:data:`SPAN_KINDS`): waiting for a neighbour's message, copying a received message into device arrays,
sending, placing its micro-batch inputs, and dispatching a jitted call (the thread's own CPU time in it:
Python, arguments, XLA's launch). :meth:`StepTimeline.breakdown` adds them up per stage; what no span covers
is the interpreter's own Python between instructions (``interpreter``), the time before the stage's
first instruction (``launch``: the driver's call reaching the worker, the batch's transfer, thread
start) and after its last (``tail``: tied gradients, the update, the report's way back), so the parts
sum to the step's wall time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

SPAN_KINDS = ("dispatch", "input", "send", "recv_wait", "recv_copy")
"""Non-compute spans a stage records: ``dispatch`` (the CPU time the stage's thread spent in a jitted call: Python,
argument handling, XLA's launch — the rest of the call's wall time, until its result is ready, is compute),
``input`` (the micro-batch inputs put on the stage's devices), ``send`` (handing a message to the transport:
device-to-host copies, serialization, the Ray call), ``recv_wait`` (blocked until the neighbour's message
arrived), ``recv_copy`` (building the received values' device arrays)."""

BREAKDOWN_KEYS = ("launch", "compute", *SPAN_KINDS, "interpreter", "tail")
"""The parts of :meth:`StepTimeline.breakdown`, which sum to the step's wall time for each stage."""


@dataclass
class StepTimeline:
    """Compute blocks ``(op, micro_batch, start_s, end_s)`` of each stage in the last step, in seconds since
    the driver issued it, and the step's wall time ``makespan`` (s). Drawn by ``plan.save_html(...,
    timeline=engine.last_timeline)``. ``spans``: each stage's non-compute spans ``(kind, micro_batch,
    start_s, end_s)`` (kinds :data:`SPAN_KINDS`), which never overlap its compute blocks."""

    blocks: list[list[tuple[str, int, float, float]]]
    makespan: float
    spans: list[list[tuple[str, int, float, float]]] = field(default_factory=list)

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

    def breakdown(self) -> list[dict[str, float]]:
        """Per stage, seconds of the step in each of :data:`BREAKDOWN_KEYS` (see the module docstring); each
        stage's parts sum to ``makespan``. A stage with no recorded activity is all ``launch``."""
        result = []
        for index, blocks in enumerate(self.blocks):
            spans = self.spans[index] if index < len(self.spans) else []
            parts = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
            everything = [*blocks, *spans]
            if not everything:
                parts["launch"] = self.makespan
                result.append(parts)
                continue
            first = min(e[2] for e in everything)
            last = max(e[3] for e in everything)
            parts["launch"] = first
            parts["tail"] = self.makespan - last
            parts["compute"] = sum(b[3] - b[2] for b in blocks)
            for kind, _, start, end in spans:
                parts[kind] += end - start
            parts["interpreter"] = (last - first) - sum(parts[k] for k in ("compute", *SPAN_KINDS))
            result.append(parts)
        return result


class StageClock:
    """Records one stage's compute blocks and non-compute spans during a step, in seconds since the step's
    ``start_time`` (a ``time.time()``)."""

    def __init__(self, start_time: float):
        self.start_time = start_time
        self.blocks: list[tuple[str, int, float, float]] = []
        self.spans: list[tuple[str, int, float, float]] = []

    def span(self, kind: str, micro_batch: int, begin: float, end: float) -> None:
        """A non-compute span from ``begin`` to ``end`` (``time.time()`` values)."""
        if end > begin:
            self.spans.append((kind, micro_batch, begin - self.start_time, end - self.start_time))

    def block(self, op: str, micro_batch: int, begin: float, end: float) -> None:
        """A compute block from ``begin`` to ``end`` (``time.time()`` values)."""
        self.blocks.append((op, micro_batch, begin - self.start_time, end - self.start_time))

    @staticmethod
    def start() -> tuple[float, float]:
        """Now, as wall time and this thread's CPU time: the start of a jitted call."""
        return time.time(), time.thread_time()

    @staticmethod
    def dispatched(started: tuple[float, float]) -> float:
        """Seconds of this thread's CPU a call begun at ``started`` took: its dispatch. (Its wall time is no measure:
        on a CPU device the computation's threads run meanwhile, on the same cores.)"""
        return time.thread_time() - started[1]

    def compute(self, op: str, micro_batch: int, started: tuple[float, float], dispatch_s: float) -> None:
        """A jitted call begun at ``started`` (:meth:`start`) whose result is ready now: its first ``dispatch_s``
        seconds are a ``dispatch`` span, the rest a compute block."""
        launched = started[0] + dispatch_s
        self.span("dispatch", micro_batch, started[0], launched)
        self.block(op, micro_batch, launched, time.time())

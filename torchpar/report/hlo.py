"""Reading collectives out of optimized HLO text (``engine.hlo_text()``).

``collectives(hlo)`` lists every collective instruction with its kind, result shapes and bytes, so tests
and benchmarks can count communication in what XLA actually compiled. Async pairs (``*-start`` /
``*-done``) count once, at the start.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"f64": 8, "f32": 4, "f16": 2, "bf16": 2, "s64": 8, "s32": 4, "u32": 4, "s16": 2, "u16": 2, "s8": 1,
          "u8": 1, "pred": 1, "u64": 8}
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>\([^=]*?\)|[^\s(]+)\s+(?P<op>" + "|".join(KINDS) + r")(?P<start>-start)?\(")
_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")


@dataclass(frozen=True)
class Collective:
    kind: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    line: str

    @property
    def elements(self) -> int:
        return sum(math.prod(dims) for _, dims in self.shapes)

    @property
    def bytes(self) -> int:
        return sum(math.prod(dims) * _BYTES.get(dtype, 4) for dtype, dims in self.shapes)


def collectives(hlo: str) -> list[Collective]:
    """Every collective in ``hlo`` (result shapes; for async starts, the shapes of what is communicated)."""
    found = []
    for line in hlo.splitlines():
        line = _COMMENT.sub("", line)
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        shapes = tuple((m.group("dtype"), tuple(int(d) for d in m.group("dims").split(",") if d))
                       for m in _ARRAY.finditer(match.group("shape")))
        if match.group("start") and match.group("op") in ("all-gather", "collective-permute", "all-to-all") and len(shapes) > 1:
            shapes = shapes[len(shapes) // 2:]  # (operands, results) tuple of an async start: keep the results
        found.append(Collective(match.group("op"), shapes, line.strip()))
    return found


def count(hlo: str) -> Counter[str]:
    """Number of collective instructions of each kind."""
    return Counter(c.kind for c in collectives(hlo))


def bytes_by_kind(hlo: str) -> Counter[str]:
    """Bytes of collective results, by kind."""
    totals: Counter[str] = Counter()
    for c in collectives(hlo):
        totals[c.kind] += c.bytes
    return totals

"""Reading collectives out of optimized HLO text (``engine.hlo_text()``).

``collectives(hlo)`` lists every collective instruction with its kind, result shapes and bytes, so tests
and benchmarks can count communication in what XLA actually compiled. Async pairs (``*-start`` /
``*-done``) count once, at the start. ``Collective.groups`` are the participating device groups, as
logical ids of the executable's device assignment (``replica_groups={{0,1},{2,3}}``, the iota form
``replica_groups=[2,2]<=[4]`` / ``[2,2]<=[2,2]T(1,0)``, or a permute's ``source_target_pairs``).
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
_LIST_GROUPS = re.compile(r"(?:replica_groups|source_target_pairs)=\{(?P<groups>(?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")


@dataclass(frozen=True)
class Collective:
    kind: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    line: str

    @property
    def groups(self) -> list[list[int]]:
        """Device groups (logical ids) the collective runs over; empty when the instruction names none (then
        it spans every device of the executable)."""
        match = _LIST_GROUPS.search(self.line)
        if match:
            return [[int(x) for x in group.split(",") if x] for group in re.findall(r"\{([\d,]*)\}", match.group("groups"))]
        match = _IOTA_GROUPS.search(self.line)
        if match:
            import numpy as np

            shape = [int(x) for x in match.group("shape").split(",")]
            dims = [int(x) for x in match.group("dims").split(",")]
            ids = np.arange(math.prod(dims)).reshape(dims)
            if match.group("perm"):
                ids = ids.transpose([int(x) for x in match.group("perm").split(",")])
            return ids.reshape(shape).tolist()
        return []

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

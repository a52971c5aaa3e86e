"""Reading collectives out of optimized HLO text (``engine.hlo_text()``).

``collectives(hlo)`` lists every collective instruction with its kind, result shapes and bytes, so tests
and benchmarks can count communication in what XLA actually compiled. Async pairs (``*-start`` /
``*-done``) count once, at the start. ``Collective.groups`` are the participating device groups, as
logical ids of the executable's device assignment (``replica_groups={{0,1},{2,3}}``, the iota form
``replica_groups=[2,2]<=[4]`` / ``[2,2]<=[2,2]T(1,0)``, or a permute's ``source_target_pairs``).
``Collective.in_loop``: the instruction sits in a ``while`` loop's body (or a computation it calls), so it runs
once per iteration — e.g. once per micro-batch of a gradient-accumulation loop — not once per step.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {
    "f64": 8,
    "f32": 4,
    "f16": 2,
    "bf16": 2,
    "s64": 8,
    "s32": 4,
    "u32": 4,
    "s16": 2,
    "u16": 2,
    "s8": 1,
    "u8": 1,
    "pred": 1,
    "u64": 8,
}
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>\([^=]*?\)|[^\s(]+)\s+(?P<op>"
    + "|".join(KINDS)
    + r")(?P<start>-start)?\("
)
_COMMENT = re.compile(r"/\*.*?\*/")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_LIST_GROUPS = re.compile(r"(?:replica_groups|source_target_pairs)=\{(?P<groups>(?:\{[\d,]*\},?)*)\}")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_CALLED = re.compile(r"(?:body|condition|calls|to_apply)=%?(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(?P<shape>[\d,]+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")


@dataclass(frozen=True)
class Collective:
    kind: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]
    line: str
    in_loop: bool = False
    """In a ``while`` body or what it calls (runs once per iteration)."""
    runs: int = 1
    """Times it runs per execution of the program: the product of the known trip counts (XLA's
    ``known_trip_count``) of the loops around it; 1 outside loops and for a loop whose count XLA does not know."""

    @property
    def groups(self) -> list[list[int]]:
        """Device groups (logical ids) the collective runs over; empty when the instruction names none (then
        it spans every device of the executable)."""
        match = _LIST_GROUPS.search(self.line)
        if match:
            return [
                [int(x) for x in group.split(",") if x] for group in re.findall(r"\{([\d,]*)\}", match.group("groups"))
            ]
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
    looped = _loop_computations(hlo)
    computation = ""
    for line in hlo.splitlines():
        line = _COMMENT.sub("", line)
        header = _COMPUTATION.match(line)
        if header and "=" not in line.split("{", 1)[0].split("(", 1)[0]:
            computation = header.group("name")
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        shapes = tuple(
            (m.group("dtype"), tuple(int(d) for d in m.group("dims").split(",") if d))
            for m in _ARRAY.finditer(match.group("shape"))
        )
        if (
            match.group("start")
            and match.group("op") in ("all-gather", "collective-permute", "all-to-all")
            and len(shapes) > 1
        ):
            shapes = shapes[len(shapes) // 2 :]  # (operands, results) tuple of an async start: keep the results
        found.append(
            Collective(match.group("op"), shapes, line.strip(), computation in looped, looped.get(computation, 1))
        )
    return found


_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')


def _loop_computations(hlo: str) -> dict[str, int]:
    """The computations that run inside a ``while`` loop (every loop's body and condition, and what they call,
    transitively), each with the times it runs per execution of the program: the known trip counts of the loops
    on the way to it multiplied (the largest over the ways; an unknown count counts 1)."""
    edges: dict[str, list[tuple[str, int, bool]]] = {}  # caller → (callee, trip count, through a loop)
    called_somewhere: set[str] = set()
    computations: list[str] = []
    computation = ""
    for line in hlo.splitlines():
        line = _COMMENT.sub("", line)
        header = _COMPUTATION.match(line)
        if header and "=" not in line.split("{", 1)[0].split("(", 1)[0]:
            computation = header.group("name")
            computations.append(computation)
            continue
        called = {m.group("name") for m in _CALLED.finditer(line)}
        for branches in _BRANCHES.finditer(line):
            called |= {name.strip().lstrip("%") for name in branches.group("names").split(",") if name.strip()}
        loop = re.search(r"\swhile\(", line) is not None
        trips = _TRIP_COUNT.search(line) if loop else None
        for name in called:
            edges.setdefault(computation, []).append((name, int(trips.group("n")) if trips else 1, loop))
            called_somewhere.add(name)
    runs: dict[str, tuple[int, bool]] = {}
    stack = [(name, 1, False) for name in computations if name not in called_somewhere]
    while stack:
        name, count, in_loop = stack.pop()
        if name in runs and runs[name] >= (count, in_loop):
            continue
        runs[name] = (count, in_loop)
        stack.extend((callee, count * trips, in_loop or loop) for callee, trips, loop in edges.get(name, ()))
    return {name: count for name, (count, in_loop) in runs.items() if in_loop}


def count(hlo: str) -> Counter[str]:
    """Number of collective instructions of each kind."""
    return Counter(c.kind for c in collectives(hlo))

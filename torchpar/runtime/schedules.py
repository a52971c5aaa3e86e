"""Static pipeline schedules: one instruction list per stage, fixed before anything runs.

A pipeline of ``S`` stages (0-based ``i``; stage ``i`` feeds stage ``i+1``) trains one step on ``M``
micro-batches (0-based ``m``). A schedule is ``list[list[Instruction]]``: ``schedule[i]`` is what stage
``i`` executes, in order, one instruction at a time. The runtime interprets the lists (one worker per
stage, FIFO channels per ``(src, dst, kind)``, blocking recvs, buffered non-blocking sends); tests and
``Plan.summary()`` inspect them without running anything.

Instructions (``Instruction.op``)::

    recv_act(m←i-1)   block until micro-batch m's activation from stage i-1 arrives (never on stage 0)
    forward(m)  "Fm"  run the stage forward on m and keep its residuals; stage 0 reads m's slice of
                      the batch, the last stage also computes the loss
    send_act(m→i+1)   hand m's output activation to stage i+1 (never on the last stage)
    recv_grad(m←i+1)  block until the gradient of m's output arrives (never on the last stage)
    backward(m) "Bm"  backward of m, accumulating parameter gradients; the last stage seeds it with
                      the loss, so it has no recv_grad
    send_grad(m→i-1)  hand the gradient of m's input to stage i-1 (never on stage 0)
    free(m)           drop m's saved residuals on this stage (right after its backward)
    update            apply the optimizer once, after every micro-batch's gradient is accumulated

The two schedules differ only in the order of forwards and backwards on a stage; the communication
around each compute instruction is always ``[recv_act] F [send_act]`` and
``[recv_grad] B [send_grad] free``, and every stage ends with ``update``.

GPipe (``gpipe``), stage i::

    F0 F1 ... F(M-1)   B0 B1 ... B(M-1)   update

1F1B / PipeDream-flush (``one_f_one_b``), stage i, with ``w_i = min(S-i-1, M)`` warm-up forwards::

    warm-up    F0 ... F(w_i - 1)
    steady     for k = 0 .. M-w_i-1:  F(w_i + k)  Bk
    cool-down  B(M-w_i) ... B(M-1)
    update

Micro-batches in flight on stage i (forward done, backward not yet; ``max_in_flight``):
GPipe ``M``; 1F1B ``min(S-i, M)`` — the last stage holds one, stage 0 at most ``S``.

Timing (``simulate``): with forward time ``f`` and backward time ``b`` on every stage, both schedules
finish in ``(M+S-1)(f+b)``; each stage is busy ``M(f+b)`` of it, so the bubble fraction is
``(S-1)/(M+S-1)``. 1F1B buys memory (in-flight ``≤ S-i`` instead of ``M``), not time.

Deadlock freedom: channel ``(i, i+1, act)`` carries activations in the order stage i sends them, which
is the order stage i+1 receives them (ascending m in both schedules); likewise ``(i+1, i, grad)``. With
buffered sends, both schedules then terminate — ``simulate`` is the proof for a given (S, M): it steps
every stage until it blocks and raises ``ValueError`` if some stage is left waiting, and ``validate``
runs it. (With rendezvous sends, e.g. raw NCCL send/recv, 1F1B's steady state would need the send and
the following recv fused; the runtime's channels are buffered, so the lists assume that.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

COMPUTE_OPS = ("forward", "backward")
SEND_OPS = ("send_act", "send_grad")
RECV_OPS = ("recv_act", "recv_grad")
OPS = ("recv_act", "forward", "send_act", "recv_grad", "backward", "send_grad", "free", "update")


@dataclass(frozen=True)
class Instruction:
    """One step of a stage's list. ``micro_batch`` is set for every op but ``update``; ``peer`` (the
    stage sent to / received from) is set exactly for sends and recvs."""

    op: str
    micro_batch: int | None = None
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown instruction op {self.op!r}; expected one of {OPS}")
        if (self.op == "update") != (self.micro_batch is None):
            raise ValueError(f"{self.op!r} {'takes no' if self.op == 'update' else 'needs a'} micro_batch, "
                             f"got {self.micro_batch!r}")
        if self.micro_batch is not None and (not isinstance(self.micro_batch, int) or self.micro_batch < 0):
            raise ValueError(f"micro_batch must be an int >= 0, got {self.micro_batch!r}")
        is_comm = self.op in SEND_OPS or self.op in RECV_OPS
        if is_comm != (self.peer is not None):
            raise ValueError(f"{self.op!r} {'needs a' if is_comm else 'takes no'} peer, got {self.peer!r}")
        if self.peer is not None and (not isinstance(self.peer, int) or self.peer < 0):
            raise ValueError(f"peer must be an int >= 0, got {self.peer!r}")

    @property
    def kind(self) -> str | None:
        """The channel kind of a send/recv (``"act"`` or ``"grad"``); None for other ops."""
        return self.op.split("_")[1] if self.peer is not None else None

    def __str__(self) -> str:
        if self.op == "forward":
            return f"F{self.micro_batch}"
        if self.op == "backward":
            return f"B{self.micro_batch}"
        if self.op in SEND_OPS:
            return f"{self.op}({self.micro_batch}→{self.peer})"
        if self.op in RECV_OPS:
            return f"{self.op}({self.micro_batch}←{self.peer})"
        if self.op == "free":
            return f"free({self.micro_batch})"
        return "update"


Schedule = list[list[Instruction]]


# --- building schedules -----------------------------------------------------------------------------

def _check_sizes(num_stages: int, num_micro_batches: int) -> None:
    for name, value in (("num_stages", num_stages), ("num_micro_batches", num_micro_batches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _forward(stage: int, num_stages: int, m: int) -> list[Instruction]:
    """``[recv_act] F [send_act]`` for micro-batch m on ``stage``."""
    out = []
    if stage > 0:
        out.append(Instruction("recv_act", m, stage - 1))
    out.append(Instruction("forward", m))
    if stage < num_stages - 1:
        out.append(Instruction("send_act", m, stage + 1))
    return out


def _backward(stage: int, num_stages: int, m: int) -> list[Instruction]:
    """``[recv_grad] B [send_grad] free`` for micro-batch m on ``stage``."""
    out = []
    if stage < num_stages - 1:
        out.append(Instruction("recv_grad", m, stage + 1))
    out.append(Instruction("backward", m))
    if stage > 0:
        out.append(Instruction("send_grad", m, stage - 1))
    out.append(Instruction("free", m))
    return out


def _expand(num_stages: int, orders: list[list[tuple[str, int]]]) -> Schedule:
    """Per-stage compute orders [("F", m) | ("B", m)] → full lists with communication and the update."""
    schedule = []
    for stage, order in enumerate(orders):
        steps: list[Instruction] = []
        for phase, m in order:
            steps += (_forward if phase == "F" else _backward)(stage, num_stages, m)
        steps.append(Instruction("update"))
        schedule.append(steps)
    return schedule


def gpipe(num_stages: int, num_micro_batches: int) -> Schedule:
    """GPipe: every stage runs all M forwards, then all M backwards (ascending m), then ``update``.

    In flight on each stage: M micro-batches.
    """
    _check_sizes(num_stages, num_micro_batches)
    order = [("F", m) for m in range(num_micro_batches)] + [("B", m) for m in range(num_micro_batches)]
    return _expand(num_stages, [order] * num_stages)


def one_f_one_b(num_stages: int, num_micro_batches: int) -> Schedule:
    """1F1B (PipeDream-flush). Stage i (0-based) runs ``w_i = min(S-i-1, M)`` warm-up forwards
    F0..F(w_i-1); then ``M-w_i`` steady pairs ``F(w_i+k), Bk`` for k = 0..M-w_i-1; then cool-down
    backwards B(M-w_i)..B(M-1); then ``update``.

    In flight on stage i: ``min(S-i, M)`` micro-batches (the warm-up plus the steady forward).
    """
    _check_sizes(num_stages, num_micro_batches)
    S, M = num_stages, num_micro_batches
    orders = []
    for i in range(S):
        warm = min(S - i - 1, M)
        order = [("F", m) for m in range(warm)]
        for k in range(M - warm):
            order += [("F", warm + k), ("B", k)]
        order += [("B", m) for m in range(M - warm, M)]
        orders.append(order)
    return _expand(S, orders)


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def make_schedule(name: str, num_stages: int, num_micro_batches: int) -> Schedule:
    """The schedule called ``name`` (``"gpipe"`` or ``"1f1b"``)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](num_stages, num_micro_batches)


def format_schedule(schedule: Schedule, *, comms: bool = False) -> str:
    """One line per stage, e.g. ``stage 0: F0 F1 B0 F2 B1 B2 update`` (sends/recvs/frees with ``comms``)."""
    lines = []
    for stage, steps in enumerate(schedule):
        shown = [str(ins) for ins in steps if comms or ins.op in COMPUTE_OPS or ins.op == "update"]
        lines.append(f"stage {stage}: " + " ".join(shown))
    return "\n".join(lines)


# --- inspecting schedules -----------------------------------------------------------------------------

def max_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most micro-batches whose forward has run and whose backward has not."""
    peaks = []
    for steps in schedule:
        live = peak = 0
        for ins in steps:
            live += (ins.op == "forward") - (ins.op == "backward")
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def validate(schedule: Schedule) -> None:
    """Raise ``ValueError`` unless ``schedule`` is a well-formed linear-pipeline schedule:

    * every stage forwards the same micro-batches, each once, and runs each one's backward once, after
      its forward, and ``free`` once, after its backward;
    * activations flow i → i+1 and gradients i+1 → i only: stage i>0 receives m's activation before
      Fm, stage i<S-1 sends it after Fm; stage i<S-1 receives m's gradient before Bm, stage i>0 sends
      it after Bm; stage 0 has no recv_act and the last stage no recv_grad;
    * each channel (src, dst, kind) carries the same micro-batches in the same order on both ends;
    * each stage ends with exactly one ``update``, after all its backwards;
    * executing the lists with blocking recvs terminates (no deadlock).
    """
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ValueError("a schedule is a non-empty list of per-stage instruction lists")
    sent: dict[tuple[int, int, str], list[int]] = {}
    received: dict[tuple[int, int, str], list[int]] = {}
    micro_batches = [_check_stage(schedule, stage, sent, received) for stage in range(len(schedule))]
    for stage, forwarded in enumerate(micro_batches):
        if forwarded != micro_batches[0]:
            raise ValueError(f"stage {stage} forwards micro-batches {sorted(forwarded)}, "
                             f"stage 0 forwards {sorted(micro_batches[0])}")
    for channel in sorted(set(sent) | set(received)):
        src, dst, kind = channel
        if sent.get(channel, []) != received.get(channel, []):
            raise ValueError(f"{kind} channel {src}→{dst}: stage {src} sends micro-batches "
                             f"{sent.get(channel, [])}, stage {dst} receives {received.get(channel, [])} "
                             f"(must match one to one, in order)")
    simulate(schedule, 1.0, 1.0)  # raises ValueError on a deadlock


_PEER_OFFSET = {"recv_act": -1, "send_act": +1, "recv_grad": +1, "send_grad": -1}
_NO_PEER = {
    "recv_act": "stage 0 has no recv_act (it reads the batch)",
    "send_act": "the last stage has no send_act (it computes the loss)",
    "recv_grad": "the last stage has no recv_grad (its backward starts from the loss)",
    "send_grad": "stage 0 has no send_grad (nothing precedes it)",
}


def _check_stage(schedule: Schedule, stage: int, sent: dict, received: dict) -> set[int]:
    """The per-stage rules of ``validate``; records the stage's sends/recvs per channel and returns the
    micro-batches it forwards."""
    steps = schedule[stage]

    def fail(index: int, why: str) -> None:
        raise ValueError(f"stage {stage}, instruction {index} ({steps[index]}): {why}")

    last = len(schedule) - 1
    forwarded: set[int] = set()
    backwarded: set[int] = set()
    freed: set[int] = set()
    acts_in: set[int] = set()
    grads_in: set[int] = set()
    for j, ins in enumerate(steps):
        if not isinstance(ins, Instruction):
            raise ValueError(f"stage {stage}, instruction {j}: expected an Instruction, got {ins!r}")
        m = ins.micro_batch
        if ins.peer is not None:
            want = stage + _PEER_OFFSET[ins.op]
            if not 0 <= want <= last:
                fail(j, _NO_PEER[ins.op])
            if ins.peer != want:
                fail(j, f"in a linear pipeline, {ins.op} on stage {stage} is with stage {want}")
            if ins.op in SEND_OPS:
                sent.setdefault((stage, ins.peer, ins.kind), []).append(m)
            else:
                received.setdefault((ins.peer, stage, ins.kind), []).append(m)
        if ins.op == "recv_act":
            if m in acts_in:
                fail(j, f"activation of micro-batch {m} received twice")
            acts_in.add(m)
        elif ins.op == "recv_grad":
            if m in grads_in:
                fail(j, f"gradient of micro-batch {m} received twice")
            grads_in.add(m)
        elif ins.op == "forward":
            if m in forwarded:
                fail(j, f"micro-batch {m} forwarded twice")
            if stage > 0 and m not in acts_in:
                fail(j, f"forward of micro-batch {m} before recv_act of its input")
            forwarded.add(m)
        elif ins.op == "send_act" and m not in forwarded:
            fail(j, f"activation of micro-batch {m} sent before its forward")
        elif ins.op == "backward":
            if m not in forwarded:
                fail(j, f"backward of micro-batch {m} before its forward")
            if m in backwarded:
                fail(j, f"micro-batch {m} backwarded twice")
            if stage < last and m not in grads_in:
                fail(j, f"backward of micro-batch {m} before recv_grad of its output gradient")
            backwarded.add(m)
        elif ins.op == "send_grad" and m not in backwarded:
            fail(j, f"gradient of micro-batch {m} sent before its backward")
        elif ins.op == "free":
            if m not in backwarded:
                fail(j, f"residuals of micro-batch {m} freed before its backward")
            if m in freed:
                fail(j, f"micro-batch {m} freed twice")
            freed.add(m)
        elif ins.op == "update":
            if j != len(steps) - 1:
                fail(j, "update must be the stage's last instruction (once per step)")
            if backwarded != forwarded:
                fail(j, f"update before the backward of micro-batches {sorted(forwarded - backwarded)}")
    if not steps or steps[-1].op != "update":
        raise ValueError(f"stage {stage}: missing the final 'update' (apply the optimizer once per step)")
    if not forwarded:
        raise ValueError(f"stage {stage}: runs no forward")
    if freed != backwarded:
        raise ValueError(f"stage {stage}: micro-batches {sorted(backwarded - freed)} never freed")
    return forwarded


# --- simulating schedules ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Block:
    """One compute instruction as simulated on a stage: ``op`` is forward, backward or update."""

    op: str
    micro_batch: int | None
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """What ``simulate`` returns. ``bubble_fraction = Σ_stages idle / (stages · makespan)``, where a
    stage is idle whenever it is not inside a block (waiting on a recv, or done before the makespan)."""

    blocks: tuple[tuple[Block, ...], ...]
    """Per stage, its compute blocks in execution order."""
    makespan: float
    """Time at which the last stage finishes its list."""
    bubble_fraction: float

    @property
    def busy(self) -> list[float]:
        """Per stage, the total time spent inside blocks."""
        return [sum(b.end - b.start for b in stage) for stage in self.blocks]

    def summary(self, *, width: int = 100) -> str:
        """Makespan, bubble and an ASCII Gantt chart (``F3``/``B3`` blocks, ``.`` idle, ``U`` update)."""
        head = (f"{len(self.blocks)} stages, makespan {self.makespan:g}, "
                f"bubble {100 * self.bubble_fraction:.1f}%")
        durations = [b.end - b.start for stage in self.blocks for b in stage if b.end > b.start]
        if not durations or self.makespan <= 0:
            return head
        unit = min(durations) / 2  # the shortest block gets two cells
        cells = min(width, max(1, round(self.makespan / unit)))
        scale = cells / self.makespan
        rows = [head]
        for stage, stage_blocks in enumerate(self.blocks):
            row = ["."] * cells
            for b in stage_blocks:
                if b.end <= b.start:
                    continue  # e.g. a free update
                lo, hi = round(b.start * scale), max(round(b.end * scale), round(b.start * scale) + 1)
                label = "U" if b.op == "update" else f"{b.op[0].upper()}{b.micro_batch}"
                text = (label + "-" * (hi - lo))[: hi - lo]
                row[lo:hi] = list(text)[: max(0, cells - lo)]
            rows.append(f"stage {stage}: " + "".join(row[:cells]))
        return "\n".join(rows)


def _per_stage(name: str, value: float | Sequence[float], num_stages: int) -> list[float]:
    values = [value] * num_stages if isinstance(value, (int, float)) else list(value)
    if len(values) != num_stages:
        raise ValueError(f"{name} has {len(values)} entries for {num_stages} stages")
    if any(not isinstance(v, (int, float)) or v < 0 for v in values):
        raise ValueError(f"{name} must be non-negative numbers, got {values}")
    return [float(v) for v in values]


def simulate(schedule: Schedule, forward_time: float | Sequence[float], backward_time: float | Sequence[float],
             *, update_time: float | Sequence[float] = 0.0) -> Timeline:
    """Execute the lists in simulated time. Each stage runs its list in order; ``forward``/``backward``/
    ``update`` take the given time on that stage (a number for all stages, or one per stage); sends take
    no time and never block; the n-th recv on a channel (src, dst, kind) waits until the n-th send on it,
    so an instruction starts at ``max(end of the stage's previous one, arrival of what it receives)``.

    This is the as-soon-as-possible (event-driven) execution: every start time is the longest path to
    it in the dependency graph, independent of the order stages are stepped in. Raises ``ValueError``
    if some stage waits forever (deadlock) or a recv gets a different micro-batch than it expects.
    """
    S = len(schedule)
    fwd = _per_stage("forward_time", forward_time, S)
    bwd = _per_stage("backward_time", backward_time, S)
    upd = _per_stage("update_time", update_time, S)
    duration = {"forward": fwd, "backward": bwd, "update": upd}
    pc = [0] * S
    clock = [0.0] * S
    blocks: list[list[Block]] = [[] for _ in range(S)]
    sent: dict[tuple[int, int, str], list[tuple[int | None, float]]] = {}
    taken: dict[tuple[int, int, str], int] = {}
    progress = True
    while progress:
        progress = False
        for s, steps in enumerate(schedule):
            while pc[s] < len(steps):
                ins = steps[pc[s]]
                if ins.op in SEND_OPS:
                    sent.setdefault((s, ins.peer, ins.kind), []).append((ins.micro_batch, clock[s]))
                elif ins.op in RECV_OPS:
                    channel = (ins.peer, s, ins.kind)
                    n = taken.get(channel, 0)
                    if n >= len(sent.get(channel, [])):
                        break  # blocked until the peer sends
                    m, arrival = sent[channel][n]
                    if m != ins.micro_batch:
                        raise ValueError(f"stage {s}: {ins} got micro-batch {m} on {ins.kind} channel "
                                         f"{ins.peer}→{s}")
                    taken[channel] = n + 1
                    clock[s] = max(clock[s], arrival)
                elif ins.op in duration:
                    start = clock[s]
                    clock[s] = start + duration[ins.op][s]
                    blocks[s].append(Block(ins.op, ins.micro_batch, start, clock[s]))
                pc[s] += 1
                progress = True
    stuck = [f"stage {s} waits at {schedule[s][pc[s]]} (instruction {pc[s]})"
             for s in range(S) if pc[s] < len(schedule[s])]
    if stuck:
        raise ValueError("schedule deadlocks: " + "; ".join(stuck))
    unread = [f"{kind} {src}→{dst}: {len(msgs) - taken.get((src, dst, kind), 0)} message(s)"
              for (src, dst, kind), msgs in sent.items() if len(msgs) > taken.get((src, dst, kind), 0)]
    if unread:
        raise ValueError("sends without a matching recv: " + "; ".join(unread))
    makespan = max(clock, default=0.0)
    busy = sum(b.end - b.start for stage in blocks for b in stage)
    bubble = (S * makespan - busy) / (S * makespan) if makespan > 0 else 0.0
    return Timeline(tuple(tuple(b) for b in blocks), makespan, bubble)

"""Static pipeline schedules: one instruction list per device group, fixed before anything runs.

A pipeline of ``N`` stages (0-based ``s``; stage ``s`` feeds stage ``s+1``) runs on ``G`` device groups
and trains one step on ``M`` micro-batches (0-based ``m``). Every schedule but interleaved 1F1B has one
stage per group (``N = G``; stage ``i`` runs on group ``i``); interleaved 1F1B gives each group ``v``
non-adjacent stages ("virtual stages", "chunks"): stage ``s`` runs on group ``s mod G`` as its chunk
``s div G`` (``N = v·G``). A schedule is ``list[list[Instruction]]``: ``schedule[g]`` is what group ``g``
executes, in order, one instruction at a time. The runtime interprets the lists (one worker per group,
FIFO channels per ``(src stage, dst stage, kind)``, blocking recvs, buffered non-blocking sends); tests and
``Plan.summary()`` inspect them without running anything.

Instructions (``Instruction.op``; ``Instruction.stage`` is the stage it belongs to, ``None`` in lists
where group ``g`` runs stage ``g`` only; ``peer`` is a stage)::

    recv_act(m←s-1)   block until micro-batch m's activation from stage s-1 arrives (never on stage 0)
    forward(m)  "Fm"  run the stage forward on m and keep its residuals; stage 0 reads m's slice of
                      the batch, the last stage also computes the loss
    send_act(m→s+1)   hand m's output activation to stage s+1 (never on the last stage)
    recv_grad(m←s+1)  block until the gradient of m's output arrives (never on the last stage)
    backward(m) "Bm"  backward of m, accumulating parameter gradients; the last stage seeds it with
                      the loss, so it has no recv_grad
    backward_input(m) "Bm"   split backward, part 1: only the cotangents of the stage's activation
                      inputs (what stage s-1 waits for), keeping what part 2 needs
    backward_weight(m) "Wm"  split backward, part 2: the parameter gradients, accumulated (deferrable:
                      nothing downstream waits for it)
    send_grad(m→s-1)  hand the gradient of m's input to stage s-1 (never on stage 0)
    free(m)           drop m's saved residuals on this stage (after its backward / backward_weight)
    update            apply the optimizer once, after every micro-batch's gradient is accumulated
                      (one per group, its last instruction; it covers all the group's stages)

The schedules differ only in the order of compute instructions on a group; the communication around
them is always ``[recv_act] F [send_act]``, ``[recv_grad] B [send_grad] free`` (fused backward) or
``[recv_grad] B [send_grad] … W free`` (split), and every group ends with ``update``.

GPipe (``gpipe``), stage i::

    F0 F1 ... F(M-1)   B0 B1 ... B(M-1)   update

1F1B / PipeDream-flush (``one_f_one_b``), stage i, with ``w_i = min(S-i-1, M)`` warm-up forwards::

    warm-up    F0 ... F(w_i - 1)
    steady     for k = 0 .. M-w_i-1:  F(w_i + k)  Bk
    cool-down  B(M-w_i) ... B(M-1)
    update

Interleaved 1F1B (``interleaved_one_f_one_b``; Megatron-LM's, Narayanan et al. 2021), group r of G with
v chunks, ``M`` a multiple of ``G``: 1F1B over the ``v·M`` (chunk, micro-batch) pairs of the group, taken
in blocks of G micro-batches per chunk. The k-th forward of the group is chunk ``(k div G) mod v`` on
micro-batch ``(k div Gv)·G + k mod G``; the k-th backward the same with chunk ``v-1-((k div G) mod v)``;
warm-up ``min(2(G-r-1) + (v-1)G, vM)`` forwards, then F/B pairs, then the remaining backwards.

ZB-H1 (``zb_h1``; Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B's order of forwards
and input-gradient backwards B, with each backward's weight-gradient part W deferred into the time the
stage would otherwise wait. The W's are placed by a list scheduler run once on unit costs (f = b = w):
a stage runs its next F/B when its input has arrived, else its oldest pending W; before a forward it
first runs W's while ``min(S, M)`` micro-batches are held (F done, W not) — the peak of 1F1B's first
stage, so no stage holds more than 1F1B's most — and it ends with the W's still pending.

Micro-batches in flight on group i (forward done, backward — W for ZB-H1 — not yet; ``max_in_flight``):
GPipe ``M``; 1F1B ``min(S-i, M)``; ZB-H1 ``min(S, M)`` (the later stages hold their W's longer);
interleaved ``min(2(G-i-1) + (v-1)G + 1, vM)`` (stage-micro-batches: each holds about ``1/v`` of the
activations a 1F1B stage of the same model on G groups holds, so in those units ``≈ 2(G-i)/v + G``).

Timing (``simulate``), every stage with forward ``f``, fused backward ``b = b_in + w`` (split into input
part ``b_in`` and weight part ``w``); the bubble fraction is ``Σ idle / (G · makespan)``:

- GPipe, 1F1B: makespan ``(M+S-1)(f+b)``, bubble ``(S-1)/(M+S-1)``. 1F1B buys memory, not time.
- interleaved 1F1B, v chunks each costing ``f/v``, ``b/v``: makespan ``(M + (G-1)/v)(f+b)``, bubble
  ``(G-1)/(vM+G-1)`` (simulated exactly for ``M`` a multiple of ``G``; ``test_schedules`` checks it).
- ZB-H1 with ``f = b_in = w``: makespan ``(3M + S - 1)·f``, bubble ``(S-1)/(3M+S-1)`` for ``M ≥ S``
  (1F1B's is ``3(S-1)/(3M+3(S-1))`` on the same costs: the cool-down chain now costs ``b_in``, not
  ``b_in + w``, per stage — the paper's ``(S-1)(f+b_in-w)`` idle per stage; checked in ``test_schedules``).

Deadlock freedom: channel ``(s, s+1, act)`` carries activations in the order stage s sends them, which
is the order stage s+1 receives them (ascending m in every schedule); likewise ``(s+1, s, grad)``. With
buffered sends, the schedules then terminate — ``simulate`` is the proof for a given (S, M): it steps
every group until it blocks and raises ``ValueError`` if some group is left waiting, and ``validate``
runs it. (With rendezvous sends, e.g. raw NCCL send/recv, 1F1B's steady state would need the send and
the following recv fused; the runtime's channels are buffered, so the lists assume that.)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

COMPUTE_OPS = ("forward", "backward", "backward_input", "backward_weight")
SEND_OPS = ("send_act", "send_grad")
RECV_OPS = ("recv_act", "recv_grad")
OPS = (
    "recv_act",
    "forward",
    "send_act",
    "recv_grad",
    "backward",
    "backward_input",
    "send_grad",
    "backward_weight",
    "free",
    "update",
)
LABELS = {"forward": "F", "backward": "B", "backward_input": "B", "backward_weight": "W", "update": "U"}
"""One-letter label of each compute op (Gantt charts, ``format_schedule``)."""


@dataclass(frozen=True)
class Instruction:
    """One step of a group's list. ``micro_batch`` is set for every op but ``update``; ``peer`` (the
    stage sent to / received from) is set exactly for sends and recvs; ``stage`` is the stage the
    instruction belongs to (``None``: the list's own index, in schedules with one stage per group)."""

    op: str
    micro_batch: int | None = None
    peer: int | None = None
    stage: int | None = None

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown instruction op {self.op!r}; expected one of {OPS}")
        if (self.op == "update") != (self.micro_batch is None):
            raise ValueError(
                f"{self.op!r} {'takes no' if self.op == 'update' else 'needs a'} micro_batch, got {self.micro_batch!r}"
            )
        if self.micro_batch is not None and (not isinstance(self.micro_batch, int) or self.micro_batch < 0):
            raise ValueError(f"micro_batch must be an int >= 0, got {self.micro_batch!r}")
        is_comm = self.op in SEND_OPS or self.op in RECV_OPS
        if is_comm != (self.peer is not None):
            raise ValueError(f"{self.op!r} {'needs a' if is_comm else 'takes no'} peer, got {self.peer!r}")
        if self.peer is not None and (not isinstance(self.peer, int) or self.peer < 0):
            raise ValueError(f"peer must be an int >= 0, got {self.peer!r}")
        if self.stage is not None and (self.op == "update" or not isinstance(self.stage, int) or self.stage < 0):
            raise ValueError(f"stage must be an int >= 0 (and None for 'update'), got {self.stage!r}")

    @property
    def kind(self) -> str | None:
        """The channel kind of a send/recv (``"act"`` or ``"grad"``); None for other ops."""
        return self.op.split("_")[1] if self.peer is not None else None

    def stage_in(self, group: int) -> int | None:
        """The stage this instruction runs on list ``group`` (None for ``update``, which covers the group)."""
        if self.op == "update":
            return None
        return group if self.stage is None else self.stage

    def __str__(self) -> str:
        at = "" if self.stage is None else f"@{self.stage}"
        if self.op in LABELS and self.op != "update":
            return f"{LABELS[self.op]}{self.micro_batch}{at}"
        if self.op in SEND_OPS:
            return f"{self.op}({self.micro_batch}→{self.peer}){at}"
        if self.op in RECV_OPS:
            return f"{self.op}({self.micro_batch}←{self.peer}){at}"
        if self.op == "free":
            return f"free({self.micro_batch}){at}"
        return "update"


Schedule = list[list[Instruction]]


# --- building schedules -----------------------------------------------------------------------------


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _expand(num_stages: int, orders: list[list[tuple[str, int, int]]], *, tagged: bool = False) -> Schedule:
    """Per-group compute orders ``[(phase, m, stage)]`` → full lists with communication and the update.
    Phases: ``F`` forward, ``B`` fused backward, ``I`` backward_input, ``W`` backward_weight. ``tagged``:
    every instruction names its stage (several stages per group)."""
    schedule = []
    for order in orders:
        steps: list[Instruction] = []
        for phase, m, s in order:
            tag = s if tagged else None
            before, after = s - 1 if s > 0 else None, s + 1 if s < num_stages - 1 else None
            if phase == "F":
                if before is not None:
                    steps.append(Instruction("recv_act", m, before, tag))
                steps.append(Instruction("forward", m, None, tag))
                if after is not None:
                    steps.append(Instruction("send_act", m, after, tag))
            elif phase in ("B", "I"):
                if after is not None:
                    steps.append(Instruction("recv_grad", m, after, tag))
                steps.append(Instruction("backward" if phase == "B" else "backward_input", m, None, tag))
                if before is not None:
                    steps.append(Instruction("send_grad", m, before, tag))
                if phase == "B":
                    steps.append(Instruction("free", m, None, tag))
            else:
                steps += [Instruction("backward_weight", m, None, tag), Instruction("free", m, None, tag)]
        steps.append(Instruction("update"))
        schedule.append(steps)
    return schedule


def gpipe(num_stages: int, num_micro_batches: int) -> Schedule:
    """GPipe: every stage runs all M forwards, then all M backwards (ascending m), then ``update``.

    In flight on each stage: M micro-batches.
    """
    _check_sizes(num_stages=num_stages, num_micro_batches=num_micro_batches)
    M = num_micro_batches
    return _expand(
        num_stages, [[("F", m, i) for m in range(M)] + [("B", m, i) for m in range(M)] for i in range(num_stages)]
    )


def _one_f_one_b_order(S: int, M: int, i: int) -> list[tuple[str, int]]:
    warm = min(S - i - 1, M)
    order = [("F", m) for m in range(warm)]
    for k in range(M - warm):
        order += [("F", warm + k), ("B", k)]
    return order + [("B", m) for m in range(M - warm, M)]


def one_f_one_b(num_stages: int, num_micro_batches: int) -> Schedule:
    """1F1B (PipeDream-flush). Stage i (0-based) runs ``w_i = min(S-i-1, M)`` warm-up forwards
    F0..F(w_i-1); then ``M-w_i`` steady pairs ``F(w_i+k), Bk`` for k = 0..M-w_i-1; then cool-down
    backwards B(M-w_i)..B(M-1); then ``update``.

    In flight on stage i: ``min(S-i, M)`` micro-batches (the warm-up plus the steady forward).
    """
    _check_sizes(num_stages=num_stages, num_micro_batches=num_micro_batches)
    S, M = num_stages, num_micro_batches
    return _expand(S, [[(p, m, i) for p, m in _one_f_one_b_order(S, M, i)] for i in range(S)])


def interleaved_one_f_one_b(num_groups: int, num_micro_batches: int, num_chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline): ``N = v·G`` stages, stage s on group ``s mod G``.

    Group r runs 1F1B over its ``v·M`` (chunk, micro-batch) pairs: the k-th forward is chunk
    ``c = (k div G) mod v`` (stage ``c·G + r``) on micro-batch ``(k div vG)·G + k mod G``; the k-th
    backward takes chunk ``v-1-((k div G) mod v)`` instead; ``min(2(G-r-1) + (v-1)G, vM)`` warm-up
    forwards, then pairs ``F(w+k), B(k)``, then the remaining backwards. ``M`` must be a multiple of
    ``G`` (as in Megatron-LM) when ``v > 1``; ``v = 1`` is 1F1B. Every instruction names its stage.
    """
    _check_sizes(num_groups=num_groups, num_micro_batches=num_micro_batches, num_chunks=num_chunks)
    G, M, v = num_groups, num_micro_batches, num_chunks
    if v > 1 and M % G:
        raise ValueError(
            f"interleaved 1F1B needs num_micro_batches ({M}) to be a multiple of the number of device groups ({G})"
        )
    total = v * M

    def micro_batch(k: int) -> int:
        return (k // (G * v)) * G + k % G

    orders = []
    for r in range(G):
        fwd = [("F", micro_batch(k), ((k // G) % v) * G + r) for k in range(total)]
        bwd = [("B", micro_batch(k), (v - 1 - (k // G) % v) * G + r) for k in range(total)]
        warm = min(2 * (G - r - 1) + (v - 1) * G, total) if v > 1 else min(G - r - 1, M)
        order = fwd[:warm]
        for k in range(total - warm):
            order += [fwd[warm + k], bwd[k]]
        orders.append(order + bwd[total - warm :])
    return _expand(v * G, orders, tagged=True)


def zb_h1(num_stages: int, num_micro_batches: int) -> Schedule:
    """ZB-H1 (zero bubble, Qi et al. ICLR 2024): 1F1B's order of forwards and input-gradient backwards
    ``B`` (``backward_input``), with every weight-gradient part ``W`` (``backward_weight``) deferred.

    Where the W's go is decided by a list scheduler run once in unit time (f = b = w = 1): at each step
    the stage that can start earliest acts; it runs its next F/B if that one's input has arrived, else
    its oldest pending W (else it waits); before a forward it runs W's while ``min(S-i, M)`` of its
    micro-batches are held (F done, W not: the most 1F1B holds, on its first stage); its remaining W's
    end the list. On equal f, b, w the result is the handcrafted ZB-H1: makespan ``3M+S-1`` and bubble
    ``(S-1)/(3M+S-1)`` for ``M ≥ S``. In flight on every stage: ``min(S, M)``.
    """
    _check_sizes(num_stages=num_stages, num_micro_batches=num_micro_batches)
    S, M = num_stages, num_micro_batches
    todo = [deque(_one_f_one_b_order(S, M, i)) for i in range(S)]
    cap = min(S, M)
    pending: list[deque[int]] = [deque() for _ in range(S)]
    held = [0] * S
    clock = [0] * S
    done: dict[tuple[str, int, int], int] = {}  # (phase, stage, m) → end time
    orders: list[list[tuple[str, int, int]]] = [[] for _ in range(S)]

    def candidate(i: int) -> tuple[int, str] | None:
        """(start time, phase) of stage i's next action; None if it must wait on something not yet done."""
        if not todo[i]:
            return (clock[i], "W") if pending[i] else None
        phase, m = todo[i][0]
        if phase == "F" and held[i] >= cap:
            return (clock[i], "W") if pending[i] else None
        dep = (("F", i - 1, m) if i > 0 else None) if phase == "F" else (("B", i + 1, m) if i < S - 1 else None)
        arrival = 0 if dep is None else done.get(dep)
        if arrival is not None and arrival <= clock[i]:
            return clock[i], phase
        if pending[i]:
            return clock[i], "W"
        return None if arrival is None else (arrival, phase)

    while any(todo) or any(pending):
        options = [(c[0], i, c[1]) for i in range(S) if (c := candidate(i)) is not None]
        assert options, "ZB-H1 list scheduler stalled"
        start, i, phase = min(options)
        if phase == "W":
            m = pending[i].popleft()
            held[i] -= 1
        else:
            _, m = todo[i].popleft()
            if phase == "F":
                held[i] += 1
            else:
                pending[i].append(m)
        clock[i] = start + 1
        done[(phase, i, m)] = clock[i]
        orders[i].append(("I" if phase == "B" else phase, m, i))
    return _expand(S, orders)


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_one_f_one_b,
    "zb_h1": zb_h1,
}
SPLIT_BACKWARD = ("zb_h1",)
"""Schedules whose lists split each backward into ``backward_input`` and ``backward_weight``."""


def make_schedule(name: str, num_stages: int, num_micro_batches: int, *, virtual_stages: int = 1) -> Schedule:
    """The schedule called ``name`` (one of ``SCHEDULES``) for a pipeline of ``num_stages`` stages.
    ``virtual_stages`` (v, ``"interleaved_1f1b"`` only) stages per device group: the lists are then those
    of ``num_stages / v`` groups."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; expected one of {sorted(SCHEDULES)}")
    if name == "interleaved_1f1b":
        if not isinstance(virtual_stages, int) or virtual_stages < 1 or num_stages % virtual_stages:
            raise ValueError(
                f"interleaved 1F1B: {num_stages} stages do not split into virtual_stages="
                f"{virtual_stages!r} chunks per device group"
            )
        return interleaved_one_f_one_b(num_stages // virtual_stages, num_micro_batches, virtual_stages)
    if virtual_stages != 1:
        raise ValueError(f"virtual_stages={virtual_stages!r} needs schedule 'interleaved_1f1b', not {name!r}")
    return SCHEDULES[name](num_stages, num_micro_batches)


def num_device_groups(stage_devices: Sequence[Sequence[int]]) -> int:
    """How many device groups a pipeline's stages run on: ``G`` such that stage ``s`` runs on exactly the
    devices of stage ``s mod G`` and stages ``0..G-1`` on pairwise disjoint ones (``G = N`` without virtual
    stages). ``ValueError`` for any other layout."""
    devices = [tuple(sorted(d)) for d in stage_devices]
    groups = next((g for g in range(1, len(devices)) if devices[g] == devices[0]), len(devices))
    for s, d in enumerate(devices):
        if d != devices[s % groups] or (s < groups and any(set(d) & set(devices[t]) for t in range(s))):
            raise ValueError(
                f"stage {s} runs on devices {list(d)}: pipeline stages must run on disjoint device "
                f"groups, stage s on the group of stage s mod {groups}"
            )
    return groups


def device_groups(schedule: str, stage_devices: Sequence[Sequence[int]]) -> int:
    """The device groups a pipeline of ``schedule`` runs on (its instruction lists): ``num_device_groups`` under
    interleaved 1F1B, one per stage otherwise (whatever devices the stages share)."""
    return num_device_groups(stage_devices) if schedule == "interleaved_1f1b" else len(stage_devices)


def format_schedule(schedule: Schedule, *, comms: bool = False) -> str:
    """One line per group, e.g. ``stage 0: F0 F1 B0 F2 B1 B2 update`` (sends/recvs/frees with ``comms``);
    lists naming their stages (interleaved) are labelled ``group g`` and show ``F0@2`` for stage 2."""
    lines = []
    tagged = any(ins.stage is not None for steps in schedule for ins in steps)
    for group, steps in enumerate(schedule):
        shown = [str(ins) for ins in steps if comms or ins.op in COMPUTE_OPS or ins.op == "update"]
        lines.append(f"{'group' if tagged else 'stage'} {group}: " + " ".join(shown))
    return "\n".join(lines)


# --- inspecting schedules -----------------------------------------------------------------------------


def max_in_flight(schedule: Schedule) -> list[int]:
    """Per group, the most (stage, micro-batch) pairs whose forward has run and whose backward (its
    ``backward_weight`` when split) has not."""
    return _peaks_in_flight(schedule)


def _peaks_in_flight(lists: Sequence[Sequence[Instruction]]) -> list[int]:
    """Per instruction list, the most forwards run whose backward (``backward_weight`` when split) has not."""
    peaks = []
    for steps in lists:
        live = peak = 0
        for ins in steps:
            live += (ins.op == "forward") - (ins.op in ("backward", "backward_weight"))
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def stage_in_flight(schedule: Schedule) -> list[int]:
    """Per stage, the most of its micro-batches whose forward has run and whose backward (its
    ``backward_weight`` when split) has not."""
    return _peaks_in_flight(stage_lists(schedule))


def stage_lists(schedule: Schedule) -> list[list[Instruction]]:
    """Each stage's instructions in the order its group runs them (``update`` excluded)."""
    per_stage: dict[int, list[Instruction]] = {}
    for group, steps in enumerate(schedule):
        for ins in steps:
            stage = ins.stage_in(group)
            if stage is not None:  # every op but update
                per_stage.setdefault(stage, []).append(ins)
    return [per_stage.get(s, []) for s in range(max(per_stage, default=-1) + 1)]


def validate(schedule: Schedule) -> None:
    """Raise ``ValueError`` unless ``schedule`` is a well-formed linear-pipeline schedule:

    * stage s's instructions are all in list ``s mod G`` (G lists), and every stage has some;
    * every stage forwards the same micro-batches, each once, and runs each one's backward once after
      its forward — either fused ``backward`` or ``backward_input`` then ``backward_weight`` — and
      ``free`` once, after all of it;
    * activations flow s → s+1 and gradients s+1 → s only: stage s>0 receives m's activation before
      Fm, stage s<N-1 sends it after Fm; stage s<N-1 receives m's gradient before its (input) backward,
      stage s>0 sends it after; stage 0 has no recv_act and the last stage no recv_grad;
    * each channel (src, dst, kind) carries the same micro-batches in the same order on both ends;
    * each group ends with exactly one ``update``, after all its backwards;
    * executing the lists with blocking recvs terminates (no deadlock).
    """
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ValueError("a schedule is a non-empty list of per-group instruction lists")
    for group, steps in enumerate(schedule):
        for j, ins in enumerate(steps):
            if not isinstance(ins, Instruction):
                raise ValueError(f"list {group}, instruction {j}: expected an Instruction, got {ins!r}")
            if ins.op == "update" and j != len(steps) - 1:
                raise ValueError(
                    f"list {group}, instruction {j} (update): update must be the stage's last "
                    "instruction (once per step)"
                )
            runs_on = ins.stage_in(group)  # None: update
            if runs_on is not None and runs_on % len(schedule) != group:
                raise ValueError(
                    f"list {group}, instruction {j} ({ins}): stage {ins.stage} belongs on list "
                    f"{runs_on % len(schedule)} (stage s runs on group s mod "
                    f"{len(schedule)})"
                )
        if not steps or steps[-1].op != "update":
            raise ValueError(f"stage {group}: missing the final 'update' (apply the optimizer once per step)")
    per_stage = stage_lists(schedule)
    if len(per_stage) % len(schedule):
        raise ValueError(f"{len(per_stage)} stages do not split evenly over {len(schedule)} lists")
    sent: dict[tuple[int, int, str], list[int]] = {}
    received: dict[tuple[int, int, str], list[int]] = {}
    micro_batches = [
        _check_stage(steps, stage, len(per_stage), sent, received) for stage, steps in enumerate(per_stage)
    ]
    for stage, forwarded in enumerate(micro_batches):
        if forwarded != micro_batches[0]:
            raise ValueError(
                f"stage {stage} forwards micro-batches {sorted(forwarded)}, stage 0 forwards {sorted(micro_batches[0])}"
            )
    for channel in sorted(set(sent) | set(received)):
        src, dst, kind = channel
        if sent.get(channel, []) != received.get(channel, []):
            raise ValueError(
                f"{kind} channel {src}→{dst}: stage {src} sends micro-batches "
                f"{sent.get(channel, [])}, stage {dst} receives {received.get(channel, [])} "
                f"(must match one to one, in order)"
            )
    simulate(schedule, 1.0, 1.0)  # raises ValueError on a deadlock


_PEER_OFFSET = {"recv_act": -1, "send_act": +1, "recv_grad": +1, "send_grad": -1}
_NO_PEER = {
    "recv_act": "stage 0 has no recv_act (it reads the batch)",
    "send_act": "the last stage has no send_act (it computes the loss)",
    "recv_grad": "the last stage has no recv_grad (its backward starts from the loss)",
    "send_grad": "stage 0 has no send_grad (nothing precedes it)",
}


def _check_stage(steps: list[Instruction], stage: int, num_stages: int, sent: dict, received: dict) -> set[int]:
    """The per-stage rules of ``validate`` on ``steps`` (stage's instructions in order, no update); records
    its sends/recvs per channel and returns the micro-batches it forwards."""

    def fail(index: int, why: str) -> None:
        raise ValueError(f"stage {stage}, instruction {index} ({steps[index]}): {why}")

    last = num_stages - 1
    forwarded: set[int] = set()
    input_grads: set[int] = set()  # backward or backward_input done: the input cotangent exists
    finished: set[int] = set()  # backward or backward_weight done
    freed: set[int] = set()
    acts_in: set[int] = set()
    grads_in: set[int] = set()
    for j, ins in enumerate(steps):
        m = ins.micro_batch
        assert m is not None  # every op but update has one, and a stage's list holds no update
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
        elif ins.op in ("backward", "backward_input"):
            if m not in forwarded:
                fail(j, f"backward of micro-batch {m} before its forward")
            if m in input_grads:
                fail(j, f"micro-batch {m} backwarded twice")
            if stage < last and m not in grads_in:
                fail(j, f"backward of micro-batch {m} before recv_grad of its output gradient")
            input_grads.add(m)
            if ins.op == "backward":
                finished.add(m)
        elif ins.op == "backward_weight":
            if m not in input_grads or m in finished:
                fail(j, f"backward_weight of micro-batch {m} needs exactly one backward_input before it")
            finished.add(m)
        elif ins.op == "send_grad" and m not in input_grads:
            fail(j, f"gradient of micro-batch {m} sent before its backward")
        elif ins.op == "free":
            if m not in finished:
                fail(j, f"residuals of micro-batch {m} freed before its backward")
            if m in freed:
                fail(j, f"micro-batch {m} freed twice")
            freed.add(m)
    if not forwarded:
        raise ValueError(f"stage {stage}: runs no forward")
    if finished != forwarded:
        raise ValueError(f"stage {stage}: update before the backward of micro-batches {sorted(forwarded - finished)}")
    if freed != finished:
        raise ValueError(f"stage {stage}: micro-batches {sorted(finished - freed)} never freed")
    return forwarded


# --- simulating schedules ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One compute instruction as simulated on a group: ``op`` is a compute op or update."""

    op: str
    micro_batch: int | None
    start: float
    end: float
    stage: int | None = None
    """The stage it ran (None for ``update``)."""


@dataclass(frozen=True)
class Timeline:
    """What ``simulate`` returns. ``bubble_fraction = Σ_groups idle / (groups · makespan)``, where a
    group is idle whenever it is not inside a block (waiting on a recv, or done before the makespan)."""

    blocks: tuple[tuple[Block, ...], ...]
    """Per group, its compute blocks in execution order."""
    makespan: float
    """Time at which the last group finishes its list."""
    bubble_fraction: float

    @property
    def busy(self) -> list[float]:
        """Per group, the total time spent inside blocks."""
        return [sum(b.end - b.start for b in stage) for stage in self.blocks]

    def summary(self, *, width: int = 100) -> str:
        """Makespan, bubble and an ASCII Gantt chart (``F3``/``B3``/``W3`` blocks, ``.`` idle, ``U`` update)."""
        head = f"{len(self.blocks)} stages, makespan {self.makespan:g}, bubble {100 * self.bubble_fraction:.1f}%"
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
                label = "U" if b.op == "update" else f"{LABELS[b.op]}{b.micro_batch}"
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


def simulate(
    schedule: Schedule,
    forward_time: float | Sequence[float],
    backward_time: float | Sequence[float],
    *,
    update_time: float | Sequence[float] = 0.0,
    weight_time: float | Sequence[float] | None = None,
) -> Timeline:
    """Execute the lists in simulated time. Each group runs its list in order; ``forward``/``backward``
    take the given time on their stage (a number for all stages, or one per stage), ``update`` the given
    time on the group (one per list); a split backward costs ``backward_time`` in all:
    ``backward_weight`` takes ``weight_time`` (default half the backward) and ``backward_input`` the rest.
    Sends take no time and never block; the n-th recv on a channel (src, dst, kind) waits until the n-th
    send on it, so an instruction starts at ``max(end of the group's previous one, arrival of what it
    receives)``.

    This is the as-soon-as-possible (event-driven) execution: every start time is the longest path to
    it in the dependency graph, independent of the order groups are stepped in. Raises ``ValueError``
    if some group waits forever (deadlock) or a recv gets a different micro-batch than it expects.
    """
    G = len(schedule)
    N = len(stage_lists(schedule)) or G
    fwd = _per_stage("forward_time", forward_time, N)
    bwd = _per_stage("backward_time", backward_time, N)
    wgt = [b / 2 for b in bwd] if weight_time is None else _per_stage("weight_time", weight_time, N)
    if any(w > b for w, b in zip(wgt, bwd)):
        raise ValueError(f"weight_time {wgt} exceeds backward_time {bwd}")
    upd = _per_stage("update_time", update_time, G)
    duration = {
        "forward": fwd,
        "backward": bwd,
        "backward_input": [b - w for b, w in zip(bwd, wgt)],
        "backward_weight": wgt,
    }
    pc = [0] * G
    clock = [0.0] * G
    blocks: list[list[Block]] = [[] for _ in range(G)]
    # channels (src, dst, kind): the stage, peer and kind of a send or recv, all set for those ops
    sent: dict[tuple[int | None, int | None, str | None], list[tuple[int | None, float]]] = {}
    taken: dict[tuple[int | None, int | None, str | None], int] = {}
    progress = True
    while progress:
        progress = False
        for g, steps in enumerate(schedule):
            while pc[g] < len(steps):
                ins = steps[pc[g]]
                s = ins.stage_in(g)
                if ins.op in SEND_OPS:
                    sent.setdefault((s, ins.peer, ins.kind), []).append((ins.micro_batch, clock[g]))
                elif ins.op in RECV_OPS:
                    channel = (ins.peer, s, ins.kind)
                    n = taken.get(channel, 0)
                    if n >= len(sent.get(channel, [])):
                        break  # blocked until the peer sends
                    m, arrival = sent[channel][n]
                    if m != ins.micro_batch:
                        raise ValueError(f"stage {s}: {ins} got micro-batch {m} on {ins.kind} channel {ins.peer}→{s}")
                    taken[channel] = n + 1
                    clock[g] = max(clock[g], arrival)
                elif ins.op in duration or ins.op == "update":
                    start = clock[g]
                    clock[g] = start + (upd[g] if s is None else duration[ins.op][s])  # s None: update
                    blocks[g].append(Block(ins.op, ins.micro_batch, start, clock[g], s))
                pc[g] += 1
                progress = True
    stuck = [
        f"stage {g} waits at {schedule[g][pc[g]]} (instruction {pc[g]})" for g in range(G) if pc[g] < len(schedule[g])
    ]
    if stuck:
        raise ValueError("schedule deadlocks: " + "; ".join(stuck))
    unread = [
        f"{kind} {src}→{dst}: {len(msgs) - taken.get((src, dst, kind), 0)} message(s)"
        for (src, dst, kind), msgs in sent.items()
        if len(msgs) > taken.get((src, dst, kind), 0)
    ]
    if unread:
        raise ValueError("sends without a matching recv: " + "; ".join(unread))
    makespan = max(clock, default=0.0)
    busy = sum(b.end - b.start for stage in blocks for b in stage)
    bubble = (G * makespan - busy) / (G * makespan) if makespan > 0 else 0.0
    return Timeline(tuple(tuple(b) for b in blocks), makespan, bubble)

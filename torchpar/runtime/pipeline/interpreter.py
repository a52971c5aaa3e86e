"""The pipeline interpreter: one device group's instruction list (:mod:`torchpar.planner.pipeline.schedules`) executed
in this process.

Both runtimes run it, one thread per device group a process holds: the local runtime holds every group, a
Ray host actor the groups whose devices it owns (a stage spanning several hosts is run by each of their
actors, in lockstep, as one SPMD program). A group runs one stage, or under interleaved 1F1B its ``v``
stages from the one list, in the list's order: each instruction names its stage, whose program and state
it uses. The only difference between the runtimes is the :class:`~.transport.Transport`, which delivers
in-process or to peer actors.

Per instruction (micro-batch ``m``):

- ``recv_act`` / ``recv_grad`` take ``m``'s activations / output cotangents from the neighbour;
- ``forward`` runs the stage on its slice of the batch and the received activations, keeping the
  residuals of ``jax.vjp``; the last stage also yields the loss (and a ratio loss's denominator, which sets the
  seed of that micro-batch's backward: :mod:`torchpar.runtime.micro_batch_loss`); a stage computing a ``step_fn``'s aux
  values keeps them for the driver (:class:`StageRun`, :mod:`torchpar.runtime.aux_parts`);
- ``send_act`` / ``send_grad`` hand the outputs / input cotangents to the neighbour, laid out as the
  neighbour reads them;
- ``backward`` runs the vjp and adds the parameter gradients into the stage's accumulator in the same
  executable; ``free`` drops the residuals;
- ``backward_input`` / ``backward_weight`` (ZB-H1) run the two parts of that backward
  (:mod:`.split_backward`): the input cotangents, to send on at once, then later the parameter gradients
  from what the first part carried, added into the accumulator;
- ``update`` ends the list: the runtime applies it once every stage's gradients are final (tied
  parameters summed across stages, clipping computed over all stages: :mod:`.gradients`).

Compute blocks are timed (each waits for its result), and so are the transport calls, input placement and
dispatch, as the stage's timeline (:class:`~.timeline.StageClock`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from torchpar.planner.pipeline.schedules import Instruction
from torchpar.runtime.pipeline.stage_program import AUX_PREFIX, DEN, LOSS, Residuals, StageProgram
from torchpar.runtime.pipeline.timeline import StageClock
from torchpar.runtime.pipeline.transport import Transport

MICRO_BATCH_SALT = 65536
"""The PRNG key of stage ``s``, micro-batch ``m`` is ``fold_in(step_key, s·65536 + m)``."""


@dataclass
class StageState:
    """What one stage holds in this process across steps: its parameters, buffers, optimizer state, and
    during a step the accumulated parameter gradients."""

    params: dict[str, jax.Array] = field(default_factory=dict)
    buffers: dict[str, jax.Array] = field(default_factory=dict)
    opt_state: dict[str, dict[str, jax.Array]] = field(default_factory=dict)
    grads: dict[str, jax.Array] | None = None


@dataclass
class StageRun:
    """One stage's results of a step: per-micro-batch losses (last stage), its compute blocks
    ``(op, micro_batch, start_s, end_s)`` in seconds since the step's start, and its non-compute spans
    (:data:`~.timeline.SPAN_KINDS`) alike. A ratio loss's last stage also gives each micro-batch's denominator and
    the reference ``r`` its seeds were divided by (:mod:`torchpar.runtime.micro_batch_loss`)."""

    losses: list[jax.Array]
    blocks: list[tuple[str, int, float, float]]
    spans: list[tuple[str, int, float, float]] = field(default_factory=list)
    dens: list[jax.Array] = field(default_factory=list)
    reference: jax.Array | None = None
    aux: dict[str, dict[int, jax.Array]] = field(default_factory=dict)
    """A ``step_fn``'s aux values the group's stages computed: key → micro-batch → value (replicated on the stage)."""


def run_instructions(
    index: int,
    programs: Mapping[int, StageProgram],
    states: Mapping[int, StageState],
    instructions: Sequence[Instruction],
    transport: Transport,
    micro_inputs: Sequence[dict[int, np.ndarray]],
    key: jax.Array,
    send_layout: Callable[[int, str], jax.sharding.Sharding],
    start_time: float,
) -> StageRun:
    """Execute device group ``index``'s ``instructions`` (see the module docstring): each instruction on its
    stage's program and state (``programs``/``states`` by stage; one stage per group but for interleaved
    schedules). ``send_layout(peer, name)`` is the sharding stage ``peer`` holds value ``name`` in;
    ``start_time`` is the step's ``time.time()``."""
    received: dict[tuple[int, int], dict[str, jax.Array]] = {}
    cotangents: dict[tuple[int, int], dict[str, jax.Array]] = {}
    residuals: dict[tuple[int, int], Residuals] = {}
    carried: dict[tuple[int, int], tuple[jax.Array, ...]] = {}  # split backward: what backward_input hands on
    outputs: dict[tuple[int, int], dict[str, jax.Array]] = {}
    losses: list[jax.Array] = []
    aux: dict[str, dict[int, jax.Array]] = {}
    dens: list[jax.Array] = []
    reference: jax.Array | None = None
    clock = StageClock(start_time)
    activation_layouts = {s: {n: p.placement.value(n) for n in p.stage.activation_inputs} for s, p in programs.items()}
    output_layouts = {s: {n: p.placement.value(n) for n in p.stage.activation_outputs} for s, p in programs.items()}
    for state in states.values():
        state.grads = None
    for ins in instructions:
        if ins.op == "update":
            continue  # applied by the runtime once every stage's gradients are final
        mb, s = ins.micro_batch, ins.stage_in(index)
        assert mb is not None and s is not None  # every op but update has both (Instruction checks)
        program, state = programs[s], states[s]
        if ins.op == "recv_act":
            received[s, mb] = transport.receive("act", _peer(ins), s, mb, activation_layouts[s], clock=clock)
        elif ins.op == "forward":
            begin = time.time()
            inputs = {i: program.put_input(i, micro_inputs[mb][i]) for i in program.stage.batch_inputs}
            started = clock.start()
            clock.span("input", mb, begin, started[0])
            diff, rest, new_buffers, vjp = program.forward(
                state.params,
                state.buffers,
                inputs,
                received.pop((s, mb), {}),
                jax.random.fold_in(key, s * MICRO_BATCH_SALT + mb),
            )
            dispatch_s = clock.dispatched(started)
            jax.block_until_ready(diff)
            clock.compute("forward", mb, started, dispatch_s)
            state.buffers = {**state.buffers, **new_buffers}
            residuals[s, mb] = vjp
            if LOSS in diff:
                losses.append(diff[LOSS])
            for name in [n for n in rest if n.startswith(AUX_PREFIX)]:  # reported, not sent on
                aux.setdefault(name.removeprefix(AUX_PREFIX), {})[mb] = rest.pop(name)
            if DEN in rest:  # a ratio loss: this micro-batch's backward seed weighs it by its denominator
                den = rest.pop(DEN)
                reference = program.den_reference(den) if reference is None else reference
                dens.append(den)
                cotangents[s, mb] = program.ratio_seed(den, reference)
            outputs[s, mb] = {**{n: v for n, v in diff.items() if n != LOSS}, **rest}
        elif ins.op == "send_act":
            values = outputs.pop((s, mb))
            peer = _peer(ins)
            transport.send("act", s, peer, mb, values, {n: send_layout(peer, n) for n in values}, clock=clock)
        elif ins.op == "recv_grad":
            cotangents[s, mb] = transport.receive("grad", _peer(ins), s, mb, output_layouts[s], clock=clock)
        elif ins.op == "backward":
            started = clock.start()
            state.grads, act_cotangents = program.backward_into(
                residuals[s, mb], cotangents.pop((s, mb), {}), state.grads
            )
            dispatch_s = clock.dispatched(started)
            jax.block_until_ready(state.grads)
            clock.compute("backward", mb, started, dispatch_s)
            outputs[s, mb] = act_cotangents
        elif ins.op == "backward_input":  # the output cotangents stay for backward_weight
            started = clock.start()
            act_cotangents, carried[s, mb] = program.backward_input(residuals[s, mb], cotangents.get((s, mb), {}))
            dispatch_s = clock.dispatched(started)
            jax.block_until_ready((act_cotangents, carried[s, mb]))
            clock.compute("backward_input", mb, started, dispatch_s)
            outputs[s, mb] = act_cotangents
        elif ins.op == "backward_weight":
            started = clock.start()
            state.grads = program.backward_weight_into(
                residuals[s, mb], cotangents.pop((s, mb), {}), carried.pop((s, mb)), state.grads
            )
            dispatch_s = clock.dispatched(started)
            jax.block_until_ready(state.grads)
            clock.compute("backward_weight", mb, started, dispatch_s)
        elif ins.op == "send_grad":
            values = outputs.pop((s, mb))
            peer = _peer(ins)
            transport.send("grad", s, peer, mb, values, {n: send_layout(peer, n) for n in values}, clock=clock)
        elif ins.op == "free":
            residuals.pop((s, mb), None)
        else:
            raise ValueError(f"unknown instruction {ins}")
    return StageRun(losses=losses, blocks=clock.blocks, spans=clock.spans, dens=dens, reference=reference, aux=aux)


def _peer(ins: Instruction) -> int:
    """The stage a send or receive talks to (set exactly for those: :class:`Instruction` checks)."""
    assert ins.peer is not None
    return ins.peer

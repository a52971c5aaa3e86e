"""The pipeline interpreter: one stage's instruction list (:mod:`.schedules`) executed in this process.

Both runtimes run it, one thread per stage a process holds: the local runtime holds every stage, a Ray
host actor the stages whose devices it owns (a stage spanning several hosts is run by each of their
actors, in lockstep, as one SPMD program). The only difference is the :class:`~.transport.Transport`,
which delivers in-process or to peer actors.

Per instruction (micro-batch ``m``):

- ``recv_act`` / ``recv_grad`` take ``m``'s activations / output cotangents from the neighbour;
- ``forward`` runs the stage on its slice of the batch and the received activations, keeping the
  residuals of ``jax.vjp``; the last stage also yields the loss;
- ``send_act`` / ``send_grad`` hand the outputs / input cotangents to the neighbour, laid out as the
  neighbour reads them;
- ``backward`` runs the vjp and adds the parameter gradients into the stage's accumulator in the same
  executable; ``free`` drops the residuals;
- ``update`` ends the list: the runtime applies it once every stage's gradients are final (tied
  parameters summed across stages, clipping computed over all stages: :mod:`.gradients`).

Compute blocks are timed (each waits for its result) and returned as the stage's timeline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np

from torchpar.runtime.schedules import Instruction
from torchpar.runtime.stage_program import LOSS, StageProgram
from torchpar.runtime.transport import Transport

MICRO_BATCH_SALT = 65536
"""The PRNG key of stage ``s``, micro-batch ``m`` is ``fold_in(step_key, s·65536 + m)``."""


@dataclass
class StageState:
    """What one stage holds in this process across steps: its parameters, buffers, optimizer state, and
    during a step the accumulated parameter gradients."""

    params: dict[str, Any] = field(default_factory=dict)
    buffers: dict[str, Any] = field(default_factory=dict)
    opt_state: dict[str, dict[str, Any]] = field(default_factory=dict)
    grads: dict[str, Any] | None = None


@dataclass
class StageRun:
    """One stage's results of a step: per-micro-batch losses (last stage) and its compute blocks
    ``(op, micro_batch, start_s, end_s)`` in seconds since the step's start."""

    losses: list[Any]
    blocks: list[tuple[str, int, float, float]]


def run_instructions(index: int, program: StageProgram, state: StageState, instructions: Sequence[Instruction],
                     transport: Transport, micro_inputs: Sequence[dict[int, np.ndarray]], key: Any,
                     send_layout: Callable[[int, str], Any], start_time: float) -> StageRun:
    """Execute stage ``index``'s ``instructions`` (see the module docstring). ``send_layout(peer, name)`` is
    the sharding stage ``peer`` holds value ``name`` in; ``start_time`` is the step's ``time.time()``."""
    received: dict[int, dict] = {}
    cotangents: dict[int, dict] = {}
    residuals: dict[int, Any] = {}
    outputs: dict[int, dict] = {}
    losses: list[Any] = []
    blocks: list[tuple[str, int, float, float]] = []
    activation_layouts = {n: program.placement.value(n) for n in program.stage.activation_inputs}
    output_layouts = {n: program.placement.value(n) for n in program.stage.activation_outputs}
    state.grads = None
    for ins in instructions:
        mb = ins.micro_batch
        if ins.op == "recv_act":
            received[mb] = transport.receive("act", ins.peer, index, mb, activation_layouts)
        elif ins.op == "forward":
            inputs = {i: program.put_input(i, micro_inputs[mb][i]) for i in program.stage.batch_inputs}
            begin = time.time()
            diff, rest, new_buffers, vjp = program.forward(state.params, state.buffers, inputs, received.pop(mb, {}),
                                                           jax.random.fold_in(key, index * MICRO_BATCH_SALT + mb))
            jax.block_until_ready(diff)
            blocks.append(("forward", mb, begin - start_time, time.time() - start_time))
            state.buffers = {**state.buffers, **new_buffers}
            residuals[mb] = vjp
            if LOSS in diff:
                losses.append(diff[LOSS])
            outputs[mb] = {**{n: v for n, v in diff.items() if n != LOSS}, **rest}
        elif ins.op == "send_act":
            values = outputs.pop(mb)
            transport.send("act", index, ins.peer, mb, values, {n: send_layout(ins.peer, n) for n in values})
        elif ins.op == "recv_grad":
            cotangents[mb] = transport.receive("grad", ins.peer, index, mb, output_layouts)
        elif ins.op == "backward":
            begin = time.time()
            state.grads, act_cotangents = program.backward_into(residuals[mb], cotangents.pop(mb, {}), state.grads)
            jax.block_until_ready(state.grads)
            blocks.append(("backward", mb, begin - start_time, time.time() - start_time))
            outputs[mb] = act_cotangents
        elif ins.op == "send_grad":
            values = outputs.pop(mb)
            transport.send("grad", index, ins.peer, mb, values, {n: send_layout(ins.peer, n) for n in values})
        elif ins.op == "free":
            residuals.pop(mb, None)
        elif ins.op == "update":
            pass  # applied by the runtime once every stage's gradients are final
        else:
            raise ValueError(f"unknown instruction {ins}")
    return StageRun(losses=losses, blocks=blocks)

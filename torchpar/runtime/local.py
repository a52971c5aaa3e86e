"""The local pipeline runtime: every stage in this process, on its own devices.

Each step interprets the per-stage instruction lists of a schedule (:mod:`.schedules`): it runs, round
robin, each stage's next instruction unless it waits for a message that has not been sent yet.
Activations and cotangents move between stages with ``jax.device_put``. JAX dispatches asynchronously,
so stages on different devices overlap. After every stage's last backward, gradients of parameters used
by several stages (tied weights) are summed, the global gradient norm is computed for clipping, and
each stage applies the optimizer once.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import jax
import numpy as np

from torchpar.runtime.schedules import Instruction
from torchpar.runtime.stage_program import LOSS, StageProgram

log = logging.getLogger(__name__)


class PipelineState:
    """Parameters, buffers and optimizer state of every stage (a tied parameter lives in each stage using it)."""

    def __init__(self, programs: Sequence[StageProgram]):
        self.programs = list(programs)
        self.params: list[dict[str, Any]] = [{} for _ in programs]
        self.buffers: list[dict[str, Any]] = [{} for _ in programs]
        self.opt_state: list[dict[str, dict[str, Any]]] = [{} for _ in programs]

    def load(self, params: dict[str, np.ndarray], buffers: dict[str, np.ndarray],
             opt_state: dict[str, dict[str, np.ndarray]]) -> None:
        for s, program in enumerate(self.programs):
            inputs = program.stage.graph.inputs
            self.params[s] = {n: program.put_param(n, params[n]) for n in program.stage.params}
            self.buffers[s] = {i.target: program.put(buffers[i.target]) for i in inputs if i.kind == "buffer"}
            self.opt_state[s] = {n: {k: program.put_state(n, v) for k, v in opt_state[n].items()}
                                 for n in program.trainable}

    def export(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
        """Host copies of everything, taking each tied parameter from the first stage that holds it."""
        params: dict[str, Any] = {}
        buffers: dict[str, Any] = {}
        opt_state: dict[str, dict[str, Any]] = {}
        for s in range(len(self.programs)):
            for n, v in self.params[s].items():
                params.setdefault(n, np.asarray(v))
            for n, v in self.buffers[s].items():
                buffers.setdefault(n, np.asarray(v))
            for n, entries in self.opt_state[s].items():
                opt_state.setdefault(n, {k: np.asarray(v) for k, v in entries.items()})
        return params, buffers, opt_state


class LocalPipeline:
    """Runs one training step of a pipeline in this process (see the module docstring)."""

    def __init__(self, programs: Sequence[StageProgram], schedule: list[list[Instruction]],
                 grad_clip_norm: float | None = None):
        self.programs = list(programs)
        self.schedule = schedule
        self.grad_clip_norm = grad_clip_norm
        self.state = PipelineState(programs)

    def load(self, params: dict[str, np.ndarray], buffers: dict[str, np.ndarray],
             opt_state: dict[str, dict[str, np.ndarray]]) -> None:
        self.state.load(params, buffers, opt_state)

    def export(self) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, Any]]]:
        return self.state.export()

    def hlo_text(self) -> list[str]:
        return [program.forward_hlo() for program in self.programs]

    def memory_stats(self) -> list[dict[str, int]]:
        return [program.memory_stats() for program in self.programs]

    def warm_up(self, scalars: Any) -> None:
        """Compile every stage's functions now rather than inside the first step."""
        for s, program in enumerate(self.programs):
            program.warm_up(self.state.params[s], self.state.buffers[s], self.state.opt_state[s], scalars)

    def step(self, micro_inputs: list[dict[int, np.ndarray]], scalars: Any, key: Any) -> float:
        """One optimizer step over the micro-batches; returns the mean micro-batch loss."""
        programs, state = self.programs, self.state
        num_stages = len(programs)
        mailbox: dict[tuple[str, int, int], Any] = {}
        received: dict[tuple[int, int], dict] = {}
        outputs: dict[tuple[int, int], tuple[dict, dict]] = {}
        residuals: dict[tuple[int, int], Any] = {}
        cotangents: dict[tuple[int, int], dict] = {}
        grads: list[dict | None] = [None] * num_stages
        losses: list[Any] = []
        pc = [0] * num_stages
        while any(pc[s] < len(self.schedule[s]) for s in range(num_stages)):
            progressed = False
            for s, program in enumerate(programs):
                while pc[s] < len(self.schedule[s]):
                    ins = self.schedule[s][pc[s]]
                    mb = ins.micro_batch
                    if ins.op == "recv_act":
                        if ("act", s, mb) not in mailbox:
                            break
                        received[(s, mb)] = mailbox.pop(("act", s, mb))
                    elif ins.op == "forward":
                        inputs = {i: program.put_input(i, micro_inputs[mb][i]) for i in program.stage.batch_inputs}
                        stage_key = jax.random.fold_in(key, s * 65536 + mb)
                        diff, rest, new_buffers, vjp = program.forward(
                            state.params[s], state.buffers[s], inputs, received.pop((s, mb), {}), stage_key)
                        state.buffers[s] = {**state.buffers[s], **new_buffers}
                        residuals[(s, mb)] = vjp
                        if LOSS in diff:
                            losses.append(diff[LOSS])
                        outputs[(s, mb)] = ({n: v for n, v in diff.items() if n != LOSS}, rest)
                    elif ins.op == "send_act":
                        diff, rest = outputs.pop((s, mb))
                        peer = programs[ins.peer]
                        mailbox[("act", ins.peer, mb)] = {n: peer.put_activation(n, v) for n, v in {**diff, **rest}.items()}
                    elif ins.op == "recv_grad":
                        if ("grad", s, mb) not in mailbox:
                            break
                        cotangents[(s, mb)] = mailbox.pop(("grad", s, mb))
                    elif ins.op == "backward":
                        grads[s], act_cotangents = program.backward_into(residuals[(s, mb)],
                                                                         cotangents.pop((s, mb), {}), grads[s])
                        outputs[(s, mb)] = (act_cotangents, {})
                    elif ins.op == "send_grad":
                        act_cotangents, _ = outputs.pop((s, mb))
                        peer = programs[ins.peer]
                        mailbox[("grad", ins.peer, mb)] = {n: jax.device_put(v, peer.placement.value(n))
                                                           for n, v in act_cotangents.items()}
                    elif ins.op == "free":
                        residuals.pop((s, mb), None)
                    elif ins.op == "update":
                        pass  # applied below, once every stage's gradients are complete
                    else:
                        raise ValueError(f"unknown instruction {ins}")
                    pc[s] += 1
                    progressed = True
            if not progressed:
                waiting = {s: str(self.schedule[s][pc[s]]) for s in range(num_stages) if pc[s] < len(self.schedule[s])}
                raise RuntimeError(f"pipeline schedule deadlocked; stages wait on {waiting}")
        self._apply_updates(grads, scalars)
        return float(np.mean([float(loss) for loss in losses]))

    def _apply_updates(self, grads: list[dict | None], scalars: Any) -> None:
        programs, state = self.programs, self.state
        grads = [g or {} for g in grads]
        shared = _shared_params(programs)
        if shared:  # a tied parameter's gradient is the sum over the stages that use it
            totals = {n: sum(np.asarray(grads[s][n], np.float64) for s in stages) for n, stages in shared.items()}
            for n, stages in shared.items():
                for s in stages:
                    grads[s][n] = programs[s].put_param(n, totals[n].astype(np.asarray(grads[s][n]).dtype))
        clip_scale = 1.0
        if self.grad_clip_norm is not None:
            owner_sq = 0.0
            counted: set[str] = set()
            for s, program in enumerate(programs):
                unique = {n: g for n, g in grads[s].items() if n not in counted}
                counted |= set(unique)
                owner_sq += float(program.squared_norm(unique)) if unique else 0.0
            total_norm = np.float32(np.sqrt(owner_sq))
            clip_scale = float(min(1.0, self.grad_clip_norm / (float(total_norm) + 1e-6)))
        for s, program in enumerate(programs):
            if program.trainable:
                state.params[s], state.opt_state[s] = program.update(
                    state.params[s], grads[s], state.opt_state[s], scalars, clip_scale)


def _shared_params(programs: Sequence[StageProgram]) -> dict[str, list[int]]:
    users: dict[str, list[int]] = {}
    for s, program in enumerate(programs):
        for name in program.trainable:
            users.setdefault(name, []).append(s)
    return {n: stages for n, stages in users.items() if len(stages) > 1}


def split_micro_batches(leaves: list[np.ndarray], num_micro_batches: int) -> list[dict[int, np.ndarray]]:
    """Split every batch leaf along dim 0 into ``num_micro_batches`` equal parts."""
    for index, leaf in enumerate(leaves):
        if leaf.ndim == 0 or leaf.shape[0] % num_micro_batches:
            raise ValueError(f"batch leaf {index} of shape {list(leaf.shape)} cannot be split into "
                             f"{num_micro_batches} equal micro-batches along dim 0")
    parts = [np.split(leaf, num_micro_batches) for leaf in leaves]
    return [{i: parts[i][m] for i in range(len(leaves))} for m in range(num_micro_batches)]



"""The Ray pipeline runtime: one actor per host, each owning its JAX devices and its stages.

The driver sends every actor the same per-step call; each actor runs the instruction lists of its stages
(one thread per stage), exchanging activations and cotangents with its neighbours: in-process when the
neighbour stage lives on the same actor, else through ``peer.deliver.remote(...)`` (numpy arrays through
Ray's object store). Receives block with a timeout. After all backwards the driver sums gradients of
parameters shared between stages, computes the clipping factor from every stage's gradient norm, and
asks each actor to apply its update.

Actors start with ``XLA_FLAGS`` giving them ``devices_per_host`` fake CPU devices (``runtime_env``) and pin
themselves to their share of the machine's cores, so hosts do not fight over cores. Every remote call
has a timeout; a dead actor or a missing message raises an error naming the stage.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
COMPILE_TIMEOUT_S = 1800.0


class PipelineError(RuntimeError):
    """A pipeline step failed on a host (dead actor, timeout, error in a stage)."""


@ray.remote(max_concurrency=16)
class HostWorker:
    """One simulated host: its JAX devices, its stages and their state."""

    def __init__(self, host: int, cores: list[int] | None):
        self.host = host
        if cores:
            os.sched_setaffinity(0, set(cores))
        self._mailbox: dict[tuple[str, int, int], Any] = {}
        self._cv = threading.Condition()
        self._programs: dict[int, Any] = {}

    def ready(self) -> dict:
        import jax

        return {"host": self.host, "pid": os.getpid(), "devices": jax.device_count(),
                "cores": sorted(os.sched_getaffinity(0))}

    def setup(self, stages: list[tuple[Any, Any, list[int]]], spec: Any, trainable: set[str], num_micro_batches: int,
              schedule: list[list[Any]], stage_host: dict[int, int], timeout_s: float,
              library_fusions: bool = True) -> None:
        import jax

        from torchpar.runtime.placement import Placement
        from torchpar.runtime.stage_program import StageProgram

        devices = jax.devices()
        self._schedule = schedule
        self._stage_host = stage_host
        self._timeout = timeout_s
        for stage_graph, stage_plan, local_devices in stages:
            placement = Placement.from_stage(stage_plan, stage_graph.graph, [devices[i] for i in local_devices])
            self._programs[stage_graph.index] = StageProgram(stage_graph, placement=placement, spec=spec,
                                                             trainable=trainable, num_micro_batches=num_micro_batches,
                                                             library_fusions=library_fusions)
        self._params = {s: {} for s in self._programs}
        self._buffers = {s: {} for s in self._programs}
        self._opt_state = {s: {} for s in self._programs}
        self._grads: dict[int, dict] = {}

    def set_peers(self, peers: dict[int, Any]) -> None:
        self._peers = peers  # host index → actor handle

    def warm_up(self, scalars: Any) -> None:
        """Compile every stage's functions now (see ``StageProgram.warm_up``)."""
        for s, program in self._programs.items():
            program.warm_up(self._params[s], self._buffers[s], self._opt_state[s], scalars)

    def load(self, params: dict, buffers: dict, opt_state: dict) -> None:
        for s, program in self._programs.items():
            self._params[s] = {n: program.put_param(n, params[n]) for n in program.stage.params}
            self._buffers[s] = {i.target: program.put(buffers[i.target]) for i in program.stage.graph.inputs
                                if i.kind == "buffer"}
            self._opt_state[s] = {n: {k: program.put_state(n, v) for k, v in opt_state[n].items()}
                                  for n in program.trainable}

    def export(self) -> tuple[dict, dict, dict]:
        params, buffers, opt_state = {}, {}, {}
        for s in sorted(self._programs):
            params.update({n: np.asarray(v) for n, v in self._params[s].items()})
            buffers.update({n: np.asarray(v) for n, v in self._buffers[s].items()})
            opt_state.update({n: {k: np.asarray(v) for k, v in e.items()} for n, e in self._opt_state[s].items()})
        return params, buffers, opt_state

    # --- messages ----------------------------------------------------------------------------------

    def deliver(self, kind: str, stage: int, micro_batch: int, payload: dict) -> None:
        with self._cv:
            self._mailbox[(kind, stage, micro_batch)] = payload
            self._cv.notify_all()

    def _receive(self, kind: str, stage: int, micro_batch: int) -> dict:
        deadline = time.monotonic() + self._timeout
        with self._cv:
            while (kind, stage, micro_batch) not in self._mailbox:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PipelineError(f"stage {stage} on host {self.host} waited {self._timeout:.0f}s for the "
                                        f"{'activations' if kind == 'act' else 'gradients'} of micro-batch {micro_batch}")
                self._cv.wait(left)
            return self._mailbox.pop((kind, stage, micro_batch))

    def _send(self, kind: str, stage: int, micro_batch: int, payload: dict) -> None:
        host = self._stage_host[stage]
        if host == self.host:
            self.deliver(kind, stage, micro_batch, payload)
        else:
            self._peers[host].deliver.remote(kind, stage, micro_batch, {n: np.asarray(v) for n, v in payload.items()})

    # --- a step ---------------------------------------------------------------------------------------

    def run_step(self, micro_inputs: list[dict[int, np.ndarray]], key_data: np.ndarray, start_time: float) -> dict:
        """Every local stage's forward/backward instructions; returns losses, gradient norms, the gradients
        of parameters shared with other stages, and each stage's compute blocks ``(op, micro_batch, start,
        end)`` in seconds since ``start_time`` (the driver's ``time.time()`` when it issued the step)."""
        import jax

        key = jax.random.wrap_key_data(key_data)
        self._step_start = start_time
        self._blocks = {s: [] for s in self._programs}
        results: dict[int, Any] = {}
        errors: list[BaseException] = []

        def run(stage: int) -> None:
            try:
                results[stage] = self._run_stage(stage, micro_inputs, key)
            except BaseException as error:  # reported to the driver below
                errors.append(error)
                with self._cv:
                    self._cv.notify_all()

        threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in self._programs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        losses = [loss for s in sorted(results) for loss in results[s]]
        sq_norms = {s: float(self._programs[s].squared_norm(self._grads[s])) if self._grads.get(s) else 0.0
                    for s in self._programs}
        grads = {s: {n: np.asarray(g) for n, g in self._grads.get(s, {}).items()} for s in self._programs}
        return {"losses": losses, "sq_norms": sq_norms, "grads_of_shared": grads, "blocks": self._blocks}

    def _run_stage(self, s: int, micro_inputs: list[dict[int, np.ndarray]], key: Any) -> list[float]:
        import jax

        program = self._programs[s]
        received: dict[int, dict] = {}
        cotangents: dict[int, dict] = {}
        residuals: dict[int, Any] = {}
        outputs: dict[int, tuple[dict, dict]] = {}
        losses = []
        self._grads[s] = None
        from torchpar.runtime.stage_program import LOSS

        for ins in self._schedule[s]:
            mb = ins.micro_batch
            if ins.op == "recv_act":
                payload = self._receive("act", s, mb)
                received[mb] = {n: program.put_activation(n, v) for n, v in payload.items()}
            elif ins.op == "forward":
                inputs = {i: program.put_input(i, micro_inputs[mb][i]) for i in program.stage.batch_inputs}
                begin = time.time()
                diff, rest, new_buffers, vjp = program.forward(self._params[s], self._buffers[s], inputs,
                                                               received.pop(mb, {}), jax.random.fold_in(key, s * 65536 + mb))
                jax.block_until_ready(diff)
                self._blocks[s].append(("forward", mb, begin - self._step_start, time.time() - self._step_start))
                self._buffers[s] = {**self._buffers[s], **new_buffers}
                residuals[mb] = vjp
                if LOSS in diff:
                    losses.append(float(diff[LOSS]))
                outputs[mb] = ({n: v for n, v in diff.items() if n != LOSS}, rest)
            elif ins.op == "send_act":
                diff, rest = outputs.pop(mb)
                self._send("act", ins.peer, mb, {**diff, **rest})
            elif ins.op == "recv_grad":
                payload = self._receive("grad", s, mb)
                cotangents[mb] = {n: jax.device_put(v, program.placement.value(n)) for n, v in payload.items()}
            elif ins.op == "backward":
                begin = time.time()
                self._grads[s], act_cotangents = program.backward_into(residuals[mb], cotangents.pop(mb, {}),
                                                                       self._grads[s])
                jax.block_until_ready(self._grads[s])
                self._blocks[s].append(("backward", mb, begin - self._step_start, time.time() - self._step_start))
                outputs[mb] = (act_cotangents, {})
            elif ins.op == "send_grad":
                act_cotangents, _ = outputs.pop(mb)
                self._send("grad", ins.peer, mb, act_cotangents)
            elif ins.op == "free":
                residuals.pop(mb, None)
        return losses

    def apply_update(self, scalars: Any, clip_scale: float, shared_totals: dict[str, np.ndarray]) -> None:
        for s, program in self._programs.items():
            if not program.trainable:
                continue
            grads = dict(self._grads.get(s) or {})
            for name in list(grads):
                if name in shared_totals:
                    grads[name] = program.put_param(name, shared_totals[name].astype(np.asarray(grads[name]).dtype))
            self._params[s], self._opt_state[s] = program.update(self._params[s], grads, self._opt_state[s], scalars,
                                                                 clip_scale)
        self._grads = {}

    def hlo_text(self) -> dict[int, str]:
        return {s: program.forward_hlo() for s, program in self._programs.items()}

    def memory_stats(self) -> dict[int, dict[str, int]]:
        return {s: program.memory_stats() for s, program in self._programs.items()}


@dataclass
class StepTimeline:
    """Measured compute blocks ``(op, micro_batch, start_s, end_s)`` of each stage in the last step."""

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
        return 1.0 - busy / (span * len(self.blocks))


class RayPipeline:
    """Driver side of the Ray runtime (see the module docstring)."""

    def __init__(self, pipeline: Any, *, spec: Any, trainable: set[str], grad_clip_norm: float | None,
                 num_hosts: int, devices_per_host: int, cores_per_host: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, library_fusions: bool = True):
        from torchpar.runtime.schedules import make_schedule

        plan = pipeline.plan
        self.timeout_s = timeout_s
        self.grad_clip_norm = grad_clip_norm
        self.num_micro_batches = plan.num_micro_batches
        stage_host = {s: devices[0] // devices_per_host for s, devices in enumerate(pipeline.devices)}
        for s, devices in enumerate(pipeline.devices):
            if {d // devices_per_host for d in devices} != {stage_host[s]}:
                raise NotImplementedError(f"stage {s} spans several hosts; the Ray runtime places a stage on one host")
        self.stage_host = stage_host
        hosts = sorted(set(stage_host.values()))
        self.workers = _start_workers(hosts, devices_per_host, cores_per_host, timeout_s)
        schedule = make_schedule(plan.schedule, len(pipeline.stages), self.num_micro_batches)
        self.stages_of_host = {h: [s for s in stage_host if stage_host[s] == h] for h in hosts}
        calls = []
        for host, worker in self.workers.items():
            local = [(pipeline.stages[s], plan.stages[s], [d - host * devices_per_host for d in pipeline.devices[s]])
                     for s in self.stages_of_host[host]]
            calls.append(worker.setup.remote(local, spec, trainable, self.num_micro_batches, schedule, stage_host,
                                             timeout_s, library_fusions))
        self._get(calls, "setting up the stages")
        self._get([w.set_peers.remote(self.workers) for w in self.workers.values()], "connecting the hosts")
        self.shared = {}
        for s, stage in enumerate(pipeline.stages):
            for name in stage.params:
                if name in trainable:
                    self.shared.setdefault(name, []).append(s)
        self.shared = {n: stages for n, stages in self.shared.items() if len(stages) > 1}

    def _get(self, refs: list, what: str, timeout: float | None = None) -> list:
        timeout = self.timeout_s if timeout is None else timeout
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise PipelineError(f"timed out after {timeout:.0f}s {what}") from None
        except ray.exceptions.RayActorError as error:
            host = next((h for h, w in self.workers.items() if getattr(error, "actor_id", None) == w._actor_id), None)
            stages = self.stages_of_host.get(host, "?") if host is not None else "?"
            raise PipelineError(f"the host actor running stage(s) {stages} died while {what}: {error}") from None
        except ray.exceptions.RayTaskError as error:
            raise PipelineError(f"a stage failed while {what}: {error}") from None

    def load(self, params: dict, buffers: dict, opt_state: dict) -> None:
        self._get([w.load.remote(params, buffers, opt_state) for w in self.workers.values()], "loading the state")

    def warm_up(self, scalars: Any) -> None:
        """Compile every stage on its host (compilation is not held to the step timeout)."""
        self._get([w.warm_up.remote(scalars) for w in self.workers.values()], "compiling the stages",
                  timeout=COMPILE_TIMEOUT_S)

    def export(self) -> tuple[dict, dict, dict]:
        params, buffers, opt_state = {}, {}, {}
        for p, b, o in self._get([w.export.remote() for w in self.workers.values()], "exporting the state"):
            for name, value in p.items():
                params.setdefault(name, value)
            for name, value in b.items():
                buffers.setdefault(name, value)
            for name, value in o.items():
                opt_state.setdefault(name, value)
        return params, buffers, opt_state

    def step(self, micro_inputs: list[dict[int, np.ndarray]], scalars: Any, key: Any) -> float:
        import jax

        if not self.workers:
            raise PipelineError("this pipeline's host actors were stopped after an earlier failure; compile again")
        key_data = np.asarray(jax.random.key_data(key))
        start = time.time()
        refs = {h: w.run_step.remote(micro_inputs, key_data, start) for h, w in self.workers.items()}
        results = dict(zip(refs, self._get_each(refs, "running the forward and backward passes")))
        blocks = {s: b for r in results.values() for s, b in r["blocks"].items()}
        self.last_timeline = StepTimeline(blocks=[blocks[s] for s in sorted(blocks)], makespan=time.time() - start)
        losses = [loss for r in results.values() for loss in r["losses"]]
        totals = {}
        for name, stages in self.shared.items():
            parts = [results[self.stage_host[s]]["grads_of_shared"][s][name] for s in stages]
            totals[name] = np.sum([p.astype(np.float64) for p in parts], axis=0)
        clip_scale = 1.0
        if self.grad_clip_norm is not None:
            sq = sum(v for r in results.values() for v in r["sq_norms"].values())
            for name, stages in self.shared.items():  # count a shared parameter once, with its total gradient
                for s in stages:
                    sq -= float(np.sum(np.square(results[self.stage_host[s]]["grads_of_shared"][s][name].astype(np.float64))))
                sq += float(np.sum(np.square(totals[name])))
            clip_scale = float(min(1.0, self.grad_clip_norm / (float(np.sqrt(max(sq, 0.0))) + 1e-6)))
        self._get([w.apply_update.remote(scalars, clip_scale, totals) for w in self.workers.values()],
                  "applying the optimizer update")
        return float(np.mean(losses))

    def _get_each(self, refs: dict, what: str) -> list:
        """Results of one call per host, in host order; the first failure (a dead actor, an error in a stage,
        or the timeout) stops the pipeline's actors and raises :class:`PipelineError` naming the stages."""
        deadline = time.monotonic() + self.timeout_s
        host_of = {ref: host for host, ref in refs.items()}
        pending = list(refs.values())
        values: dict[int, Any] = {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                stuck = [self.stages_of_host[host_of[r]] for r in pending]
                self._abort()
                raise PipelineError(f"timed out after {self.timeout_s:.0f}s {what}; stage(s) {stuck} did not finish "
                                    "(the pipeline's actors were stopped)")
            ref = ready[0]
            host = host_of[ref]
            try:
                values[host] = ray.get(ref)
            except ray.exceptions.RayActorError as error:
                self._abort()
                raise PipelineError(f"the host actor running stage(s) {self.stages_of_host[host]} died while {what} "
                                    f"({type(error).__name__}); the pipeline's actors were stopped") from None
            except ray.exceptions.RayTaskError as error:
                self._abort()
                raise PipelineError(f"stage(s) {self.stages_of_host[host]} failed while {what}: {error}") from None
        return [values[host] for host in refs]

    def _abort(self) -> None:
        for worker in self.workers.values():
            ray.kill(worker)
        self.workers = {}

    def hlo_text(self) -> list[str]:
        return self._per_stage("hlo_text", "reading HLO")

    def memory_stats(self) -> list[dict[str, int]]:
        return self._per_stage("memory_stats", "reading memory statistics")

    def _per_stage(self, method: str, what: str) -> list[Any]:
        """A per-stage result gathered from every host's actor, in stage order."""
        results: dict[int, Any] = {}
        for result in self._get([getattr(w, method).remote() for w in self.workers.values()], what):
            results.update(result)
        return [results[s] for s in sorted(results)]

    def shutdown(self) -> None:
        for worker in self.workers.values():
            ray.kill(worker)
        self.workers = {}


def _start_workers(hosts: list[int], devices_per_host: int, cores_per_host: int | None,
                   timeout_s: float) -> dict[int, Any]:
    available = int(ray.available_resources().get("CPU", 0))
    cpus = os.cpu_count() or 1
    per_host = cores_per_host or (max(1, cpus // len(hosts)) if len(hosts) <= cpus else 1)
    if len(hosts) > available:
        raise PipelineError(f"the Ray cluster has {available} free CPU(s) but the plan needs {len(hosts)} host actors "
                            "(one CPU each); use fewer hosts or a bigger cluster")
    workers = {}
    flags = f"--xla_force_host_platform_device_count={devices_per_host}"
    for index, host in enumerate(hosts):
        cores = [c % cpus for c in range(index * per_host, (index + 1) * per_host)] if len(hosts) <= cpus else None
        workers[host] = HostWorker.options(
            num_cpus=1, runtime_env={"env_vars": {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}},
            name=None).remote(host, cores)
    try:
        ready = ray.get([w.ready.remote() for w in workers.values()], timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        for worker in workers.values():
            ray.kill(worker)
        raise PipelineError(f"the host actors did not start within {timeout_s:.0f}s (not enough free CPUs in the Ray "
                            "cluster?)") from None
    for info in ready:
        if info["devices"] < devices_per_host:
            raise PipelineError(f"host actor {info['host']} sees {info['devices']} JAX devices, needs {devices_per_host}")
    log.info("ray hosts: %s", ready)
    return workers

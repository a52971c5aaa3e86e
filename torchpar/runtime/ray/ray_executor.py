"""The Ray executor: one host actor (:mod:`.host_actor`) per host the plan uses, driven from this process.

The driver holds no device of the plan. Building it:

1. checks the cluster has the CPUs (one per actor) and GPUs (``devices_per_host`` per actor on a GPU
   cluster) free, naming the open engines of this process that hold them if not;
2. starts the actors, each pinned to its host's node (``NodeAffinitySchedulingStrategy``), and waits for
   them to be placed (a cluster that cannot place them is an error within the timeout, naming the hosts);
3. joins them into one JAX system (rank ``r`` serves the ``r``-th host the plan uses) and builds each
   one's worker.

Every call goes to all actors at once; large arguments (state, batches) are put in Ray's object store
once and read by every actor from there. Each call has a deadline. The first failure — an actor that
died (its process killed, its node lost), an error inside a worker, or the deadline — stops every actor
of the engine (one of them may be blocked in a collective with the lost process) and raises
:class:`HostFailure` naming the host, its node and process, and its stages. ``close()`` kills the actors
and waits until Ray has released them.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar, cast

import numpy as np
import ray

from torchpar.runtime.batch_parts import Ahead
from torchpar.runtime.devices import DeviceMap
from torchpar.runtime.executor import Executor, Prepared, R, open_executors
from torchpar.runtime.ray.host_actor import HostActor, HostActorHandle, HostInfo, actor_environment
from torchpar.runtime.ray.ray_cluster import RayCluster
from torchpar.runtime.worker import ExecutionSpec, Worker

if TYPE_CHECKING:
    from ray.actor import ActorClass, ActorHandle

log = logging.getLogger(__name__)

T = TypeVar("T")

RESOURCE_GRACE_S = 5.0
"""How long a start waits for CPUs/GPUs that a just-closed engine is releasing."""
LIVENESS_PERIOD_S = 2.0
"""While a call is outstanding, every actor is pinged this often: a dead one ends the wait at once."""
DEATH_NOTICE_S = 5.0
"""When an actor fails, how long to wait for Ray to report a peer dead (the failure may be its consequence)."""


class HostFailure(RuntimeError):
    """A host actor died, failed or timed out; the engine's actors were stopped."""


class RayExecutor(Executor):
    """Runs a plan on Ray host actors (see the module docstring)."""

    kind = "ray"

    def __init__(
        self,
        spec: ExecutionSpec,
        cluster: RayCluster,
        *,
        timeout_s: float,
        cores_per_host: int | None = None,
        label: str = "",
    ):
        per_host = cluster.devices_per_host
        used = sorted({d // per_host for stage in spec.plan.stages for d in stage.devices()})
        if used and used[-1] >= len(cluster.hosts):
            raise ValueError(
                f"the plan uses host {used[-1]} but the Ray cluster has {len(cluster.hosts)} host(s) "
                f"({cluster.describe()}); plan for this cluster or init a bigger one"
            )
        spec.devices = DeviceMap(per_host, tuple(used))
        super().__init__(spec, label)
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.hosts = [cluster.hosts[h] for h in used]
        self.actors: list[HostActorHandle] = []
        self.infos: list[HostInfo] = []
        self._tokens = itertools.count()
        ranks = spec.stage_ranks()
        self.stages_of_rank = {r: [s for s, members in ranks.items() if r in members] for r in range(len(used))}
        try:
            self._start(cores_per_host)
        except BaseException:
            self.close()
            raise

    # --- start --------------------------------------------------------------------------------------------------

    def _start(self, cores_per_host: int | None) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        cluster, per_host = self.cluster, self.cluster.devices_per_host
        gpus = per_host if cluster.accelerator == "gpu" else 0
        start = time.perf_counter()
        self._check_resources(len(self.hosts), gpus)
        env = actor_environment(per_host)
        slots: dict[str | None, int] = {}
        on_node = {h.node_id: sum(1 for g in self.hosts if g.node_id == h.node_id) for h in self.hosts}
        for rank, host in enumerate(self.hosts):
            slot = slots.get(host.node_id, 0)
            slots[host.node_id] = slot + 1
            options: dict[str, object] = {"num_cpus": 1, "num_gpus": gpus, "runtime_env": {"env_vars": env}}
            if host.node_id is not None:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(host.node_id, soft=False)
            actor_class = cast("ActorClass[HostActor]", HostActor)  # ray.remote made it one (mypy reads no decorator)
            actor = actor_class.options(**options).remote(
                host.index, rank, slot, on_node[host.node_id], cores_per_host if cluster.simulated else None
            )
            self.actors.append(cast(HostActorHandle, actor))
        self.infos = self._gather(
            {r: a.info.remote() for r, a in enumerate(self.actors)},
            "starting the host actors",
            self.timeout_s,
            placing=True,
        )
        placed = time.perf_counter()
        coordinator: str | None = None
        if len(self.actors) > 1:
            coordinator = self._gather(
                {0: self.actors[0].coordinator_address.remote()}, "choosing the JAX coordinator", self.timeout_s
            )[0]
        joined = self._gather(
            {r: a.join.remote(coordinator, len(self.actors), self.timeout_s) for r, a in enumerate(self.actors)},
            "joining the hosts into one JAX system",
            self.timeout_s + 30,
        )
        for info, devices in zip(self.infos, joined):
            info.update(devices)
            if cluster.accelerator == "gpu" and devices["platform"] == "cpu":
                log.warning(
                    "torchpar: host %d was given GPU(s) %s by Ray but JAX found no GPU there; it runs on "
                    "%d CPU device(s)",
                    info["host"],
                    info["gpu_ids"],
                    len(devices["local_devices"]),
                )
            if len(devices["local_devices"]) < per_host:
                raise HostFailure(
                    f"host {info['host']} ({info['address']}, pid {info['pid']}) has "
                    f"{len(devices['local_devices'])} JAX device(s), the plan needs {per_host}"
                )
        joined_at = time.perf_counter()
        peers = dict(enumerate(self.actors))
        spec_ref = ray.put(self.spec)
        channels = {r: devices["channel"] for r, devices in enumerate(joined) if "channel" in devices}
        self._gather(
            {r: a.build.remote(spec_ref, peers, channels) for r, a in enumerate(self.actors)},
            "building the stage programs",
            self.compile_timeout_s,
        )
        self.timings = {
            "start_hosts": placed - start,
            "join_hosts": joined_at - placed,
            "build_workers": time.perf_counter() - joined_at,
        }
        log.info(
            "torchpar: %d host actor(s) ready in %s: %s",
            len(self.actors),
            ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items()),
            [(i["host"], i["address"], i["pid"], i["platform"]) for i in self.infos],
        )

    def _check_resources(self, actors: int, gpus_each: int) -> None:
        deadline = time.monotonic() + RESOURCE_GRACE_S
        while True:
            free = ray.available_resources()
            short = []
            if free.get("CPU", 0) < actors:
                short.append(f"{free.get('CPU', 0):g} free CPU(s) for {actors} host actor(s) (one CPU each)")
            if gpus_each and free.get("GPU", 0) < actors * gpus_each:
                short.append(f"{free.get('GPU', 0):g} free GPU(s) for {actors} host actor(s) of {gpus_each} GPU(s)")
            if not short or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if short:
            others = [e for e in open_executors() if isinstance(e, RayExecutor) and e is not self]
            held = ""
            if others:
                held = (
                    f" {len(others)} open torchpar engine(s) of this process hold host actors: "
                    + "; ".join(e.summary() for e in others)
                    + ". Call engine.close() on those you are done with "
                    "(or use `with torchpar.compile(...) as engine:`), or torchpar.shutdown() to free them all."
                )
            raise HostFailure(f"the Ray cluster has {' and '.join(short)}.{held}")

    # --- calls --------------------------------------------------------------------------------------------------

    def _call(self, method: Callable[..., R], *args: object, what: str, timeout_s: float | None = None) -> list[R]:
        self._check_open()
        if len(self.actors) > 1:  # one copy in the object store, read by every actor
            args = tuple(ray.put(a) if _is_bulky(a) else a for a in args)
        refs = {rank: actor.call.remote(method.__name__, *args) for rank, actor in enumerate(self.actors)}
        # each actor's worker ran `method`, which returns an R
        return cast("list[R]", self._gather(refs, what, self.timeout_s if timeout_s is None else timeout_s))

    def _call_ranks(
        self, method: Callable[..., R], args_by_rank: Sequence[tuple], what: str, timeout_s: float | None = None
    ) -> list[R]:
        """Each actor its own arguments (its part of a batch): sent to it alone, through the object store (the
        method by name: the wire carries names; :meth:`.host_actor.HostActor.call` looks it up)."""
        self._check_open()
        refs = {
            rank: actor.call.remote(method.__name__, *args)
            for rank, (actor, args) in enumerate(zip(self.actors, args_by_rank))
        }
        # each actor's worker ran `method`, which returns an R
        return cast("list[R]", self._gather(refs, what, self.timeout_s if timeout_s is None else timeout_s))

    @property
    def num_ranks(self) -> int:
        return len(self.actors)

    def prepare(self, key: Hashable, leaves: Sequence[np.ndarray]) -> Prepared:
        """Each actor's part of the batch sent now and, one-stage plans, placed on its devices beside the running
        step (``place_ahead``); a pipeline's parts wait in the object store."""
        payloads = [ray.put(payload) for payload in self.payloads(key, leaves)]
        if self.spec.is_pipeline:
            return Prepared(payloads)
        token = next(self._tokens)
        pending: dict[int, object] = {
            rank: actor.call.remote(Worker.place_ahead.__name__, token, key, payload)
            for rank, (actor, payload) in enumerate(zip(self.actors, payloads))
        }
        return Prepared([Ahead(token)] * len(payloads), pending)

    def _await_prepared(self, prepared: Prepared) -> None:
        if prepared.pending:  # the references prepare() made
            pending = cast("dict[int, ray.ObjectRef[object]]", prepared.pending)
            self._gather(pending, "placing a prefetched batch", self.timeout_s)

    def _gather(
        self, refs: Mapping[int, ray.ObjectRef[T]], what: str, timeout_s: float, placing: bool = False
    ) -> list[T]:
        """Results of one call per rank, in rank order; the first failure stops every actor and raises."""
        deadline = time.monotonic() + timeout_s
        rank_of = {ref: rank for rank, ref in refs.items()}
        pending = list(refs.values())
        values: dict[int, T] = {}
        while pending:
            left = max(deadline - time.monotonic(), 0.0)
            ready, pending = ray.wait(pending, num_returns=1, timeout=min(left, LIVENESS_PERIOD_S))
            if not ready and left > LIVENESS_PERIOD_S:
                if not placing:
                    self._check_alive(what)  # a dead peer leaves the others blocked in a collective: name it
                continue
            if not ready:
                late = sorted(rank_of[r] for r in pending)
                if placing:
                    self._fail(
                        f"timed out after {timeout_s:.0f}s {what}: Ray could not place the actor(s) of "
                        + ", ".join(self._where(r, placed=False) for r in late)
                        + "; check the nodes' free CPUs/GPUs (`ray status`)"
                    )
                silent = self._unresponsive(late)
                hung = (
                    (
                        f"; {', '.join(self._where(r) for r in silent)} does not answer at all (hung or stopped: "
                        "the others wait for it)"
                    )
                    if silent
                    else ""
                )
                self._fail(
                    f"timed out after {timeout_s:.0f}s {what}; "
                    + ", ".join(self._where(r) for r in late)
                    + f" did not finish{hung}"
                )
            ref = ready[0]
            rank = rank_of[ref]
            try:
                values[rank] = ray.get(ref)
            except ray.exceptions.RayActorError as error:
                self._fail(f"the actor of {self._where(rank)} died while {what} ({type(error).__name__})")
            except ray.exceptions.RayTaskError as error:
                # a collective fails fast when its peer process is gone: blame the dead peer, not the survivor
                self._check_alive(
                    what,
                    wait_s=DEATH_NOTICE_S,
                    consequence=f"{self._where(rank)} failed as a consequence: {error.cause}",
                )
                self._fail(
                    f"{self._where(rank)} failed while {what}: {type(error.cause).__name__}: {error.cause}",
                    cause=error.cause,
                )
        return [values[rank] for rank in sorted(values)]

    def _check_alive(self, what: str, wait_s: float = LIVENESS_PERIOD_S, consequence: str = "") -> None:
        """Raise naming the first actor Ray reports dead within ``wait_s`` (the others may be waiting for it,
        or have failed because of it: ``consequence``). With a ``consequence`` (another rank failed, perhaps because
        of a dead peer), an actor that does not even answer a ping within ``wait_s`` is named too: Ray may not have
        noticed a killed process yet, but a live actor answers at once (pings are served beside its calls)."""
        pings = {actor.ping.remote(): rank for rank, actor in enumerate(self.actors)}
        ready, silent = ray.wait(list(pings), num_returns=len(pings), timeout=wait_s)
        for ref in sorted(ready, key=lambda r: pings[r]):
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as error:
                self._fail(
                    f"the actor of {self._where(pings[ref])} died while {what} ({type(error).__name__})"
                    + (f"; {consequence}" if consequence else "")
                )
        if consequence and silent:
            named = ", ".join(self._where(pings[ref]) for ref in sorted(silent, key=lambda r: pings[r]))
            self._fail(f"{named} does not answer (its process died or hangs) while {what}; {consequence}")

    def _unresponsive(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` whose actor does not answer a ping within ``LIVENESS_PERIOD_S`` (a busy actor answers:
        it serves calls on several threads)."""
        pings = {self.actors[rank].ping.remote(): rank for rank in ranks}
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=LIVENESS_PERIOD_S)
        return sorted(rank for ref, rank in pings.items() if ref not in ready)

    def _where(self, rank: int, placed: bool = True) -> str:
        host = self.hosts[rank]
        info = self.infos[rank] if placed and rank < len(self.infos) else {}
        place = f"node {host.address}" + (f", pid {info['pid']}" if "pid" in info else "")
        stages = self.stages_of_rank.get(rank, [])
        return f"host {host.index} ({place}) running stage(s) {stages}"

    def _fail(self, message: str, cause: BaseException | None = None) -> None:
        self._stop(f"a host failed: {message}")
        full = f"{message}; this engine's host actors were stopped"
        if isinstance(cause, (ValueError, TypeError, NotImplementedError)):  # a user error, raised as its own type
            try:
                user_error = type(cause)(full)
            except Exception:
                user_error = None
            if user_error is not None:
                raise user_error from cause
        raise HostFailure(full) from cause

    # --- lifecycle ----------------------------------------------------------------------------------------------

    def _release(self) -> None:
        actors, self.actors = self.actors, []
        if not actors or not ray.is_initialized():
            return
        held_cpus = ray.available_resources().get("CPU", 0) + len(actors)
        for actor in actors:
            try:
                ray.kill(cast("ActorHandle[HostActor]", actor), no_restart=True)  # a handle ray made
            except Exception as error:  # already gone
                log.debug("ray.kill: %s", error)
        _await_death(actors, timeout_s=10.0)
        # Ray returns a dead actor's resources asynchronously; wait (bounded) so a compile right after
        # close() finds them free
        deadline = time.monotonic() + 10.0
        while ray.available_resources().get("CPU", 0) < held_cpus and time.monotonic() < deadline:
            time.sleep(0.05)

    def summary(self) -> str:
        return (
            f"{self.label} engine compiled at {self.created} on {len(self.hosts)} host actor(s) "
            f"(hosts {[h.index for h in self.hosts]})"
        )


def _await_death(actors: list[HostActorHandle], timeout_s: float) -> None:
    """Wait until Ray reports every actor dead, so its resources are free when ``close()`` returns."""
    deadline = time.monotonic() + timeout_s
    alive = list(actors)
    while alive and time.monotonic() < deadline:
        still = []
        for actor in alive:
            try:
                ray.get(actor.ping.remote(), timeout=1.0)
                still.append(actor)
            except ray.exceptions.RayActorError:
                continue
            except ray.exceptions.GetTimeoutError:
                still.append(actor)
        alive = still
        if alive:
            time.sleep(0.05)
    if alive:
        log.warning("torchpar: %d host actor(s) were not reported dead within %.0fs of ray.kill", len(alive), timeout_s)


def _is_bulky(value: object) -> bool:
    """Arguments worth one object-store copy for all actors: arrays and containers of them."""
    if isinstance(value, np.ndarray):
        return value.nbytes > 1 << 16
    return isinstance(value, (list, dict, tuple)) or hasattr(value, "params")

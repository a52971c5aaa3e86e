"""The Ray actor of one host: a process owning the host's accelerators and running its
:class:`~torchpar.runtime.worker.Worker`.

Life of an actor (driven by :mod:`.ray_executor`):

1. created on its node with ``num_gpus = devices_per_host`` on a GPU cluster (Ray sets
   ``CUDA_VISIBLE_DEVICES``; JAX sees exactly those GPUs), or with ``XLA_FLAGS`` giving it
   ``devices_per_host`` JAX CPU devices; ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` so JAX shares the GPU
   with anything else in the process; simulated hosts sharing one machine pin themselves to disjoint cores;
2. :meth:`HostActor.join` — all actors of an engine form one JAX multi-controller system
   (``jax.distributed.initialize``, coordinator on rank 0; CPU collectives over gloo), so a mesh may span
   them; a single actor skips it;
3. :meth:`HostActor.build` — the worker for the plan, then the garbage collector settled (:func:`_settle_collector`);
   peers are the other actors, reached for stage messages over direct connections (:mod:`.channels`, listening
   since ``join``), never via the driver (:meth:`HostActor.deliver`, Ray's object transfer, serves a peer without a
   channel);
4. :meth:`HostActor.call` — any worker call (load, step, export, …). Calls run on the actor's thread pool,
   so deliveries from peers arrive while a step waits for them.

JAX is imported only here, after the environment is set, so the actor's devices are the host's.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Protocol, TypedDict, TypeVar, cast

import ray

from torchpar import compile_cache, host_heap

if TYPE_CHECKING:
    from torchpar.runtime.pipeline.transport import MessageKey
    from torchpar.runtime.worker import ExecutionSpec, PipelineWorker, Worker

log = logging.getLogger(__name__)

T = TypeVar("T")

ACTOR_CONCURRENCY = 32
"""Threads serving an actor's calls: a step, its stage threads' deliveries from peers, and pings."""


class HostInfo(TypedDict, total=False):
    """What a host actor reports: where it runs (:meth:`HostActor.info`), then the JAX system it joined
    (:meth:`HostActor.join`: the driver adds those fields to the first)."""

    host: int
    rank: int
    pid: int
    node_id: str
    address: str
    gpu_ids: list[str]
    cuda_visible_devices: str | None
    cores: list[int]
    process_index: int
    platform: str
    local_devices: list[str]
    global_devices: int
    channel: tuple[str, int, str]


class RemoteMethod(Protocol[T]):
    """A method of an actor handle: ``remote(*args)`` starts the call, whose result the returned reference gives."""

    def remote(self, *args: object) -> ray.ObjectRef[T]: ...


class HostActorHandle(Protocol):
    """A :class:`HostActor` as the driver and the peers hold it (a Ray actor handle)."""

    info: RemoteMethod[HostInfo]
    coordinator_address: RemoteMethod[str]
    join: RemoteMethod[HostInfo]
    build: RemoteMethod[None]
    call: RemoteMethod[object]
    deliver: RemoteMethod[None]
    ping: RemoteMethod[int]


@ray.remote(max_concurrency=ACTOR_CONCURRENCY)  # type: ignore[call-overload]  # ray's overloads omit actor options
class HostActor:
    """One host of an engine (see the module docstring)."""

    def __init__(self, host: int, rank: int, slot: int, slots_on_node: int, cores_per_host: int | None):
        self.host = host
        self.rank = rank
        self.worker: Worker | None = None
        self._cores = _pin(slot, slots_on_node, cores_per_host)

    def info(self) -> HostInfo:
        """Where the actor runs (node, pid, the GPUs Ray gave it, pinned cores); imports nothing heavy."""
        return {
            "host": self.host,
            "rank": self.rank,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "address": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cores": self._cores,
        }

    def coordinator_address(self) -> str:
        """``ip:port`` of a free port on this node for the JAX coordinator (rank 0)."""
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return f"{ray.util.get_node_ip_address()}:{port}"

    def join(self, coordinator: str | None, num_processes: int, timeout_s: float) -> HostInfo:
        """Join the engine's JAX system as process ``rank`` (``coordinator=None``: a single process); returns
        the devices JAX sees."""
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if coordinator is not None:
            jax.distributed.initialize(
                coordinator,
                num_processes=num_processes,
                process_id=self.rank,
                initialization_timeout=int(max(timeout_s, 1)),
            )
        local = jax.local_devices()
        joined: HostInfo = {
            "rank": self.rank,
            "process_index": jax.process_index(),
            "platform": local[0].platform,
            "local_devices": [str(d) for d in local],
            "global_devices": jax.device_count(),
        }
        if coordinator is not None:  # peers will send stage messages: listen for them
            from torchpar.runtime.ray.channels import ChannelServer

            self._channel = ChannelServer(ray.util.get_node_ip_address(), self.deliver)
            joined["channel"] = self._channel.address
        return joined

    def build(
        self,
        spec: ExecutionSpec,
        peers: dict[int, HostActorHandle],
        channels: dict[int, tuple[str, int, str]] | None = None,
    ) -> None:
        """Build this host's worker for ``spec``; ``peers`` maps process ranks to actor handles, ``channels`` to
        the address each listens on (:mod:`.channels`)."""
        from torchpar.runtime.ray.channels import PeerLinks
        from torchpar.runtime.worker import make_worker

        self._peers = peers
        self._links = PeerLinks(
            {r: cast("tuple[str, int, str]", tuple(a)) for r, a in (channels or {}).items() if r != self.rank}
        )
        self.worker = make_worker(spec, self.rank, self._deliver_to_peer)
        _settle_collector()

    def call(self, method: str, *args: object) -> object:
        """``worker.method(*args)``."""
        return getattr(self.worker, method)(*args)

    def deliver(self, key: MessageKey, payload: object) -> None:
        """A stage message from a peer (see :mod:`torchpar.runtime.pipeline.transport`)."""
        cast("PipelineWorker", self.worker).deliver(key, payload)  # only pipeline stages send messages

    def ping(self) -> int:
        return self.rank

    def _deliver_to_peer(self, rank: int, key: MessageKey, payload: object) -> None:
        if rank in self._links:
            self._links.send(rank, key, payload)
        else:
            self._peers[rank].deliver.remote(key, payload)


ACTOR_GC_THRESHOLD = (50_000, 20, 10)
"""The cyclic garbage collector's thresholds in a host actor (Python's default: ``(700, 10, 10)``)."""


def _settle_collector() -> None:
    """Freeze what the actor's start-up left alive (the imports of JAX and the worker: never garbage, never walked
    again) and collect young garbage every 50,000 allocations instead of 700, as Ray Serve does in its proxies: the
    full collections of a fresh actor walk every imported object and drop JAX's weak-reference caches mid-compile
    (about a tenth of a small engine's actor CPU time, measured on ``tests/runtime/test_ray_engine.py``), and a
    collection in the middle of a step delays every stage waiting on this host. The actor process is torchpar's;
    the driver's collector is left as the user set it."""
    import gc

    gc.collect()
    gc.freeze()
    gc.set_threshold(*ACTOR_GC_THRESHOLD)


def _pin(slot: int, slots_on_node: int, cores_per_host: int | None) -> list[int]:
    """Pin this process to its share of the node's cores when several host actors share the node."""
    if slots_on_node < 2 and cores_per_host is None:
        return sorted(os.sched_getaffinity(0))
    cores = sorted(os.sched_getaffinity(0))
    per_host = cores_per_host or max(1, len(cores) // slots_on_node)
    if per_host * slots_on_node > len(cores) and cores_per_host is None:
        return cores  # more hosts than cores: do not pin
    chosen = [cores[c % len(cores)] for c in range(slot * per_host, (slot + 1) * per_host)]
    os.sched_setaffinity(0, set(chosen))
    return chosen


def actor_environment(devices_per_host: int) -> dict[str, str]:
    """Environment variables of a host actor (see the module docstring): the CPU device count only matters
    where JAX runs on CPU; no platform is forced (a GPU actor whose JAX has no GPU falls back to CPU). The
    driver's JAX compilation cache (:mod:`torchpar.compile_cache`: its directory and thresholds) is passed on,
    so an actor loads the steps the driver or an earlier actor compiled, and actors on a shared file system
    share them. malloc keeps what a step frees for the next (:mod:`torchpar.host_heap`)."""
    flags = os.environ.get("XLA_FLAGS", "")
    flags = " ".join(f for f in flags.split() if not f.startswith("--xla_force_host_platform_device_count"))
    env = {
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices_per_host}".strip(),
        "XLA_PYTHON_CLIENT_PREALLOCATE": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
    }
    env.update(compile_cache.environment())
    env.update(host_heap.environment())
    return env

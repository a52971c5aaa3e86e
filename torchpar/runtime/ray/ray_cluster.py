"""The Ray cluster torchpar runs on: which hosts, how many devices each, CPU or GPU.

``torchpar.init(cluster="ray", ...)`` calls :func:`connect`:

- ``address=None`` starts an embedded Ray on this machine and *simulates* ``num_hosts`` hosts on it: every
  host actor runs on this node. If the node has at least ``num_hosts × devices_per_host`` GPUs, hosts own
  GPUs; otherwise each host actor gets ``devices_per_host`` JAX CPU devices (tests, laptops).
- ``address="auto"`` or ``"ip:port"`` joins a running cluster and reads its alive nodes (``ray.nodes()``):
  each node is a host. On a GPU cluster ``devices_per_host`` defaults to the GPUs per node (the fewest
  any GPU node has) and only nodes with that many GPUs are hosts; on a CPU cluster it defaults to 1 CPU
  device per node. ``num_hosts`` / ``devices_per_host`` select a subset, as ``alpa.init(cluster="ray",
  num_nodes=..., devices_per_node=...)`` does.

Hosts are ordered with the driver's node first, then by address; host ``h`` owns cluster devices
``[h·D, (h+1)·D)``. The accelerator can be forced with ``accelerator="cpu"`` / ``"gpu"``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypedDict

log = logging.getLogger(__name__)

ACCELERATORS = ("auto", "cpu", "gpu")


@dataclass(frozen=True)
class RayHost:
    """One host: the Ray node its actor is placed on (``None``: the driver's node, for simulated hosts)."""

    index: int
    node_id: str | None
    address: str
    cpus: float
    gpus: float


@dataclass(frozen=True)
class RayCluster:
    """The hosts torchpar uses, their devices, and whether torchpar started Ray itself."""

    hosts: tuple[RayHost, ...]
    devices_per_host: int
    accelerator: str
    """``"gpu"``: each host actor requests ``devices_per_host`` GPUs; ``"cpu"``: that many JAX CPU devices."""
    embedded: bool
    simulated: bool
    """All hosts are simulated on one node (``address=None``)."""

    def describe(self) -> str:
        nodes = sorted({h.address for h in self.hosts})
        return (
            f"{len(self.hosts)} host(s) × {self.devices_per_host} {self.accelerator.upper()} device(s) on "
            f"{len(nodes)} node(s) {nodes}{' (simulated hosts)' if self.simulated else ''}"
        )


class RayNode(TypedDict, total=False):
    """A ``ray.nodes()`` entry: the fields read here (the liveness flag as ``Alive`` or ``alive``)."""

    NodeID: str
    NodeManagerAddress: str
    Alive: bool
    alive: bool
    Resources: dict[str, float]


_current: RayCluster | None = None

EMBEDDED_WORKER_NICENESS = 0
"""Niceness of the Ray workers (host actors) of an embedded Ray instance: the driver's own priority."""


def current() -> RayCluster | None:
    """The cluster of the last :func:`connect` (``None`` before, and after :func:`disconnect`)."""
    return _current


def connect(
    *, address: str | None, num_hosts: int | None, devices_per_host: int | None, accelerator: str = "auto"
) -> RayCluster:
    """Start or join Ray and choose the hosts (see the module docstring)."""
    global _current
    import ray

    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {accelerator!r}")
    embedded = False
    if address is None:
        if num_hosts is None or devices_per_host is None:
            raise ValueError(
                "cluster='ray' without an address simulates hosts on this machine: give num_hosts and "
                "devices_per_host (or address='auto' to join a running cluster)"
            )
        if not ray.is_initialized():
            cpus = max(os.cpu_count() or 1, num_hosts)
            # address="local": never attach to another Ray instance found running on this machine (another
            # program's, or a test's), whose resources and lifetime are not ours
            # simulated hosts are this machine's compute: Ray's default worker niceness (15) would give them only what
            # every other process leaves, and a pipeline, which needs all its hosts at once, loses most (issue 12)
            with _quiet_token_notice():
                ray.init(
                    address="local",
                    num_cpus=cpus,
                    include_dashboard=False,
                    log_to_driver=True,
                    configure_logging=False,
                    runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}},
                    _system_config={"worker_niceness": EMBEDDED_WORKER_NICENESS},
                )
            embedded = True
        _current = _simulated(num_hosts, devices_per_host, accelerator, embedded)
    else:
        if ray.is_initialized():
            log.warning(
                "torchpar.init(address=%r): disconnecting from the Ray instance this process was using", address
            )
            ray.shutdown()
        ray.init(address=address, log_to_driver=True, configure_logging=False)
        _current = _from_nodes(
            ray.nodes(), ray.get_runtime_context().get_node_id(), num_hosts, devices_per_host, accelerator
        )
    log.info("torchpar ray cluster: %s", _current.describe())
    return _current


def disconnect() -> None:
    """Forget the cluster and stop Ray (torchpar's embedded instance, or the connection to a cluster)."""
    global _current
    import ray

    _current = None
    if ray.is_initialized():
        ray.shutdown()


TOKEN_NOTICE_LOGGER = "ray._private.authentication.authentication_token_setup"
"""Ray's logger of "Token authentication is enabled for this Ray cluster …", a notice about clusters others may
reach: an embedded cluster of simulated hosts lives and dies with this process."""


@contextlib.contextmanager
def _quiet_token_notice() -> Iterator[None]:
    """Ray's token-authentication notice (a WARNING) left out while torchpar starts its own embedded cluster; its
    errors still show. The user's own ``ray.init`` is untouched."""
    notices = logging.getLogger(TOKEN_NOTICE_LOGGER)
    level = notices.level
    notices.setLevel(logging.ERROR)
    try:
        yield
    finally:
        notices.setLevel(level)


def _simulated(num_hosts: int, devices_per_host: int, accelerator: str, embedded: bool) -> RayCluster:
    import ray

    node = ray.get_runtime_context().get_node_id()
    gpus = float(ray.cluster_resources().get("GPU", 0))
    cpus = float(ray.cluster_resources().get("CPU", 0))
    wanted = num_hosts * devices_per_host
    if accelerator == "auto":
        accelerator = "gpu" if gpus >= wanted else "cpu"
    elif accelerator == "gpu" and gpus < wanted:
        raise ValueError(
            f"accelerator='gpu' needs {num_hosts} × {devices_per_host} = {wanted} GPUs; this machine's "
            f"Ray node has {gpus:g}"
        )
    address = ray.util.get_node_ip_address()
    hosts = tuple(RayHost(index=h, node_id=node, address=address, cpus=cpus, gpus=gpus) for h in range(num_hosts))
    return RayCluster(
        hosts=hosts, devices_per_host=devices_per_host, accelerator=accelerator, embedded=embedded, simulated=True
    )


def _from_nodes(
    nodes: list[RayNode], driver_node: str, num_hosts: int | None, devices_per_host: int | None, accelerator: str
) -> RayCluster:
    """Hosts from ``ray.nodes()`` entries (see the module docstring)."""
    alive = [n for n in nodes if n.get("Alive") or n.get("alive")]
    if not alive:
        raise RuntimeError("the Ray cluster has no alive node")
    gpu_counts = [int(n.get("Resources", {}).get("GPU", 0)) for n in alive]
    if accelerator == "auto":
        accelerator = "gpu" if any(gpu_counts) else "cpu"
    if accelerator == "gpu":
        per_host = (devices_per_host or min(c for c in gpu_counts if c > 0)) if any(gpu_counts) else 0
        if per_host < 1:
            raise ValueError("accelerator='gpu' but no node of the Ray cluster has a GPU resource")
        usable = [n for n, c in zip(alive, gpu_counts) if c >= per_host]
    else:
        per_host = devices_per_host or 1
        usable = [n for n in alive if n.get("Resources", {}).get("CPU", 0) >= 1]
    usable.sort(key=lambda n: (n["NodeID"] != driver_node, n.get("NodeManagerAddress", ""), n["NodeID"]))
    count = num_hosts or len(usable)
    if count > len(usable):
        need = f"{per_host} GPU(s)" if accelerator == "gpu" else "a CPU"
        raise ValueError(
            f"asked for {count} host(s) but only {len(usable)} node(s) of the Ray cluster have {need}: "
            + ", ".join(f"{n.get('NodeManagerAddress')} {n.get('Resources', {})}" for n in alive)
        )
    hosts = tuple(
        RayHost(
            index=h,
            node_id=n["NodeID"],
            address=n.get("NodeManagerAddress", "?"),
            cpus=float(n.get("Resources", {}).get("CPU", 0)),
            gpus=float(n.get("Resources", {}).get("GPU", 0)),
        )
        for h, n in enumerate(usable[:count])
    )
    return RayCluster(hosts=hosts, devices_per_host=per_host, accelerator=accelerator, embedded=False, simulated=False)

"""``torchpar.init`` and the cluster description the planner prices plans with.

``init(cluster="local", num_devices=N)`` must run before JAX is first imported in the process: it
sets ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` so JAX's CPU backend exposes N devices.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


@dataclass(kw_only=True, frozen=True)
class ClusterSpec:
    """Hosts × devices and the constants of the analytic cost model."""

    num_hosts: int = 1
    """Number of hosts (Ray actors in the ``ray`` runtime)."""
    devices_per_host: int = 1
    """JAX devices owned by each host."""
    device_flops: float = 5e10
    """Sustained FLOP/s of one device (fp32); prices compute in plan estimates."""
    device_memory_bytes: int = 8 << 30
    """Memory budget of one device."""
    alpha: tuple[float, float] = (1e-4, 1e-5)
    """Collective latency (s) on logical mesh axis 0 and axis 1; axis 1 is the inner, faster one."""
    beta: tuple[float, float] = (1e-9, 1e-10)
    """Inverse bandwidth (s/byte) on logical mesh axis 0 and axis 1."""

    def __post_init__(self) -> None:
        if self.num_hosts < 1 or self.devices_per_host < 1:
            raise ValueError(f"a cluster needs ≥1 host and ≥1 device per host, got {self.num_hosts}×{self.devices_per_host}")
        if self.device_flops <= 0 or self.device_memory_bytes <= 0:
            raise ValueError("device_flops and device_memory_bytes must be positive")
        if len(self.alpha) != 2 or len(self.beta) != 2 or min(*self.alpha, *self.beta) < 0:
            raise ValueError(f"alpha and beta are two non-negative numbers (axis 0, axis 1), got {self.alpha}, {self.beta}")

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host


_cluster: ClusterSpec | None = None


def init(cluster: str = "local", num_devices: int | None = None, **kwargs: object) -> ClusterSpec:
    """Declare the cluster torchpar plans for.

    ``cluster="local"``: one process; with ``num_devices=N`` on a CPU-only machine JAX is given N fake
    CPU devices (call before anything imports JAX). Returns the :class:`ClusterSpec` in force.
    """
    global _cluster
    if cluster != "local":
        raise NotImplementedError(f"cluster={cluster!r}: only cluster='local' is available in this version")
    if kwargs:
        raise TypeError(f"init(cluster='local') got unexpected options {sorted(kwargs)}")
    if num_devices is not None:
        if num_devices < 1:
            raise ValueError(f"num_devices must be ≥ 1, got {num_devices}")
        _set_host_device_count(num_devices)
    import jax  # after XLA_FLAGS is set

    available = jax.device_count()
    if num_devices is not None and available < num_devices:
        raise RuntimeError(
            f"torchpar.init asked for {num_devices} devices but JAX has {available}: JAX was imported before "
            "torchpar.init; call torchpar.init first, or set XLA_FLAGS="
            f"{_DEVICE_COUNT_FLAG}={num_devices} before starting Python")
    _cluster = ClusterSpec(num_hosts=1, devices_per_host=num_devices or available)
    log.info("torchpar cluster: local, %d device(s) of %s", _cluster.num_devices, jax.devices()[0].platform)
    return _cluster


def current_cluster() -> ClusterSpec:
    """The cluster from the last :func:`init`, or one device if ``init`` was never called."""
    return _cluster if _cluster is not None else ClusterSpec()


def _set_host_device_count(count: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    flags = re.sub(rf"{_DEVICE_COUNT_FLAG}=\d+", "", flags).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_COUNT_FLAG}={count}".strip()
    if "jax" in sys.modules:
        log.debug("jax already imported; XLA_FLAGS only takes effect if no backend was created yet")

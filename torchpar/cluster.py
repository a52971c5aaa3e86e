"""``torchpar.init`` and the cluster description the planner prices plans with.

``init(cluster="local", num_devices=N)`` must run before JAX is first imported in the process: it
sets ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` so JAX's CPU backend exposes N devices.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

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
    """Collective latency (s) inside a host, on logical mesh axis 0 and axis 1; axis 1 is the inner, faster one."""
    beta: tuple[float, float] = (1e-9, 1e-10)
    """Inverse bandwidth (s/byte) inside a host, on logical mesh axis 0 and axis 1."""
    inter_host_alpha: float = 1e-4
    """Collective latency (s) of a mesh axis whose devices sit on different hosts (priced with the slower of this
    and the axis's in-host constants: :mod:`torchpar.planner.mesh_links`)."""
    inter_host_beta: float = 1e-9
    """Inverse bandwidth (s/byte) of the link between hosts, per device."""
    preset: str | None = None
    """The hardware preset the constants came from (:mod:`torchpar.hardware`), or ``None`` if set by hand."""
    runtime: str = "local"
    """Where plans run: ``"local"`` (this process's devices) or ``"ray"`` (one actor per host)."""
    cores_per_host: int | None = None
    """Ray runtime, simulated hosts on one machine: CPU cores each host actor is pinned to (``None`` = an even
    share)."""
    accelerator: str = "cpu"
    """Devices of a host: ``"cpu"`` (JAX CPU devices) or ``"gpu"``."""
    timeout_s: float = 60.0
    """Ray runtime: the longest a step, a message between stages or placing the host actors may take before
    the engine raises (compilation has its own, longer limit)."""

    def __post_init__(self) -> None:
        if self.num_hosts < 1 or self.devices_per_host < 1:
            raise ValueError(
                f"a cluster needs ≥1 host and ≥1 device per host, got {self.num_hosts}×{self.devices_per_host}"
            )
        if self.device_flops <= 0 or self.device_memory_bytes <= 0:
            raise ValueError("device_flops and device_memory_bytes must be positive")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {self.timeout_s}")
        if len(self.alpha) != 2 or len(self.beta) != 2 or min(*self.alpha, *self.beta) < 0:
            raise ValueError(
                f"alpha and beta are two non-negative numbers (axis 0, axis 1), got {self.alpha}, {self.beta}"
            )
        if min(self.inter_host_alpha, self.inter_host_beta) < 0:
            raise ValueError(
                f"inter_host_alpha and inter_host_beta must be ≥ 0, got {self.inter_host_alpha}, {self.inter_host_beta}"
            )
        object.__setattr__(self, "alpha", tuple(float(a) for a in self.alpha))  # a plan's JSON gives lists
        object.__setattr__(self, "beta", tuple(float(b) for b in self.beta))

    @classmethod
    def from_preset(cls, name: str, **fields: Any) -> ClusterSpec:
        """A cluster with the cost constants of the hardware preset ``name`` (:data:`torchpar.hardware.PRESETS`:
        ``"h100-nvlink"``, ``"a100-80g"``, ``"a100-40g"``, ``"v100-16g"``, ``"cpu-sim"``); ``fields`` set the rest
        (``num_hosts``, ``devices_per_host``, …) and may override a constant."""
        from torchpar.hardware import preset

        return cls(**{**preset(name).cluster_constants(), **fields})

    def cost_constants(self) -> dict[str, Any]:
        """The fields the planner prices with (a plan stores them: ``Plan.cluster``), as JSON values."""
        return {
            "num_hosts": self.num_hosts,
            "devices_per_host": self.devices_per_host,
            "device_flops": self.device_flops,
            "device_memory_bytes": self.device_memory_bytes,
            "alpha": list(self.alpha),
            "beta": list(self.beta),
            "inter_host_alpha": self.inter_host_alpha,
            "inter_host_beta": self.inter_host_beta,
            "preset": self.preset,
        }

    @property
    def num_devices(self) -> int:
        return self.num_hosts * self.devices_per_host


_cluster: ClusterSpec | None = None


def init(
    cluster: str = "local",
    num_devices: int | None = None,
    *,
    num_hosts: int | None = None,
    devices_per_host: int | None = None,
    address: str | None = None,
    accelerator: str = "auto",
    cores_per_host: int | None = None,
    timeout_s: float = 60.0,
    preset: str | None = None,
    compile_cache: bool | str = True,
    **constants: Any,
) -> ClusterSpec:
    """Declare the cluster torchpar plans for and runs on; call it before anything imports JAX.

    - ``cluster="local", num_devices=N``: one process with N (fake CPU) devices, seen as one host; or
      ``num_hosts=H, devices_per_host=D`` to simulate H hosts of D devices in this process.
    - ``cluster="ray", num_hosts=H, devices_per_host=D``: start an embedded Ray on this machine with one actor
      per simulated host, each owning D devices (GPUs if the machine has H·D of them, else JAX CPU devices).
    - ``cluster="ray", address="auto" | "ip:port"``: join a running Ray cluster; every alive node is a host,
      owning its GPUs (``devices_per_host`` defaults to the GPUs per node; 1 CPU device on CPU-only nodes);
      ``num_hosts`` / ``devices_per_host`` select a subset.
    - ``accelerator``: ``"auto"``, or force ``"cpu"`` / ``"gpu"`` host devices (Ray runtime).
    - ``cores_per_host``: simulated hosts are pinned to this many cores each (default: an even share).
    - ``timeout_s``: Ray runtime, the longest a step or placing the actors may take before it raises.
    - ``preset``: price plans with the constants of real hardware (:mod:`torchpar.hardware`: ``"h100-nvlink"``,
      ``"a100-80g"``, ``"a100-40g"``, ``"v100-16g"``); ``None`` on local GPUs takes the preset of the GPUs found
      (:func:`torchpar.hardware.detect`, logged; a GPU no preset describes keeps the defaults); ``constants`` set
      any cost field of :class:`ClusterSpec` by hand (``inter_host_beta=1 / 25e9``, ``device_memory_bytes=...``),
      over the preset's.
    - ``compile_cache``: keep compiled steps on disk so the next process loads them instead of compiling
      (:mod:`torchpar.compile_cache`): ``True`` in ``$TORCHPAR_CACHE_DIR``, by default ``~/.cache/torchpar/xla``
      (``TORCHPAR_CACHE_DIR=off`` turns it off), a path for that directory, ``False`` for none. A cache set
      through JAX (``JAX_COMPILATION_CACHE_DIR``) is kept as it is. Ray host actors use the same directory.

    The driver process holds no device of a Ray plan. Returns the :class:`ClusterSpec` in force.
    """
    _check_constants(preset, constants)
    if not isinstance(compile_cache, bool | str):
        raise TypeError(f"compile_cache must be True, False or a directory, got {compile_cache!r}")
    spec = _init_devices(
        cluster, num_devices, num_hosts, devices_per_host, address, accelerator, cores_per_host, timeout_s
    )
    _init_compile_cache(compile_cache)
    if preset is None and spec.runtime == "local" and spec.accelerator == "gpu":
        preset = _detected_preset()
    if preset is not None:
        spec = replace(
            spec,
            **ClusterSpec.from_preset(preset).cost_constants()
            | {"num_hosts": spec.num_hosts, "devices_per_host": spec.devices_per_host},
        )
    global _cluster
    _cluster = replace(spec, **constants) if constants else spec
    return _cluster


def _detected_preset() -> str | None:
    """The hardware preset of this process's GPUs (:func:`torchpar.hardware.detect`), logged."""
    import jax

    from torchpar.hardware import detect

    kind = jax.devices()[0].device_kind
    found = detect(kind)
    if found is None:
        log.warning(
            "torchpar: no hardware preset describes %s; plans are priced with the default constants "
            "(pass init(preset=...) or the constants)",
            kind,
        )
    else:
        log.info("torchpar: %s found: plans are priced with the %r preset", kind, found)
    return found


def default_compile_cache() -> None:
    """Turn the compile cache on as ``init()`` would, for a process that compiles without calling ``init``
    (:func:`torchpar.compile` calls it); after an ``init`` its ``compile_cache`` setting stands."""
    if _cluster is None and not _compile_cache_set:
        _init_compile_cache(True)


def _init_compile_cache(setting: bool | str) -> None:
    """After the devices (JAX reads ``XLA_FLAGS`` when it first creates a backend), before any compilation."""
    from torchpar import compile_cache

    global _compile_cache_set
    _compile_cache_set = True
    if setting is False:
        compile_cache.disable()
    else:
        compile_cache.enable(None if setting is True else setting)


_compile_cache_set = False  # init (or default_compile_cache) decided the compile cache in this process

_COST_FIELDS = ("device_flops", "device_memory_bytes", "alpha", "beta", "inter_host_alpha", "inter_host_beta")


def _check_constants(preset_name: str | None, constants: dict[str, Any]) -> None:
    unknown = sorted(set(constants) - set(_COST_FIELDS))
    if unknown:
        raise TypeError(
            f"torchpar.init got unknown option(s) {unknown}; the cost constants it takes are {', '.join(_COST_FIELDS)}"
        )
    if preset_name is not None:
        from torchpar.hardware import preset

        preset(preset_name)  # unknown names fail before any device is set up


def _init_devices(
    cluster: str,
    num_devices: int | None,
    num_hosts: int | None,
    devices_per_host: int | None,
    address: str | None,
    accelerator: str,
    cores_per_host: int | None,
    timeout_s: float,
) -> ClusterSpec:
    if cluster not in ("local", "ray"):
        raise ValueError(f"cluster must be 'local' or 'ray', got {cluster!r}")
    if cores_per_host is not None and cores_per_host < 1:
        raise ValueError(f"cores_per_host must be ≥ 1, got {cores_per_host}")
    if num_hosts is not None and num_hosts < 1 or devices_per_host is not None and devices_per_host < 1:
        raise ValueError(f"num_hosts and devices_per_host must be ≥ 1, got {num_hosts} and {devices_per_host}")
    if cluster == "ray":
        return _init_ray(address, num_hosts, devices_per_host, accelerator, cores_per_host, timeout_s)
    if address is not None:
        raise ValueError("address= joins a Ray cluster: use cluster='ray'")
    if num_hosts is not None or devices_per_host is not None:
        if num_hosts is None or devices_per_host is None:
            raise ValueError("give both num_hosts ≥ 1 and devices_per_host ≥ 1")
        if num_devices is not None and num_devices != num_hosts * devices_per_host:
            raise ValueError(f"num_devices={num_devices} contradicts {num_hosts} hosts × {devices_per_host} devices")
        num_devices = num_hosts * devices_per_host
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
            f"{_DEVICE_COUNT_FLAG}={num_devices} before starting Python"
        )
    hosts = num_hosts or 1
    per_host = devices_per_host or (num_devices or available)
    accelerator_found = "gpu" if jax.devices()[0].platform == "gpu" else "cpu"
    log.info("torchpar cluster: local, %d host(s) × %d device(s) of %s", hosts, per_host, jax.devices()[0].platform)
    return ClusterSpec(
        num_hosts=hosts,
        devices_per_host=per_host,
        runtime="local",
        cores_per_host=cores_per_host,
        accelerator=accelerator_found,
        timeout_s=timeout_s,
    )


def _init_ray(
    address: str | None,
    num_hosts: int | None,
    devices_per_host: int | None,
    accelerator: str,
    cores_per_host: int | None,
    timeout_s: float,
) -> ClusterSpec:
    from torchpar.runtime import ray_cluster

    if address is None and (num_hosts is None or devices_per_host is None):
        raise ValueError(
            "cluster='ray' needs num_hosts and devices_per_host (simulated hosts on this machine), or "
            "address='auto' / 'ip:port' to join a running Ray cluster"
        )
    _keep_driver_off_accelerators()
    connected = ray_cluster.connect(
        address=address, num_hosts=num_hosts, devices_per_host=devices_per_host, accelerator=accelerator
    )
    return ClusterSpec(
        num_hosts=len(connected.hosts),
        devices_per_host=connected.devices_per_host,
        runtime="ray",
        cores_per_host=cores_per_host,
        accelerator=connected.accelerator,
        timeout_s=timeout_s,
    )


def _keep_driver_off_accelerators() -> None:
    """The driver of a Ray cluster holds no device of the plan: its own JAX (PRNG keys, a pipeline's eval
    forward) runs on the CPU, so it never takes GPU memory from a host actor on the same node. Only possible
    before this process first used JAX; after that the driver keeps the backend it has."""
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        if jax.default_backend() != "cpu":
            log.warning(
                "torchpar: this process already uses JAX on %s; as the driver of a Ray cluster it keeps it "
                "(call torchpar.init before using JAX to keep the driver off the accelerators)",
                jax.default_backend(),
            )
        return
    jax.config.update("jax_platforms", "cpu")


_shutdown_hooks: list[Callable[[], None]] = []


def on_shutdown(hook: Callable[[], None]) -> None:
    """Have :func:`shutdown` call ``hook`` (once, however often it is registered). The floors above the cluster
    register what they must close — :mod:`torchpar.runtime` its open engines and its Ray connection — so this
    module imports none of them (data flows down)."""
    if hook not in _shutdown_hooks:
        _shutdown_hooks.append(hook)


def shutdown() -> None:
    """Close every open engine of this process (freeing their Ray actors), disconnect from Ray (stopping the
    embedded instance if torchpar started one) and forget the cluster: the :func:`on_shutdown` hooks, in the order
    they were registered, then the cluster."""
    global _cluster
    for hook in list(_shutdown_hooks):
        hook()
    _cluster = None


def current_cluster() -> ClusterSpec:
    """The cluster from the last :func:`init`, or one device if ``init`` was never called."""
    return _cluster if _cluster is not None else ClusterSpec()


def _set_host_device_count(count: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    flags = re.sub(rf"{_DEVICE_COUNT_FLAG}=\d+", "", flags).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_DEVICE_COUNT_FLAG}={count}".strip()
    if "jax" in sys.modules:
        log.debug("jax already imported; XLA_FLAGS only takes effect if no backend was created yet")

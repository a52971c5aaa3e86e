"""The session: ``torchpar.init`` / ``shutdown``, the current cluster, the compile cache and the Ray connection.

``init(cluster="local", num_devices=N)`` must run before JAX is first imported in the process: it
sets ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` so JAX's CPU backend exposes N devices. The cluster
description itself, :class:`~torchpar.hardware.ClusterSpec`, is pure data on a lower floor (the planner reads it
without this module's side effects); it is re-exported here and as ``torchpar.ClusterSpec``.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from torchpar.hardware import ClusterSpec

log = logging.getLogger(__name__)

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


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
    if accelerator != "gpu":
        from torchpar import host_heap

        host_heap.keep_freed_memory()  # before JAX starts its threads (torchpar.host_heap)
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
        from torchpar import host_heap

        host_heap.keep_freed_memory()  # (late: threads that allocated already keep arenas of their own)


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


def _check_constants(preset_name: str | None, constants: Mapping[str, object]) -> None:
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
    from torchpar.runtime.ray import ray_cluster

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


def shutdown() -> None:
    """Close every open engine of this process (freeing their Ray actors), disconnect from Ray (stopping the
    embedded instance if torchpar started one) and forget the cluster. The runtime is asked only if something
    imported it (no engine exists otherwise): the session sits above it, and calls down."""
    global _cluster
    if "torchpar.runtime" in sys.modules:
        from torchpar.runtime import close_session

        close_session()
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

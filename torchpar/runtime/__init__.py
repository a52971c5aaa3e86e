"""Runtime: how a plan runs. One interface (:class:`~torchpar.runtime.executor.Executor`), two homes for its
workers — this process (``local``) or one Ray actor per host (``ray``) — built by :func:`build_executor`."""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchpar.hardware import ClusterSpec
    from torchpar.runtime.executor import Executor
    from torchpar.runtime.worker import ExecutionSpec

log = logging.getLogger(__name__)


def build_executor(spec: ExecutionSpec, cluster: ClusterSpec, label: str = "") -> Executor:
    """The executor of ``spec`` on ``cluster``'s runtime (``cluster.runtime``: ``"local"`` or ``"ray"``)."""
    from torchpar.runtime.devices import DeviceMap

    if cluster.runtime == "ray":
        from torchpar.runtime.ray import ray_cluster
        from torchpar.runtime.ray.ray_executor import RayExecutor

        connected = ray_cluster.current()
        if connected is None:
            raise RuntimeError(
                "cluster='ray' but torchpar is not connected to Ray: call torchpar.init(cluster='ray', ...) first"
            )
        return RayExecutor(
            spec, connected, timeout_s=cluster.timeout_s, cores_per_host=cluster.cores_per_host, label=label
        )
    from torchpar.runtime.executor import LocalExecutor

    spec.devices = DeviceMap(cluster.devices_per_host, None)
    return LocalExecutor(spec, label)


def close_session() -> None:
    """:func:`torchpar.shutdown`'s part in the runtime: close every open engine's executor, then disconnect from
    Ray (both only if this process got that far)."""
    if "torchpar.runtime.executor" in sys.modules:
        from torchpar.runtime.executor import close_all

        closed = close_all()
        if closed:
            log.info("torchpar.shutdown: closed %d open engine(s)", closed)
    if "ray" in sys.modules:
        from torchpar.runtime.ray import ray_cluster

        ray_cluster.disconnect()

"""Cluster device indices → JAX devices, in the process that runs them.

A plan names devices by cluster index: host ``h`` owns indices ``[h·D, (h+1)·D)`` for ``D`` devices per
host (:attr:`torchpar.planner.plan.StagePlan.device_ids`). In the local runtime one process holds every
device and index ``i`` is ``jax.devices()[i]``. In the Ray runtime each host is one process of a JAX
multi-controller system: the host actors of an engine are ranked ``0..R-1`` in the order of the hosts
they serve, a rank is the JAX ``process_index``, and index ``i`` is local device ``i mod D`` of the
process serving host ``i div D``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax


@dataclass(frozen=True)
class DeviceMap:
    """Resolves cluster device indices (see the module docstring). ``hosts[r]`` is the host that process rank
    ``r`` serves; ``None`` means one process holding every device (the local runtime)."""

    devices_per_host: int
    hosts: tuple[int, ...] | None = None

    def rank_of_device(self, index: int) -> int:
        """The process rank owning cluster device ``index``."""
        if self.hosts is None:
            return 0
        host = index // self.devices_per_host
        try:
            return self.hosts.index(host)
        except ValueError:
            raise ValueError(
                f"device {index} is on host {host}, which no process of this engine serves (hosts {list(self.hosts)})"
            ) from None

    def ranks(self, indices: Sequence[int]) -> tuple[int, ...]:
        """The process ranks owning any of ``indices``, ascending."""
        return tuple(sorted({self.rank_of_device(i) for i in indices}))

    def jax_devices(self, indices: Sequence[int]) -> list[jax.Device]:
        """The JAX devices of cluster device ``indices`` (global devices: some may belong to other processes)."""
        import jax

        everything = jax.devices()
        if self.hosts is None:
            if max(indices, default=-1) >= len(everything):
                raise ValueError(
                    f"the plan uses device {max(indices)}, but JAX has {len(everything)} devices; call "
                    "torchpar.init(num_devices=...) before JAX is imported"
                )
            return [everything[i] for i in indices]
        by_process: dict[int, list[jax.Device]] = {}
        for device in everything:
            by_process.setdefault(device.process_index, []).append(device)
        for devices in by_process.values():
            devices.sort(key=lambda d: d.id)
        result = []
        for index in indices:
            rank = self.rank_of_device(index)
            local = by_process.get(rank, [])
            position = index % self.devices_per_host
            if position >= len(local):
                raise ValueError(
                    f"device {index} is local device {position} of process {rank}, which has {len(local)} JAX device(s)"
                )
            result.append(local[position])
        return result

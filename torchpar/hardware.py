"""Hardware presets: the cost-model constants of real clusters, from their public specifications.

A preset fills the constants of a :class:`torchpar.cluster.ClusterSpec` that the planner prices plans with:
per-device peak FLOP/s and memory, the in-host link (NVLink) and the link between hosts (the network). Each
link is ``(α, β)``: latency of one collective in seconds, and inverse bandwidth in seconds per byte, for one
device's share of the link in one direction.

| preset | device | FLOP/s (dense bf16/fp16) | memory | in-host link | between hosts |
|---|---|---|---|---|---|
| ``h100-sxm`` | H100 SXM (HGX/DGX H100) | 989 T | 80 GiB | NVLink 4, 450 GB/s | 8×400 Gb/s InfiniBand: 50 GB/s per GPU |
| ``a100-sxm`` | A100 SXM 80 GB | 312 T | 80 GiB | NVLink 3, 300 GB/s | 8×200 Gb/s InfiniBand: 25 GB/s per GPU |
| ``v100-p3`` | V100 16 GB (AWS p3.16xlarge, Alpa's testbed) | 125 T | 16 GiB | NVLink 2, 150 GB/s | 25 Gb/s Ethernet per host: 0.39 GB/s per GPU |
| ``cpu-sim`` | simulated hosts of fake JAX CPU devices | 50 G | 8 GiB | 10 GB/s (axis 1), 1 GB/s (axis 0) | 1 GB/s |

Latencies: 10 µs for a collective inside a host, 30 µs across hosts (NCCL's small-message all-reduce on such
systems; order of magnitude only). FLOP/s are the vendor's dense tensor-core peaks: the estimates are at peak,
so they rank plans rather than predict wall-clock time.
"""

from __future__ import annotations

from dataclasses import dataclass

_GIB = 1 << 30


@dataclass(kw_only=True, frozen=True)
class HardwarePreset:
    """The cost constants of one kind of host; :meth:`torchpar.cluster.ClusterSpec.from_preset` applies them."""

    name: str
    description: str
    device_flops: float
    """Peak FLOP/s of one device (dense, at the training precision the preset names)."""
    device_memory_bytes: int
    in_host_alpha: tuple[float, float]
    """Collective latency (s) inside a host, per logical mesh axis (0, 1)."""
    in_host_beta: tuple[float, float]
    """Inverse bandwidth (s/byte) inside a host, per logical mesh axis (0, 1)."""
    inter_host_alpha: float
    inter_host_beta: float

    def cluster_constants(self) -> dict[str, object]:
        """The :class:`~torchpar.cluster.ClusterSpec` fields this preset sets."""
        return {"device_flops": self.device_flops, "device_memory_bytes": self.device_memory_bytes,
                "alpha": self.in_host_alpha, "beta": self.in_host_beta, "inter_host_alpha": self.inter_host_alpha,
                "inter_host_beta": self.inter_host_beta, "preset": self.name}


def _gpu(name: str, description: str, flops: float, memory_gib: int, nvlink_gbs: float, network_gbs: float
         ) -> HardwarePreset:
    return HardwarePreset(name=name, description=description, device_flops=flops, device_memory_bytes=memory_gib * _GIB,
                          in_host_alpha=(1e-5, 1e-5), in_host_beta=(1 / (nvlink_gbs * 1e9),) * 2,
                          inter_host_alpha=3e-5, inter_host_beta=1 / (network_gbs * 1e9))


PRESETS: dict[str, HardwarePreset] = {preset.name: preset for preset in (
    _gpu("h100-sxm", "NVIDIA H100 SXM 80 GB, NVLink 4 in a host, 400 Gb/s InfiniBand per GPU between hosts",
         989e12, 80, 450.0, 50.0),
    _gpu("a100-sxm", "NVIDIA A100 SXM 80 GB, NVLink 3 in a host, 200 Gb/s InfiniBand per GPU between hosts",
         312e12, 80, 300.0, 25.0),
    _gpu("v100-p3", "NVIDIA V100 16 GB (AWS p3.16xlarge), NVLink 2 in a host, 25 Gb/s Ethernet between hosts",
         125e12, 16, 150.0, 25 / 8 / 8),
    HardwarePreset(name="cpu-sim", description="simulated hosts of fake JAX CPU devices (the defaults)",
                   device_flops=5e10, device_memory_bytes=8 * _GIB, in_host_alpha=(1e-4, 1e-5),
                   in_host_beta=(1e-9, 1e-10), inter_host_alpha=1e-4, inter_host_beta=1e-9),
)}
"""Every preset by name."""


def preset(name: str) -> HardwarePreset:
    """The preset called ``name``; ``ValueError`` listing the presets if there is none."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown hardware preset {name!r}; the presets are {', '.join(sorted(PRESETS))} "
                         "(or set ClusterSpec's constants yourself)") from None

"""Hardware presets: the cost-model constants of real clusters, from their public specifications.

A preset fills the constants of a :class:`ClusterSpec` (hosts × devices and the cost constants: pure data, read by
the planner; defined here, below the session in :mod:`torchpar.cluster`) that the planner prices plans with:
per-device peak FLOP/s and memory, the in-host link (NVLink) and the link between hosts (the network). Each
link is ``(α, β)``: latency of one collective in seconds, and inverse bandwidth in seconds per byte, for one
device's share of the link in one direction.

| preset | device | dense FLOP/s fp32 / tf32 / bf16 / fp16 | memory | in-host link | between hosts |
|---|---|---|---|---|---|
| ``h100-nvlink`` | H100 SXM 80 GB (HGX/DGX H100) | 67 T / 495 T / 989 T / 989 T | 80 GiB | NVLink 4, 450 GB/s | 8×400 Gb/s InfiniBand: 50 GB/s per GPU |
| ``a100-80g`` | A100 SXM 80 GB | 19.5 T / 156 T / 312 T / 312 T | 80 GiB | NVLink 3, 300 GB/s | 8×200 Gb/s InfiniBand: 25 GB/s per GPU |
| ``a100-40g`` | A100 SXM 40 GB (DGX A100 40 GB) | 19.5 T / 156 T / 312 T / 312 T | 40 GiB | NVLink 3, 300 GB/s | 8×200 Gb/s InfiniBand: 25 GB/s per GPU |
| ``v100-16g`` | V100 SXM2 16 GB (AWS p3.16xlarge, Alpa's testbed) | 15.7 T / — / — / 125 T | 16 GiB | NVLink 2, 150 GB/s | 25 Gb/s Ethernet per host: 0.39 GB/s per GPU |
| ``cpu-sim`` | simulated hosts of fake JAX CPU devices | 50 G | 8 GiB | 10 GB/s (axis 1), 1 GB/s (axis 0) | 1 GB/s |

``device_flops``, what the planner prices every FLOP at, is the training precision's peak: bf16 (fp16 on the V100,
which has no bf16 tensor cores). ``peak_flops`` has each precision's (``None``: not supported), for MFU. Former
names stay valid: ``h100-sxm`` = ``h100-nvlink``, ``a100-sxm`` = ``a100-80g``, ``v100-p3`` = ``v100-16g``
(:data:`ALIASES`). :func:`detect` names the preset of a GPU from its device kind (``"NVIDIA H100 80GB HBM3"``);
``torchpar.init`` uses it when no preset is given and the local devices are GPUs.

Latencies: 10 µs for a collective inside a host, 30 µs across hosts (NCCL's small-message all-reduce on such
systems; order of magnitude only). FLOP/s are the vendor's dense tensor-core peaks: the estimates are at peak,
so they rank plans rather than predict wall-clock time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_GIB = 1 << 30


@dataclass(kw_only=True, frozen=True)
class HardwarePreset:
    """The cost constants of one kind of host; :meth:`ClusterSpec.from_preset` applies them."""

    name: str
    description: str
    device_flops: float
    """Peak FLOP/s of one device (dense, at the training precision the preset names)."""
    peak_flops: dict[str, float | None]
    """Dense peak FLOP/s per precision: ``fp32``, ``tf32``, ``bf16``, ``fp16`` (``None``: no such units)."""
    device_memory_bytes: int
    in_host_alpha: tuple[float, float]
    """Collective latency (s) inside a host, per logical mesh axis (0, 1)."""
    in_host_beta: tuple[float, float]
    """Inverse bandwidth (s/byte) inside a host, per logical mesh axis (0, 1)."""
    inter_host_alpha: float
    inter_host_beta: float

    def cluster_constants(self) -> dict[str, object]:
        """The :class:`~torchpar.cluster.ClusterSpec` fields this preset sets."""
        return {
            "device_flops": self.device_flops,
            "device_memory_bytes": self.device_memory_bytes,
            "alpha": self.in_host_alpha,
            "beta": self.in_host_beta,
            "inter_host_alpha": self.inter_host_alpha,
            "inter_host_beta": self.inter_host_beta,
            "preset": self.name,
        }


def _gpu(
    name: str, description: str, peaks: tuple[float | None, ...], memory_gib: int, nvlink_gbs: float, network_gbs: float
) -> HardwarePreset:
    peak_flops = dict(zip(("fp32", "tf32", "bf16", "fp16"), peaks, strict=True))
    training = peak_flops["bf16"] or peak_flops["fp16"]
    assert training is not None  # every GPU preset has bf16 or fp16 units
    return HardwarePreset(
        name=name,
        description=description,
        device_flops=training,
        peak_flops=peak_flops,
        device_memory_bytes=memory_gib * _GIB,
        in_host_alpha=(1e-5, 1e-5),
        in_host_beta=(1 / (nvlink_gbs * 1e9),) * 2,
        inter_host_alpha=3e-5,
        inter_host_beta=1 / (network_gbs * 1e9),
    )


_A100_PEAKS = (19.5e12, 156e12, 312e12, 312e12)
PRESETS: dict[str, HardwarePreset] = {
    preset.name: preset
    for preset in (
        _gpu(
            "h100-nvlink",
            "NVIDIA H100 SXM 80 GB, NVLink 4 in a host, 400 Gb/s InfiniBand per GPU between hosts",
            (67e12, 494.7e12, 989.4e12, 989.4e12),
            80,
            450.0,
            50.0,
        ),
        _gpu(
            "a100-80g",
            "NVIDIA A100 SXM 80 GB, NVLink 3 in a host, 200 Gb/s InfiniBand per GPU between hosts",
            _A100_PEAKS,
            80,
            300.0,
            25.0,
        ),
        _gpu(
            "a100-40g",
            "NVIDIA A100 SXM 40 GB, NVLink 3 in a host, 200 Gb/s InfiniBand per GPU between hosts",
            _A100_PEAKS,
            40,
            300.0,
            25.0,
        ),
        _gpu(
            "v100-16g",
            "NVIDIA V100 SXM2 16 GB (AWS p3.16xlarge), NVLink 2 in a host, 25 Gb/s Ethernet between hosts",
            (15.7e12, None, None, 125e12),
            16,
            150.0,
            25 / 8 / 8,
        ),
        HardwarePreset(
            name="cpu-sim",
            description="simulated hosts of fake JAX CPU devices (the defaults)",
            device_flops=5e10,
            peak_flops={"fp32": 5e10, "tf32": None, "bf16": None, "fp16": None},
            device_memory_bytes=8 * _GIB,
            in_host_alpha=(1e-4, 1e-5),
            in_host_beta=(1e-9, 1e-10),
            inter_host_alpha=1e-4,
            inter_host_beta=1e-9,
        ),
    )
}
"""Every preset by name."""

ALIASES = {"h100-sxm": "h100-nvlink", "a100-sxm": "a100-80g", "v100-p3": "v100-16g"}
"""Former preset names."""


def preset(name: str) -> HardwarePreset:
    """The preset called ``name`` (or a former name, :data:`ALIASES`); ``ValueError`` listing the presets if there
    is none."""
    try:
        return PRESETS[ALIASES.get(name, name)]
    except KeyError:
        raise ValueError(
            f"unknown hardware preset {name!r}; the presets are {', '.join(sorted(PRESETS))} "
            "(or set ClusterSpec's constants yourself)"
        ) from None


def detect(device_kind: str) -> str | None:
    """The preset of a GPU from its device kind as JAX reports it (``jax.devices()[0].device_kind``: e.g.
    ``"NVIDIA H100 80GB HBM3"``, ``"NVIDIA A100-SXM4-40GB"``, ``"Tesla V100-SXM2-16GB"``), or ``None`` for a device
    no preset describes (a 32 GB V100, an H100 PCIe, any other GPU)."""
    kind = device_kind.upper().replace("-", " ")
    if "H100" in kind and "PCIE" not in kind:
        return "h100-nvlink"
    if "A100" in kind and "PCIE" not in kind:
        return "a100-40g" if "40GB" in kind.replace(" ", "") else "a100-80g"
    if "V100" in kind and "32GB" not in kind.replace(" ", ""):
        return "v100-16g"
    return None


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

"""Hardware presets: the cost-model constants of real clusters, from their public specifications.

A preset fills the constants of a :class:`torchpar.cluster.ClusterSpec` that the planner prices plans with:
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

_GIB = 1 << 30


@dataclass(kw_only=True, frozen=True)
class HardwarePreset:
    """The cost constants of one kind of host; :meth:`torchpar.cluster.ClusterSpec.from_preset` applies them."""

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

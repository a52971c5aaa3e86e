"""The numerics a PyTorch user asked for: float32 matmul precision, TF32 convolutions, autocast dtypes.

Read from torch's global settings at compile time (``torch.get_float32_matmul_precision()``, which
``torch.backends.cuda.matmul.allow_tf32 = True`` sets to ``"high"``; ``torch.backends.cudnn.allow_tf32``),
unless ``torchpar.compile(matmul_precision=...)`` names one, which then also governs convolutions.
"""

from __future__ import annotations

import torch

MATMUL_PRECISIONS: tuple[str, ...] = ("highest", "high", "medium")
"""PyTorch's names of float32 matmul precisions (``torch.set_float32_matmul_precision``)."""

MIXED_PRECISIONS: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""``compile(mixed_precision=...)`` names → the autocast dtype."""


def torch_matmul_precision() -> str:
    """PyTorch's float32 matmul precision now: ``"highest"``, ``"high"`` (TF32) or ``"medium"``."""
    precision = torch.get_float32_matmul_precision()
    return precision if precision in MATMUL_PRECISIONS else "highest"


def torch_conv_precision() -> str:
    """``"high"`` when PyTorch lets cuDNN convolutions use TF32 (its default), else ``"highest"``."""
    conv = getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision", None)
    if conv in ("tf32", "ieee"):
        return "high" if conv == "tf32" else "highest"
    return "high" if torch.backends.cudnn.allow_tf32 else "highest"


def resolve_precisions(matmul_precision: str | None) -> tuple[str, str]:
    """``(products, convolutions)`` precision names to compile with: ``matmul_precision`` for both when given,
    else PyTorch's current settings."""
    if matmul_precision is not None:
        if matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(
                f"matmul_precision must be one of {MATMUL_PRECISIONS} or None (follow "
                f"torch.get_float32_matmul_precision()), got {matmul_precision!r}"
            )
        return matmul_precision, matmul_precision
    return torch_matmul_precision(), torch_conv_precision()


def autocast_dtype(mixed_precision: str | None) -> torch.dtype | None:
    """The autocast dtype of a ``mixed_precision`` option (``None`` = no autocast)."""
    if mixed_precision is None:
        return None
    try:
        return MIXED_PRECISIONS[mixed_precision]
    except KeyError:
        raise ValueError(
            f"mixed_precision must be one of {tuple(MIXED_PRECISIONS)} or None, got {mixed_precision!r}"
        ) from None


def autocast_device(model: torch.nn.Module, batch_leaves: list[torch.Tensor]) -> str:
    """The device type whose autocast policy a capture uses: where the model's parameters live (else the batch's
    first tensor), as ``torch.autocast`` only casts ops on its own device type. A CUDA-resident model gets
    PyTorch's CUDA policy (``layer_norm``, ``softmax`` and the losses in float32), a CPU model the CPU policy;
    a device type without autocast (``meta``) uses the CPU policy."""
    tensors = [*model.parameters(), *model.buffers(), *batch_leaves]
    device_type = tensors[0].device.type if tensors else "cpu"
    return device_type if device_type != "meta" and torch.amp.is_autocast_available(device_type) else "cpu"


_WIDE = (torch.float64, torch.complex128)


def check_no_float64(model: torch.nn.Module) -> None:
    """Raise ``ValueError`` naming the parameters and buffers of ``model`` held in float64 (or complex128): JAX runs
    with 64-bit types off, so they would train in float32 and be written back rounded, differing from PyTorch."""
    wide = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.dtype in _WIDE]
    if wide:
        shown = ", ".join(wide[:3]) + (f" and {len(wide) - 3} more" if len(wide) > 3 else "")
        raise ValueError(
            f"{type(model).__name__} holds float64 tensors ({shown}): torchpar runs JAX with 64-bit types off, so they "
            "would train in float32 and come back rounded, unlike PyTorch. Train the model in float32 "
            "(model.float(), and float32 batches), or keep a float64 model in PyTorch."
        )

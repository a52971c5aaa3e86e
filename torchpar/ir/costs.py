"""FLOP estimates per ATen op, from static shapes alone.

Contract: ``op_flops(target, operands, out)`` returns floating-point operations of the forward op
(a multiply-add counts 2). Matmuls and convolutions are exact; everything else is approximated by
the number of output elements (elementwise) or input elements (reductions), which is what matters
for balancing layers and pricing stages — the matmuls dominate transformer FLOPs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torchpar.ir.graph import OutMeta, TensorMeta
from torchpar.ir.op_families import FREE, GROUPED_MATMULS

_REDUCTIONS = (
    "sum",
    "mean",
    "amax",
    "amin",
    "max",
    "min",
    "prod",
    "var",
    "std",
    "any",
    "all",
    "_softmax",
    "_log_softmax",
    "native_layer_norm",
    "_native_batch_norm",
    "argmax",
    "argmin",
)


def op_flops(target: str, operands: Sequence[OutMeta], out: OutMeta) -> float:
    """FLOPs of one op; ``operands`` are the metas of its tensor operands in argument order."""
    tensors = [m for m in operands if isinstance(m, TensorMeta)]
    outs = [out] if isinstance(out, TensorMeta) else [m for m in (out or ()) if isinstance(m, TensorMeta)]
    out_numel = sum(m.numel for m in outs)
    name = target.split(".")[1] if target.startswith("aten.") else target
    if target in FREE:
        return 0.0
    if name in ("mm", "addmm", "bmm", "baddbmm", "matmul") and len(tensors) >= 2:
        a, b = (tensors[1], tensors[2]) if name in ("addmm", "baddbmm") and len(tensors) >= 3 else tensors[:2]
        contracted = a.shape[-1] if a.shape else 1
        return 2.0 * out_numel * contracted
    if target in GROUPED_MATMULS and len(tensors) >= 2:  # every row times its own expert's [K, N]
        return 2.0 * out_numel * tensors[0].shape[-1]
    if name == "scaled_dot_product_attention" and len(tensors) >= 3:
        query, key, value = tensors[:3]  # [..., L, E], [..., S, E], [..., S, Ev]: Q·Kᵀ then softmax(·)·V
        batch = out_numel // max(value.shape[-1], 1) // max(query.shape[-2], 1)
        return 2.0 * batch * query.shape[-2] * key.shape[-2] * (query.shape[-1] + value.shape[-1])
    if name == "convolution" and len(tensors) >= 2:
        weight = tensors[1]
        per_output = math.prod(weight.shape[1:])  # C_in / groups × kernel
        return 2.0 * out_numel * per_output
    if name.startswith(_REDUCTIONS) and tensors:
        return float(tensors[0].numel) * (5 if "norm" in name or "softmax" in name else 1)
    return float(out_numel)


EXPERT_EXCHANGE_HEADROOM = 2.0
"""An expert-parallel exchange's fast path sizes each peer's slot at this multiple of a balanced router's share
of rows; a batch that overflows one takes the exact path (``jaxbackend.ops.expert_parallel``)."""


def expert_slot_rows(local_rows: int, peers: int, capacity: float | None = None) -> int:
    """Rows of one peer's slot in the fast exchange of a device's ``local_rows`` sorted rows among ``peers``
    expert devices: ``⌈capacity · local_rows / peers⌉`` (``capacity`` defaults to
    :data:`EXPERT_EXCHANGE_HEADROOM`), at least 1 and at most ``local_rows`` (every row to one peer)."""
    factor = EXPERT_EXCHANGE_HEADROOM if capacity is None else capacity
    return max(1, min(local_rows, math.ceil(factor * local_rows / peers)))

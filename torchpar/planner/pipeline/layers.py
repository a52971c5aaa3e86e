"""Layers: contiguous groups of IR nodes, the unit the stage DP (:mod:`.stages`) assigns to stages.

Two ways to form them:

- :func:`manual_layers` cuts after every ``torchpar.pipeline_boundary`` node
  (``mark_pipeline_boundary`` in the model).
- :func:`cluster_layers` is Alpa's operator clustering (Alpa §5.2, ``cluster_jaxpr_by_cost``):

Operator clustering as a DP
---------------------------
Let ``h_1 … h_K`` be the *heavy* ops in graph order (matmul, conv and attention; see
:data:`HEAVY_OPS`), with forward FLOPs ``f_k``, and ``L`` the number of layers asked for. The light ops
between ``h_k`` and ``h_{k+1}`` are split at one cut, the position ``c_k`` in that gap where the fewest
bytes are live (defined before ``c_k``, read at or after it; ties → the latest position), so that
unit ``u_k`` = ``h_k`` plus the light ops around it up to the cuts (:func:`_units`). A layer is a
contiguous run of units ``[a..b]`` with

    heavy FLOPs      F(a, b) = Σ_{k=a..b} f_k
    entering bytes   C(a, b) = Σ bytes of the distinct values read by a node of units a..b and
                                defined by a node of an earlier unit or a batch input
                                (parameters, buffers and constants are not activations)

Constraint: F(a, b) ≤ cap with cap = (1 + eps) · Σ_k f_k / L, except that a single unit heavier than
cap (an LM head) may form a layer by itself. If no split satisfies that, cap is raised to the smallest
achievable max-layer FLOPs. Both relaxations warn.

Objective, lexicographic: (1) the largest C of any layer, (2) Σ F² over layers (with L and Σ F fixed,
this is the FLOP variance: among the splits with the smallest boundary, the most balanced), (3) the
sum of C. Solved exactly by two DPs over prefixes (:func:`_prefix_dp`):

    G(l, b) = min_{a ≤ b, F(a,b) ≤ cap}  max(G(l−1, a−1), C(a, b))           G(0, −1) = 0
    M* = G(L, K−1)
    S(l, b) = lexmin_{a ≤ b, F(a,b) ≤ cap, C(a,b) ≤ M*}  S(l−1, a−1) + (F(a, b)², C(a, b))

Every layer holds at least one heavy op, so L ≤ K. The C matrix is built in O(K² + Σ reads) with a
difference array (:func:`_entering_bytes`); each DP is O(K²·L) numpy work.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from torchpar.ir.function_regions import function_regions
from torchpar.ir.graph import Graph, Node, OutMeta, TensorMeta

log = logging.getLogger(__name__)

BOUNDARY_OP = "torchpar.pipeline_boundary"

HEAVY_OPS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "matmul",
        "linear",
        "convolution",
        "_convolution",
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    }
)
"""ATen op names (the part between ``aten.`` and the overload) whose FLOPs operator clustering balances."""

_ATTENTION_OPS = frozenset(name for name in HEAVY_OPS if "scaled_dot_product" in name)


@dataclass(frozen=True)
class Layering:
    """An assignment of every IR node to one of ``num_layers`` contiguous layers, with per-layer totals.

    ``boundary_bytes[l]`` counts each distinct value read by a node of layer ``l`` that is defined by a
    node of an earlier layer or is a batch input (graph input of kind ``"input"``); parameters,
    buffers and constants are state, not activations, and are never counted. Layer 0's boundary is the
    batch inputs it reads.
    """

    layer_of: dict[str, int]
    """IR node name → layer id (0..num_layers−1, non-decreasing in graph order)."""
    num_layers: int
    node_ranges: tuple[tuple[int, int], ...]
    """``[start, end)`` indices into ``graph.nodes`` of each layer."""
    flops: tuple[float, ...]
    """Forward FLOPs of each layer, all ops (attention counted as its two matmuls)."""
    heavy_flops: tuple[float, ...]
    """Forward FLOPs of each layer's heavy ops (:data:`HEAVY_OPS`), the quantity clustering balances."""
    boundary_bytes: tuple[int, ...]
    """Bytes entering each layer (see the class docstring)."""
    method: str = "manual"
    """``"manual"`` (pipeline boundaries) or ``"cluster"`` (operator clustering)."""
    solve_s: float = 0.0
    """Seconds spent forming the layers."""

    def summary(self) -> str:
        """One line per layer: node range, FLOPs and entering bytes."""
        total = sum(self.flops) or 1.0
        lines = [
            f"Layering ({self.method}): {self.num_layers} layer(s), {total / 1e9:.3f} GFLOP forward, "
            f"max entering {max(self.boundary_bytes, default=0) / 2**20:.2f} MiB, {self.solve_s:.3f}s"
        ]
        for layer, (start, end) in enumerate(self.node_ranges):
            lines.append(
                f"  layer {layer:3d}: nodes [{start}, {end}), {self.flops[layer] / 1e9:8.3f} GFLOP "
                f"({100 * self.flops[layer] / total:5.1f}%), heavy {self.heavy_flops[layer] / 1e9:8.3f} "
                f"GFLOP, entering {self.boundary_bytes[layer] / 2**20:8.2f} MiB"
            )
        return "\n".join(lines)


def manual_layers(graph: Graph) -> Layering:
    """Cut ``graph`` after each ``torchpar.pipeline_boundary`` node (the boundary node belongs to the layer
    before the cut). A boundary that is the graph's last node adds no empty layer."""
    t0 = time.perf_counter()
    cuts = [index + 1 for index, node in enumerate(graph.nodes) if node.target == BOUNDARY_OP]
    if not cuts:
        raise ValueError(
            "layer_option='manual' needs pipeline boundaries, but the graph has none: call "
            "torchpar.mark_pipeline_boundary(x) on the activation at the end of each layer in forward(), "
            "or use AutoLayerOption(layer_num=...)"
        )
    starts = sorted({0, *(c for c in cuts if c < len(graph.nodes))})
    if len(starts) != len(cuts) + 1:
        warnings.warn(
            "the pipeline boundary at the end of the graph was ignored (it would make an empty layer)", stacklevel=2
        )
    return _make_layering(graph, starts, method="manual", seconds=time.perf_counter() - t0)


def cluster_layers(graph: Graph, layer_num: int, eps: float = 0.5) -> Layering:
    """Alpa's operator clustering (see the module docstring): ``layer_num`` contiguous layers whose heavy
    FLOPs are within ``(1 + eps)`` of the mean, minimizing the largest number of bytes entering a layer."""
    if layer_num < 1:
        raise ValueError(f"layer_num must be ≥ 1, got {layer_num}")
    if eps < 0:
        raise ValueError(f"eps must be ≥ 0, got {eps}")
    t0 = time.perf_counter()
    metas = graph.metas()
    heavy = [(index, flops) for index, node in enumerate(graph.nodes) if (flops := heavy_op_flops(node, metas)) > 0]
    if not heavy:
        raise ValueError(
            "operator clustering found no matmul, convolution or attention op to balance; "
            "use layer_option='manual' with torchpar.mark_pipeline_boundary"
        )
    if layer_num > len(heavy):
        raise ValueError(
            f"layer_num={layer_num} is more than the graph's {len(heavy)} heavy ops (matmul, conv, "
            f"attention); every layer needs one, so layer_num can be at most {len(heavy)}"
        )
    unit_starts = _units(graph, [index for index, _ in heavy])
    unit_flops = np.array([flops for _, flops in heavy])
    entering = _entering_bytes(graph, unit_starts)
    prefix = np.concatenate([[0.0], np.cumsum(unit_flops)])
    block_flops = prefix[None, 1:] - prefix[:-1, None]  # [a, b] = F(a, b) for a ≤ b
    upper = np.triu(np.ones_like(block_flops, dtype=bool))

    cap = (1.0 + eps) * prefix[-1] / layer_num * (1 + 1e-12)
    allowed = upper & ((block_flops <= cap) | np.eye(len(unit_flops), dtype=bool))
    max_entering, _ = _prefix_dp(np.where(allowed, entering, np.inf), layer_num, np.maximum)
    if not math.isfinite(max_entering):  # the ops are too lumpy for the cap: use the most balanced split
        balanced, _ = _prefix_dp(np.where(upper, block_flops, np.inf), layer_num, np.maximum)
        warnings.warn(
            f"no {layer_num}-layer split keeps every layer within (1+eps)={1 + eps:g}× the mean heavy "
            f"FLOPs; allowing up to {balanced / prefix[-1] * layer_num:.2f}× the mean",
            stacklevel=2,
        )
        allowed = upper & (block_flops <= balanced * (1 + 1e-12))
        max_entering, _ = _prefix_dp(np.where(allowed, entering, np.inf), layer_num, np.maximum)
    elif (oversized := unit_flops > cap).any():
        names = [graph.nodes[heavy[k][0]].name for k in np.flatnonzero(oversized)]
        warnings.warn(
            f"heavy op(s) {', '.join(names[:4])} exceed (1+eps)={1 + eps:g}× the mean layer FLOPs on "
            "their own; each may form a layer by itself",
            stacklevel=2,
        )
    assert math.isfinite(max_entering), "the most balanced split is feasible"
    allowed &= entering <= max_entering
    _, firsts = _prefix_dp(
        np.where(allowed, block_flops**2, np.inf), layer_num, np.add, np.where(allowed, entering, np.inf)
    )
    starts = [unit_starts[a] for a in firsts]
    layering = _make_layering(graph, starts, method="cluster", seconds=time.perf_counter() - t0)
    log.info(
        "clustered %d ops (%d heavy) into %d layers in %.3fs; max entering %.2f MiB",
        len(graph.nodes),
        len(heavy),
        layer_num,
        layering.solve_s,
        max_entering / 2**20,
    )
    return layering


def heavy_op_flops(node: Node, metas: dict[str, OutMeta]) -> float:
    """Forward FLOPs of ``node`` if it is a heavy op (:data:`HEAVY_OPS`), else 0.

    Attention is priced as its two matmuls, ``2·N·Lq·Lk·(E + Ev)`` for ``q`` of shape ``[N…, Lq, E]``
    and ``v`` of ``[N…, Lk, Ev]`` (``node.flops`` counts only its output elements).
    """
    name = _op_name(node.target)
    if name not in HEAVY_OPS:
        return 0.0
    if name in _ATTENTION_OPS:
        operands = [m for m in (metas.get(r) for r in node.refs()) if isinstance(m, TensorMeta)]
        if len(operands) < 3 or len(operands[0].shape) < 2:
            return node.flops
        q, k, v = operands[:3]
        rows = math.prod(q.shape[:-1])
        return 2.0 * rows * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    return node.flops


def node_flops(node: Node, metas: dict[str, OutMeta]) -> float:
    """Forward FLOPs of ``node``: :func:`heavy_op_flops` for heavy ops, ``node.flops`` otherwise."""
    return heavy_op_flops(node, metas) or node.flops


def _op_name(target: str) -> str:
    parts = target.split(".")
    return parts[1] if target.startswith("aten.") and len(parts) > 1 else target


def _value_reads(graph: Graph) -> tuple[dict[str, int], dict[str, int], list[list[str]]]:
    """(position of each value's definition: node index, or −1 for a batch input; its bytes;
    the distinct activation values each node reads)."""
    defined: dict[str, int] = {i.name: -1 for i in graph.inputs if i.kind == "input"}
    nbytes: dict[str, int] = {i.name: i.meta.nbytes for i in graph.inputs if i.kind == "input"}
    reads: list[list[str]] = []
    for index, node in enumerate(graph.nodes):
        reads.append([r for r in dict.fromkeys(node.refs()) if r in defined])
        defined[node.name] = index
        nbytes[node.name] = node.out_bytes
    return defined, nbytes, reads


def _units(graph: Graph, heavy: list[int]) -> list[int]:
    """First node index of each unit: 0, then one cut per gap between consecutive heavy ops at the
    position with the fewest live bytes (latest on ties)."""
    defined, nbytes, reads = _value_reads(graph)
    last_read: dict[str, int] = {}
    for index, names in enumerate(reads):
        for name in names:
            last_read[name] = index
    live = np.zeros(len(graph.nodes) + 2)
    for name, last in last_read.items():
        start = defined[name]
        if start >= 0:  # batch inputs cross every cut alike
            live[start + 1] += nbytes[name]
            live[last + 1] -= nbytes[name]
    live = np.cumsum(live)  # live[c]: bytes defined before node c and read at or after it
    starts = [0]
    for left, right in zip(heavy, heavy[1:]):
        window = live[left + 1 : right + 1]
        starts.append(left + 1 + int(len(window) - 1 - np.argmin(window[::-1])))
    return starts


def _entering_bytes(graph: Graph, unit_starts: list[int]) -> np.ndarray:
    """``C[a, b]``: bytes of distinct values defined before unit ``a`` (or batch inputs) read in units
    ``a..b``; ``inf`` below the diagonal.

    For a value defined in unit ``d`` and read in units ``r_1 < r_2 < …`` (all > d), a layer starting at
    unit ``a ∈ (r_{j−1}, r_j]`` first reads it in unit ``r_j``, so it adds to ``C[a, b]`` for ``b ≥ r_j``:
    a difference array ``D[a, r_j] += bytes`` summed along ``b``.
    """
    num_units = len(unit_starts)
    unit_of_node = np.repeat(np.arange(num_units), np.diff([*unit_starts, len(graph.nodes)]))
    defined, nbytes, reads = _value_reads(graph)
    read_units: dict[str, list[int]] = {}
    for index, names in enumerate(reads):
        for name in names:
            units = read_units.setdefault(name, [])
            unit = int(unit_of_node[index])
            if not units or units[-1] != unit:
                units.append(unit)
    delta = np.zeros((num_units, num_units))
    for name, units in read_units.items():
        size = nbytes[name]
        if size == 0:
            continue
        low = int(unit_of_node[defined[name]]) + 1 if defined[name] >= 0 else 0
        for unit in units:
            if unit >= low:
                delta[low : unit + 1, unit] += size
                low = unit + 1
    entering = np.cumsum(delta, axis=1)
    entering[np.tril_indices(num_units, -1)] = np.inf
    return entering


def _prefix_dp(
    cost: np.ndarray,
    num_layers: int,
    combine: Callable[[np.ndarray, np.ndarray], np.ndarray],
    tie_cost: np.ndarray | None = None,
) -> tuple[float, list[int]]:
    """Split units ``0..K−1`` into ``num_layers`` runs ``[a..b]`` minimizing the ``combine``-fold
    (``np.maximum`` or ``np.add``) of ``cost[a, b]`` (``inf`` = not allowed); among exact ties of that,
    minimize the sum of ``tie_cost[a, b]``. Returns (optimal value, first unit of each layer)."""
    num_units = cost.shape[0]
    value = cost[0].copy()  # l = 1: one layer over units 0..b
    tie = tie_cost[0].copy() if tie_cost is not None else None
    choices = []
    for _ in range(1, num_layers):
        candidates = combine(value[:-1, None], cost[1:, :])  # [a−1, b]: layer [a..b] after prefix 0..a−1
        best = candidates.min(axis=0)
        if tie is not None and tie_cost is not None:  # tie is set exactly when tie_cost is
            tied = np.where(candidates == best[None, :], tie[:-1, None] + tie_cost[1:, :], np.inf)
            first = tied.argmin(axis=0)
            tie = np.where(np.isfinite(best), tied[first, np.arange(num_units)], np.inf)
        else:
            first = candidates.argmin(axis=0)
        value = best
        choices.append(first + 1)
    total = float(value[-1])
    if not math.isfinite(total):
        return total, []
    firsts, end = [], num_units - 1
    for first in reversed(choices):
        firsts.append(int(first[end]))
        end = firsts[-1] - 1
    return total, [0, *reversed(firsts)]


def _outside_functions(graph: Graph, starts: list[int]) -> list[int]:
    """``starts`` with each layer start that falls inside a custom autograd.Function's region moved to the
    region's start (a Function's forward and its own backward run as one piece; see
    :mod:`torchpar.ir.function_regions`); a layer this empties is dropped, with a warning."""
    regions = function_regions(graph)
    if not regions:
        return starts
    moved = []
    for start in starts:
        region = next((r for r in regions if r.start < start < r.stop), None)
        moved.append(region.start if region is not None else start)
    kept = sorted(set(moved))
    if kept != starts:
        warnings.warn(
            f"{len([a for a, b in zip(starts, moved) if a != b])} layer cut(s) fell inside a custom "
            "torch.autograd.Function and moved to its start"
            + (f"; {len(starts) - len(kept)} layer(s) merged" if len(kept) < len(starts) else ""),
            stacklevel=3,
        )
    return kept


def _make_layering(graph: Graph, starts: list[int], *, method: str, seconds: float) -> Layering:
    starts = _outside_functions(graph, starts)
    ends = [*starts[1:], len(graph.nodes)]
    metas = graph.metas()
    layer_of: dict[str, int] = {}
    flops, heavy, entering = [], [], []
    for layer, (start, end) in enumerate(zip(starts, ends)):
        assert start < end, "layers are non-empty"
        nodes = graph.nodes[start:end]
        layer_of.update((node.name, layer) for node in nodes)
        flops.append(float(sum(node_flops(n, metas) for n in nodes)))
        heavy.append(float(sum(heavy_op_flops(n, metas) for n in nodes)))
    defined, nbytes, reads = _value_reads(graph)
    for start, end in zip(starts, ends):
        outside = {name for index in range(start, end) for name in reads[index] if defined[name] < start}
        entering.append(int(sum(nbytes[name] for name in outside)))
    return Layering(
        layer_of=layer_of,
        num_layers=len(starts),
        node_ranges=tuple(zip(starts, ends)),
        flops=tuple(flops),
        heavy_flops=tuple(heavy),
        boundary_bytes=tuple(entering),
        method=method,
        solve_s=seconds,
    )

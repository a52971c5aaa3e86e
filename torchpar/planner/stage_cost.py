"""Stage cost models for the inter-op DP (:mod:`.stages`): what one micro-batch of a stage costs on a submesh.

:class:`StageCostModel` is the interface the DP calls; :class:`AnalyticStageCost` prices a stage from the IR
alone with the cluster's alpha-beta constants (its docstring has the formulas).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from torchpar.cluster import ClusterSpec
from torchpar.ir.graph import Graph
from torchpar.ir.op_families import VIEWS
from torchpar.planner.layers import Layering
from torchpar.planner.mesh_links import stage_mesh
from torchpar.planner.remat import BACKWARD_WORKING_COPIES, materialized, remat_memory
from torchpar.planner.sharding.solver_graph import attention_probabilities_bytes

Shape = tuple[int, int]


@dataclass(frozen=True)
class StageCost:
    """One micro-batch's forward + backward of a stage on a submesh with a logical mesh."""

    latency_s: float
    """Seconds per micro-batch (data-parallel gradient sync amortized over the micro-batches)."""
    memory_bytes: float
    """Per-device bytes that do not depend on the schedule: parameters, gradients, optimizer state."""
    activation_bytes: float = 0.0
    """Per-device bytes kept for the backward pass, per micro-batch in flight."""
    compute_s: float = 0.0
    communication_s: float = 0.0

    def peak_bytes(self, in_flight: int) -> float:
        """Per-device memory with ``in_flight`` micro-batches' activations alive."""
        return self.memory_bytes + in_flight * self.activation_bytes


class StageCostModel(Protocol):
    """``cost(first_layer, last_layer, submesh, logical)`` → :class:`StageCost` of layers
    ``[first_layer..last_layer]`` (inclusive) on the physical ``submesh`` with logical mesh ``logical``."""

    def __call__(self, first_layer: int, last_layer: int, submesh: Shape, logical: Shape) -> StageCost: ...


class AnalyticStageCost:
    """The alpha-beta stage cost model, from the IR alone (no compilation, no profiling).

    ``graph`` is captured on one micro-batch (as :func:`torchpar.planner.pipeline_plan.plan_pipeline` does).
    A logical mesh ``(a, b)`` is read as ``a``-way data parallel (axis 0) × ``b``-way tensor parallel
    (axis 1). For layers ``k..i`` with forward FLOPs ``F``, parameter bytes ``P`` (every parameter the
    stage reads, so a tied weight counts in each stage that uses it), buffer bytes ``Q``, activation bytes
    ``A`` (the outputs a compiled step materializes: :func:`torchpar.planner.remat.materialized`):

        compute_s       = 3·F / (a·b · device_flops)                    (backward ≈ 2× forward)
        data-parallel   = AR_0(P / b) / num_micro_batches               (gradient sync once per step)
        tensor-parallel = Σ_w AR_1(X_w / a)                             (Megatron: per weight matmul ``w``
                                                                         one all-reduce of X_w, fwd or bwd)
        latency_s       = compute_s + data-parallel + tensor-parallel
        memory_bytes    = (P·(2 + optimizer_state_copies) + Q) / b      (weights, grads, optimizer state
                          + (R + 2·W) / (a·b)                            replicated over axis 0; one layer
                                                                         live again while recomputed; the
                                                                         backward's working set: W the
                                                                         largest materialized output)
        activation_bytes = (A + I) / (a·b)                              (I: the stage's inputs, held per
                                                                         micro-batch in flight, as the ILP
                                                                         holds its input roots)

    Under activation checkpointing (``remat``, priced by :func:`torchpar.planner.remat.remat_memory` as the ILP
    prices it) ``A`` counts only the outputs kept for the backward, ``R`` is the largest model layer's dropped
    outputs within the stage (``0`` without remat), and ``compute_s`` adds one forward of the recomputed ops'
    FLOPs ``F_r``: ``(3·F + F_r) / (a·b · device_flops)``.

    ``X_w`` is the smaller of the weight matmul's activation operand and its output (a column-split matmul
    all-reduces its input's gradient in the backward, a row-split one its output in the forward: a GPT block's QKV,
    projection and two MLP matmuls give Megatron's four all-reduces of the hidden states per micro-batch).

    A data axis that does not divide the micro-batch's rows ``R`` (the batch inputs' leading dim: ``R mod a ≠ 0``)
    cannot be read as data parallelism; such a logical mesh is priced ``latency_s = ∞`` (not a candidate), so the DP
    does not choose a mesh whose data parallelism only exists on paper (GPT-3 175B on 128 × 8 GPUs: 8-row
    micro-batches on (16, 8) stages, which the ILP then had to split across hosts at 19× the communication).

    with ``AR_x`` the all-reduce cost on logical axis ``x`` priced with the links that axis crosses on the
    submesh (:func:`torchpar.planner.mesh_links.stage_mesh`: in-host or between hosts), as the ILP prices it. ``(n, 1)`` is pure data parallelism and ``(1, n)`` pure tensor parallelism; the DP picks
    the cheapest shape that fits memory. Cross-stage transfers are not priced (as in Alpa).
    """

    def __init__(self, layering: Layering, graph: Graph, cluster: ClusterSpec, num_micro_batches: int,
                 optimizer_state_copies: float, remat: str = "none"):
        if num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be ≥ 1, got {num_micro_batches}")
        if optimizer_state_copies < 0:
            raise ValueError(f"optimizer_state_copies must be ≥ 0, got {optimizer_state_copies}")
        self.layering = layering
        self.cluster = cluster
        self.num_micro_batches = num_micro_batches
        self.optimizer_state_copies = float(optimizer_state_copies)
        kinds = {i.name: (i.kind, i.target, i.meta.nbytes) for i in graph.inputs}
        self._state_bytes = {target: nbytes for kind, target, nbytes in kinds.values() if kind in ("param", "buffer")}
        self._params: list[frozenset[str]] = []
        self._buffers: list[frozenset[str]] = []
        self._activation: list[float] = []
        self._recomputed_flops: list[float] = []
        self._dropped: list[dict[int, float]] = []  # per layer: bytes each remat group does not keep
        self._largest: list[float] = []  # per layer: its largest materialized output (the backward's working set)
        self._tensor_parallel: list[tuple[int, float]] = []  # per layer: (weight matmuls, Σ X_w bytes)
        of_weight = _weight_values(graph)
        kept = remat_memory(graph, remat)
        live = materialized(graph)
        metas = graph.metas()
        group_of = {name: g for g, names in enumerate(kept.dropped_groups) for name in names}
        for start, end in layering.node_ranges:
            nodes = graph.nodes[start:end]
            reads = [kinds[r] for node in nodes for r in node.refs() if r in kinds]
            self._params.append(frozenset(target for kind, target, _ in reads if kind == "param"))
            self._buffers.append(frozenset(target for kind, target, _ in reads if kind == "buffer"))
            counted = [n for n in nodes if n.target not in VIEWS]
            held = {n.name: n.out_bytes + attention_probabilities_bytes(n, [metas.get(r) for r in n.refs()])
                    for n in nodes}  # an attention's L × S probabilities beside its output, as the ILP counts them
            self._activation.append(float(sum(held[n.name] for n in counted if n.name in kept.kept)))
            self._recomputed_flops.append(float(sum(n.flops for n in nodes if n.name in kept.recomputed)))
            dropped: dict[int, float] = {}
            for n in counted:
                if n.name in group_of:
                    dropped[group_of[n.name]] = dropped.get(group_of[n.name], 0.0) + held[n.name]
            self._dropped.append(dropped)
            self._largest.append(float(max((held[n.name] for n in nodes if n.name in live), default=0)))
            exchanged = [_all_reduced_bytes(n, metas, of_weight) for n in nodes if n.target in _WEIGHT_MATMULS]
            exchanged = [nbytes for nbytes in exchanged if nbytes is not None]
            self._tensor_parallel.append((len(exchanged), float(sum(exchanged))))
        self._entering = _entering_values(graph, layering)
        leading = [i.meta.shape[0] for i in graph.inputs if i.kind == "input" and i.meta.shape]
        self.micro_batch_rows: int | None = math.gcd(*leading) if leading else None
        """Rows of one micro-batch (the gcd of the batch inputs' leading dims); ``None``: no batch input."""
        self._range = lru_cache(maxsize=None)(self._range_totals)

    def _range_totals(self, first: int, last: int
                      ) -> tuple[float, float, float, float, tuple[int, float], float, float, float, float]:
        layers = range(first, last + 1)
        params = frozenset().union(*(self._params[l] for l in layers))
        buffers = frozenset().union(*(self._buffers[l] for l in layers)) - params
        dropped: dict[int, float] = {}
        for l in layers:
            for group, nbytes in self._dropped[l].items():
                dropped[group] = dropped.get(group, 0.0) + nbytes
        return (float(sum(self.layering.flops[l] for l in layers)),
                float(sum(self._state_bytes[t] for t in params)),
                float(sum(self._state_bytes[t] for t in buffers)),
                float(sum(self._activation[l] for l in layers)),
                (sum(self._tensor_parallel[l][0] for l in layers), sum(self._tensor_parallel[l][1] for l in layers)),
                float(sum(self._recomputed_flops[l] for l in layers)),
                max(dropped.values(), default=0.0),
                float(sum(nbytes for defined, readers, nbytes in self._entering
                          if defined < first and any(first <= r <= last for r in readers))),
                max(self._largest[l] for l in layers))

    def parameter_bytes(self, first_layer: int, last_layer: int) -> float:
        """Bytes of the distinct parameters layers ``first_layer..last_layer`` read."""
        return self._range(first_layer, last_layer)[1]

    def __call__(self, first_layer: int, last_layer: int, submesh: Shape, logical: Shape) -> StageCost:
        devices = submesh[0] * submesh[1]
        data, tensor = logical
        if data * tensor != devices:
            raise ValueError(f"logical mesh {logical} does not have the {devices} devices of submesh {submesh}")
        if data > 1 and self.micro_batch_rows is not None and self.micro_batch_rows % data:
            return StageCost(latency_s=math.inf, memory_bytes=math.inf)
        (flops, params, buffers, activations, (matmuls, exchanged), recomputed, recomputed_peak,
         received, largest) = self._range(first_layer, last_layer)
        mesh = stage_mesh((data, tensor), self.cluster, submesh)
        compute = (3.0 * flops + recomputed) / (devices * self.cluster.device_flops)
        latency_1 = mesh.all_reduce(0.0, [1])  # AR_1 is affine in its bytes: α + slope·bytes
        tensor_parallel = matmuls * latency_1 + (mesh.all_reduce(1.0, [1]) - latency_1) * exchanged / data
        communication = mesh.all_reduce(params / tensor, [0]) / self.num_micro_batches + tensor_parallel
        return StageCost(
            latency_s=compute + communication,
            memory_bytes=((params * (2.0 + self.optimizer_state_copies) + buffers) / tensor
                          + (recomputed_peak + BACKWARD_WORKING_COPIES * largest) / devices),
            activation_bytes=(activations + received) / devices,
            compute_s=compute,
            communication_s=communication,
        )


_WEIGHT_MATMULS = frozenset({"aten.mm.default", "aten.addmm.default"})
_SAME_VALUES = VIEWS | {"aten._to_copy.default", "aten.clone.default", "aten.alias.default"}
"""Ops whose output is their first operand's values (viewed or cast: mixed precision casts each weight)."""


def _weight_values(graph: Graph) -> set[str]:
    """The parameters and the views and casts of them (a ``Linear``'s transposed bf16 weight) by name."""
    found = {i.name for i in graph.inputs if i.kind == "param"}
    for node in graph.nodes:
        if node.target in _SAME_VALUES and next(node.refs(), None) in found:
            found.add(node.name)
    return found


def _all_reduced_bytes(node, metas: dict, of_weight: set[str]) -> float | None:
    """``X_w`` of a matmul ``node`` reading a weight (the class docstring); ``None`` if it reads none."""
    refs = list(node.refs())[1:] if node.target == "aten.addmm.default" else list(node.refs())
    if not any(r in of_weight for r in refs):
        return None
    activations = [metas[r].nbytes for r in refs if r not in of_weight and r in metas]
    return float(min([node.out_bytes, *activations]))


def _entering_values(graph: Graph, layering: Layering) -> list[tuple[int, tuple[int, ...], int]]:
    """Every activation a layer reads from an earlier layer, and every batch input: ``(layer defining it (−1 for a
    batch input), layers reading it, bytes)``. A stage of layers ``k..i`` receives those defined before ``k`` and
    read in ``k..i`` (views count as the value they view, as :func:`torchpar.planner.slicing.slice_stages` sends)."""
    kinds = {i.name: i.kind for i in graph.inputs}
    sizes = {i.name: i.meta.nbytes for i in graph.inputs if i.kind == "input"}
    defined: dict[str, int] = {name: -1 for name in sizes}
    readers: dict[str, set[int]] = {}
    for node in graph.nodes:
        layer = layering.layer_of[node.name]
        defined[node.name] = layer
        sizes[node.name] = node.out_bytes
        for ref in node.refs():
            if kinds.get(ref, "input") == "input" and ref in defined and defined[ref] < layer:
                readers.setdefault(ref, set()).add(layer)
    return [(defined[name], tuple(sorted(layers)), sizes[name]) for name, layers in readers.items()]

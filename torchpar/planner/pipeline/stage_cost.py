"""Stage cost models for the inter-op DP (:mod:`.stages`): what one micro-batch of a stage costs on a submesh.

:class:`StageCostModel` is the interface the DP calls; :class:`AnalyticStageCost` prices a stage from the IR
alone with the cluster's alpha-beta constants (its docstring has the formulas).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple, Protocol, cast

import numpy as np

from torchpar.hardware import ClusterSpec
from torchpar.ir.graph import DTYPE_BYTES, Graph, Node
from torchpar.ir.layout import Spec
from torchpar.ir.op_families import GROUPED_MATMULS, VIEWS
from torchpar.planner.mesh_links import stage_mesh
from torchpar.planner.pipeline.layers import Layering
from torchpar.planner.remat import BACKWARD_WORKING_COPIES, materialized, remat_memory
from torchpar.planner.sharding.cost_model import LogicalMesh
from torchpar.planner.sharding.solver_graph import attention_probabilities_bytes
from torchpar.planner.sharding.strategies import expert_strategies

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


def stage_options(
    cost: StageCostModel, first_layer: int, last_layer: int, submesh: Shape, logical: Shape
) -> tuple[StageCost, ...]:
    """The costs ``cost`` offers for a stage: those of its ``options`` method when it has one (layout families
    with different memory, of which the DP takes the fastest that fits), else its one ``cost(...)``."""
    options = getattr(cost, "options", None)
    if options is None:
        return (cost(first_layer, last_layer, submesh, logical),)
    return tuple(options(first_layer, last_layer, submesh, logical))


class AnalyticStageCost:
    """The alpha-beta stage cost model, from the IR alone (no compilation, no profiling).

    ``graph`` is captured on one micro-batch (as :func:`torchpar.planner.pipeline.pipeline_plan.plan_pipeline` does).
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

    A mixture-of-experts grouped matmul ``x [S, K] · w [E, K, N]`` (``X_g``: the smaller of ``x`` and its output) is
    priced as the stage ILP prices it, its cheapest of: the experts split over axis 1 with the tokens exchanged by
    all-to-all (:func:`torchpar.planner.sharding.strategies.expert_strategies`, forward and backward, on the
    stage's micro-batch; its weight-gradient sync is the data-parallel term above), or the hidden dims split over
    axis 1 at one all-reduce of ``X_g / a`` as a dense weight matmul. Its compute beyond ``3·F_g / (a·b)`` (an
    exchange whose rows are not split over every device) is added to ``compute_s``. On ``(a, 1)`` it costs nothing
    beyond its FLOPs (weights replicated, as the memory term has them).

    ``X_w`` is the smaller of the weight matmul's activation operand and its output (a column-split matmul
    all-reduces its input's gradient in the backward, a row-split one its output in the forward: a GPT block's QKV,
    projection and two MLP matmuls give Megatron's four all-reduces of the hidden states per micro-batch). A
    convolution is a weight matmul over its channels (a ResNet bottleneck's 1×1 and 3×3 convolutions split as an
    MLP's matmuls are).

    :meth:`options` offers more layouts of the same stage, the DP taking the fastest that fits: on a ``(n, 1)`` mesh
    the stage with weight matmuls split over all ``n`` devices, in order of cost per byte saved (each split saves
    its weight's state but costs an all-reduce of ``X_w`` per micro-batch: :meth:`_split_weight_options`; a wide
    convolution does not fit replicated, and the ILP splits its channels over axis 0 while the rest stays data
    parallel); with experts on ``(a, b > 1)``, the dense weights replicated (below).

    A data axis that does not divide the micro-batch's rows ``R`` (the batch inputs' leading dim: ``R mod a ≠ 0``)
    cannot be read as data parallelism; such a logical mesh is priced ``latency_s = ∞`` (not a candidate), so the DP
    does not choose a mesh whose data parallelism only exists on paper (GPT-3 175B on 128 × 8 GPUs: 8-row
    micro-batches on (16, 8) stages, which the ILP then had to split across hosts at 19× the communication).

    with ``AR_x`` the all-reduce cost on logical axis ``x`` priced with the links that axis crosses on the
    submesh (:func:`torchpar.planner.mesh_links.stage_mesh`: in-host or between hosts), as the ILP prices it.
    ``(n, 1)`` is pure data parallelism and ``(1, n)`` pure tensor parallelism; the DP picks the cheapest shape that
    fits memory. Cross-stage transfers are not priced (as in Alpa).
    """

    def __init__(
        self,
        layering: Layering,
        graph: Graph,
        cluster: ClusterSpec,
        num_micro_batches: int,
        optimizer_state_copies: float,
        remat: str = "none",
    ):
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
        self._weight_matmuls: list[tuple[tuple[float, float], ...]] = []  # per layer: (X_w, weight bytes) of each
        self._grouped: list[tuple[_GroupedMatmul, ...]] = []  # per layer: its MoE grouped matmuls
        self._expert_params: list[frozenset[str]] = []  # per layer: the parameters its grouped matmuls read as w
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
            held = {
                n.name: n.out_bytes + attention_probabilities_bytes(n, [metas.get(r) for r in n.refs()]) for n in nodes
            }  # an attention's L × S probabilities beside its output, as the ILP counts them
            self._activation.append(float(sum(held[n.name] for n in counted if n.name in kept.kept)))
            self._recomputed_flops.append(float(sum(n.flops for n in nodes if n.name in kept.recomputed)))
            dropped: dict[int, float] = {}
            for n in counted:
                if n.name in group_of:
                    dropped[group_of[n.name]] = dropped.get(group_of[n.name], 0.0) + held[n.name]
            self._dropped.append(dropped)
            self._largest.append(float(max((held[n.name] for n in nodes if n.name in live), default=0)))
            weight_matmuls = [n for n in nodes if n.target in _WEIGHT_MATMULS]
            exchanged = [_all_reduced_bytes(n, metas, of_weight) for n in weight_matmuls]
            self._weight_matmuls.append(
                tuple(
                    (nbytes, float(self._state_bytes[of_weight[weight]]))
                    for n, nbytes in zip(weight_matmuls, exchanged)
                    if nbytes is not None
                    for weight in [_weight_of(n, of_weight)]
                    if of_weight[weight] in self._state_bytes
                )
            )
            reduced = [nbytes for nbytes in exchanged if nbytes is not None]
            self._tensor_parallel.append((len(reduced), float(sum(reduced))))
            grouped = (_grouped_matmul(n, metas) for n in nodes if n.target in GROUPED_MATMULS)
            self._grouped.append(tuple(g for g in grouped if g is not None))
            self._expert_params.append(
                frozenset(
                    of_weight[ref]
                    for n in nodes
                    if n.target in GROUPED_MATMULS
                    for ref in list(n.refs())[1:2]
                    if ref in of_weight
                )
            )
        self._entering = _entering_values(graph, layering)
        leading = [i.meta.shape[0] for i in graph.inputs if i.kind == "input" and i.meta.shape]
        self.micro_batch_rows: int | None = math.gcd(*leading) if leading else None
        """Rows of one micro-batch (the gcd of the batch inputs' leading dims); ``None``: no batch input."""
        self._range = lru_cache(maxsize=None)(self._range_totals)
        self._experts = lru_cache(maxsize=None)(self._layer_expert_costs)
        self._weight_arrays = lru_cache(maxsize=None)(self._weight_matmul_arrays)
        self._largest_weights_first = lru_cache(maxsize=None)(self._largest_weights_first_uncached)
        self._mesh = lru_cache(maxsize=None)(lambda logical, submesh: stage_mesh(logical, cluster, submesh))

    def _range_totals(self, first: int, last: int) -> _RangeTotals:
        layers = range(first, last + 1)
        params = frozenset().union(*(self._params[layer] for layer in layers))
        experts = frozenset().union(*(self._expert_params[layer] for layer in layers)) & params
        buffers = frozenset().union(*(self._buffers[layer] for layer in layers)) - params
        dropped: dict[int, float] = {}
        for layer in layers:
            for group, nbytes in self._dropped[layer].items():
                dropped[group] = dropped.get(group, 0.0) + nbytes
        return _RangeTotals(
            flops=float(sum(self.layering.flops[layer] for layer in layers)),
            param_bytes=float(sum(self._state_bytes[t] for t in params)),
            buffer_bytes=float(sum(self._state_bytes[t] for t in buffers)),
            activation_bytes=float(sum(self._activation[layer] for layer in layers)),
            weight_matmuls=sum(self._tensor_parallel[layer][0] for layer in layers),
            exchanged_bytes=float(sum(self._tensor_parallel[layer][1] for layer in layers)),
            recomputed_flops=float(sum(self._recomputed_flops[layer] for layer in layers)),
            recomputed_peak_bytes=max(dropped.values(), default=0.0),
            received_bytes=float(
                sum(
                    nbytes
                    for defined, readers, nbytes in self._entering
                    if defined < first and any(first <= r <= last for r in readers)
                )
            ),
            largest_bytes=max(self._largest[layer] for layer in layers),
            expert_param_bytes=float(sum(self._state_bytes[t] for t in experts)),
        )

    def _layer_expert_costs(self, layer: int, submesh: Shape, logical: Shape) -> tuple[float, float]:
        """``(compute_s, communication_s)`` layer ``layer``'s grouped matmuls add per micro-batch beyond their
        FLOPs over every device (class docstring)."""
        if not self._grouped[layer] or logical[1] == 1:
            return 0.0, 0.0
        mesh = self._mesh(tuple(logical), tuple(submesh))
        compute = communication = 0.0
        for matmul in self._grouped[layer]:
            extra_compute, extra_communication = _grouped_matmul_cost(matmul, mesh)
            compute += extra_compute
            communication += extra_communication
        return compute, communication

    def parameter_bytes(self, first_layer: int, last_layer: int) -> float:
        """Bytes of the distinct parameters layers ``first_layer..last_layer`` read."""
        return self._range(first_layer, last_layer).param_bytes

    def __call__(self, first_layer: int, last_layer: int, submesh: Shape, logical: Shape) -> StageCost:
        return self._price(first_layer, last_layer, submesh, logical, dense_replicated=False)

    def options(self, first_layer: int, last_layer: int, submesh: Shape, logical: Shape) -> tuple[StageCost, ...]:
        """The stage's costs under each layout family the screening knows (the DP takes the fastest that fits):
        the class docstring's; on ``(n, 1)`` with weights split over the devices (:meth:`_split_weight_options`); and
        for a stage with experts on ``(a, b > 1)`` the other weights replicated too (their matmuls data parallel over
        both axes, no tensor-parallel all-reduce)."""
        plain = self._price(first_layer, last_layer, submesh, logical, dense_replicated=False)
        if logical[1] == 1:
            return (plain, *self._split_weight_options(plain, first_layer, last_layer, submesh, logical))
        sharded = self._sharded_state_options(plain, first_layer, last_layer, submesh, logical)
        if not self._range(first_layer, last_layer).expert_param_bytes:
            return (plain, *sharded)
        return plain, *sharded, self._price(first_layer, last_layer, submesh, logical, dense_replicated=True)

    def _sharded_state_options(
        self, plain: StageCost, first_layer: int, last_layer: int, submesh: Shape, logical: Shape
    ) -> tuple[StageCost, ...]:
        """On an ``(a > 1, b > 1)`` mesh, the stage with some weights' state (weight, gradient, optimizer state)
        split over axis 0 as well as axis 1 — ZeRO-3 / FSDP inside the tensor-parallel layout, which the ILP reaches
        by storing a parameter split over both axes and gathering it over axis 0 for its use: weight ``w`` saves
        ``P_w·(2 + optimizer_state_copies)·(1 − 1/a) / b`` bytes and costs one all-gather ``AG_0(P_w / b)`` per
        micro-batch (the gathered copy serves the forward and the backward; its gradient is reduced once per step as
        the plain layout's is, and split again for free). Per byte saved a weight costs ``α_0·b / (c·P_w) + const``,
        so the largest weights go first on every mesh (:meth:`_largest_weights_first_uncached`); one option per
        fraction of the bytes all of them would save (the DP takes the fastest that fits)."""
        data, tensor = logical
        if data == 1:
            return ()
        mesh = self._mesh(tuple(logical), tuple(submesh))
        latency = mesh.all_gather(0.0, [0])
        slope = mesh.all_gather(1.0, [0]) - latency
        per_byte_saved = (2.0 + self.optimizer_state_copies) * (1 - 1 / data) / tensor
        options = []
        for count, weight_bytes in self._largest_weights_first(first_layer, last_layer):
            added = count * latency + slope * weight_bytes / tensor
            options.append(
                StageCost(
                    latency_s=plain.latency_s + added,
                    memory_bytes=plain.memory_bytes - weight_bytes * per_byte_saved,
                    activation_bytes=plain.activation_bytes,
                    compute_s=plain.compute_s,
                    communication_s=plain.communication_s + added,
                )
            )
        return tuple(options)

    def _largest_weights_first_uncached(
        self, first_layer: int, last_layer: int, fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0)
    ) -> tuple[tuple[int, float], ...]:
        """Per fraction ``f`` of the weight matmuls' weight bytes: the fewest largest weights holding at least ``f``
        of them, as ``(how many, their bytes)``; empty without weight matmuls."""
        _, weights = self._weight_arrays(first_layer, last_layer)
        if not len(weights):
            return ()
        so_far = np.cumsum(np.sort(weights)[::-1])
        picked = []
        for fraction in fractions:
            last = min(int(np.searchsorted(so_far, fraction * so_far[-1] * (1 - 1e-9))), len(so_far) - 1)
            picked.append((last + 1, float(so_far[last])))
        return tuple(picked)

    def _split_weight_options(
        self,
        plain: StageCost,
        first_layer: int,
        last_layer: int,
        submesh: Shape,
        logical: Shape,
        fractions: tuple[float, ...] = (0.25, 0.5, 0.75, 1.0),
    ) -> tuple[StageCost, ...]:
        """On a data-parallel ``(n, 1)`` mesh, the stage with some weight matmuls split over all ``n`` devices (the
        ILP may split a weight over axis 0 too, e.g. a wide convolution's channels, when replicating it does not
        fit): weight ``w`` split saves ``P_w·(2 + optimizer_state_copies)·(1 − 1/n)`` bytes and its gradient sync,
        and costs one all-reduce of ``X_w`` per micro-batch. Weights are split in order of cost per byte saved; one
        option per ``fractions`` of the bytes all of them would save (the DP takes the fastest that fits)."""
        devices = logical[0]
        exchanged, weights = self._weight_arrays(first_layer, last_layer)
        if devices == 1 or not len(weights):
            return ()
        mesh = self._mesh(tuple(logical), tuple(submesh))
        latency = mesh.all_reduce(0.0, [0])
        slope = mesh.all_reduce(1.0, [0]) - latency
        saved = weights * (2.0 + self.optimizer_state_copies) * (1 - 1 / devices)
        cost = latency + slope * (exchanged - weights / self.num_micro_batches)
        order = np.argsort(cost / saved, kind="stable")
        saved_so_far, cost_so_far = np.cumsum(saved[order]), np.cumsum(cost[order])
        options = []
        for fraction in fractions:  # the fewest cheapest splits that save this fraction of all the bytes
            last = min(int(np.searchsorted(saved_so_far, fraction * saved_so_far[-1] * (1 - 1e-9))), len(order) - 1)
            added = float(cost_so_far[last])
            options.append(
                StageCost(
                    latency_s=plain.latency_s + added,
                    memory_bytes=plain.memory_bytes - float(saved_so_far[last]),
                    activation_bytes=plain.activation_bytes,
                    compute_s=plain.compute_s,
                    communication_s=plain.communication_s + added,
                )
            )
        return tuple(options)

    def _weight_matmul_arrays(self, first_layer: int, last_layer: int) -> tuple[np.ndarray, np.ndarray]:
        """``(X_w, weight bytes)`` of layers ``first_layer..last_layer``'s weight matmuls with a weight of their own
        (bytes > 0), as arrays."""
        pairs = [
            pair for layer in range(first_layer, last_layer + 1) for pair in self._weight_matmuls[layer] if pair[1] > 0
        ]
        return (np.array([x for x, _ in pairs], dtype=np.float64), np.array([w for _, w in pairs], dtype=np.float64))

    def _price(
        self, first_layer: int, last_layer: int, submesh: Shape, logical: Shape, *, dense_replicated: bool
    ) -> StageCost:
        devices = submesh[0] * submesh[1]
        data, tensor = logical
        if data * tensor != devices:
            raise ValueError(f"logical mesh {logical} does not have the {devices} devices of submesh {submesh}")
        rows_split = devices if dense_replicated else data
        if rows_split > 1 and self.micro_batch_rows is not None and self.micro_batch_rows % rows_split:
            return StageCost(latency_s=math.inf, memory_bytes=math.inf)
        totals = self._range(first_layer, last_layer)
        params, expert_params, matmuls = totals.param_bytes, totals.expert_param_bytes, totals.weight_matmuls
        mesh = self._mesh((data, tensor), tuple(submesh))
        compute = (3.0 * totals.flops + totals.recomputed_flops) / (devices * self.cluster.device_flops)
        experts = [self._experts(layer, submesh, logical) for layer in range(first_layer, last_layer + 1)]
        compute += sum(c for c, _ in experts)
        communication = sum(c for _, c in experts)
        if dense_replicated:
            split, whole = expert_params, params - expert_params
            communication += (
                mesh.all_reduce(split / tensor, [0]) + mesh.all_reduce(whole, [0, 1])
            ) / self.num_micro_batches
        else:
            split, whole = params, 0.0
            latency_1 = mesh.all_reduce(0.0, [1])  # AR_1 is affine in its bytes: α + slope·bytes
            communication += (
                mesh.all_reduce(params / tensor, [0]) / self.num_micro_batches
                + matmuls * latency_1
                + (mesh.all_reduce(1.0, [1]) - latency_1) * totals.exchanged_bytes / data
            )
        state_copies = 2.0 + self.optimizer_state_copies
        return StageCost(
            latency_s=compute + communication,
            memory_bytes=(
                (split * state_copies + totals.buffer_bytes) / tensor
                + whole * state_copies
                + (totals.recomputed_peak_bytes + BACKWARD_WORKING_COPIES * totals.largest_bytes) / devices
            ),
            activation_bytes=(totals.activation_bytes + totals.received_bytes) / devices,
            compute_s=compute,
            communication_s=communication,
        )


class _RangeTotals(NamedTuple):
    """What a stage of layers ``k..i`` holds and does, summed over its layers (the class docstring's symbols)."""

    flops: float
    """F: forward FLOPs."""
    param_bytes: float
    """P: the distinct parameters read (a tied weight in each stage that reads it)."""
    buffer_bytes: float
    """Q: buffers read that are not parameters."""
    activation_bytes: float
    """A: outputs kept for the backward pass, per micro-batch."""
    weight_matmuls: int
    """Weight matmuls (each one tensor-parallel all-reduce's latency)."""
    exchanged_bytes: float
    """Σ X_w over the weight matmuls."""
    recomputed_flops: float
    """F_r: FLOPs recomputed under remat."""
    recomputed_peak_bytes: float
    """R: the largest remat group's dropped outputs."""
    received_bytes: float
    """I: the stage's inputs (activations from earlier stages and batch inputs)."""
    largest_bytes: float
    """W: the largest materialized output (the backward's working set)."""
    expert_param_bytes: float
    """The parameters grouped matmuls read as their experts' weights."""


@dataclass(frozen=True)
class _GroupedMatmul:
    """A grouped matmul ``x [S, K] · w [E, K, N]`` as the screening prices it."""

    shapes: tuple[tuple[int, ...], ...]
    """``x``, ``w`` and the offsets' shapes."""
    flops: float
    itemsize: int
    exchanged_bytes: float
    """``X_g``: the smaller of ``x`` and the output, the tensor-parallel all-reduce's buffer."""


def _grouped_matmul(node: Node, metas: dict) -> _GroupedMatmul | None:
    """``node``'s :class:`_GroupedMatmul`, ``None`` unless it has the ``x [S, K], w [E, K, N], offs [E]`` form."""
    refs = list(node.refs())
    if len(refs) < 2 or any(r not in metas for r in refs[:3]):
        return None
    shapes = tuple(tuple(metas[r].shape) for r in refs[:3])
    if len(shapes[0]) != 2 or len(shapes[1]) != 3:
        return None
    return _GroupedMatmul(
        shapes=shapes,
        flops=float(node.flops),
        itemsize=DTYPE_BYTES.get(metas[refs[0]].dtype, 4),
        exchanged_bytes=float(min(node.out_bytes, metas[refs[0]].nbytes)),
    )


def _grouped_matmul_cost(matmul: _GroupedMatmul, mesh: LogicalMesh) -> tuple[float, float]:
    """``(compute_s, communication_s)`` ``matmul`` adds per micro-batch on ``mesh`` beyond ``3·F_g / (a·b)``: the
    cheaper of its expert-parallel strategies over axis 1 and a tensor-parallel all-reduce over axis 1."""
    data, tensor = mesh.shape
    base = mesh.compute(3.0 * matmul.flops, data * tensor)
    options = [(0.0, mesh.all_reduce(matmul.exchanged_bytes / data, [1]))]
    # rows split over both axes, the experts' axis major, are not the rows of the stage's other ops (the batch over
    # axis 0): the tokens are re-laid by an all-to-all over both axes, forward and backward
    relayout = 2.0 * mesh.all_to_all(matmul.exchanged_bytes / (data * tensor), [0, 1]) if data > 1 else 0.0
    # the weight's gradient sync is the stage's data-parallel term: not priced again here
    for strategy in expert_strategies(matmul.shapes, matmul.flops, matmul.itemsize, (True, False, False), mesh):
        x_spec, w_spec = cast(tuple[Spec, Spec], strategy.in_specs[:2])  # the rows' and the experts' layouts
        row_axes, expert_axes = cast(tuple[int, ...], x_spec[0]), cast(tuple[int, ...], w_spec[0])  # both split
        if 1 in expert_axes:
            rows_both = len(row_axes) == 2
            options.append((max(strategy.compute_s - base, 0.0), strategy.comm_s + (relayout if rows_both else 0.0)))
    return min(options, key=sum)


_WEIGHT_MATMULS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.convolution.default"})
"""Ops that read a weight and are split as Megatron splits a matmul (a convolution over its channels)."""
_SAME_VALUES = VIEWS | {"aten._to_copy.default", "aten.clone.default", "aten.alias.default"}
"""Ops whose output is their first operand's values (viewed or cast: mixed precision casts each weight)."""


def _weight_values(graph: Graph) -> dict[str, str]:
    """The parameters and the views and casts of them (a ``Linear``'s transposed bf16 weight) by name → the
    parameter's target."""
    found = {i.name: i.target for i in graph.inputs if i.kind == "param"}
    for node in graph.nodes:
        source = next(node.refs(), None)
        if node.target in _SAME_VALUES and source in found:
            found[node.name] = found[source]
    return found


def _operands(node: Node) -> list[str]:
    """A weight matmul's operand names, an ``addmm``'s bias left out."""
    return list(node.refs())[1:] if node.target == "aten.addmm.default" else list(node.refs())


def _weight_of(node: Node, of_weight: dict[str, str]) -> str:
    """The operand of weight matmul ``node`` that is a weight (or a view or cast of one)."""
    return next(r for r in _operands(node) if r in of_weight)


def _all_reduced_bytes(node: Node, metas: dict, of_weight: dict[str, str]) -> float | None:
    """``X_w`` of a matmul ``node`` reading a weight (the class docstring); ``None`` if it reads none."""
    refs = _operands(node)
    if not any(r in of_weight for r in refs):
        return None
    activations = [metas[r].nbytes for r in refs if r not in of_weight and r in metas]
    return float(min([node.out_bytes, *activations]))


def _entering_values(graph: Graph, layering: Layering) -> list[tuple[int, tuple[int, ...], int]]:
    """Every activation a layer reads from an earlier layer, and every batch input: ``(layer defining it (−1 for a
    batch input), layers reading it, bytes)``. A stage of layers ``k..i`` receives those defined before ``k`` and
    read in ``k..i`` (views count as the value they view, as :func:`torchpar.planner.pipeline.slicing.slice_stages`
    sends)."""
    kinds = {i.name: i.kind for i in graph.inputs}
    sizes = {i.name: i.meta.nbytes for i in graph.inputs if i.kind == "input"}
    defined: dict[str, int] = dict.fromkeys(sizes, -1)
    readers: dict[str, set[int]] = {}
    for node in graph.nodes:
        layer = layering.layer_of[node.name]
        defined[node.name] = layer
        sizes[node.name] = node.out_bytes
        for ref in node.refs():
            if kinds.get(ref, "input") == "input" and ref in defined and defined[ref] < layer:
                readers.setdefault(ref, set()).add(layer)
    return [(defined[name], tuple(sorted(layers)), sizes[name]) for name, layers in readers.items()]

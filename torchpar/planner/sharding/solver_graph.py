"""IR → solver graph: roots with strategies, and resharding-cost edges between them.

Roots are parameters, batch inputs, buffers/constants (replicated only) and anchor ops (see
:mod:`.strategies`). Every other op is merged into the root of the operand it follows (the largest
one), so it shares that root's ILP variable: for each of the root's strategies the follower's layout
is computed by :func:`.follow.follow`, and its costs are added to the root's cost vector. An edge
``(u, v)`` holds ``R[k, l]``: the cost of resharding the values flowing from root ``u`` (in strategy
``k``) into what root ``v`` (in strategy ``l``) requires, forward plus — when the value needs a
gradient — the reverse resharding of that gradient in the backward pass. An expert weight gathered into a
larger layout than it is stored in also holds memory: the gathered copy (``memory_edges``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from torchpar.ir.graph import DTYPE_BYTES, Graph, Input, Node, OutMeta, TensorMeta
from torchpar.ir.layout import Multi, Spec
from torchpar.ir.op_families import ASSERTS, GROUPED_MATMULS, SLICES
from torchpar.planner.remat import BACKWARD_WORKING_COPIES, remat_memory
from torchpar.planner.sharding.cost_model import LogicalMesh
from torchpar.planner.sharding.exchange_strategies import anchor_of, exchange_strategies, replicated_put
from torchpar.planner.sharding.follow import Follow, OutSpec, follow
from torchpar.planner.sharding.strategies import (
    Einsum,
    Strategy,
    attention_scores_bytes,
    context_strategies,
    einsum_strategies,
    expert_strategies,
    layout_root_strategies,
)

ATTENTION = "aten.scaled_dot_product_attention.default"
ROW_SCATTERED = ("aten.mm.default", "aten.addmm.default")
"""Matmuls whose contracted-split strategies also come with their output rows reduce-scattered (Megatron's
sequence parallelism: :func:`.strategies.einsum_strategies`)."""
_ATTENTION_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclass
class Root:
    """An ILP node. ``cost[k]``/``memory[k]``: seconds and per-device bytes of strategy ``k``, its own
    plus those of the ops merged into it; ``transient[k]``: the bytes strategy ``k`` holds only while it runs
    (:attr:`Strategy.transient_bytes`; the step's peak adds the largest over the roots)."""

    name: str
    kind: str
    label: str
    strategies: list[Strategy]
    cost: np.ndarray
    memory: np.ndarray
    share_key: str | None = None
    followers: list[str] = field(default_factory=list)
    transient: np.ndarray | None = None


@dataclass
class ValueLayout:
    """The value's spec under each strategy of its root (``Multi`` for multi-output ops)."""

    root: int
    specs: list[OutSpec]


@dataclass
class SolverGraph:
    mesh: LogicalMesh
    roots: list[Root]
    edges: dict[tuple[int, int], np.ndarray]
    values: dict[str, ValueLayout]
    anchor_operands: dict[str, list[str]]
    num_micro_batches: int = 1
    """Micro-batches per step (gradient accumulation): costs are per step."""
    recomputed: frozenset[str] = frozenset()
    """Anchor ops whose forward runs again in the backward (remat): their compute is 4/3 of forward + backward."""
    memory_edges: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    """``(u, v) → G[k, l]``: per-device bytes of parameter root ``u`` (stored as its strategy ``k``) gathered into
    the larger layout root ``v``'s strategy ``l`` reads it in — a copy live from the forward to the backward,
    which reads it again. Zero where the use is a slice of what is stored. Counted for the experts of grouped
    matmuls, where the alternative to gathering every expert on every device is to split them (expert
    parallelism); other parameters are priced as used in place, as the stage DP's analytic model assumes (its
    memory figure is what the ILP can fit: ``tests/planner/test_one_memory_model.py``)."""

    @property
    def num_strategies(self) -> int:
        return sum(len(r.strategies) for r in self.roots)

    def summary(self) -> str:
        kinds: defaultdict[str, int] = defaultdict(int)
        for root in self.roots:
            kinds[root.kind] += 1
        return (
            f"solver graph on mesh {self.mesh.shape}: {len(self.roots)} roots {dict(kinds)}, "
            f"{self.num_strategies} strategies, {len(self.edges)} edges"
        )


def build_solver_graph(
    graph: Graph,
    mesh: LogicalMesh,
    *,
    trainable: set[str],
    optimizer_state_copies: float,
    batch_dim_axes: tuple[int, ...] | None = None,
    num_micro_batches: int = 1,
    accumulated_weight_grads: bool = True,
    remat: str = "none",
    in_flight: int = 1,
    experts: str = "auto",
    context: str = "auto",
) -> SolverGraph:
    """The solver graph of ``graph`` on ``mesh``.

    ``trainable``: parameter names that get gradients and optimizer state (``2 + optimizer_state_copies``
    copies in memory). ``batch_dim_axes``: if given, batch inputs must split dim 0 over exactly these axes
    (data-parallel style plans). ``num_micro_batches``: ``graph`` is one micro-batch's step and a training step
    accumulates the gradients of that many (see ``strategies.einsum_strategies``): every cost counts that many
    times a step except the reduction of a weight's gradient, once (``accumulated_weight_grads``; ``False``: it too
    is reduced in every micro-batch, as ZeRO-3 does). ``remat``: activation checkpointing
    (:func:`torchpar.planner.remat.remat_memory`): an op output it does not keep costs no memory (except in the
    largest layer, recomputed once at a time), and a recomputed matmul costs one more forward (a third of its
    forward + backward compute). ``in_flight``: micro-batches whose activations a pipeline stage holds at once (its
    schedule's, as the stage DP counts them): the kept activations and the stage's inputs count that many times,
    the recomputed layer once. ``experts``: which layouts a grouped matmul may take (:func:`_expert_choice`;
    ``"split"``: its expert-parallel strategies, :func:`.strategies.expert_strategies`). ``context``: whether an
    attention may split its sequence (``ShardParallel.context``: ``"auto"``, ``"off"``, or one variant,
    ``"allgather"``/``"ring"``, which then is its only choice where it applies;
    :func:`.strategies.context_strategies`).
    """
    builder = _Builder(
        graph,
        mesh,
        trainable,
        optimizer_state_copies,
        batch_dim_axes,
        num_micro_batches,
        accumulated_weight_grads,
        remat,
        in_flight,
        experts,
        context,
    )
    return builder.build()


class PlannerOpError(RuntimeError):
    """The planner failed on one op of the graph (a defect, not the user's): names the op, its shapes and line."""


_INTERNAL_ERRORS = (TypeError, KeyError, IndexError, AttributeError, AssertionError, ZeroDivisionError)
"""What a planner defect raises, as opposed to the ``ValueError`` s that tell the user what does not fit."""


class _Builder:
    def __init__(
        self,
        graph: Graph,
        mesh: LogicalMesh,
        trainable: set[str],
        state_copies: float,
        batch_dim_axes: tuple[int, ...] | None,
        num_micro_batches: int = 1,
        accumulated_weight_grads: bool = True,
        remat: str = "none",
        in_flight: int = 1,
        experts: str = "auto",
        context: str = "auto",
    ):
        self.graph = graph
        self.experts = experts
        self.context = context
        self.mesh = mesh
        self.trainable = trainable
        self.state_copies = state_copies
        self.batch_dim_axes = batch_dim_axes
        self.metas = graph.metas()
        self.roots: list[Root] = []
        self.edges: dict[tuple[int, int], np.ndarray] = {}
        self.memory_edges: dict[tuple[int, int], np.ndarray] = {}
        self.values: dict[str, ValueLayout] = {}
        self.anchor_operands: dict[str, list[str]] = {}
        self.needs_grad = self._needs_grad()
        self.num_micro_batches = num_micro_batches
        self.remat = remat_memory(graph, remat)
        self.in_flight = in_flight
        # values whose gradients are reduced once per step; with none, every value counts as batch-dependent
        self.batch_dependent = self._batch_dependent() if accumulated_weight_grads else None
        self._paths: dict[int, tuple[str, str]] = {}  # root → (module path, what it is), for share classes

    def _needs_grad(self) -> set[str]:
        grad = {i.name for i in self.graph.inputs if i.kind == "param" and i.target in self.trainable}
        for node in self.graph.nodes:
            if any(r in grad for r in node.refs()):
                grad.add(node.name)
        return grad

    def _batch_dependent(self) -> set[str]:
        """Values computed from a batch input (the others — weights and what is derived from them alone — have
        gradients that accumulate over micro-batches)."""
        dependent = {i.name for i in self.graph.inputs if i.kind == "input"}
        for node in self.graph.nodes:
            if any(r in dependent for r in node.refs()):
                dependent.add(node.name)
        return dependent

    def _copies(self, name: str, working_set: bool = True) -> int:
        """Copies of node ``name``'s output in the step's peak memory: one per micro-batch in flight if it is kept
        for the backward, one if only the recomputed layer holds it, none if it is not materialized; the largest
        materialized output adds the backward's working set (:data:`~torchpar.planner.remat.BACKWARD_WORKING_COPIES`)
        unless ``working_set`` is false."""
        working = BACKWARD_WORKING_COPIES if working_set and name in self.remat.working else 0
        if name in self.remat.kept:
            return self.in_flight + working
        return (1 if name in self.remat.peak_layer else 0) + working

    def _weights(self, refs: list[str]) -> list[bool]:
        """Which of ``refs`` are weights, whose gradients accumulate over micro-batches and are reduced once."""
        return [self.batch_dependent is not None and r not in self.batch_dependent for r in refs]

    def build(self) -> SolverGraph:
        for inp in self.graph.inputs:
            self._add_input(inp)
        for node in self.graph.nodes:
            if node.target in ASSERTS or node.out is None:
                continue
            try:
                self._add_node(node)
            except _INTERNAL_ERRORS as error:  # a planner defect on this op: say which op, shapes and line
                raise PlannerOpError(
                    f"torchpar's planner failed on {node.target} ({node.describe_inputs(self.metas)} → {node.out}) "
                    f"{'at ' + node.source if node.source else '(its source line is unknown)'}: "
                    f"{type(error).__name__}: {error}. This is a torchpar defect, please report it with this "
                    "message; meanwhile a hand method (DataParallel, Zero2Parallel) or rewriting that line with "
                    "other ops may avoid it."
                ) from error
        for out in self.graph.outputs:
            if out.kind == "buffer" and out.value is not None and out.value.name in self.values:
                meta = cast(TensorMeta, self.metas[out.value.name])  # a buffer's new value
                replicated = (None,) * len(meta.shape)
                self._require(out.value.name, lambda k, spec=replicated: spec, meta, None)
        self._assign_share_keys()
        return SolverGraph(
            self.mesh,
            self.roots,
            self.edges,
            self.values,
            self.anchor_operands,
            self.num_micro_batches,
            self.remat.recomputed,
            self.memory_edges,
        )

    def _assign_share_keys(self) -> None:
        """Roots in identical repeated blocks (``h.0``, ``h.1``, … with the same ops, at least two anchors
        each) get one share key per position, so the ILP picks one layout for all of them."""
        blocks: dict[str, dict[str, list[tuple[int, str]]]] = defaultdict(lambda: defaultdict(list))
        for index, (path, what) in sorted(self._paths.items()):
            match = re.match(r"^(.*?\.\d+)(\..*)?$", path)
            if not match:
                continue
            instance = match.group(1)
            pattern = re.sub(r"\.\d+$", ".#", instance)
            blocks[pattern][instance].append((index, f"{match.group(2) or ''}|{what}"))
        for pattern, instances in blocks.items():
            signatures = {tuple(w for _, w in members) for members in instances.values()}
            anchors = sum(self.roots[i].kind == "anchor" for i, _ in next(iter(instances.values())))
            if len(instances) < 2 or len(signatures) != 1 or anchors < 2:
                continue
            for members in instances.values():
                for position, (index, what) in enumerate(members):
                    self.roots[index].share_key = f"{pattern}|{position}|{what}"

    # --- roots ----------------------------------------------------------------------------------

    def _new_root(self, name: str, kind: str, label: str, strategies: list[Strategy], share_key: str | None) -> int:
        cost = np.array([s.compute_s + s.comm_s for s in strategies], dtype=np.float64)
        memory = np.array([s.memory_bytes for s in strategies], dtype=np.float64)
        transient = np.array([s.transient_bytes for s in strategies], dtype=np.float64)
        self.roots.append(
            Root(
                name, kind, label, strategies, cost, memory, share_key, transient=transient if transient.any() else None
            )
        )
        index = len(self.roots) - 1
        self.values[name] = ValueLayout(index, [s.out_spec for s in strategies])
        return index

    def _add_input(self, inp: Input) -> None:
        meta = inp.meta
        if inp.kind == "param":
            tied = next((i.name for i in self.graph.inputs if i.kind == "param" and i.target == inp.target), inp.name)
            if tied != inp.name:  # a tied parameter (e.g. GPT-2's wte/lm_head) is one tensor with one layout
                self.values[inp.name] = self.values[tied]
                return
            copies = 2.0 + self.state_copies if inp.target in self.trainable else 1.0
            strategies = layout_root_strategies(meta.shape, meta.nbytes, self.mesh, state_copies=copies)
            self._new_root(inp.name, "param", inp.target, strategies, None)
            self._paths[len(self.roots) - 1] = (
                inp.target.rsplit(".", 1)[0],
                f"param {inp.target.rsplit('.', 1)[-1]}|{meta}",
            )
        elif inp.kind == "activation":  # from the previous pipeline stage: any layout, priced by its consumers
            strategies = layout_root_strategies(meta.shape, meta.nbytes, self.mesh, state_copies=float(self.in_flight))
            self._new_root(inp.name, "activation", f"activation {inp.target}", strategies, None)
        elif inp.kind == "input":
            strategies = layout_root_strategies(meta.shape, meta.nbytes, self.mesh, state_copies=float(self.in_flight))
            if self.batch_dim_axes is not None and meta.shape:
                wanted = self.batch_dim_axes or None
                strategies = [s for s in strategies if s.out_spec[0] == wanted and not any(s.out_spec[1:])]
                if not strategies:
                    micro = self.num_micro_batches
                    shards = math.prod(self.mesh.shape[a] for a in self.batch_dim_axes)
                    per_step = (
                        f" (one of num_micro_batches={micro} micro-batches: the batch's {meta.shape[0] * micro} "
                        f"rows must be a multiple of {micro} micro-batches × {shards} devices = {micro * shards};"
                        f" use fewer micro-batches or a batch size that divides)"
                        if micro > 1
                        else ""
                    )
                    rows = (
                        ""
                        if micro > 1
                        else f" ({meta.shape[0]} rows over {shards} devices: give an example "
                        f"batch of a multiple of {shards} rows, or use fewer devices, "
                        f"e.g. the method's mesh_shape as in torchpar.DataParallel(mesh_shape=(1, "
                        f"{math.gcd(meta.shape[0], shards)})); "
                        "later batches may be uneven)"
                    )
                    raise ValueError(
                        f"batch input {inp.target} of shape {list(meta.shape)} cannot be split over mesh "
                        f"axes {self.batch_dim_axes} of {self.mesh.shape}: the batch size must divide "
                        f"evenly{per_step}{rows}"
                    )
            self._new_root(inp.name, "input", f"input {inp.target}", strategies, None)
        else:  # buffers and constants stay replicated
            spec = (None,) * len(meta.shape)
            self._new_root(
                inp.name, inp.kind, inp.target, [Strategy("replicated", spec, memory_bytes=meta.nbytes)], None
            )

    # --- nodes ----------------------------------------------------------------------------------

    def _add_node(self, node: Node) -> None:
        refs = list(node.refs())
        operand_metas = [self.metas.get(r) for r in refs]
        anchor = anchor_of(node, operand_metas)
        if anchor is not None:
            self._add_anchor(node, refs, cast(list[TensorMeta], operand_metas), *anchor)  # all tensors (anchor_of)
            return
        tracked = [i for i, r in enumerate(refs) if r in self.values]
        if not tracked:
            self._add_constant(node)
            return
        main = max(tracked, key=lambda i: (_numel(operand_metas[i]), -i))
        self._add_follower(node, refs, operand_metas, main)

    def _add_constant(self, node: Node) -> None:
        out = node.out
        assert out is not None  # build() skips ops with no output
        if isinstance(out, TensorMeta):
            spec: Spec = (None,) * len(out.shape)
        else:
            spec = Multi((None,) * len(m.shape) if m is not None else None for m in out)
        self._new_root(node.name, "constant", node.target, [Strategy("replicated", spec)], None)

    def _add_anchor(
        self, node: Node, refs: list[str], metas: list[TensorMeta], einsum: Einsum | None, form: str | None = None
    ) -> None:
        """An anchor's root: its einsum strategies (a put with no einsum view: run whole), the expert, attention or
        row-exchange (``form``, :func:`.exchange_strategies.row_exchange_form`) ones its op adds."""
        out = cast(TensorMeta, node.out)  # one tensor, as anchor_of requires
        grads = [r in self.needs_grad for r in refs]
        if einsum is not None:
            strategies = einsum_strategies(
                einsum,
                [m.shape for m in metas],
                out.shape,
                node.flops,
                out.nbytes,
                [m.nbytes for m in metas],
                grads,
                self.mesh,
                weight_operands=self._weights(refs),
                num_micro_batches=self.num_micro_batches,
                scatter_rows=node.target in ROW_SCATTERED and len(out.shape) == 2,
            )
        else:
            strategies = [replicated_put([m.shape for m in metas], out.nbytes)]
        if form is not None:
            moved = metas[0] if form == "gather" else metas[2]
            strategies = strategies + exchange_strategies(
                form,
                [m.shape for m in metas],
                DTYPE_BYTES.get(moved.dtype, 4),
                grads,
                self.mesh,
                num_micro_batches=self.num_micro_batches,
            )
        if node.target in GROUPED_MATMULS:
            split = expert_strategies(
                [m.shape for m in metas],
                node.flops,
                DTYPE_BYTES.get(metas[0].dtype, 4),
                grads,
                self.mesh,
                weight_operands=self._weights(refs),
                num_micro_batches=self.num_micro_batches,
            )
            strategies = _expert_choice(self.experts, strategies, split)
        if node.target == ATTENTION:
            strategies = self._attention_strategies(node, metas, strategies)
        index = self._new_root(node.name, "anchor", f"{node.target} {node.module_path}".strip(), strategies, None)
        root = self.roots[index]
        root.memory *= self._copies(node.name)
        if node.name in self.remat.recomputed:
            root.cost += np.array([s.compute_s for s in strategies], dtype=np.float64) / 3.0
        if node.module_path:
            self._paths[index] = (node.module_path, f"{node.target}|{node.out}")
        self.anchor_operands[node.name] = refs
        for position, ref in enumerate(refs):
            if ref not in self.values:
                continue
            self._require(
                ref,
                lambda k, p=position: strategies[k].in_specs[p],
                metas[position],
                index,
                grad=ref in self.needs_grad,
                count_gathered=node.target in GROUPED_MATMULS,
            )

    def _attention_strategies(self, node: Node, metas: list[TensorMeta], einsum: list[Strategy]) -> list[Strategy]:
        """An attention's strategies: the einsum ones (batch, heads), charged the ``L × S`` probabilities their
        composition keeps for the backward (not a 16-bit one that may take cuDNN's flash kernel) and, when causal,
        half the FLOPs; and (under ``context``) those splitting its sequence."""
        itemsize = DTYPE_BYTES.get(metas[0].dtype, 4)
        form = attention_form(node)
        scores = attention_probabilities_bytes(node, metas)
        # causal: priced as a flash kernel computes it (cuDNN's on a GPU), the masked half of the blocks skipped
        share = 0.5 if form else 1.0
        whole = [
            dataclasses.replace(
                s,
                memory_bytes=s.memory_bytes + scores / _shards(s.out_spec[:2], self.mesh),
                compute_s=s.compute_s * share,
            )
            for s in einsum
        ]
        if self.context == "off" or form is None or len(metas) != 3 or any(len(m.shape) != 4 for m in metas):
            return whole
        variants = ("allgather", "ring") if self.context == "auto" else (self.context,)
        split = context_strategies(
            [m.shape for m in metas],
            node.flops,
            itemsize,
            self.mesh,
            causal=form,
            variants=variants,
            num_micro_batches=self.num_micro_batches,
        )
        if self.context != "auto" and split:
            return split
        return whole + split

    def _add_follower(self, node: Node, refs: list[str], metas: list[OutMeta], main: int) -> None:
        layout = self.values[refs[main]]
        root = self.roots[layout.root]
        grads = [r in self.needs_grad for r in refs]
        weights = self._weights(refs)
        cache: dict[str, Follow] = {}
        results = []
        for spec in layout.specs:
            cache_key = repr(spec)
            if cache_key not in cache:
                cache[cache_key] = follow(node, metas, main, spec, self.mesh, grads, weights)
            results.append(cache[cache_key])
        copies = self._copies(node.name)
        gathered = self._gathered_view_bytes(node, refs[main], main, metas[main], layout.specs, results)
        for k, result in enumerate(results):
            root.cost[k] += self.num_micro_batches * result.comm_s + result.weight_grad_comm_s
            root.memory[k] += copies * _local_bytes(node.out, result.out, self.mesh) + gathered[k]
        root.followers.append(node.name)
        self.values[node.name] = ValueLayout(layout.root, [r.out for r in results])
        for position, ref in enumerate(refs):
            if ref not in self.values or metas[position] is None or isinstance(metas[position], tuple):
                continue
            if all(r.required[position] is None for r in results):
                continue
            self._require(
                ref,
                lambda k, p=position: results[k].required[p],
                cast(TensorMeta, metas[position]),  # neither None nor a tuple: a tensor
                layout.root,
                grad=ref in self.needs_grad,
            )

    def _gathered_view_bytes(
        self, node: Node, ref: str, main: int, meta: OutMeta, specs: list[OutSpec], results: list[Follow]
    ) -> list[float]:
        """Per strategy: the bytes a slice or split of ``ref`` (``op_families.SLICES``) holds when it needs ``ref``
        gathered into a larger layout. Its result aliases the gathered copy (XLA fuses the slice into its
        readers), so the copy lives as long as ``ref`` does: ``ref``'s kept copies × the gathered local bytes (HF
        Mixtral's ``gate, up = gate_up.chunk(2)`` of a column-split grouped matmul: the whole ``gate_up``). ``ref`` is
        the view's operand number ``main``."""
        none = [0.0] * len(results)
        if node.target not in SLICES or not isinstance(meta, TensorMeta):
            return none
        kept = self._copies(ref, working_set=False)
        if not kept:
            return none
        return [
            kept
            * _gathered_bytes(meta, spec, result.required[main] if main < len(result.required) else None, self.mesh)
            for spec, result in zip(specs, results)
        ]

    def _require(
        self,
        ref: str,
        required_of: Callable[..., Spec | None],
        meta: TensorMeta,
        consumer_root: int | None,
        grad: bool = False,
        count_gathered: bool = False,
    ) -> None:
        """Charge resharding value ``ref`` into ``required_of(k)`` for each strategy ``k`` of the consumer root
        (``None``: a fixed requirement, charged to the value's own root). ``count_gathered``: a parameter gathered
        into a larger layout for this use also holds memory (``memory_edges``)."""
        layout = self.values[ref]
        nbytes = float(meta.nbytes)
        source = layout.root
        if consumer_root is None or consumer_root == source:
            root = self.roots[source]
            for k, spec in enumerate(layout.specs):
                wanted = required_of(k)
                if wanted is not None and spec is not None:
                    root.cost[k] += self._reshard(nbytes, spec, wanted, grad)
            return
        rows = len(self.roots[source].strategies)
        cols = len(self.roots[consumer_root].strategies)
        matrix = np.zeros((rows, cols))
        is_param = count_gathered and self.roots[source].kind == "param"
        gathered = np.zeros((rows, cols)) if is_param else None
        wanted_specs = [required_of(k) for k in range(cols)]
        cache: dict[tuple[str, str], float] = {}
        for k, spec in enumerate(layout.specs):
            if spec is None:
                continue
            for column, wanted in enumerate(wanted_specs):
                if wanted is None:
                    continue
                key = (repr(spec), repr(wanted))
                if key not in cache:
                    cache[key] = self._reshard(nbytes, spec, wanted, grad)
                matrix[k, column] = cache[key]
                if gathered is not None:  # is_param
                    gathered[k, column] = _gathered_bytes(meta, spec, wanted, self.mesh)
        self._add_pair(self.edges, source, consumer_root, matrix)
        if gathered is not None:
            self._add_pair(self.memory_edges, source, consumer_root, gathered)

    @staticmethod
    def _add_pair(edges: dict[tuple[int, int], np.ndarray], source: int, consumer: int, matrix: np.ndarray) -> None:
        """Add ``matrix`` (source strategies × consumer strategies) to the edge of the two roots, stored with the
        lower root index first."""
        if not matrix.any():
            return
        pair = (source, consumer) if source < consumer else (consumer, source)
        if pair != (source, consumer):
            matrix = matrix.T
        edges[pair] = edges.get(pair, 0) + matrix

    def _reshard(self, nbytes: float, src: Spec, dst: Spec, grad: bool) -> float:
        """Seconds a step spends resharding a value (and its gradient) from ``src`` to ``dst``: once per
        micro-batch."""
        if len(src) != len(dst):
            return 0.0
        cost = self.mesh.resharding(nbytes, src, dst)
        if grad:
            cost += self.mesh.resharding(nbytes, dst, src)
        return self.num_micro_batches * cost


def attention_probabilities_bytes(node: Node, operand_metas: Sequence[OutMeta]) -> float:
    """Bytes of ``L × S`` probabilities an attention node keeps for its backward when its sequence is whole
    (:func:`.strategies.attention_scores_bytes`); 0 for other nodes, and for a 16-bit attention with no mask or
    dropout, which takes cuDNN's flash kernel on a GPU (it keeps only the rows' log-sum-exp)."""
    if (
        node.target != ATTENTION
        or len(operand_metas) < 2
        or not all(isinstance(m, TensorMeta) for m in operand_metas[:2])
    ):
        return 0.0
    query, key = cast(TensorMeta, operand_metas[0]), cast(TensorMeta, operand_metas[1])  # tensors, as just checked
    itemsize = DTYPE_BYTES.get(query.dtype, 4)
    if itemsize == 2 and attention_form(node) is not None:
        return 0.0
    return float(attention_scores_bytes(query.shape, key.shape, itemsize))


def attention_form(node: Node) -> bool | None:
    """Whether an attention node is causal, or ``None`` when its sequence cannot be split (a mask operand or
    dropout: ``jaxbackend.ops.context_attention`` takes neither)."""
    values = dict(zip(_ATTENTION_ARGS, node.args))
    values.update({k: v for k, v in node.kwargs.items() if k in _ATTENTION_ARGS})
    if values.get("attn_mask") is not None or (values.get("dropout_p") or 0.0) > 0.0:
        return None
    return bool(values.get("is_causal", False))


def _shards(spec: Spec, mesh: LogicalMesh) -> int:
    return math.prod(mesh.shape[a] for entry in spec if entry for a in entry)


def _expert_choice(experts: str, einsum: list[Strategy], split: list[Strategy]) -> list[Strategy]:
    """A grouped matmul's strategies under ``experts`` (``ShardParallel.experts``): all of them for ``"auto"``, else
    those of one kind — expert splits (``"split"``), hidden-dim splits only (``"tensor"``: labels ``k``/``n`` of
    :func:`.strategies.anchor_einsum`'s ``sk, ekn, e → sn``), the replicated one — or all if it has none."""
    if experts == "split":
        kept = split
    elif experts == "tensor":
        kept = [
            s
            for s in einsum
            if s.name != "replicated" and all(part.split("@")[0] in ("k", "n") for part in s.name.split(","))
        ]
    elif experts == "replicated":
        kept = [s for s in einsum if s.name == "replicated"]
    else:
        kept = []
    return kept or einsum + split


def _numel(meta: OutMeta) -> int:
    if isinstance(meta, TensorMeta):
        return meta.numel
    if isinstance(meta, tuple):
        return max((m.numel for m in meta if m is not None), default=0)
    return 0


def _gathered_bytes(meta: TensorMeta, spec: Spec | None, wanted: Spec | None, mesh: LogicalMesh) -> float:
    """Per-device bytes of the copy made when a value laid out as ``spec`` is read as ``wanted``, if that layout is
    larger (a gather); 0 when it is not, or when either layout is unknown."""
    if wanted is None or spec is None or len(wanted) != len(spec):
        return 0.0
    used = _local_bytes(meta, wanted, mesh)
    return used if used > _local_bytes(meta, spec, mesh) else 0.0


def _local_bytes(out: OutMeta, spec: OutSpec, mesh: LogicalMesh) -> float:
    """Per-device bytes of an op output ``out`` (a ``TensorMeta``, or a tuple of them for a multi-output op)
    laid out as ``spec`` (a ``Spec``, or a :class:`Multi` of one per output): each tensor's bytes over the
    number of pieces its own spec cuts it into; an output without a spec counts whole."""
    if isinstance(out, tuple):
        specs = spec if isinstance(spec, Multi) and len(spec) == len(out) else (None,) * len(out)
        return sum(_local_bytes(m, s, mesh) for m, s in zip(out, specs) if m is not None)
    nbytes = float(getattr(out, "nbytes", 0))
    if not isinstance(spec, tuple) or isinstance(spec, Multi) or not spec:
        return nbytes
    pieces = 1
    for entry in spec:
        for axis in entry or ():
            pieces *= mesh.shape[axis]
    return nbytes / pieces

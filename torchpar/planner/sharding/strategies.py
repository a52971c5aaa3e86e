"""Sharding strategies of the ops that get their own ILP variable.

Three kinds of values choose a layout in the ILP (they are the *roots* of the solver graph):
parameters, batch inputs, and *anchor* ops — matmuls, convolution, embedding and attention, described
as einsums over labelled dims. Every other op *follows* an operand (see :mod:`.solver_graph`).

An einsum strategy assigns each mesh axis to at most one label (an axis may also stay unused; one
label may take both axes). Its costs, for an op ``O = f(A, B)``:

- compute: ``3·FLOPs / (∏ assigned axis sizes) / device_flops`` (forward + backward);
- forward all-reduce of the (local) output over each axis assigned to a contracted label;
- backward all-reduce of ``∂A`` over each axis whose label is not in ``A`` (it is contracted when
  computing ``∂A = g(∂O, B)``), if ``A`` needs a gradient — e.g. the data-parallel weight-gradient
  sync (batch label absent from the weight) or Megatron's input-gradient sync after a column split.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from torchpar.ir.costs import expert_slot_rows
from torchpar.ir.graph import one_row_index
from torchpar.ir.layout import Spec, describe, is_valid, make_spec
from torchpar.ir.op_families import GROUPED_MATMULS
from torchpar.planner.sharding.cost_model import LogicalMesh


@dataclass(frozen=True)
class Strategy:
    """One layout choice of a root.

    ``out_spec``: the root's output layout (for tuple outputs, of the first). ``in_specs``: the layout
    each tensor operand must have (in ``Node.refs()`` order; ``None`` = no requirement).
    ``compute_s``/``comm_s``: seconds this choice costs by itself; ``memory_bytes``: per-device bytes
    it keeps alive at the training step's peak; ``transient_bytes``: per-device bytes it holds only while it runs
    (buffers freed within the op, forward or backward) — the step's peak adds the largest over the ops, not their
    sum (:mod:`.ilp`). ``lowering``: keyword arguments the op's lowering takes to run this choice
    (``(("context", "ring"),)``: how an attention with its sequence split brings keys to queries).
    """

    name: str
    out_spec: Spec
    in_specs: tuple[Spec | None, ...] = ()
    compute_s: float = 0.0
    comm_s: float = 0.0
    memory_bytes: float = 0.0
    transient_bytes: float = 0.0
    collectives: tuple[str, ...] = field(default=(), compare=False)
    lowering: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Einsum:
    """An op as an einsum: one label string per tensor operand, and the output's labels.

    Labels absent from ``out`` are contracted. ``free`` labels are those a strategy may split (spatial
    dims of a convolution are not splittable, for instance).
    """

    operands: tuple[str, ...]
    out: str
    splittable: str

    @property
    def contracted(self) -> str:
        return "".join(sorted({label for ops in self.operands for label in ops} - set(self.out)))


def layout_strategies(shape: Sequence[int], mesh: LogicalMesh) -> list[Spec]:
    """Every valid layout of a tensor of ``shape``: replicated, one dim on one or both axes, or two
    dims on one axis each. Axes of size 1 are never used (they add nothing)."""
    rank = len(shape)
    live_axes = [a for a in (0, 1) if mesh.shape[a] > 1]
    specs: list[Spec] = [make_spec(rank, {})]
    for dim in range(rank):
        for axes in _axis_groups(live_axes):
            specs.append(make_spec(rank, {dim: axes}))
    if len(live_axes) == 2:
        for d0, d1 in itertools.permutations(range(rank), 2):
            specs.append(make_spec(rank, {d0: (0,), d1: (1,)}))
    return [s for s in dict.fromkeys(specs) if is_valid(s, shape, mesh.shape)]


def _axis_groups(live_axes: list[int]) -> list[tuple[int, ...]]:
    groups: list[tuple[int, ...]] = [(a,) for a in live_axes]
    if len(live_axes) == 2:
        groups.append((0, 1))
    return groups


def einsum_strategies(
    einsum: Einsum,
    operand_shapes: Sequence[Sequence[int]],
    out_shape: Sequence[int],
    flops: float,
    out_bytes: float,
    operand_bytes: Sequence[float],
    needs_grad: Sequence[bool],
    mesh: LogicalMesh,
    *,
    weight_operands: Sequence[bool] = (),
    num_micro_batches: int = 1,
    scatter_rows: bool = False,
) -> list[Strategy]:
    """Every assignment of mesh axes to splittable labels that divides the dims evenly.

    Gradient accumulation over ``num_micro_batches`` M: the op runs M times a step, so its compute and
    collectives count M times, except the backward all-reduce of a *weight* operand (``weight_operands``: one
    that does not depend on the batch): that gradient is summed over the micro-batches on each device and
    reduced once per step.

    ``scatter_rows`` (a 2-D matmul ``mk, kn → mn``): each assignment that splits the contracted ``k`` also comes
    with its output's rows ``m`` split over ``k``'s axes (named ``…>m@A``): Megatron's sequence parallelism, the
    partial products reduce-scattered by rows instead of all-reduced — ``RS(out)`` forward and the output
    gradient's all-gather ``AG(out)`` backward in place of ``AR(out)``, and ``1/|A|`` of the output kept."""
    sizes = _label_sizes(einsum, operand_shapes, out_shape)
    live_axes = [a for a in (0, 1) if mesh.shape[a] > 1]
    labels = [label for label in dict.fromkeys(einsum.splittable) if label in sizes]
    assignments: list[dict[str, tuple[int, ...]]] = [{}]
    for axes in _axis_groups(live_axes):
        for label in labels:
            assignments.append({label: axes})
    if len(live_axes) == 2:
        for l0, l1 in itertools.permutations(labels, 2):
            assignments.append({l0: (0,), l1: (1,)})
    strategies = []
    for assignment in assignments:
        if any(sizes[label] % math.prod(mesh.shape[a] for a in axes) for label, axes in assignment.items()):
            continue
        strategy = _einsum_strategy(
            einsum,
            assignment,
            operand_shapes,
            out_shape,
            flops,
            out_bytes,
            operand_bytes,
            needs_grad,
            mesh,
            weight_operands,
            num_micro_batches,
        )
        strategies.append(strategy)
        if scatter_rows and "k" in assignment:
            scattered = _rows_scattered(strategy, assignment, sizes, out_bytes, mesh, num_micro_batches)
            strategies += [scattered] if scattered is not None else []
    return strategies


def _rows_scattered(
    strategy: Strategy,
    assignment: dict[str, tuple[int, ...]],
    sizes: dict[str, int],
    out_bytes: float,
    mesh: LogicalMesh,
    num_micro_batches: int,
) -> Strategy | None:
    """``strategy`` (of ``mk, kn → mn`` with ``k`` split over ``A``) with its output rows scattered over ``A`` too
    (:func:`einsum_strategies`); ``None`` if the rows do not divide."""
    axes = assignment["k"]
    rows_axes = tuple(assignment.get("m", ())) + axes
    if sizes["m"] % math.prod(mesh.shape[a] for a in rows_axes):
        return None
    out_local = out_bytes / math.prod(mesh.shape[a] for label in "mn" for a in assignment.get(label, ()))
    saved = mesh.all_reduce(out_local, axes)
    scatter = mesh.reduce_scatter(out_local, axes) + mesh.all_gather(out_local, axes)
    out_spec = (rows_axes, assignment.get("n"))
    return dataclasses.replace(
        strategy,
        name=f"{strategy.name}>m@{''.join(map(str, rows_axes))}",
        out_spec=out_spec,
        comm_s=strategy.comm_s + num_micro_batches * (scatter - saved),
        memory_bytes=strategy.memory_bytes / math.prod(mesh.shape[a] for a in axes),
        collectives=tuple(
            c.replace("fwd all-reduce", "fwd reduce-scatter (bwd all-gather)") for c in strategy.collectives
        ),
        lowering=(("scatter", "rows"),),
    )


def _label_sizes(einsum: Einsum, operand_shapes: Sequence[Sequence[int]], out_shape: Sequence[int]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for labels, shape in [*zip(einsum.operands, operand_shapes), (einsum.out, out_shape)]:
        for label, size in zip(labels, shape):
            sizes[label] = max(sizes.get(label, 1), int(size))
    return sizes


def _spec_for(labels: str, assignment: dict[str, tuple[int, ...]]) -> Spec:
    return tuple(assignment.get(label) for label in labels)


def _unsplit_broadcast(spec: Spec, shape: Sequence[int]) -> Spec:
    """Size-1 (broadcast) dims are never split."""
    return tuple(None if size == 1 else entry for entry, size in zip(spec, shape))


def _einsum_strategy(
    einsum: Einsum,
    assignment: dict[str, tuple[int, ...]],
    operand_shapes,
    out_shape,
    flops,
    out_bytes,
    operand_bytes,
    needs_grad,
    mesh: LogicalMesh,
    weight_operands: Sequence[bool] = (),
    num_micro_batches: int = 1,
) -> Strategy:
    out_spec = _spec_for(einsum.out, assignment)
    in_specs = tuple(
        _unsplit_broadcast(_spec_for(labels, assignment), shape)
        for labels, shape in zip(einsum.operands, operand_shapes)
    )
    shards = math.prod(mesh.shape[a] for axes in assignment.values() for a in axes)
    comm = 0.0
    collectives = []
    out_local = out_bytes / math.prod(mesh.shape[a] for label in einsum.out for a in assignment.get(label, ()))
    for label, axes in assignment.items():
        if label not in einsum.out:
            comm += num_micro_batches * mesh.all_reduce(out_local, axes)
            collectives.append(f"fwd all-reduce {out_local:.0f}B over {axes}")
    for position, (labels, nbytes, grad) in enumerate(zip(einsum.operands, operand_bytes, needs_grad)):
        if not grad:
            continue
        local = nbytes / math.prod(mesh.shape[a] for label in labels for a in assignment.get(label, ()))
        weight = position < len(weight_operands) and weight_operands[position]
        times = 1 if weight else num_micro_batches  # a weight gradient is accumulated, then reduced once
        for label, axes in assignment.items():
            if label not in labels:
                comm += times * mesh.all_reduce(local, axes)
                collectives.append(f"bwd all-reduce {local:.0f}B over {axes}")
    name = ",".join(f"{label}@{''.join(map(str, axes))}" for label, axes in assignment.items()) or "replicated"
    return Strategy(
        name=name,
        out_spec=out_spec,
        in_specs=in_specs,
        compute_s=num_micro_batches * mesh.compute(3.0 * flops, shards),
        comm_s=comm,
        memory_bytes=out_local,
        collectives=tuple(collectives),
    )


def layout_root_strategies(
    shape: Sequence[int], nbytes: float, mesh: LogicalMesh, *, state_copies: float
) -> list[Strategy]:
    """Strategies of a parameter or batch input: each valid layout, holding ``state_copies`` × its bytes
    per device (a parameter: itself, its gradient and the optimizer state; an input: 1)."""
    strategies = []
    for spec in layout_strategies(shape, mesh):
        local = nbytes / math.prod(mesh.shape[a] for entry in spec if entry for a in entry)
        strategies.append(Strategy(name=describe(spec), out_spec=spec, memory_bytes=state_copies * local))
    return strategies


# --- einsum descriptions of the anchor ops --------------------------------------------------------------

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def anchor_einsum(target: str, args: tuple, operand_ranks: Sequence[int], out_rank: int) -> Einsum | None:
    """The einsum view of an anchor op, or ``None`` if ``target`` is not one (its operands are its tensor
    operands in ``Node.refs()`` order, whose ranks are ``operand_ranks``)."""
    if target == "aten.mm.default":
        return Einsum(("mk", "kn"), "mn", "mkn")
    if target == "aten.addmm.default":
        bias = "mn"[2 - operand_ranks[0] :] if operand_ranks[0] <= 2 else "mn"
        return Einsum((bias, "mk", "kn"), "mn", "mkn")
    if target == "aten.bmm.default":
        return Einsum(("bmk", "bkn"), "bmn", "bmkn")
    if target == "aten.baddbmm.default":
        bias = "bmn"[3 - operand_ranks[0] :]
        return Einsum((bias, "bmk", "bkn"), "bmn", "bmkn")
    if target == "aten.convolution.default":
        spatial = out_rank - 2
        space = "hwd"[:spatial]
        kernel = "uvz"[:spatial]
        groups = args[8] if len(args) > 8 else 1
        splittable = "no" + ("c" if groups == 1 else "")
        operands = ["nc" + space, "oc" + kernel] + (["o"] if len(operand_ranks) > 2 else [])
        if groups != 1:
            splittable = "n"
        return Einsum(tuple(operands), "no" + space, splittable)
    if target == "aten.embedding.default":
        index_labels = _LETTERS[: operand_ranks[1]]
        return Einsum(("VD", index_labels), index_labels + "D", "VD" + index_labels)
    if target == "aten.index.Tensor" and len(operand_ranks) == 2 and one_row_index(args) and operand_ranks[0] >= 1:
        # table[idx]: an embedding lookup of the table's rows (any trailing dims)
        index_labels, rest = _LETTERS[: operand_ranks[1]], "DFGHJ"[: operand_ranks[0] - 1]
        return Einsum(("V" + rest, index_labels), index_labels + rest, "V" + rest + index_labels)
    if target in GROUPED_MATMULS and tuple(operand_ranks[:3]) == (2, 3, 1) and out_rank == 2:
        # rows s, contracted k, experts e, columns n; splitting e (expert parallelism) is not an einsum
        # strategy: :func:`expert_strategies` adds it
        return Einsum(("sk", "ekn", "e"), "sn", "skn")
    if target == "aten.scaled_dot_product_attention.default":
        if operand_ranks[0] != 4:
            return None
        operands = ["bhle", "bhse", "bhsf"]
        if len(operand_ranks) > 3:  # attn_mask broadcasts against [b, h, l, s]
            operands.append("bhls"[4 - operand_ranks[3] :])
        return Einsum(tuple(operands), "bhlf", "bh")
    return None


def expert_strategies(
    operand_shapes: Sequence[Sequence[int]],
    flops: float,
    itemsize: int,
    needs_grad: Sequence[bool],
    mesh: LogicalMesh,
    *,
    weight_operands: Sequence[bool] = (),
    num_micro_batches: int = 1,
) -> list[Strategy]:
    """Expert-parallel strategies of a grouped matmul ``x [S, K] · w [E, K, N]`` (offsets ``[E]``), lowered by
    ``jaxbackend.ops.expert_parallel``: ``w``'s experts split over axes ``A`` (one axis, or both), ``x``'s rows
    over ``R ⊇ A`` (``A``, or ``A`` and the other axis ``b``: data parallelism beside the experts), optionally
    ``N`` over ``b`` when the rows are not (tensor parallelism inside each expert). ``A`` is the major axis of the
    rows' split, so a device's share of the sorted rows is mostly for its own experts. **Priced for a balanced
    router** (the routing is data; the plan cannot know it): per micro-batch, with ``L = S / |R|`` rows per device,
    ``P = |A|`` and ``T = expert_slot_rows(L, P)`` rows per peer's slot on the fast exchange (``2·L/P``):

    - compute ``3·FLOPs / |R| / |cols|``: each device multiplies the ``L`` rows its experts receive (the lowering
      skips the blocks of its buffer past them; a skewed router costs more, and a batch that overflows a slot runs
      the exact exchange, ``T = L``);
    - all-to-all of ``[P·T, K]`` rows and of ``[P·T, N/|cols|]`` results over ``A``, forward and backward;
    - weight gradient all-reduce over the row axes beyond ``A`` (once per step for a weight); with ``N`` split,
      the rows' gradient all-reduced over ``b``;
    - memory: the output's ``L`` rows plus the receive buffers kept for the weight gradient: the fast path's
      ``[L + P·T, K]`` and, when it has one (``T < L``), the exact path's ``[L + P·L, K]`` — the two paths are the
      branches of a ``lax.cond``, whose saved residuals are both branches';
    - transient (``transient_bytes``): the exchange's buffers while it runs — send and receive slots, the rows
      reordered by expert and their results before they return — ``(L + P·T + [L + P·L]) · (K + N/|cols|)`` bytes
      (both paths' rows, as the saved buffers: XLA keeps the two branches' buffers apart). Calibrated on the op
      alone (``[4096, 256] × [8, 256, 1024]`` and three other shapes on 4 devices: XLA's forward temporaries
      0.96–1.2× it); the step's peak adds the largest op's.
    """
    (rows, width), (experts, _, columns) = operand_shapes[0], operand_shapes[1]
    live = [a for a in (0, 1) if mesh.shape[a] > 1]
    choices: list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = []
    for a in live:
        others = [b for b in live if b != a]
        choices.append(((a,), (a,), ()))
        for b in others:  # rows over (a, b), a major: a device's sorted rows are mostly its own experts'
            choices += [((a,), (a, b), ()), ((a,), (a,), (b,))]
    if len(live) == 2:
        choices.append(((0, 1), (0, 1), ()))
    size = lambda axes: math.prod(mesh.shape[x] for x in axes)
    strategies = []
    for expert_axes, row_axes, column_axes in choices:
        peers, chunks, column_shards = size(expert_axes), size(row_axes), size(column_axes)
        if experts % peers or rows % chunks or columns % column_shards:
            continue
        local_rows = rows // chunks
        slot = expert_slot_rows(local_rows, peers)
        sent_in = peers * slot * width * itemsize
        sent_out = peers * slot * columns // column_shards * itemsize
        exchange = mesh.all_to_all(sent_in, expert_axes) + mesh.all_to_all(sent_out, expert_axes)
        comm = 2.0 * num_micro_batches * exchange
        collectives = [f"all-to-all {sent_in:.0f}B + {sent_out:.0f}B over {expert_axes}, forward and backward"]
        data_axes = tuple(a for a in row_axes if a not in expert_axes)
        weight_local = experts // peers * width * columns // column_shards * itemsize
        if data_axes and len(needs_grad) > 1 and needs_grad[1]:
            times = 1 if len(weight_operands) > 1 and weight_operands[1] else num_micro_batches
            comm += times * mesh.all_reduce(weight_local, data_axes)
            collectives.append(f"bwd all-reduce {weight_local:.0f}B over {data_axes}")
        if column_axes and needs_grad and needs_grad[0]:
            comm += num_micro_batches * mesh.all_reduce(local_rows * width * itemsize, column_axes)
            collectives.append(f"bwd all-reduce {local_rows * width * itemsize:.0f}B over {column_axes}")
        name = f"experts@{''.join(map(str, expert_axes))},s@{''.join(map(str, row_axes))}" + (
            f",n@{''.join(map(str, column_axes))}" if column_axes else ""
        )
        out_bytes = local_rows * columns // column_shards * itemsize
        buffer_rows = local_rows + peers * slot
        if slot < local_rows:  # the exact path's buffer is saved too
            buffer_rows += local_rows + peers * local_rows
        buffer_bytes = buffer_rows * width * itemsize
        transient = buffer_rows * (width + columns // column_shards) * itemsize
        strategies.append(
            Strategy(
                name=name,
                out_spec=(row_axes, column_axes or None),
                in_specs=((row_axes, None), (expert_axes, None, column_axes or None), (None,)),
                compute_s=num_micro_batches * mesh.compute(3.0 * flops, chunks * column_shards),
                comm_s=comm,
                memory_bytes=out_bytes + buffer_bytes,
                transient_bytes=transient,
                collectives=tuple(collectives),
            )
        )
    return strategies


def attention_scores_bytes(query_shape: Sequence[int], key_shape: Sequence[int], itemsize: int) -> float:
    """Bytes of the probabilities ``[..., N, L, S]`` an attention computed whole (its composition of matmul, softmax,
    matmul) keeps for its backward: float32, and a copy in the inputs' dtype for ``P·V`` when that is narrower."""
    batch_heads = math.prod(query_shape[:-2])
    return batch_heads * query_shape[-2] * key_shape[-2] * (4 + (itemsize if itemsize < 4 else 0))


def context_strategies(
    operand_shapes: Sequence[Sequence[int]],
    flops: float,
    itemsize: int,
    mesh: LogicalMesh,
    *,
    causal: bool,
    variants: Sequence[str],
    num_micro_batches: int = 1,
) -> list[Strategy]:
    """Strategies of an attention ``q [B, H, L, E], k [B, Hk, S, E], v [B, Hk, S, F]`` with its sequence split
    (context parallelism, ``jaxbackend.ops.context_attention``): ``L`` and ``S`` over mesh axes ``A`` (``P``
    devices; one axis or both), the other axis (if any) free or on the batch or the heads. Per micro-batch, with
    ``o`` devices on the other axis and ``kv`` one device's ``K|V`` bytes:

    - compute ``3·FLOPs·f / (P·o)``, ``f = (2P+1)/(4P)`` when causal (zig-zag chunks: each device computes
      ``2P+1`` of the ``4P²`` chunk-pair blocks, the others are masked whole), else 1. (A causal whole-sequence
      attention is priced at ``f = ½``, as a flash kernel skips masked blocks: see the solver graph.)
    - ``"allgather"``: all-gather of ``K|V`` (``P·kv``) forward, again in the backward, and the reduce-scatter
      of its float32 gradient;
    - ``"ring"``: ``P−1`` steps forward, each exposing ``max(α, transfer(kv) − block compute)``; backward the block
      and its float32 gradient travel (``P−1`` steps against twice the block compute) and the gradient goes home;
    - causal: the zig-zag moves of ``q|k|v`` in and the output back, forward and backward;
    - memory: the output, the rows' log-sum-exp and, causal, the zig-zag copies of ``q|k|v`` and the output kept
      for the backward. No ``L × S`` probabilities (the whole-sequence attention keeps them,
      :func:`attention_scores_bytes`).
    """
    (batch, heads, queries, width), (k_batch, kv_heads, keys, _), (_, _, _, v_width) = operand_shapes[:3]
    if causal and queries != keys:
        return []
    live = [a for a in (0, 1) if mesh.shape[a] > 1]
    size = lambda axes: math.prod(mesh.shape[x] for x in axes)
    choices: list[tuple[tuple[int, ...], str | None, tuple[int, ...]]] = []
    for a in live:
        choices.append(((a,), None, ()))
        for b in (x for x in live if x != a):
            choices += [((a,), "b", (b,)), ((a,), "h", (b,))]
    if len(live) == 2:
        choices.append(((0, 1), None, ()))
    strategies = []
    for seq_axes, other, other_axes in choices:
        p, o = size(seq_axes), size(other_axes)
        if queries % (2 * p if causal else p) or keys % p:
            continue
        if other == "b" and (batch % o or (k_batch > 1 and k_batch % o)):
            continue
        if other == "h" and (heads % o or (kv_heads > 1 and kv_heads % o)):
            continue
        kv_split = o if (other == "b" and k_batch > 1) or (other == "h" and kv_heads > 1) else 1
        q_local = batch * heads * queries * width * itemsize / (p * o)
        out_local = batch * heads * queries * v_width * itemsize / (p * o)
        kv_local = k_batch * kv_heads * keys * (width + v_width) * itemsize / (p * kv_split)
        share = (2 * p + 1) / (4 * p) if causal else 1.0
        forward_s = mesh.compute(flops * share, p * o)
        permute = lambda nbytes, seq_axes=seq_axes: max(mesh.alpha[a] + mesh.beta[a] * nbytes for a in seq_axes)
        grad_kv = kv_local * 4 / itemsize
        zigzag = 2.0 * (permute(q_local + kv_local) + permute(out_local)) if causal else 0.0
        entries = lambda n_dim, kv, other=other, other_axes=other_axes, seq_axes=seq_axes: (
            (other_axes if other == "b" and n_dim > 1 else None),
            (other_axes if other == "h" and (kv_heads > 1 or not kv) else None),
            seq_axes,
            None,
        )
        q_spec = entries(batch, False)
        kv_spec = entries(k_batch, True)
        base = f"seq@{''.join(map(str, seq_axes))}" + (f",{other}@{''.join(map(str, other_axes))}" if other else "")
        for variant in variants:
            if variant == "allgather":
                comm = 2.0 * mesh.all_gather(p * kv_local, seq_axes) + mesh.reduce_scatter(p * grad_kv, seq_axes)
                what = f"all-gather {p * kv_local:.0f}B over {seq_axes} forward and backward, reduce-scatter its grad"
            else:
                step_s = forward_s / p
                comm = (p - 1) * max(permute(kv_local) - step_s, min(mesh.alpha[a] for a in seq_axes))
                comm += (p - 1) * max(
                    permute(kv_local) + permute(grad_kv) - 2 * step_s, min(mesh.alpha[a] for a in seq_axes)
                ) + permute(grad_kv)
                what = f"ring: {p - 1} moves of {kv_local:.0f}B over {seq_axes} forward, K|V and its grad backward"
            collectives = (what,) + ((f"zig-zag moves of q|k|v and the output over {seq_axes}",) if causal else ())
            rows = batch * heads * queries / (p * o)
            memory = out_local + 4 * rows + ((q_local + kv_local + out_local) if causal else 0.0)
            strategies.append(
                Strategy(
                    name=f"{base},{variant}",
                    out_spec=q_spec,
                    in_specs=(q_spec, kv_spec, kv_spec),
                    compute_s=num_micro_batches * 3.0 * forward_s,
                    comm_s=num_micro_batches * (comm + zigzag),
                    memory_bytes=memory,
                    collectives=collectives,
                    lowering=(("context", variant),),
                )
            )
    return strategies

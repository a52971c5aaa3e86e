"""A mixture-of-experts grouped matmul split over mesh devices: by its experts (expert parallelism) or its rows.

The op is ``_grouped_mm(x [S, K], w [E, K, N], offs [E])``: rows ``offs[e-1] … offs[e] − 1`` of ``x`` (sorted by
expert) times ``w[e]``. Under an expert split, ``w``'s expert dim is split over the mesh axes ``A`` (``P`` devices,
each holding ``E_l = E / P`` consecutive experts) and ``x``'s rows are split over the axes ``R ⊇ A`` (``|R|``
contiguous chunks of ``L = S / |R|`` rows of the globally sorted order); ``offs`` is whole on every device, so
every device knows where every row is going. On each device (``c`` = its row chunk, ``i`` = its place on ``A``,
``c(p)`` = the chunk of its peer ``p`` on ``A`` — the same other coordinates):

    M[c, e]   = |[c·L, (c+1)·L) ∩ [offs[e−1], offs[e])|          rows of expert e in chunk c   (from offs alone)
    send[p]   = Σ_{e ∈ experts(p)} M[c, e]                         my rows for peer p (contiguous: x is sorted)
    own rows  = send[i] rows, which stay;   the others travel in slots of T rows per peer:
    x_send    [P, T, K]: slot p = my rows for peer p (p ≠ i), zero-padded     → all_to_all over A →
    buffer    [L + P·T, K] = my own rows, then slot s = peer s's rows for my experts, each part sorted by expert
    y         = grouped matmul of the buffer reordered expert-major (E_l groups), back in buffer order
    y_send    → all_to_all back → slot p = my rows' results from peer p;  y[q] = own or y_back[p(q), q − start_p]

Because ``x`` is sorted, a chunk's rows belong to a contiguous run of experts, and when ``A`` is the major axis of
``R`` a balanced router's rows of chunk ``c`` are (nearly all) for the experts of its own device: what travels is
the spill at the edges of each chunk's range, and the token dispatch itself happened before, in the gather that
sorted ``x``. So slots are small: ``T = ⌈2·L/P⌉`` (:func:`torchpar.ir.costs.expert_slot_rows`) on the fast path;
if any device would send more than ``T`` rows to one peer (a skewed router) the whole mesh takes the exact path,
``T = L`` (a ``lax.cond`` on a ``pmax``: every device takes the same branch, so the collectives in it complete).
Nothing is dropped by default. With a ``capacity`` ``c`` there is only the path with ``T = ⌈c·L/P⌉``, and rows past
a slot (a chunk's last rows for one peer: its highest experts') are **dropped** — their output is zero, as with
GShard's capacity factor — which PyTorch's grouped_mm never does, so it is opt-in.

How the slots travel (:mod:`.exchange_collective`): on GPUs by ``jax.lax.ragged_all_to_all`` — each peer's rows go
straight from where they lie in ``x`` to their place in the receiver's buffer, and only the rows sent move
(``send[p]`` rows, not ``T``), both ways; elsewhere as the dense ``[P, T, K]`` slots above by ``all_to_all``, since
XLA:CPU does not implement ``ragged-all-to-all``. Both fill the same buffers (rows past a slot dropped alike), so
everything around the exchange is shared; the tests run the ragged path on the CPU through an emulation of the
collective written from its documented semantics.

The receiving matmul (:func:`.grouped_matmul.blocked_ragged_dot`) has blocks sized for a balanced ``L / E_l`` rows
per expert and runs only the blocks that hold rows: the work follows the rows received, not the buffer's static
``L + P·T``.

With no expert axes (``w`` whole on every device, ``x``'s rows split) there is no exchange: each device multiplies
its chunk's part of every group, ``M[c, ·]``, by the experts it holds (data parallelism over the rows; GSPMD
would gather the rows to find the groups).

Other mesh axes: ``x``'s rows may also be split over the axis not in ``A`` (data parallelism beside the experts:
each slice along it runs its own exchange; the experts' weight gradients are then partial sums over that axis,
which ``jax.grad`` of the ``shard_map`` reduces), and ``w``'s ``N`` dim may be split over an axis not in ``R``
(tensor parallelism inside every expert: output columns split, no collective in the forward).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TypedDict, TypeVar, Unpack

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jaxbackend.ops import exchange_collective
from jaxbackend.ops.grouped_matmul import block_rows_for, blocked_ragged_dot
from jaxbackend.sharding import AXIS_NAMES, shard_map
from torchpar.ir.costs import expert_slot_rows

E = TypeVar("E")


class DotOptions(TypedDict, total=False):
    """How the grouped matmul multiplies (the keywords :func:`~jaxbackend.ops.grouped_matmul.blocked_ragged_dot`
    takes from the op)."""

    weight_transposed: bool
    precision: jax.lax.PrecisionLike
    preferred_element_type: jax.typing.DTypeLike | None


@dataclasses.dataclass(frozen=True)
class GroupedMatmulSplit:
    """Where a split grouped matmul's operands live (mesh axes are ints, axis ``a`` named ``d{a}``).

    ``expert_axes``: the axes splitting ``w``'s expert dim (``A``; empty: every device holds every expert and
    only the rows are split); ``row_axes``: the axes splitting ``x``'s rows
    (``R``, a superset of ``A``, major first as in the spec); ``column_axes``: axes splitting ``w``'s and the
    output's last dim (disjoint from ``R``); ``mesh_shape``: the logical mesh; ``capacity``: ``None`` (exact)
    or the slot capacity factor (module docstring)."""

    expert_axes: tuple[int, ...]
    row_axes: tuple[int, ...]
    column_axes: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    capacity: float | None = None

    def __post_init__(self):
        if not self.expert_axes and not self.row_axes:
            raise ValueError("a split grouped matmul splits its rows, its experts or both")
        if not set(self.expert_axes) <= set(self.row_axes):
            raise ValueError(
                f"an expert split needs x's rows split over its expert axes {self.expert_axes}; "
                f"they are split over {self.row_axes}"
            )
        if set(self.column_axes) & set(self.row_axes):
            raise ValueError(f"columns and rows split over one axis: {self.column_axes}, {self.row_axes}")
        if self.expert_axes and not _contiguous(self.expert_axes, self.row_axes):
            raise ValueError(f"expert axes {self.expert_axes} are not a contiguous run of row axes {self.row_axes}")

    @property
    def expert_devices(self) -> int:
        return math.prod(self.mesh_shape[a] for a in self.expert_axes)

    @property
    def chunk_stride(self) -> int:
        """How far apart (in row chunks) two neighbours along the expert axes are."""
        last = self.row_axes.index(self.expert_axes[-1])
        return math.prod(self.mesh_shape[a] for a in self.row_axes[last + 1 :])

    def slot_rows(self, local_rows: int) -> int:
        """Rows of one peer's slot on the fast path: ``⌈capacity · L / P⌉``, the capacity defaulting to
        :data:`torchpar.ir.costs.EXPERT_EXCHANGE_HEADROOM` (at most ``L``)."""
        return expert_slot_rows(local_rows, self.expert_devices, self.capacity)

    def specs(
        self, weight_transposed: bool = False
    ) -> tuple[PartitionSpec, PartitionSpec, PartitionSpec, PartitionSpec]:
        """``shard_map`` specs of ``x``, ``w`` (``[E, K, N]``, or ``[E, N, K]`` with ``weight_transposed``),
        ``offs`` and the output."""
        weight = (_names(self.expert_axes), None, _names(self.column_axes))
        return (
            PartitionSpec(_names(self.row_axes), None),
            PartitionSpec(*(swap_weight_dims(weight) if weight_transposed else weight)),
            PartitionSpec(),
            PartitionSpec(_names(self.row_axes), _names(self.column_axes)),
        )


def swap_weight_dims(spec: Sequence[E]) -> tuple[E | None, E | None, E | None]:
    """A weight's spec ``[E, K, N]`` as the spec of ``[E, N, K]`` and back (missing trailing entries: ``None``)."""
    entries: tuple[E | None, ...] = tuple(spec) + (None,) * (3 - len(spec))
    return entries[0], entries[2], entries[1]


def _contiguous(inner: Sequence[int], outer: Sequence[int]) -> bool:
    start = outer.index(inner[0]) if inner[0] in outer else -1
    return start >= 0 and tuple(outer[start : start + len(inner)]) == tuple(inner)


def _names(axes: Sequence[int]) -> str | tuple[str, ...] | None:
    if not axes:
        return None
    return AXIS_NAMES[axes[0]] if len(axes) == 1 else tuple(AXIS_NAMES[a] for a in axes)


def _overlaps(chunk_starts: jax.Array, chunk_rows: int, offs: jax.Array) -> jax.Array:
    """``M [C, E]``: rows of expert ``e`` in the chunk ``[chunk_starts[c], + chunk_rows)``."""
    ends = offs.astype(jnp.int32)
    starts = ends - jnp.diff(ends, prepend=0)
    lo = jnp.maximum(starts[None, :], chunk_starts[:, None])
    hi = jnp.minimum(ends[None, :], chunk_starts[:, None] + chunk_rows)
    return jnp.maximum(hi - lo, 0)


def split_grouped_mm_local(
    x: jax.Array,
    weight: jax.Array,
    offs: jax.Array,
    split: GroupedMatmulSplit,
    *,
    weight_transposed: bool = False,
    precision=None,
    preferred_element_type=None,
) -> jax.Array:
    """This device's part of a split grouped matmul, inside a ``shard_map`` over the mesh axes ``split`` names:
    ``x [L, K]`` its row chunk, ``weight [E_l, K, N_l]`` its experts (all ``E`` when ``split`` has no expert
    axes; ``[E_l, N_l, K]`` with ``weight_transposed``), ``offs [E]`` whole. Returns its rows' outputs ``[L, N_l]``
    (module docstring)."""
    rows, _ = x.shape
    local_experts = weight.shape[0]
    peers = split.expert_devices
    experts = local_experts * peers
    dot = dict(precision=precision, preferred_element_type=preferred_element_type, weight_transposed=weight_transposed)
    if offs.shape[0] != experts:
        raise ValueError(
            f"grouped_mm offsets name {offs.shape[0]} experts; the split weight holds {local_experts} "
            f"on each of {peers} devices"
        )
    chunk = jax.lax.axis_index(_names(split.row_axes))
    if not split.expert_axes:  # rows split, every expert here: this chunk's part of each group, no exchange
        sizes = _overlaps(chunk[None] * rows, rows, offs)[0]
        return blocked_ragged_dot(x, weight, sizes, **dot)
    me = jax.lax.axis_index(_names(split.expert_axes))
    peer = jnp.arange(peers, dtype=jnp.int32)
    peer_chunks = chunk + (peer - me) * split.chunk_stride
    counts = _overlaps(peer_chunks * rows, rows, offs).reshape(peers, peers, local_experts)  # [source, owner, e_l]
    routing = _Routing(me=me, sent=counts[me].sum(axis=1), received=counts[:, me, :])
    exchange = lambda slot: lambda x, w: _exchange(x, w, routing, slot, split, **dot)
    fast, exact = split.slot_rows(rows), rows  # exact: every row of the chunk may go to one peer
    if fast == exact or split.capacity is not None:
        return exchange(fast)(x, weight)
    # every device of the mesh takes the same branch: the collectives inside a branch complete
    spill = jnp.where(peer == me, 0, routing.sent).max()
    overflow = jax.lax.pmax(spill, AXIS_NAMES[: len(split.mesh_shape)]) > fast
    return jax.lax.cond(overflow, exchange(exact), exchange(fast), x, weight)


@dataclasses.dataclass(frozen=True)
class _Routing:
    """One device's side of the exchange: ``me`` its place on the expert axes; ``sent [P]`` its rows bound for
    each peer's experts (its own at ``me``); ``received [P, E_l]`` each peer's rows for each of its own experts."""

    me: jax.Array
    sent: jax.Array
    received: jax.Array


def _exchange(
    x: jax.Array,
    weight: jax.Array,
    routing: _Routing,
    slot: int,
    split: GroupedMatmulSplit,
    **dot: Unpack[DotOptions],
) -> jax.Array:
    """Rows to their experts' devices, multiplied there, and back (module docstring): the rows for this device's
    own experts stay (``L`` of them at most), the others travel in slots of ``slot`` rows per peer. Rows past a
    slot's end come back zero (only with a ``capacity``: the other callers size slots to fit)."""
    rows = x.shape[0]
    peers, local_experts = routing.received.shape
    axes = _names(split.expert_axes)
    me = routing.me
    # send: slot p holds my rows for peer p, which start where the rows of the experts before p's end; my own
    # experts' rows stay here (their slot goes out empty)
    send_start = jnp.cumsum(routing.sent) - routing.sent
    peer = jnp.arange(peers, dtype=jnp.int32)
    own_row = jnp.clip(send_start[me] + jnp.arange(rows, dtype=jnp.int32), 0, rows - 1)
    ragged = exchange_collective.ragged()
    if ragged:
        assert axes is not None  # an exchange has expert axes
        trips = _RaggedTrips.of(routing, send_start, slot, rows, axes)
        buffer = trips.out(x, jnp.concatenate([x[own_row], jnp.zeros((peers * slot, x.shape[1]), x.dtype)]))
    else:
        slot_row = jnp.arange(slot, dtype=jnp.int32)
        taken = (slot_row[None, :] < routing.sent[:, None]) & (peer != me)[:, None]  # [P, slot]
        source_row = jnp.clip(send_start[:, None] + slot_row[None, :], 0, rows - 1)
        x_send = jnp.where(taken[..., None], x[source_row], jnp.zeros((), x.dtype))
        x_recv = jax.lax.all_to_all(x_send, axes, 0, 0, tiled=True)
        buffer = jnp.concatenate([x[own_row], x_recv.reshape(peers * slot, -1)])  # [L + P·slot, K]

    # my experts' rows: my own (the first L rows of the buffer), then slot s of peer s; reorder expert-major
    # (each expert's rows from every source together), so the matmul has E_l groups, not P·E_l (each pads a block)
    order = _ExpertMajor(routing.received, me, rows, slot)
    block = block_rows_for(rows, local_experts)  # sized for a balanced router's L / E_l rows per expert
    y_sorted = blocked_ragged_dot(buffer[order.source_row], weight, order.sizes, block_rows=block, **dot)
    y_buffer = jnp.where(order.buffer_used[:, None], y_sorted[order.sorted_row], 0)
    if ragged:
        y_back = trips.back(y_buffer, jnp.zeros((peers * slot, y_buffer.shape[1]), y_buffer.dtype))
        y_back = y_back.reshape(peers, slot, -1)
    else:
        y_back = jax.lax.all_to_all(y_buffer[rows:].reshape(peers, slot, -1), axes, 0, 0, tiled=True)

    # my row q went to its expert's owner p, at place q − send_start[p] of that slot (or stayed, if p is me)
    row = jnp.arange(rows, dtype=jnp.int32)
    ends = jnp.cumsum(routing.sent)
    owner = jnp.clip(jnp.searchsorted(ends, row, side="right"), 0, peers - 1).astype(jnp.int32)
    place = row - send_start[owner]
    stayed = owner == me
    kept = (row < ends[-1]) & (stayed | (place < slot))
    travelled = y_back[owner, jnp.clip(place, 0, slot - 1)]
    out = jnp.where(stayed[:, None], y_buffer[jnp.clip(place, 0, rows - 1)], travelled)
    return jnp.where(kept[:, None], out, jnp.zeros((), out.dtype))


@dataclasses.dataclass(frozen=True)
class _RaggedTrips:
    """The two ``ragged_all_to_all`` calls of one device's exchange. Out: my rows for peer ``p`` (``sent[p]`` of
    them from ``send_start[p]``, capped at a slot, none to myself) land at ``L + me·T`` of ``p``'s buffer; I receive
    ``came[s]`` rows from each peer ``s`` at ``L + s·T`` of mine — the dense path's slot ``s``. Back: buffer part
    ``s`` (``came[s]`` results) returns to ``s`` at ``me·T`` of its ``[P·T]`` results, and I receive ``sent[p]`` from
    each ``p`` at ``p·T``: the dense path's ``y_back[p]``."""

    out_offsets: jax.Array  # [P] where my rows start in each peer's buffer: L + me·T
    send_start: jax.Array  # [P] where my rows for each peer start in x
    sent: jax.Array  # [P] rows I send each peer (0 to myself), at most T
    came: jax.Array  # [P] rows each peer sends me, at most T
    part_start: jax.Array  # [P] where each peer's part of my buffer starts: L + s·T
    back_offsets: jax.Array  # [P] where my results start in each peer's [P·T] results: me·T
    axes: str | tuple[str, ...]

    @classmethod
    def of(
        cls, routing: _Routing, send_start: jax.Array, slot: int, rows: int, axes: str | tuple[str, ...]
    ) -> _RaggedTrips:
        peers = routing.sent.shape[0]
        others = jnp.arange(peers, dtype=jnp.int32) != routing.me
        capped = lambda count: jnp.where(others, jnp.minimum(count, slot), 0).astype(jnp.int32)
        everyone = jnp.ones((peers,), jnp.int32)
        return cls(
            out_offsets=(rows + routing.me * slot) * everyone,
            send_start=send_start.astype(jnp.int32),
            sent=capped(routing.sent),
            came=capped(routing.received.sum(axis=1)),
            part_start=rows + jnp.arange(peers, dtype=jnp.int32) * slot,
            back_offsets=routing.me * slot * everyone,
            axes=axes,
        )

    def out(self, x: jax.Array, buffer: jax.Array) -> jax.Array:
        return exchange_collective.ragged_all_to_all(
            x, buffer, self.send_start, self.sent, self.out_offsets, self.came, self.axes
        )

    def back(self, y_buffer: jax.Array, results: jax.Array) -> jax.Array:
        return exchange_collective.ragged_all_to_all(
            y_buffer, results, self.part_start, self.came, self.back_offsets, self.sent, self.axes
        )


class _ExpertMajor:
    """The receive buffer ``[L + P·T]`` — this device's own rows for its experts (part ``me``: the first ``L``
    rows), then slot ``s`` of peer ``s`` (``T`` rows; the slot of ``me`` is empty) — where part ``s`` holds
    ``n[s, e]`` rows for my expert ``e``, in expert order, reordered expert-major: expert ``e``'s rows from parts
    ``0 … P−1``, then expert ``e+1``'s.

    ``source_row [L + P·T]``: the buffer row each sorted row comes from (rows past the ``Σ n`` received: any);
    ``sizes [E_l]``: rows per expert; ``sorted_row`` / ``buffer_used`` (per buffer row): where it went, and
    whether it holds a row. ``n`` is clipped to the part's length (a capacity drops the rows past a slot)."""

    def __init__(self, received: jax.Array, me: jax.Array, rows: int, slot: int):
        peers, local_experts = received.shape
        part = jnp.arange(peers, dtype=jnp.int32)
        length = jnp.where(part == me, rows, slot)  # [P]
        base = jnp.where(part == me, 0, rows + part * slot)  # [P]
        within = jnp.cumsum(received, axis=1) - received  # [P, E_l] start in the part
        taken = jnp.minimum(within + received, length[:, None]) - jnp.minimum(within, length[:, None])
        self.sizes = taken.sum(axis=0)
        # expert-major start of group (e, s): rows of the experts before e, then of e from the parts before s
        sorted_start = (jnp.cumsum(self.sizes) - self.sizes)[:, None] + jnp.cumsum(taken.T, axis=1) - taken.T
        flat_start = sorted_start.reshape(-1)  # [E_l·P], increasing
        size = rows + peers * slot
        position = jnp.arange(size, dtype=jnp.int32)
        group = jnp.clip(jnp.searchsorted(flat_start, position, side="right") - 1, 0, flat_start.shape[0] - 1)
        expert, source = group // peers, group % peers
        self.source_row = jnp.clip(base[source] + within[source, expert] + position - flat_start[group], 0, size - 1)
        # per buffer row: its part, its place in the part, the expert it holds rows of
        in_slots = position >= rows
        part_of = jnp.where(in_slots, (position - rows) // slot, me)
        row_in = jnp.where(in_slots, (position - rows) % slot, position)
        ends = jnp.cumsum(taken, axis=1)  # [P, E_l]
        expert_of = jnp.clip(
            jax.vmap(lambda e, r: jnp.searchsorted(e, r, side="right"))(ends[part_of], row_in), 0, local_experts - 1
        )
        self.buffer_used = (row_in < ends[part_of, -1]) & ~(in_slots & (part_of == me))
        self.sorted_row = jnp.clip(sorted_start[expert_of, part_of] + row_in - within[part_of, expert_of], 0, size - 1)


def split_grouped_mm(
    x: jax.Array,
    weight: jax.Array,
    offs: jax.Array,
    mesh: Mesh,
    split: GroupedMatmulSplit,
    **dot_options: Unpack[DotOptions],
) -> jax.Array:
    """The split grouped matmul of global arrays (under ``jit``/GSPMD): a ``shard_map`` over ``mesh`` of
    :func:`split_grouped_mm_local`. ``x [S, K]``, ``weight [E, K, N]`` (``[E, N, K]`` with
    ``weight_transposed=True`` among ``dot_options``), ``offs [E]`` → ``[S, N]``."""
    x_spec, w_spec, offs_spec, out_spec = split.specs(dot_options.get("weight_transposed", False))
    body = lambda x, w, o: split_grouped_mm_local(x, w, o, split, **dot_options)
    return shard_map(body, mesh, in_specs=(x_spec, w_spec, offs_spec), out_specs=out_spec)(x, weight, offs)


def grouped_mm_split_of(
    x_spec: Sequence[Sequence[int] | None] | None,
    weight_spec: Sequence[Sequence[int] | None] | None,
    mesh_shape: Sequence[int],
    capacity: float | None = None,
) -> GroupedMatmulSplit | None:
    """The :class:`GroupedMatmulSplit` that the operand layouts ``x_spec`` (``[S, K]``) and ``weight_spec``
    (``[E, K, N]``) describe (spec entries: tuples of mesh axes or ``None``), or ``None`` when neither the rows nor
    the experts are split (GSPMD partitions the plain lowering: replicated, or columns split). Raises
    ``ValueError`` for an expert split the exchange cannot run (a split ``K``; rows not split over the expert
    axes)."""
    x_spec = tuple(x_spec or (None, None))
    weight_spec = tuple(weight_spec or (None, None, None))
    rows, experts = tuple(x_spec[0] or ()), tuple(weight_spec[0] or ())
    if not rows and not experts:
        return None
    if x_spec[1] or weight_spec[1]:
        if experts:
            raise ValueError(f"an expert-split grouped_mm with its contracted dim split (x {x_spec}, w {weight_spec})")
        return None
    return GroupedMatmulSplit(experts, rows, tuple(weight_spec[2] or ()), tuple(mesh_shape), capacity)


__all__ = ["GroupedMatmulSplit", "grouped_mm_split_of", "split_grouped_mm", "split_grouped_mm_local"]

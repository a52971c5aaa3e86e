"""Per-device execution of a graph: what ``lower`` does differently inside ``jax.shard_map``.

Under GSPMD (the default) every op sees global shapes and XLA partitions the program. Inside a
``shard_map`` every op sees its device's shard, so the program must say itself what XLA would
otherwise insert. :class:`LocalProgram` does that from the value layouts of a plan
(a ``ValueLayouts`` from the planner, taken as data: a spec per value, the spec each op reads its
operands in, and where a local result is a partial sum):

- an operand laid out differently from what its op reads is resharded: a split dim that must be whole
  is all-gathered, a whole dim that must be split is sliced at this device's ``axis_index``;
- size arguments (``view``, ``expand``, ``new_zeros``, …) become the output's local shape;
- a partial result is finished with ``psum`` (sum, contraction) or ``pmean`` (mean); batch norm over a
  split batch averages its statistics across the devices (``pmean``), as one device would see them;
- a matmul or convolution whose local result is a partial product adds its bias once, after the psum;
  an embedding whose table is split by rows looks up only the rows it holds (zeros elsewhere);
- a grouped matmul whose rows or experts are split runs its per-device part (:mod:`jaxbackend.ops.expert_parallel`:
  an all-to-all exchange of rows with their experts' devices);
- a random op whose output is split draws from a key folded with the device's position, so shards draw
  different numbers;
- buffers' new values are gathered whole;
- every result is checked against its local shape.

The backward pass needs no rules: ``jax.grad`` transposes these collectives (psum ↔ broadcast,
all-gather ↔ reduce-scatter), which is what makes gradient reduce-scatter explicit in the HLO.
Mesh axis ``a`` is named ``"d{a}"`` (:data:`jaxbackend.sharding.AXIS_NAMES`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, cast

import jax
import jax.numpy as jnp

from jaxbackend import collectives
from jaxbackend.ops.expert_parallel import grouped_mm_split_of
from jaxbackend.ops.registry import LoweringFn
from jaxbackend.ops.row_exchange import gather_rows_local, put_rows_local, rows_from_end
from jaxbackend.sharding import AXIS_NAMES
from torchpar.ir.graph import Node, TensorMeta
from torchpar.ir.layout import Multi, Spec
from torchpar.ir.op_families import BIAS_ARGUMENT, GROUPED_MATMULS, SIZE_ARGUMENT


class LocalModeError(RuntimeError):
    """A per-device program cannot run this graph (found while tracing); the GSPMD path can."""


def axis_names(axes: Sequence[int]) -> tuple[str, ...]:
    return tuple(AXIS_NAMES[a] for a in axes)


class Layouts(Protocol):
    """What a per-device program reads of a plan's value layouts (the planner's ``ValueLayouts``, taken as data; its
    docstring defines the fields)."""

    @property
    def mesh_shape(self) -> tuple[int, int]: ...

    @property
    def values(self) -> Mapping[str, Spec | None]:
        """The spec of every input and node (a :class:`~torchpar.ir.layout.Multi` for a multi-output op)."""
        ...

    @property
    def operands(self) -> Mapping[str, Sequence[Spec | None]]: ...

    @property
    def partial(self) -> Mapping[str, tuple[str, tuple[int, ...]]]: ...

    @property
    def statistics_axes(self) -> Mapping[str, tuple[int, ...]]: ...

    @property
    def options(self) -> Mapping[str, Mapping[str, str]]: ...

    def local_shape(self, shape: tuple[int, ...], spec: Spec | None) -> tuple[int, ...]: ...


class LocalProgram:
    """Per-device rules for one graph; ``layouts`` is a ``ValueLayouts`` (see the module docstring)."""

    def __init__(self, layouts: Layouts):
        self.layouts = layouts
        self.mesh_shape = tuple(layouts.mesh_shape)

    def spec(self, name: str) -> Spec | None:
        return self.layouts.values.get(name)

    def read_operands(self, node: Node, env: dict[str, object]) -> dict[str, object]:
        """``env`` with each operand of ``node`` resharded to the spec the op reads it in."""
        required = self.layouts.operands.get(node.name)
        if not required:
            return env
        scope = env
        for ref, wanted in zip(node.refs(), required):
            have = self.spec(ref)
            if wanted is None or have is None or tuple(have) == tuple(wanted):
                continue
            if scope is env:
                scope = dict(env)
            scope[ref] = self.reshard(cast(jax.Array, env[ref]), have, wanted)  # a tensor operand
        return scope

    def reshard(
        self,
        x: jax.Array,
        have: Sequence[Sequence[int] | None],
        wanted: Sequence[Sequence[int] | None],
        *,
        invariant: bool = True,
    ) -> jax.Array:
        """``x`` (this device's shard under ``have``) as its shard under ``wanted``: all-gather the dims
        whose split changes, then slice the dims ``wanted`` splits.

        ``invariant``: the gathered value is typed as the same on every device along the gathered axes (its
        gradient is sliced back, with no communication); ``False`` keeps it per-device, so the gradient is
        reduce-scattered onto the shard (a ZeRO-3 parameter, whose gradient is a per-device partial sum)."""
        if len(have) != len(wanted):
            raise LocalModeError(f"cannot reshard a rank-{len(have)} layout to rank {len(wanted)}")
        gather = _all_gather_invariant if invariant else collectives.all_gather
        for dim, (old, new) in enumerate(zip(have, wanted)):
            if old and old != new:
                x = gather(x, axis_names(old), axis=dim, tiled=True)
        for dim, (old, new) in enumerate(zip(have, wanted)):
            if new and old != new:
                pieces = math.prod(self.mesh_shape[a] for a in new)
                size = x.shape[dim] // pieces
                start = jax.lax.axis_index(axis_names(new)) * size
                x = jax.lax.dynamic_slice_in_dim(x, start, size, axis=dim)
        return x

    def prepare(
        self, node: Node, fn: LoweringFn, args: Sequence[object], kwargs: dict[str, object]
    ) -> tuple[LoweringFn, Sequence[object], dict[str, object], Callable[[object], object]]:
        """The per-device call of ``node``: its lowering (or a replacement), arguments (local sizes, extra
        keywords, a per-shard random key, a held-back bias) and what finishes its result."""
        args = self.rewrite_args(node, args)
        kwargs = {**kwargs, **self.extra_kwargs(node)}
        if "key" in kwargs:
            kwargs["key"] = self.key(node, cast(jax.Array, kwargs["key"]))  # the lowering's PRNG key
        args, bias_term = self.hold_back_bias(node, args, kwargs)
        return self.replacement(node) or fn, args, kwargs, functools.partial(self.finish, node, bias_term=bias_term)

    def whole(self, x: jax.Array, spec: Spec | None) -> jax.Array:
        """This device's shard of a value laid out as ``spec``, gathered to the whole value."""
        if not spec or not any(spec):
            return x
        return self.reshard(x, spec, (None,) * len(spec))

    def rewrite_args(self, node: Node, args: Sequence[object]) -> Sequence[object]:
        """``args`` with a size argument replaced by the output's local shape."""
        position = SIZE_ARGUMENT.get(node.target)
        if position is None or not isinstance(node.out, TensorMeta) or len(args) <= position:
            return args
        args = list(args)
        args[position] = list(self.layouts.local_shape(node.out.shape, self.spec(node.name)))
        return args

    def extra_kwargs(self, node: Node) -> dict[str, object]:
        """Keyword arguments that make an op's lowering work across devices (batch-norm statistics of the
        whole split batch: ``across=`` mesh axis names; a grouped matmul's split: ``local_split=``)."""
        axes = self.layouts.statistics_axes.get(node.name)
        if axes:
            return {"across": axis_names(axes)}
        refs = list(node.refs())
        if node.target in GROUPED_MATMULS and len(refs) >= 3:
            specs = self.layouts.operands.get(node.name) or [self.spec(ref) for ref in refs]
            split = grouped_mm_split_of(specs[0], specs[1], self.mesh_shape)
            return {"local_split": split} if split is not None else {}
        return {}

    def key(self, node: Node, key: jax.Array) -> jax.Array:
        """The key a random op draws from: folded with the device's position along the axes splitting its
        output, so each shard draws its own numbers (and replicas along other axes the same ones)."""
        axes = sorted({a for entry in _first_spec(self.spec(node.name)) or () if entry for a in entry})
        if not axes:
            return key
        return jax.random.fold_in(key, jax.lax.axis_index(axis_names(axes)))

    def replacement(self, node: Node) -> LoweringFn | None:
        """A per-device lowering to use instead of the op's own, or ``None``: an embedding (or a one-index
        ``table[idx]``) whose table is split by rows looks up only the rows this device holds (zeros elsewhere; the
        psum completes it); a gather or put the plan runs as a row exchange runs its per-device part
        (:mod:`jaxbackend.ops.row_exchange`)."""
        table_spec = (self.layouts.operands.get(node.name) or (None,))[0]
        rows_axes = table_spec[0] if table_spec else None
        if not rows_axes:
            return None
        names = axis_names(rows_axes)
        peers = math.prod(self.mesh_shape[a] for a in rows_axes)
        if self.layouts.options.get(node.name, {}).get("rows") == "exchange":
            if node.target == "aten.index.Tensor":
                return lambda table, indices: gather_rows_local(table, indices[0], names, peers)
            return lambda base, indices, values, accumulate=False: put_rows_local(
                base, indices[0], values, names, peers, accumulate
            )
        if node.name not in self.layouts.partial:
            return None
        if node.target == "aten.embedding.default":
            return functools.partial(_embedding_rows, names=names)
        if node.target == "aten.index.Tensor":
            return lambda table, indices: _embedding_rows(
                table, rows_from_end(indices[0], table.shape[0] * peers), names=names
            )
        return None

    def hold_back_bias(
        self, node: Node, args: Sequence[object], kwargs: dict[str, object]
    ) -> tuple[Sequence[object], Callable[[jax.Array], jax.Array] | None]:
        """For a biased matmul/convolution whose local result is a partial product (a split contracted dim):
        the arguments without the bias, and the bias term to add once after the sum (else every device would
        add it). ``(args, None)`` for every other op."""
        position = BIAS_ARGUMENT.get(node.target)
        partial = self.layouts.partial.get(node.name)
        if (
            position is None
            or partial is None
            or partial[0] != "contract"
            or len(args) <= position
            or args[position] is None
        ):
            return args, None
        args = list(args)
        bias = cast(jax.Array, args[position])  # the bias operand, present
        if node.target == "aten.convolution.default":
            args[position] = None
            return args, lambda out: out + bias.reshape((1, -1) + (1,) * (out.ndim - 2))
        beta = cast(float, kwargs.get("beta", args[3] if len(args) > 3 else 1))  # an ATen Scalar
        args[position] = jnp.zeros((), bias.dtype)
        return args, lambda out: out + beta * bias

    def finish(self, node: Node, result: object, bias_term: Callable[[jax.Array], jax.Array] | None = None) -> object:
        """Complete a partial local result with its collective (then add a held-back bias term)."""
        partial = self.layouts.partial.get(node.name)
        if partial is None:
            return result
        kind, axes = partial
        names = axis_names(axes)
        if kind == "mean":
            return jax.lax.pmean(result, names)
        total = jax.lax.psum(result, names)
        return bias_term(total) if bias_term is not None else total

    def local_meta(self, meta: TensorMeta, spec: Spec | None) -> TensorMeta:
        return TensorMeta(self.layouts.local_shape(meta.shape, spec), meta.dtype)


def _all_gather_invariant(x: jax.Array, axes: tuple[str, ...], *, axis: int, tiled: bool) -> jax.Array:
    # JAX's all-gather whose result is typed invariant along ``axes`` (transpose: a local slice). It is not
    # re-exported from jax.lax in JAX 0.10; tests/jaxbackend/test_spmd.py pins its behaviour.
    from jax._src.lax.parallel import all_gather_invariant

    return all_gather_invariant(x, axes, axis=axis, tiled=tiled)


def _embedding_rows(
    weight: jax.Array,
    indices: jax.Array,
    padding_idx: int = -1,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
    *,
    names: tuple[str, ...],
) -> jax.Array:
    """``aten.embedding`` on this device's block of table rows (global row ``i`` is local row
    ``i - axis_index·rows``): rows held elsewhere give zeros, so a ``psum`` over ``names`` completes it."""
    if scale_grad_by_freq:
        raise NotImplementedError("embedding(scale_grad_by_freq=True) is not supported")
    rows = weight.shape[0]
    local = indices - jax.lax.axis_index(names) * rows
    held = (local >= 0) & (local < rows)
    out = jnp.take(weight, jnp.clip(local, 0, rows - 1), axis=0)
    if padding_idx is not None and padding_idx >= 0:  # the padding row gets no gradient, as in PyTorch
        out = jnp.where((indices == padding_idx)[..., None], jax.lax.stop_gradient(out), out)
    return jnp.where(held.reshape(held.shape + (1,) * (out.ndim - held.ndim)), out, jnp.zeros((), out.dtype))


def require_invariant(value: jax.Array, what: str) -> jax.Array:
    """Raise :class:`LocalModeError` unless ``value`` is the same on every device by construction (its
    type varies along no mesh axis), as a loss must be for its gradient to be right."""
    varying: frozenset[str] = getattr(getattr(jax.typeof(value), "manual_axis_type", None), "varying", frozenset())
    if varying:
        raise LocalModeError(f"{what} varies along mesh axes {sorted(varying)}: it is not reduced across devices")
    return value


def _first_spec(spec: Spec | None) -> Sequence[Sequence[int] | None] | None:
    if isinstance(spec, Multi):  # a multi-output op: its first tensor result's spec
        return next((s for s in spec if s is not None), None)
    return spec


__all__ = ["Layouts", "LocalModeError", "LocalProgram", "axis_names", "require_invariant"]

"""The compiled functions of one pipeline stage, on its own devices.

For micro-batch ``m`` a stage runs ``forward`` (its sub-graph, saving the residuals of ``jax.vjp`` so
the backward pass does not recompute the forward; a ``step_fn``'s aux values it computes come out beside, not
differentiated), later ``backward`` with the cotangents of the
activations it sent on (the last stage seeds its loss with ``1/M`` for a mean, ``1`` for a sum, and ``w_m/M``
for a ratio loss, whose denominator it also returns: :mod:`torchpar.runtime.micro_batch_loss`), and adds the parameter
gradients into an accumulator. After the last micro-batch, ``update`` applies the optimizer once to the stage's
parameters with the accumulated gradients (optionally scaled by a global clipping factor).

Everything here is plain JAX on the stage's placement, whose devices may span several processes (then
every process of the stage builds the same program and runs it on global arrays); the pipeline
interpreter (:mod:`.interpreter`) moves activations and cotangents between stages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeAlias, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import PyTreeDef
from jax.typing import ArrayLike

from jaxbackend.compiler import compiler_options
from jaxbackend.lower import lower
from jaxbackend.precision import Numerics
from torchpar.ir.graph import Ref, TensorMeta
from torchpar.ir.optimizer import OptimizerSpec, Scalars
from torchpar.planner.pipeline.slicing import StageGraph
from torchpar.runtime.arrays import put, put_batch
from torchpar.runtime.micro_batch_loss import MicroBatchLoss, reference_of
from torchpar.runtime.one_stage.placement import Placement
from torchpar.runtime.train_step import Arrays, nonfinite_count, optimizer_tail, remat_groups

if TYPE_CHECKING:
    from jax.extend.core import Primitive

    from torchpar.runtime.pipeline.split_backward import SplitBackward

LOSS = "__loss__"
DEN = "__loss_den__"
"""A ratio loss's denominator among the last stage's forward results (not differentiated)."""
KEEP = "__keep__"
"""A ratio loss's seed entry: whether the micro-batch's denominator is nonzero (else its gradients are zeroed)."""
AUX_PREFIX = "__aux__:"
"""A ``step_fn``'s aux value among the forward's other (not differentiated) results: this prefix and its key."""

Residuals: TypeAlias = Callable[[Arrays], tuple[Arrays, Arrays]]
"""One micro-batch's residuals: the forward's ``jax.vjp`` function (a pytree holding the saved arrays), the
cotangents of its float outputs → (parameter gradients, cotangents of the float activation inputs)."""
Split: TypeAlias = "tuple[SplitBackward, jax.stages.Wrapped, jax.stages.Wrapped, jax.stages.Wrapped]"
"""A backward split for one argument structure: the split, and jitted B, W, and W adding into an accumulator."""
Signature: TypeAlias = tuple[object, ...]
"""A jitted function's arguments as :func:`_signature_of` describes them (shape, dtype, sharding of each array)."""


def _is_float(dtype_name: str) -> bool:
    return dtype_name in ("float16", "bfloat16", "float32", "float64")


def sub_spec(spec: OptimizerSpec, names: tuple[str, ...]) -> OptimizerSpec:
    """The optimizer spec restricted to ``names`` (group indices and flags kept)."""
    keep = [(n, g) for n, g in zip(spec.param_names, spec.group_of_param) if n in set(names)]
    return dataclasses.replace(spec, param_names=tuple(n for n, _ in keep), group_of_param=tuple(g for _, g in keep))


class StageProgram:
    """Jitted forward / backward / accumulate / update of one stage (see the module docstring)."""

    _residual_layout: tuple[PyTreeDef, dict[int, tuple[str, str | int]]] | None
    """(treedef, {leaf: (kind, name)}) of the forward's residuals, set at its trace."""

    def __init__(
        self,
        stage: StageGraph,
        *,
        placement: Placement,
        spec: OptimizerSpec,
        trainable: set[str],
        num_micro_batches: int,
        library_fusions: bool = True,
        numerics: Numerics | None = None,
        remat: str = "none",
        split_backward: bool = False,
    ):
        self.stage = stage
        self.placement = placement
        self.num_micro_batches = num_micro_batches
        self.trainable = tuple(n for n in stage.params if n in trainable)
        self.spec = sub_spec(spec, self.trainable)
        metas = {i.name: i.meta for i in stage.graph.inputs}
        self.float_acts = tuple(a for a in stage.activation_inputs if _is_float(metas[a].dtype))
        self.other_acts = tuple(a for a in stage.activation_inputs if a not in self.float_acts)
        run = lower(
            stage.graph,
            value_shardings=placement.values,
            operand_shardings=placement.operands,
            op_options=placement.options,
            numerics=numerics,
            remat=remat_groups(stage.graph, remat),
        )
        value_outputs = [o for o in stage.graph.outputs if o.kind != "buffer"]
        out_names = [
            {"loss": LOSS, "loss_den": DEN, "aux": AUX_PREFIX + o.target}.get(o.kind, o.target) for o in value_outputs
        ]
        node_metas = stage.graph.metas()
        float_out = {
            name
            for name, o in zip(out_names, value_outputs)
            # an activation output names one tensor value
            if name == LOSS
            or (o.kind == "activation" and _is_float(cast(TensorMeta, node_metas[cast(Ref, o.value).name]).dtype))
        }
        replicated = placement.replicated
        trainable_names = self.trainable
        self.loss = MicroBatchLoss.of(stage.graph)
        scale = self.loss.seed_share(num_micro_batches)
        self._scale = scale

        def forward(params, buffers, inputs, acts, key):
            frozen = {n: v for n, v in params.items() if n not in trainable_names}
            other = {a: acts[a] for a in self.other_acts}

            def f(train_params, float_acts):
                outputs, new_buffers = run({**frozen, **train_params}, buffers, inputs, key, {**float_acts, **other})
                values = dict(zip(out_names, outputs))
                diff = {n: v for n, v in values.items() if n in float_out}
                rest = {n: v for n, v in values.items() if n not in float_out and v is not None}
                return diff, (rest, new_buffers)

            diff, vjp_fn, (rest, new_buffers) = jax.vjp(
                jax.checkpoint(f, policy=_recompute_transposes),
                {n: params[n] for n in trainable_names},
                {a: acts[a] for a in self.float_acts},
                has_aux=True,
            )
            # aux values whole on every device of the stage: its lead process reads them (a stage may span hosts)
            rest = {
                n: jax.lax.with_sharding_constraint(v, replicated) if n.startswith(AUX_PREFIX) else v
                for n, v in rest.items()
            }
            # residuals that are arguments (parameters, buffers, inputs, received activations) are not outputs (the
            # executable would copy them): forward() puts the caller's arrays back in their places
            leaves, treedef = jax.tree.flatten(vjp_fn)
            given = (("params", params), ("buffers", buffers), ("inputs", inputs), ("acts", acts))
            state = {id(v): (kind, n) for kind, tree in given for n, v in tree.items()}
            holes = {k: state[id(leaf)] for k, leaf in enumerate(leaves) if id(leaf) in state}
            self._residual_layout = (treedef, holes)
            return diff, rest, new_buffers, [None if k in holes else leaf for k, leaf in enumerate(leaves)]

        def backward(vjp_fn, cotangents):
            keep = cotangents.get(KEEP)
            cotangents = {n: v for n, v in cotangents.items() if n != KEEP}
            if self.stage.has_loss:  # a seed passed in (loss scaling, a ratio's weight) wins over the share
                cotangents = {LOSS: jnp.asarray(scale, jnp.float32), **cotangents}
            grads, act_cotangents = vjp_fn(cotangents)
            if keep is not None:  # a ratio's micro-batch with denominator 0 adds nothing (its 0/0 loss is no nan here)
                zero = lambda g: jnp.where(keep, g, jnp.zeros((), g.dtype))
                grads, act_cotangents = jax.tree.map(zero, grads), jax.tree.map(zero, act_cotangents)
            return grads, act_cotangents

        def accumulate(total, grads):
            return jax.tree.map(jnp.add, total, grads)

        def backward_accumulate(vjp_fn, cotangents, total):
            grads, act_cotangents = backward(vjp_fn, cotangents)
            return accumulate(total, grads), act_cotangents

        def update(params, grads, state, scalars, clip_scale):
            return optimizer_tail(self.spec, params, grads, state, scalars, clip_scale=clip_scale)[:2]

        def squared_norm(grads):
            return sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in grads.values()), jnp.float32(0))

        options = self._options = compiler_options(library_fusions, placement.mesh.devices.size)
        self._forward = jax.jit(forward, compiler_options=options)
        self._residual_layout = None
        self._forward_signature: Signature | None = None
        self._backward_signature: Signature | None = None
        self._inspected: dict[jax.stages.Wrapped, jax.stages.Compiled] = {}
        self._backward = jax.jit(backward, compiler_options=options)
        self._backward_accumulate = jax.jit(backward_accumulate, donate_argnums=(2,), compiler_options=options)
        self._update_fn = update
        # jitted at the first call, when the optimizer state's keys are known
        self._update: jax.stages.Wrapped | None = None
        self._squared_norm = jax.jit(squared_norm, compiler_options=options)
        self._nonfinite_count = jax.jit(nonfinite_count, compiler_options=options)
        self._loss_seed: jax.Array | None = None
        self._ratio_seed = jax.jit(_ratio_seed, compiler_options=options)
        self._reference_of = jax.jit(reference_of, compiler_options=options)
        self._backward_fn = backward
        self.split_backward = split_backward
        """ZB-H1: the backward runs as backward_input then backward_weight_into (warm_up compiles those)."""
        self._splits: dict[PyTreeDef, Split] = {}  # residuals/cotangents tree → its split

    def set_loss_scale(self, loss_scale: float) -> None:
        """Seed the loss cotangent with ``S·share`` instead of ``share`` (``1/M``, or 1 for a sum loss) from now on
        (dynamic loss scaling, fp16 mixed precision: the gradients come out times ``S``; the update is given
        ``1/S``). A traced argument of the backward, so a new scale compiles nothing."""
        if self.stage.has_loss:
            self._loss_seed = self.put(np.float32(np.float64(loss_scale) * self._scale))

    def _seeded(self, cotangents: Arrays) -> Arrays:
        if self._loss_seed is None or LOSS in cotangents:
            return cotangents
        return {**cotangents, LOSS: self._loss_seed}

    def den_reference(self, den: jax.Array) -> jax.Array:
        """A ratio loss's ``r`` from the first micro-batch's denominator (:mod:`torchpar.runtime.micro_batch_loss`)."""
        return self._reference_of(den)

    def ratio_seed(self, den: jax.Array, reference: jax.Array) -> Arrays:
        """The last stage's seed entries for a ratio loss's micro-batch with denominator ``den``: the loss cotangent
        ``share·S·den/r`` and whether ``den`` is nonzero (:data:`KEEP`); to pass as that micro-batch's cotangents."""
        base = self._loss_seed if self._loss_seed is not None else np.float32(self._scale)
        seed, keep = self._ratio_seed(den, reference, base)
        return {LOSS: seed, KEEP: keep}

    # --- calls ------------------------------------------------------------------------------------

    def put(self, value: ArrayLike) -> jax.Array:
        """``value`` replicated on this stage's devices."""
        return put(value, self.placement.replicated)

    def put_param(self, name: str, value: ArrayLike) -> jax.Array:
        return put(value, self.placement.param(name))

    def put_input(self, index: int, value: ArrayLike) -> jax.Array:
        return put_batch(value, self.placement.input(index))

    def put_activation(self, name: str, value: ArrayLike) -> jax.Array:
        return put_batch(value, self.placement.value(name))

    def forward(
        self, params: Arrays, buffers: Arrays, inputs: dict[int, jax.Array], acts: Arrays, key: jax.Array
    ) -> tuple[Arrays, Arrays, Arrays, Residuals]:
        """→ (float outputs incl. the loss, other outputs, new buffers, residuals)."""
        if self._forward_signature is None:
            self._forward_signature = _signature_of((params, buffers, inputs, acts, key))
        diff, rest, new_buffers, leaves = self._forward(params, buffers, inputs, acts, key)
        assert self._residual_layout is not None  # set while the call above traced the forward
        treedef, holes = self._residual_layout
        given = {"params": params, "buffers": buffers, "inputs": inputs, "acts": acts}
        leaves = [  # a hole names an argument and its key there (a batch input's key is its index)
            cast("Mapping[str | int, jax.Array]", given[holes[k][0]])[holes[k][1]] if k in holes else leaf
            for k, leaf in enumerate(leaves)
        ]
        return diff, rest, new_buffers, jax.tree.unflatten(treedef, leaves)

    def forward_hlo(self) -> str:
        """Optimized HLO of the stage's forward (available after its first step)."""
        return _text(self._compiled(self._forward, self._forward_signature))

    def backward_hlo(self) -> str:
        """Optimized HLO of the stage's backward (available after its first step)."""
        return _text(self._compiled(self._backward, self._backward_signature))

    def memory_stats(self) -> dict[str, int]:
        """XLA's per-device memory analysis of the stage's forward and backward executables, fields prefixed
        ``forward_``/``backward_`` (available after the stage's first forward and backward)."""
        from jaxbackend.compiler import memory_analysis

        stats = {}
        for prefix, fn, signature in (
            ("forward", self._forward, self._forward_signature),
            ("backward", self._backward, self._backward_signature),
        ):
            stats.update({f"{prefix}_{k}": v for k, v in memory_analysis(self._compiled(fn, signature)).items()})
        return stats

    def _compiled(self, fn: jax.stages.Wrapped, signature: Signature | None) -> jax.stages.Compiled:
        """``fn`` compiled for ``signature`` (once: HLO text and memory statistics read the same executable)."""
        if signature is None:
            raise RuntimeError("the stage has not run yet: call engine.step first")
        if fn not in self._inspected:
            self._inspected[fn] = fn.lower(*signature).compile(compiler_options=self._options)
        return self._inspected[fn]

    def backward(self, residuals: Residuals, cotangents: Arrays) -> tuple[Arrays, Arrays]:
        """→ (parameter gradients, cotangents of the float activation inputs)."""
        cotangents = self._seeded(cotangents)
        if self._backward_signature is None:
            self._backward_signature = _signature_of((residuals, cotangents))
        return self._backward(residuals, cotangents)

    def backward_into(self, residuals: Residuals, cotangents: Arrays, total: Arrays | None) -> tuple[Arrays, Arrays]:
        """Backward of one micro-batch with its parameter gradients added into ``total`` (donated) in the
        same executable, so the accumulation costs no extra pass over the gradients.
        → (accumulated gradients, cotangents of the float activation inputs)."""
        if total is None:
            return self.backward(residuals, cotangents)
        return self._backward_accumulate(residuals, self._seeded(cotangents), total)

    def backward_input(self, residuals: Residuals, cotangents: Arrays) -> tuple[Arrays, tuple[jax.Array, ...]]:
        """Split backward, part 1 (ZB-H1's B, :mod:`.split_backward`): → (cotangents of the float activation
        inputs, the carry that :meth:`backward_weight_into` needs). No parameter gradient is computed."""
        cotangents = self._seeded(cotangents)
        return self._split(residuals, cotangents)[1](residuals, cotangents)

    def backward_weight_into(
        self, residuals: Residuals, cotangents: Arrays, carry: tuple[jax.Array, ...], total: Arrays | None
    ) -> Arrays:
        """Split backward, part 2 (ZB-H1's W): the parameter gradients from ``carry`` and the residuals, added into
        ``total`` (donated) in the same executable. → accumulated gradients."""
        cotangents = self._seeded(cotangents)
        _, _, weight, weight_accumulate = self._split(residuals, cotangents)
        if total is None:
            return weight(residuals, cotangents, carry)
        return weight_accumulate(residuals, cotangents, carry, total)

    def split_stats(self) -> dict[str, tuple[int, int] | int]:
        """How the backward split (after the first split backward): equations in B and W, carried bytes."""
        split = next(iter(self._splits.values()))[0]
        return {"equations": split.equations, "carry_bytes": split.carry_bytes}

    def _split(self, residuals: Residuals, cotangents: Arrays) -> Split:
        """The backward split into jitted B, W and W-with-accumulation, traced once per argument structure."""
        from torchpar.runtime.pipeline.split_backward import split_backward

        tree = jax.tree.structure((residuals, cotangents))
        if tree not in self._splits:
            split = split_backward(self._backward_fn, residuals, cotangents)

            def weight_accumulate(residuals, cotangents, carry, total):
                return jax.tree.map(jnp.add, total, split.weight_part(residuals, cotangents, carry))

            options = self._options
            self._splits[tree] = (
                split,
                jax.jit(split.input_part, compiler_options=options),
                jax.jit(split.weight_part, compiler_options=options),
                jax.jit(weight_accumulate, donate_argnums=(3,), compiler_options=options),
            )
        return self._splits[tree]

    def squared_norm(self, grads: Arrays) -> jax.Array:
        return self._squared_norm(grads)

    def nonfinite_count(self, grads: Arrays) -> jax.Array:
        """How many elements of ``grads`` are inf or nan (an int32 scalar on the stage's devices)."""
        return self._nonfinite_count(grads)

    def update(
        self, params: Arrays, grads: Arrays, state: dict[str, Arrays], scalars: Scalars, clip_scale: float = 1.0
    ) -> tuple[Arrays, dict[str, Arrays]]:
        owned = {n: params[n] for n in self.trainable}
        if self._update is None:
            # pin the outputs to the planned layouts: left to XLA's propagation, a parameter could come back
            # in another layout than it was placed in, and the next step would compile every stage function again
            placement = self.placement
            out_shardings = (
                {n: placement.param(n) for n in owned},
                {n: {k: placement.state_of(n) for k in entries} for n, entries in state.items()},
            )
            self._update = jax.jit(
                self._update_fn, out_shardings=out_shardings, donate_argnums=(0, 2), compiler_options=self._options
            )
        new_params, new_state = self._update(owned, grads, state, scalars, np.float32(clip_scale))
        return {**params, **new_params}, new_state

    def warm_up(self, params: Arrays, buffers: Arrays, opt_state: dict[str, Arrays], scalars: Scalars) -> None:
        """Compile every function of the stage by running it once on zeros of the right shapes (the state
        passed in is not modified), so the first training step does not pay XLA compilation."""
        from jaxbackend.dtypes import to_jax

        zeros = lambda meta: np.zeros(meta.shape, to_jax(meta.dtype))
        graph_inputs = self.stage.graph.inputs
        inputs = {
            int(i.target): self.put_input(int(i.target), zeros(i.meta)) for i in graph_inputs if i.kind == "input"
        }
        acts = {i.name: self.put_activation(i.name, zeros(i.meta)) for i in graph_inputs if i.kind == "activation"}
        diff, rest, _, vjp = self.forward(params, buffers, inputs, acts, jax.random.key(0))
        cotangents = {n: jnp.zeros_like(v) for n, v in diff.items() if n != LOSS}
        if DEN in rest:  # the seed entries every step passes (the same argument structure compiles once)
            cotangents.update(self.ratio_seed(rest[DEN], self.den_reference(rest[DEN])))
        copy = lambda tree: jax.tree.map(jnp.copy, tree)
        if self.split_backward:  # ZB-H1 runs only B and W; the fused backward compiles if asked (memory_stats)
            self._backward_signature = _signature_of((vjp, self._seeded(cotangents)))
            _, carry = self.backward_input(vjp, cotangents)
            grads = self.backward_weight_into(vjp, cotangents, carry, None)
            self.backward_weight_into(vjp, cotangents, carry, copy(grads))
        else:
            grads, _ = self.backward(vjp, cotangents)
            self.backward_into(vjp, cotangents, copy(grads))
        self.squared_norm(grads)
        self.nonfinite_count(grads)
        if self.trainable:
            self.update(copy(params), grads, copy(opt_state), scalars, 1.0)
        jax.block_until_ready(grads)


def _text(compiled: jax.stages.Compiled) -> str:
    text = compiled.as_text()
    assert text is not None  # XLA's executables (CPU, GPU) have their HLO text
    return text


def _ratio_seed(den: jax.Array, reference: jax.Array, base: jax.Array) -> tuple[jax.Array, jax.Array]:
    den = den.astype(jnp.float32)
    return base.astype(jnp.float32) * den / reference, den != 0


_RECOMPUTED = frozenset({"transpose", "sharding_constraint", "reduce_precision", "copy"})
"""Primitives whose results the forward does not save for the backward (:func:`_recompute_transposes`)."""


def _recompute_transposes(primitive: Primitive, *_: object, **__: object) -> bool:
    """The forward's residual policy: save every intermediate but layout changes and rounding (:data:`_RECOMPUTED`).
    A transposed weight (``x @ w.T``, as a torch ``Linear`` lowers, then laid out and rounded to the matmul's
    precision) would otherwise be written out whole by every micro-batch's forward and read back by its backward;
    recomputed there from the weight itself, it costs next to nothing (XLA folds the transpose into the dot), and
    the weight is no copy (:meth:`StageProgram.forward` passes arguments back as they are). Recomputation is exact."""
    return primitive.name not in _RECOMPUTED


def _signature_of(args: Signature) -> Signature:
    """Shapes, dtypes and shardings of ``args`` (a pytree of arrays), to lower a jitted function again.

    An uncommitted array (the step's PRNG key, made on the process's default device) keeps no sharding: at
    run time it follows the stage's committed arguments, and pinning it to the default device would make the
    lowering ask for two device sets whenever the stage does not run on that device."""

    def struct(a: jax.Array) -> jax.ShapeDtypeStruct:
        sharding = getattr(a, "sharding", None) if getattr(a, "committed", True) else None
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

    return jax.tree.map(struct, args)

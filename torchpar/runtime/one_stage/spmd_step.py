"""The training step of a one-stage plan as one per-device program (``jax.shard_map``).

The GSPMD step (:func:`torchpar.runtime.train_step.make_fused_step`) leaves collectives to XLA's partitioner. This one
writes them: the lowering runs per device (:mod:`jaxbackend.spmd`), and the step around it handles parameters by their
three layouts in the plan — stored (``S``), read by the model (``U``), gradient and optimizer state
(``G``):

- ``S == U`` (data parallel, ZeRO-2): the parameter enters the loss as a *varying* copy
  (``pcast`` outside ``jax.grad``), so ``jax.grad`` returns this device's partial gradient. It is finished
  explicitly: ``psum_scatter`` to ``G``'s split (ZeRO-2: a reduce-scatter in the HLO, not all-reduce +
  slice — except over gloo, :mod:`jaxbackend.collectives`) and ``psum`` over the other axes it varies along
  (data parallel: the gradient all-reduce, once per parameter even when it is read twice, as a tied embedding
  is);
- ``S == U`` in other plans (tensor parallel, the ILP's): the parameter enters as it is, and JAX's
  transposes of the implicit ``pvary`` where it meets per-device values all-reduce its gradient exactly
  over the axes whose devices contributed differently;
- ``S != U`` (ZeRO-3): the stored shard is all-gathered inside the loss; the transpose of that
  all-gather reduce-scatters the gradient onto the shard;
- the optimizer updates this device's piece of ``G`` (a local slice of a replicated parameter under
  ZeRO-2), with gradient clipping's norm completed across shards. Updated ZeRO-2 parameters leave the
  program sharded and the jit output sharding all-gathers them.

The loss and new buffer values (batch-norm running statistics) must come out the same on every device
by construction (``psum``/``pmean``-reduced where the plan reduces over a split batch); otherwise
:class:`jaxbackend.spmd.LocalModeError` is raised while tracing, and the caller falls back to GSPMD.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jaxbackend import sharding as jsh
from jaxbackend.collectives import reduce_scatter
from jaxbackend.lower import StepFn
from jaxbackend.spmd import Layouts, LocalProgram, axis_names, require_invariant
from torchpar.ir.layout import JsonSpec, Spec
from torchpar.ir.optimizer import OptimizerSpec
from torchpar.planner.plan import StagePlan
from torchpar.runtime.aux_parts import AuxOutputs
from torchpar.runtime.micro_batch_loss import MicroBatchLoss
from torchpar.runtime.train_step import (
    accumulate,
    keep_if,
    optimizer_tail,
    scale_loss,
    share,
    split_scalars,
    unscale_grads,
)


def make_spmd_step(
    run: StepFn,
    layouts: Layouts,
    stage: StagePlan,
    *,
    mesh: Mesh,
    param_names: list[str],
    buffer_names: list[str],
    state_keys: dict[str, list[str]],
    num_inputs: int,
    trainable: tuple[str, ...],
    spec: OptimizerSpec,
    grad_clip_norm: float | None,
    gradient_axes: tuple[str, ...],
    check_finite: bool = False,
    loss_scaling: bool = False,
    num_micro_batches: int = 1,
    micro_loss: MicroBatchLoss = MicroBatchLoss(),
    aux: AuxOutputs = AuxOutputs(),
) -> Callable:
    """``step(params, opt_state, buffers, inputs, scalars, key) → (loss, aux, finite, grad_norm, params, opt_state,
    buffers)`` as
    a ``shard_map`` over ``mesh``, for ``run`` lowered per device with ``layouts`` (see the module
    docstring). Arguments and results are global arrays; ``params`` come back in their ``G`` layout.

    ``gradient_axes``: mesh axes along which every device's loss contribution is distinct (the axes that split the
    batch: all of them in data-parallel and ZeRO plans), so gradients are taken per device along them and reduced
    explicitly once (ZeRO-2 needs this for its reduce-scatter; gradient accumulation, to synchronize once per
    step). Along the other axes (tensor parallelism, whose devices may compute the same values) JAX's transposes
    of its implicit broadcasts reduce the gradients where they arise. A parameter that reaches the loss other
    than through the batch would make the loss vary along those axes: :class:`jaxbackend.spmd.LocalModeError`.
    ``check_finite`` skips the update of a step whose loss or gradients are not finite (as
    :func:`torchpar.runtime.train_step.make_fused_step`), counting non-finite gradient elements across shards;
    ``loss_scaling`` as there (``scalars`` carry a loss scale; finiteness is then always checked).
    ``num_micro_batches``: gradient accumulation over that many micro-batches of each device's rows
    (:func:`torchpar.runtime.train_step.accumulate`); the partial sums along ``gradient_axes`` are accumulated locally
    and reduced once, after the last one; ``micro_loss`` says how the micro-batch losses make the whole batch's
    (:mod:`torchpar.runtime.micro_batch_loss`; a ratio's denominator, like the loss, is the same on every device).
    ``aux``: the graph's aux outputs, returned whole (the lowering gathers them) and the same on every device like the
    loss, combined over micro-batches as :mod:`torchpar.runtime.aux_parts` says."""
    check_finite = check_finite or loss_scaling
    program = LocalProgram(layouts)
    stored = {n: _spec(stage.params.get(n)) for n in param_names}
    at_use = {n: _spec(stage.params_at_use.get(n)) or stored[n] for n in param_names}
    grad = {n: _spec(stage.grads.get(n)) or stored[n] for n in param_names}
    state = {n: _spec(stage.optimizer_state.get(n)) or grad[n] for n in param_names}
    live_axes = tuple(a for a in jsh.AXIS_NAMES if mesh.shape[a] > 1)
    gradient_axes = tuple(a for a in gradient_axes if a in live_axes)

    def body(params, opt_state, buffers, inputs, scalars, key):
        scalars, loss_scale = split_scalars(scalars, loss_scaling)
        read = {n: _relayout(program, p, stored[n], at_use[n]) for n, p in params.items() if n not in trainable}

        # data parallel: differentiate with respect to per-device copies, so each gradient is this device's partial
        # sum, reduced once below (the invariant parameter's gradient would be all-reduced at every use by the
        # transposes of JAX's implicit pvary); other plans: let those transposes reduce it
        copies = {n: _varying_copy(params[n], stored[n], at_use[n], gradient_axes) for n in trainable}

        def grad_of(micro_inputs, micro_buffers, micro_key):
            def loss_of(train_params):
                used = dict(read)
                for name, p in train_params.items():
                    used[name] = _relayout(program, p, stored[name], at_use[name], invariant=False)
                outputs, new_buffers = run(used, micro_buffers, micro_inputs, micro_key)
                for name, value in new_buffers.items():
                    require_invariant(value, f"the new value of buffer {name}")
                loss = require_invariant(outputs[0], "the loss")
                den = micro_loss.den(outputs)
                if den is not None:
                    den = require_invariant(den, "the loss's denominator")
                values = {k: require_invariant(v, f"step_fn's aux[{k!r}]") for k, v in aux.pick(outputs).items()}
                return (
                    share(scale_loss(loss, loss_scale), num_micro_batches, micro_loss),
                    (loss, den, values, new_buffers),
                )

            (_, (loss, den, values, new_buffers)), grads = jax.value_and_grad(loss_of, has_aux=True)(copies)
            return loss, den, values, grads, new_buffers

        loss, grads, new_buffers, _, whole_aux = accumulate(
            grad_of, list(inputs), buffers, key, num_micro_batches, micro_loss, aux
        )
        grads = unscale_grads({n: _finish_gradient(g, stored[n], grad[n]) for n, g in grads.items()}, loss_scale)
        pieces = {n: _relayout(program, p, stored[n], grad[n]) if n in grads else p for n, p in params.items()}
        # a sharded gradient's sum of squares (and non-finite count) is completed across its shards
        complete_sum = lambda name, s: jax.lax.psum(s, _axes(grad[name])) if _axes(grad[name]) else s
        finite = jnp.isfinite(loss) & (_nonfinite_total(grads, live_axes) == 0) if check_finite else None
        new_params, new_state, norm = optimizer_tail(
            spec,
            pieces,
            grads,
            opt_state,
            scalars,
            grad_clip_norm=grad_clip_norm,
            complete_sum=complete_sum,
            norm_of=lambda g: _global_norm(g, grad),
            keep=finite,
        )
        new_buffers = {**buffers, **new_buffers}
        if finite is None:
            return loss, whole_aux, jnp.bool_(True), norm, new_params, new_state, new_buffers
        # the optimizer kept the parameters and its state itself (keep=finite)
        return loss, whole_aux, finite, norm, new_params, new_state, keep_if(finite, new_buffers, buffers)

    P = jsh.partition_spec
    param_out = {n: P(grad[n] or ()) if n in trainable else P(stored[n] or ()) for n in param_names}
    state_specs = {n: {k: P(state[n] or ()) for k in keys} for n, keys in state_keys.items()}
    input_specs = [P(stage.inputs.get(str(i)) or ()) for i in range(num_inputs)]
    whole = jax.sharding.PartitionSpec()
    in_specs = (
        {n: P(stored[n] or ()) for n in param_names},
        state_specs,
        dict.fromkeys(buffer_names, whole),
        input_specs,
        whole,
        whole,
    )
    out_specs = (
        whole,
        dict.fromkeys(aux.keys, whole),
        whole,
        whole,
        param_out,
        state_specs,
        dict.fromkeys(buffer_names, whole),
    )
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


def _nonfinite_total(grads: dict[str, jax.Array], live_axes: tuple[str, ...]) -> jax.Array:
    """How many inf/nan elements the gradients hold, over every device, with at most one scalar all-reduce: the
    local counts are added first (a replicated gradient is counted once per copy: the total is only compared
    with zero), and reduced only if some gradient is split."""
    total, varying_total = jnp.int32(0), None
    for g in grads.values():
        count = jnp.sum(~jnp.isfinite(g), dtype=jnp.int32)
        varying: frozenset[str] = getattr(jax.typeof(count).manual_axis_type, "varying", frozenset())
        if not varying:
            total = total + count
            continue
        missing = tuple(a for a in live_axes if a not in varying)
        count = jax.lax.pcast(count, missing, to="varying") if missing else count
        varying_total = count if varying_total is None else varying_total + count
    if varying_total is None:
        return total
    return total + jax.lax.psum(varying_total, live_axes)


def _finish_gradient(g: jax.Array, stored: Spec | None, target: Spec | None) -> jax.Array:
    """This device's partial gradient → its piece of the whole gradient laid out as ``target``:
    reduce-scatter onto ``target``'s split dims, then all-reduce over the other axes it still varies along
    (axes splitting the stored parameter are a layout, not a partial sum)."""
    owned = set(_mesh_axes(stored))
    for dim, entry in enumerate(target or ()):
        if entry and not set(entry) <= owned:
            g = reduce_scatter(g, axis_names(entry), dim=dim)
            owned |= set(entry)
    varying: frozenset[str] = getattr(jax.typeof(g).manual_axis_type, "varying", frozenset())
    rest = tuple(a for a in jsh.AXIS_NAMES if a in varying and jsh.AXIS_NAMES.index(a) not in owned)
    return jax.lax.psum(g, rest) if rest else g


def _varying_copy(p: jax.Array, stored: Spec | None, at_use: Spec | None, gradient_axes: tuple[str, ...]) -> jax.Array:
    """``p`` typed as varying along the ``gradient_axes`` it is not split over (a ZeRO-3 shard, all-gathered
    inside the loss, needs no copy: the all-gather's transpose already reduce-scatters its gradient)."""
    if not _same(stored, at_use):
        return p
    free = tuple(a for a in gradient_axes if a not in _axes(stored))
    return jax.lax.pcast(p, free, to="varying") if free else p


def _relayout(
    program: LocalProgram, p: jax.Array, have: Spec | None, wanted: Spec | None, *, invariant: bool = True
) -> jax.Array:
    """This device's piece of ``p`` (laid out as ``have``; ``None`` = whole) as laid out as ``wanted``."""
    if _same(have, wanted):
        return p
    whole = (None,) * p.ndim
    return program.reshard(p, have or whole, wanted or whole, invariant=invariant)


def batch_axes(stage: StagePlan, num_inputs: int) -> tuple[str, ...]:
    """Mesh axes that split dim 0 of every batch input of ``stage`` (the axes along which devices see different
    rows)."""
    common: set[int] | None = None
    for i in range(num_inputs):
        spec = _spec(stage.inputs.get(str(i)))
        if not spec:
            continue
        axes = set(spec[0] or ())
        common = axes if common is None else common & axes
    return axis_names(tuple(sorted(common or ())))


def _spec(json_spec: JsonSpec | None) -> Spec | None:
    """A plan's JSON spec as a tuple spec (``None`` if absent)."""
    if json_spec is None:
        return None
    return tuple(tuple(entry) if entry else None for entry in json_spec)


def _global_norm(grads: dict[str, jax.Array], layouts: dict[str, Spec | None]) -> jax.Array:
    """The gradients' global L2 norm (float32) with one scalar ``psum`` per distinct set of mesh axes sharding them
    (usually one, often none): each device's sums of squares are added first, then completed across the shards.
    ``layouts``: each gradient's spec (:func:`_axes` gives the axes splitting it)."""
    partial: dict[tuple[str, ...], jax.Array] = {}
    for name, g in grads.items():
        axes = _axes(layouts[name])
        partial[axes] = partial.get(axes, jnp.float32(0)) + jnp.sum(jnp.square(g.astype(jnp.float32)))
    total = sum((jax.lax.psum(s, axes) if axes else s for axes, s in partial.items()), jnp.float32(0))
    return jnp.sqrt(total)


def _axes(spec: Spec | None) -> tuple[str, ...]:
    return axis_names(_mesh_axes(spec))


def _mesh_axes(spec: Spec | None) -> tuple[int, ...]:
    return tuple(a for entry in (spec or ()) if entry for a in entry)


def _same(a: Spec | None, b: Spec | None) -> bool:
    return tuple(a or ()) == tuple(b or ()) or (not _mesh_axes(a) and not _mesh_axes(b))


__all__ = ["make_spmd_step"]

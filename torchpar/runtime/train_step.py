"""The training step as pure JAX functions: one builder, specialized by how a program runs.

Every executable that trains ends the same way — finish the gradients (reduce them to their layout),
clip them by their global norm, apply the optimizer — and starts the same way — run the lowered graph
with the trainable parameters as the differentiated argument. The variants differ only in where the
step is cut and who completes the collectives:

- :func:`make_fused_step` — one-stage plans under GSPMD (one device included): forward, backward and
  update in one function; XLA's partitioner inserts the collectives (ZeRO gradients are constrained to
  their sharded layout so they are reduce-scattered);
- ``runtime.spmd_step.make_spmd_step`` — the same step as a per-device ``shard_map`` program whose
  gradient reductions are explicit; it reuses :func:`optimizer_tail` with a cross-shard norm;
- ``runtime.stage_program.StageProgram`` — a pipeline stage: forward and backward are separate
  executables per micro-batch, and its update is :func:`optimizer_tail` with the clipping factor the
  runtime computed from every stage's gradients.

Non-finite steps (``compile(on_nonfinite=...)``): with ``check_finite`` a one-stage step also returns
``finite`` (the loss and every gradient element are finite: :func:`nonfinite_count` is zero) and, when it is false,
returns the parameters, optimizer state and buffers it was given (:func:`keep_if`): the step is skipped
inside the executable, as ``torch.amp.GradScaler`` skips ``optimizer.step``. A pipeline's stages report
their gradients' non-finite counts and the runtime skips the update on the host side.

Dynamic loss scaling (``compile(mixed_precision="fp16")``): the step's ``scalars`` are then
``(optimizer scalars, loss_scale)`` with ``loss_scale = [S, 1/S]`` (float32, ``1/S`` computed in float64 on the
host as ``torch.amp.GradScaler`` does). The differentiated value is ``loss·S``; the gradients are multiplied by
``1/S`` before clipping and the update, and a step whose unscaled gradients hold an inf/nan is skipped (the host
then backs the scale off: :mod:`torchpar.runtime.loss_scale`). The loss returned is the unscaled one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import NamedTuple, TypeAlias, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxbackend import optimizer as jax_optim
from jaxbackend.remat import Remat
from torchpar.ir.graph import Graph
from torchpar.ir.optimizer import OptimizerSpec, Scalars
from torchpar.planner.remat import check_remat, layer_groups
from torchpar.runtime import micro_batch_loss
from torchpar.runtime.aux_parts import AuxOutputs
from torchpar.runtime.micro_batch_loss import MicroBatchLoss

log = logging.getLogger(__name__)

T = TypeVar("T")

LossScale: TypeAlias = jax.Array | np.ndarray
"""``[S, 1/S]`` (float32): a host array on the host, traced inside a step."""

StepScalars: TypeAlias = Scalars | tuple[Scalars, LossScale]
"""A step's ``scalars`` argument: the optimizer scalars, or ``(optimizer scalars, loss_scale)`` under loss scaling."""

Arrays: TypeAlias = dict[str, jax.Array]
"""Arrays by name (parameters, gradients, buffers, aux values)."""

GradOf: TypeAlias = Callable[
    [list[jax.Array], Arrays, jax.Array], tuple[jax.Array, jax.Array | None, Arrays, Arrays, Arrays]
]
"""``grad_of(micro_inputs, buffers, key) → (loss, den, aux values, grads, new buffer values)`` (:func:`accumulate`)."""


def optimizer_tail(
    spec: OptimizerSpec,
    params: Mapping[str, jax.Array],
    grads: Mapping[str, jax.Array],
    opt_state: Mapping[str, Mapping[str, jax.Array]],
    scalars: Scalars,
    *,
    grad_clip_norm: float | None = None,
    complete_sum: Callable[[str, jax.Array], jax.Array] | None = None,
    clip_scale: jax.Array | None = None,
    norm_of: Callable[[Mapping[str, jax.Array]], jax.Array] | None = None,
    keep: jax.Array | None = None,
) -> tuple[Arrays, dict[str, Arrays], jax.Array | None]:
    """Clip and apply the optimizer: ``→ (new params, new optimizer state, the gradients' global norm before
    clipping)`` (the norm is ``None`` with ``clip_scale``: the pipeline computed it from every stage).

    Clipping is either computed here from ``grads`` (``grad_clip_norm``; ``complete_sum`` completes a
    sharded gradient's sum of squares inside ``shard_map``) or given as ``clip_scale``, the factor a
    pipeline computed from every stage (:func:`jaxbackend.optimizer.clip_coefficient`). Without clipping the norm is
    ``norm_of(grads)`` (default :func:`jaxbackend.optimizer.global_norm` with ``complete_sum``): only reported, so a
    per-device step may compute it with fewer collectives. ``keep`` (the step's finiteness): where false the
    parameters and state come back as given (:func:`jaxbackend.optimizer.apply_updates`)."""
    norm: jax.Array | None = None
    if grad_clip_norm is not None:
        grads, norm = jax_optim.clip_grads_by_global_norm(grads, grad_clip_norm, complete_sum)
    elif clip_scale is not None:
        grads = {n: g * clip_scale.astype(g.dtype) for n, g in grads.items()}
    else:
        norm = norm_of(grads) if norm_of is not None else jax_optim.global_norm(grads, complete_sum)
    return (*jax_optim.apply_updates(spec, params, grads, opt_state, scalars, keep), norm)


def nonfinite_count(grads: Mapping[str, jax.Array]) -> jax.Array:
    """How many gradient elements are inf or nan (int32), over the arrays as this program sees them."""
    total = jnp.int32(0)
    for g in grads.values():
        total = total + jnp.sum(~jnp.isfinite(g), dtype=jnp.int32)
    return total


def all_finite(grads: Mapping[str, jax.Array]) -> jax.Array:
    """Whether every gradient element is finite (a bool scalar): ``Σ g·0`` over each gradient is 0 unless an
    element is inf or nan (``0·inf`` is nan; XLA does not fold ``x·0`` for floats). Equal to
    ``nonfinite_count(grads) == 0``, without the int32 mask a count materializes per gradient (XLA:CPU, 3.1M
    elements in 36 gradients: 1.8 → 0.8 ms)."""
    total = jnp.float32(0)
    for g in grads.values():
        total = total + jnp.sum(g * jnp.zeros((), g.dtype), dtype=jnp.float32)
    return jnp.isfinite(total)


def split_scalars(scalars: StepScalars, loss_scaling: bool) -> tuple[Scalars, LossScale | None]:
    """``(optimizer scalars, loss_scale or None)`` of a step's ``scalars`` argument (see the module docstring)."""
    if loss_scaling:
        scaled = cast("tuple[Scalars, LossScale]", scalars)
        return (scaled[0], scaled[1])
    return (cast(Scalars, scalars), None)


def scale_loss(loss: jax.Array, loss_scale: LossScale | None) -> jax.Array:
    """The value to differentiate: ``loss·S`` in float32 (GradScaler's ``scale(loss)``), or ``loss`` unscaled."""
    return loss if loss_scale is None else loss.astype(jnp.float32) * loss_scale[0]


def share(value: jax.Array, num_micro_batches: int, loss: MicroBatchLoss = MicroBatchLoss()) -> jax.Array:
    """One micro-batch's share of the value a step differentiates: ``value / M`` for a mean or ratio loss, ``value``
    for a sum and for ``M = 1`` (:mod:`.micro_batch_loss`)."""
    factor = loss.seed_share(num_micro_batches)
    return value if factor == 1.0 else value / num_micro_batches


def unscale_grads(grads: Mapping[str, jax.Array], loss_scale: LossScale | None) -> Arrays:
    """Gradients of ``loss·S`` times ``1/S`` (GradScaler's ``unscale_``), each in its own dtype."""
    if loss_scale is None:
        return dict(grads)
    return {n: g * loss_scale[1].astype(g.dtype) for n, g in grads.items()}


def keep_if(finite: jax.Array, new: T, old: T) -> T:
    """``new`` where ``finite`` else ``old``, leaf by leaf (same tree structure): a skipped step's state."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def micro_batches(inputs: list[jax.Array], num_micro_batches: int) -> list[jax.Array]:
    """Each batch leaf ``[B, ...]`` as ``[M, B/M, ...]``, micro-batch ``m`` holding rows ``m, m+M, m+2M, …``
    (row ``i`` goes to micro-batch ``i mod M``). With dim 0 split over ``d`` devices (``B/M`` a multiple of ``d``)
    every device keeps its rows: the reshape ``[B] → [B/M, M]`` splits the minor part of each device's block, so
    the same rows are chosen in a global (GSPMD) and in a per-device (``shard_map``) program."""
    return [x.reshape(x.shape[0] // num_micro_batches, num_micro_batches, *x.shape[1:]).swapaxes(0, 1) for x in inputs]


class Accumulated(NamedTuple):
    """What :func:`accumulate` returns: the whole batch's loss and (seed-scaled) gradients, the buffers after the last
    micro-batch, a ratio loss's whole-batch denominator ``D`` (``None`` for other reductions, for combining data
    replicas: :func:`.micro_batch_loss.combine_replicas`) and the whole batch's aux values (:mod:`.aux_parts`)."""

    loss: jax.Array
    grads: Arrays
    buffers: Arrays
    den: jax.Array | None
    aux: Arrays


def accumulate(
    grad_of: GradOf,
    inputs: list[jax.Array],
    buffers: Arrays,
    key: jax.Array,
    num_micro_batches: int,
    loss: MicroBatchLoss = MicroBatchLoss(),
    aux: AuxOutputs = AuxOutputs(),
) -> Accumulated:
    """Gradient accumulation: ``grad_of(micro_inputs, buffers, key) → (loss, den, aux values, grads, new buffer
    values)`` over the ``num_micro_batches`` micro-batches of ``inputs`` (:func:`micro_batches`) in one loop, each
    micro-batch seeing the buffers the previous one left (as a PyTorch accumulation loop does) and the key folded with
    its index. ``grad_of`` differentiates its micro-batch's loss times ``loss.seed_share(M)`` (:func:`share`); ``den``
    is a ratio loss's denominator (else ``None``). The result (:class:`Accumulated`) holds ``L`` and ``∇``, the whole
    batch's loss and (seed-scaled) gradient as ``loss`` combines them (:mod:`.micro_batch_loss`: the mean, the sum, or
    ``Σ num / Σ den`` of a ratio, whose gradients are weighted by ``den_m / r`` as they are added and multiplied by
    ``M r / D`` after the last), and the aux values combined as ``aux`` says
    (:meth:`.aux_parts.AuxOutputs.over_micro_batches`). The first micro-batch writes the accumulator, the others add to
    it (a ``lax.scan`` over ``M − 1``, which stacks their aux values): no zero-filled buffer, and a per-device
    program's gradients keep their partial-sum type until the caller reduces them once. ``M = 1`` is one call of
    ``grad_of``."""
    if num_micro_batches == 1:
        micro_loss, den, micro_aux, grads, changed = grad_of(inputs, buffers, key)
        return Accumulated(micro_loss, grads, changed, den, micro_aux)
    ratio = loss.is_ratio
    stacked = micro_batches(inputs, num_micro_batches)
    first_loss, den, first_aux, grads, changed = grad_of([x[0] for x in stacked], buffers, jax.random.fold_in(key, 0))
    names = tuple(changed)
    reference = micro_batch_loss.reference_of(cast(jax.Array, den)) if ratio else None  # a ratio has its den

    def start(micro_loss, micro_den, micro_grads):
        if not ratio:
            return micro_loss.astype(jnp.float32), jnp.float32(0), micro_grads
        return (
            micro_batch_loss.numerator(micro_loss, micro_den),
            micro_den.astype(jnp.float32),
            micro_batch_loss.weigh(micro_grads, micro_den, reference),
        )

    def one(carry, xs):
        total, den_total, acc, state = carry
        index, micro = xs
        micro_loss, micro_den, micro_aux, micro_grads, micro_changed = grad_of(
            list(micro), {**buffers, **state}, jax.random.fold_in(key, index)
        )
        part, part_den, part_grads = start(micro_loss, micro_den, micro_grads)
        acc = {n: acc[n] + g for n, g in part_grads.items()}
        return (total + part, den_total + part_den, acc, {n: micro_changed[n] for n in names}), micro_aux

    rest = (jnp.arange(1, num_micro_batches), [x[1:] for x in stacked])
    (total, den_total, grads, changed), rest_aux = jax.lax.scan(one, (*start(first_loss, den, grads), changed), rest)
    whole_aux = aux.over_micro_batches(
        {k: jnp.concatenate([v[None], rest_aux[k]]) for k, v in first_aux.items()}, num_micro_batches
    )
    if ratio:
        assert reference is not None  # set above for a ratio loss
        factor = num_micro_batches * reference / den_total
        grads = {n: g * factor.astype(g.dtype) for n, g in grads.items()}
        return Accumulated((total / den_total).astype(first_loss.dtype), grads, changed, den_total, whole_aux)
    whole = total if loss.kind == "sum" else total / num_micro_batches
    return Accumulated(whole.astype(first_loss.dtype), grads, changed, None, whole_aux)


def make_fused_step(
    run: Callable,
    trainable: tuple[str, ...],
    spec: OptimizerSpec,
    grad_clip_norm: float | None,
    grad_shardings: Mapping[str, NamedSharding],
    check_finite: bool = False,
    count_nonfinite: Callable[[Arrays], jax.Array] | None = None,
    loss_scaling: bool = False,
    num_micro_batches: int = 1,
    loss: MicroBatchLoss = MicroBatchLoss(),
    data_axis: str | None = None,
    aux: AuxOutputs = AuxOutputs(),
) -> Callable:
    """``step(params, opt_state, buffers, inputs, scalars, key) → (loss, aux, finite, grad_norm, params, opt_state,
    buffers)`` for ``run`` (a lowered graph whose first output is the loss; ``aux`` its aux values by key, the whole
    batch's: :mod:`.aux_parts`). ``grad_shardings`` constrains gradients
    whose layout differs from their parameter's (ZeRO). ``check_finite``: skip the update (return the
    state given) unless the loss and gradients are finite; else ``finite`` is always true.
    ``count_nonfinite(grads)`` counts the gradients' inf/nan elements (default :func:`nonfinite_count`; a sharded
    step passes one that reduces every device's count with one collective). ``loss_scaling``: ``scalars`` carry a
    loss scale (module docstring), and the step checks finiteness whatever ``check_finite`` says.
    ``num_micro_batches``: the gradients of that many micro-batches of ``inputs`` are accumulated
    (:func:`accumulate`, combined as ``loss`` says: :mod:`.micro_batch_loss`) before the update; ``run`` is the graph
    of one micro-batch. ``aux``: the graph's aux outputs (returned, never differentiated).

    ``data_axis``: the step is the body of a ``shard_map`` manual over that mesh axis of data replicas
    (:func:`over_data_replicas`), ``inputs`` being this replica's rows. Each replica's gradients are its own (the
    region is not varying-typed: nothing reduces them implicitly) until they are combined once, after accumulation,
    as the whole batch's loss combines (:func:`.micro_batch_loss.combine_replicas`); the PRNG key is folded with the
    replica's index (each replica its own dropout masks)."""
    check_finite = check_finite or loss_scaling

    def step(params, opt_state, buffers, inputs, scalars, key):
        scalars, loss_scale = split_scalars(scalars, loss_scaling)
        frozen = {n: v for n, v in params.items() if n not in trainable}
        train = {n: params[n] for n in trainable}
        if data_axis is not None:
            key = jax.random.fold_in(key, jax.lax.axis_index(data_axis))

        def grad_of(micro_inputs, micro_buffers, micro_key):
            def loss_of(train_params):
                outputs, new_buffers = run({**frozen, **train_params}, micro_buffers, micro_inputs, micro_key)
                return (
                    share(scale_loss(outputs[0], loss_scale), num_micro_batches, loss),
                    (outputs[0], loss.den(outputs), aux.pick(outputs), new_buffers),
                )

            (_, (micro_loss, den, micro_aux, new_buffers)), grads = jax.value_and_grad(loss_of, has_aux=True)(train)
            return micro_loss, den, micro_aux, grads, new_buffers

        whole_loss, grads, new_buffers, den, whole_aux = accumulate(
            grad_of, list(inputs), buffers, key, num_micro_batches, loss, aux
        )
        if data_axis is not None:
            whole_loss, grads = micro_batch_loss.combine_replicas(loss, whole_loss, den, grads, data_axis)
            whole_aux = aux.over_replicas(whole_aux, data_axis)
        grads = unscale_grads(grads, loss_scale)
        if grad_shardings:  # ZeRO: reduce-scatter the gradients instead of all-reducing them
            from jaxbackend.sharding import constrain

            grads = {n: constrain(g, grad_shardings.get(n)) for n, g in grads.items()}
        finite = None
        if check_finite:
            finite = jnp.isfinite(whole_loss) & (
                all_finite(grads) if count_nonfinite is None else count_nonfinite(grads) == 0
            )
        new_params, new_state, norm = optimizer_tail(
            spec, params, grads, opt_state, scalars, grad_clip_norm=grad_clip_norm, keep=finite
        )
        new_buffers = {**buffers, **new_buffers}
        if finite is None:
            return whole_loss, whole_aux, jnp.bool_(True), norm, new_params, new_state, new_buffers
        # the optimizer kept the parameters and its state itself (keep=finite)
        return whole_loss, whole_aux, finite, norm, new_params, new_state, keep_if(finite, new_buffers, buffers)

    return step


def over_data_replicas(step: Callable, mesh: Mesh, num_inputs: int, data_axis: str) -> Callable:
    """``step`` (:func:`make_fused_step` with ``data_axis``) as one program over ``mesh``: a ``shard_map`` manual over
    ``data_axis`` only, the batch leaves' rows split over it (replica ``r`` gets the ``r``-th block of every leaf's
    dim 0), everything else — state, scalars, key, and every output — the same on every replica (the parameters'
    layouts over the other axes are the arguments' own: those axes stay under XLA's partitioner).

    Not varying-typed (``check_vma=False``): under JAX's type checking a ``shard_map`` nested inside (context
    attention, a row-scattered matmul, split experts) gives its residuals for the backward an output spec naming the
    data axis as well, which the partitioner rejects as bound twice (``jax/_src/core.py``, ``nospec``'s TODO); the
    nested ones are unchecked too (:func:`jaxbackend.sharding.shard_map`)."""
    from jax.sharding import PartitionSpec

    whole, rows = PartitionSpec(), PartitionSpec(data_axis)
    return jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(whole, whole, whole, [rows] * num_inputs, whole, whole),
        out_specs=whole,
        axis_names={data_axis},
        check_vma=False,
    )


def remat_groups(graph: Graph, remat: str) -> Remat | None:
    """The lowering's activation checkpointing for ``remat`` (:mod:`torchpar.planner.remat`): one group per
    layer of ``graph``; ``None`` for ``"none"``. A graph with no numbered layers checkpoints nothing (logged)."""
    if check_remat(remat) == "none":
        return None
    groups = layer_groups(graph)
    if not groups:
        log.warning(
            "torchpar: remat=%r found no layers (numbered submodules, e.g. model.layers.3) in this graph; "
            "nothing is recomputed",
            remat,
        )
        return None
    return Remat(remat, groups)

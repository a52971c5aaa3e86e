"""The whole batch's loss and gradient from its micro-batches, for every way a step accumulates them.

The graph's loss reduction (:mod:`torchpar.ir.loss_parts`) says how micro-batch losses ``ℓ_m`` combine:
``"mean"`` → ``L = (1/M) Σ ℓ_m``, ``"sum"`` → ``L = Σ ℓ_m``, ``"ratio"`` (``ℓ_m = num_m / den_m``, ``den``
free of parameters) → ``L = Σ num_m / D`` with ``D = Σ den_m``. Every step differentiates
``share · S · ℓ_m`` per micro-batch (``S`` the fp16 loss scale, 1 without it; ``share`` = ``1/M`` for a mean or
ratio, ``1`` for a sum), so the backward's values keep the magnitudes PyTorch's whole-batch backward has
(``GradScaler`` overflows where PyTorch's does). A ratio then weighs micro-batch ``m``'s gradient by
``w_m = den_m / r`` (``r`` = the first micro-batch's denominator, or 1 if it is 0: ``w_m ≈ 1``) and multiplies
the sum by ``M·r / D``::

    Σ_m w_m · (S/M) ∇ℓ_m · (M r / D) = Σ_m (den_m / r)(S/M)(∇num_m / den_m)(M r / D)
                                     = S · Σ_m ∇num_m / D = S · ∇L

A micro-batch with ``den_m = 0`` (every token ignored) contributes nothing: its ``0/0`` loss and gradients are
masked out (``where``, not ``0 · nan``), as the whole batch's sums leave it out. ``D = 0`` gives a nan loss, as
PyTorch's ``0/0`` does.

- one-stage steps (:func:`.train_step.accumulate`): the weighting happens as each micro-batch's gradients are
  added; the factor after the last one;
- pipelines: the last stage seeds micro-batch ``m``'s backward with ``share·S·w_m`` (:meth:`.stage_program.
  StageProgram.ratio_seed`), so every stage's accumulated gradients carry the weights; the driver multiplies the
  update (and the clipping norm) by ``M r / D`` (:func:`gradient_factor`) from the denominators the last stage
  reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torchpar.ir.graph import Graph
from torchpar.ir.loss_parts import LOSS_DEN, ReductionKind, loss_reduction

if TYPE_CHECKING:
    import jax


@dataclass(frozen=True)
class MicroBatchLoss:
    """How a lowered graph's micro-batch losses combine: the reduction and where its denominator comes out."""

    kind: ReductionKind = "mean"
    den_output: int | None = None
    """``"ratio"``: the denominator's position among the lowered function's outputs (its non-buffer outputs)."""

    @classmethod
    def of(cls, graph: Graph) -> MicroBatchLoss:
        reduction = loss_reduction(graph)
        if reduction.kind != "ratio":
            return cls(reduction.kind)
        values = [o for o in graph.outputs if o.kind != "buffer"]
        return cls("ratio", next(i for i, o in enumerate(values) if o.kind == LOSS_DEN))

    @property
    def is_ratio(self) -> bool:
        return self.kind == "ratio"

    def seed_share(self, num_micro_batches: int) -> float:
        """The factor of each micro-batch's loss in the value differentiated: ``1`` for a sum, else ``1/M``."""
        return 1.0 if self.kind == "sum" else 1.0 / num_micro_batches

    def den(self, outputs: Sequence[jax.Array]) -> jax.Array | None:
        """A ratio's denominator among the lowered outputs (``None`` for other reductions)."""
        return outputs[self.den_output] if self.den_output is not None else None


# --- in the executables (JAX) -----------------------------------------------------------------------------


def reference_of(den: jax.Array) -> jax.Array:
    """``r``: the first micro-batch's denominator as float32, or 1 where it is 0."""
    import jax.numpy as jnp

    den = den.astype(jnp.float32)
    return jnp.where(den != 0, den, jnp.float32(1))


def weigh(grads: Mapping[str, jax.Array], den: jax.Array, reference: jax.Array) -> dict[str, jax.Array]:
    """Each gradient times ``den / r`` (float32 product, in its own dtype); zero where ``den`` is 0."""
    import jax.numpy as jnp

    den = den.astype(jnp.float32)
    weight = den / reference
    keep = den != 0
    return {
        n: jnp.where(keep, (g.astype(jnp.float32) * weight).astype(g.dtype), jnp.zeros((), g.dtype))
        for n, g in grads.items()
    }


def numerator(loss: jax.Array, den: jax.Array) -> jax.Array:
    """``num_m = ℓ_m · den_m`` in float32, 0 where ``den_m`` is 0 (whose ``ℓ_m`` is ``0/0``)."""
    import jax.numpy as jnp

    den = den.astype(jnp.float32)
    return jnp.where(den != 0, loss.astype(jnp.float32) * den, jnp.float32(0))


def combine_replicas(
    loss: MicroBatchLoss, value: jax.Array, den: jax.Array | None, grads: Mapping[str, jax.Array], axis: str
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The whole batch's loss and gradients from each data replica's (inside a ``shard_map`` manual over ``axis``;
    every replica holds an equal share of the rows): ``value``, ``grads`` are the replica's own, as :func:`.train_step.
    accumulate` returns them, ``den`` its ratio denominator. A mean averages over the replicas, a sum adds, a ratio
    weighs each replica by its denominator: ``L = Σ_r D_r L_r / Σ_r D_r`` and ``∇L = Σ_r D_r ∇L_r / Σ_r D_r``
    (a replica with ``D_r = 0`` left out, as its ``0/0`` is; ``Σ D_r = 0`` gives nan, as PyTorch's ``0/0``). One
    ``psum`` per gradient, in its own dtype (a ratio's products in float32)."""
    import jax
    import jax.numpy as jnp

    if loss.kind == "sum":
        return jax.lax.psum(value, axis), {n: jax.lax.psum(g, axis) for n, g in grads.items()}
    if loss.kind == "mean":
        return jax.lax.pmean(value, axis), {n: jax.lax.pmean(g, axis) for n, g in grads.items()}
    assert den is not None  # a ratio loss's replicas have their denominators
    den = den.astype(jnp.float32)
    keep = den != 0
    total = jax.lax.psum(den, axis)
    whole = jax.lax.psum(jnp.where(keep, value.astype(jnp.float32) * den, jnp.float32(0)), axis) / total
    combined = {}
    for n, g in grads.items():
        weighted = jnp.where(keep, g.astype(jnp.float32) * den, jnp.zeros((), jnp.float32))
        combined[n] = (jax.lax.psum(weighted, axis) / total).astype(g.dtype)
    return whole.astype(value.dtype), combined


# --- on the host (pipelines) -------------------------------------------------------------------------------


def whole_batch_loss(kind: ReductionKind, losses: Sequence[float], dens: Sequence[float]) -> float:
    """``L`` from the micro-batch losses (and a ratio's denominators), in float64."""
    import math

    if kind == "sum":
        return float(math.fsum(losses))
    if kind == "mean":
        return float(math.fsum(losses) / len(losses))
    if len(dens) != len(losses):
        raise AssertionError(f"{len(losses)} micro-batch losses but {len(dens)} denominators")
    total = math.fsum(dens)
    num = math.fsum(loss * den for loss, den in zip(losses, dens) if den != 0)
    return num / total if total != 0 else math.nan


def gradient_factor(num_micro_batches: int, reference: float, dens: Sequence[float]) -> float:
    """A ratio's ``M·r / D``: turns the weighted gradient sum into the whole batch's gradient (module docstring)."""
    import math

    total = math.fsum(dens)
    return num_micro_batches * reference / total if total != 0 else math.nan


__all__ = [
    "MicroBatchLoss",
    "combine_replicas",
    "gradient_factor",
    "numerator",
    "reference_of",
    "weigh",
    "whole_batch_loss",
]

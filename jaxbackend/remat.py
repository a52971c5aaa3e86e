"""Activation checkpointing (rematerialization) of a lowered graph, as data the lowering applies.

A :class:`Remat` names groups of consecutive graph nodes (one per model layer, chosen by
:mod:`torchpar.planner.remat`) and a policy. :func:`jaxbackend.lower.lower` computes each group inside
``jax.checkpoint``, so the backward pass that ``jax.grad`` derives keeps only what the policy saves and
recomputes the rest of the group's forward when it needs it:

| policy | kept for the backward, per group | recomputed in the backward |
|---|---|---|
| ``"layers"`` | the group's inputs | the group's whole forward |
| ``"selective"`` | its inputs and the outputs of matmuls without batch dimensions (the linear layers) | everything else: elementwise ops, norms, softmax, attention's batched products |

Memory and time. Without remat a layer keeps every residual its backward reads (for a transformer layer of
``b·s`` tokens and width ``h`` with ``a`` heads, about ``b·s·(34·h + 5·a·s)`` bytes in fp32-equivalent units,
Korthikanti et al. 2022); with ``"layers"`` it keeps its input (``b·s·h`` elements) and pays one more forward
of the layer (about a third more compute per step); ``"selective"`` keeps the linear layers' outputs and
recomputes the cheap, memory-hungry rest (attention scores and softmax, activations, norms) for a few percent
more compute. Random ops draw from ``fold_in(key, node_index)``, so a recomputed dropout draws the same mask:
losses and gradients are those of the run without remat, up to XLA's reassociation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

POLICIES = ("layers", "selective")

R = TypeVar("R")


@dataclasses.dataclass(frozen=True)
class Remat:
    """``groups``: tuples of node names, each a run of consecutive nodes of the graph being lowered (names that
    are not in the graph are ignored, so one ``Remat`` serves a whole graph and its pipeline stages);
    ``policy``: one of :data:`POLICIES`."""

    policy: str
    groups: tuple[tuple[str, ...], ...]

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"remat policy must be one of {POLICIES}, got {self.policy!r}")


def checkpoint(fn: Callable[..., R], policy: str) -> Callable[..., R]:
    """``fn(*args)`` whose backward recomputes what ``policy`` does not keep (module docstring), and recomputes it
    only once the cotangent of its results exists.

    ``jax.checkpoint`` alone marks the recomputation, but nothing orders it after the layers above: measured on
    XLA:CPU (jax 0.10), 8 unrolled checkpointed layers of ``tanh(x W)`` keep 680 MiB of temporaries, exactly as
    many as without ``jax.checkpoint`` (the scheduler runs the recomputation during the forward; the
    optimization barriers are gone by then). So the backward adds ``0 · g₀`` (``g₀`` an element of the first
    floating cotangent) to every floating residual before the pullback recomputes from them: a data dependency
    no pass removes (``x · 0`` is not folded for floats), which brings those layers to 176 MiB. Integer residuals
    and PRNG keys (their key data) get the same ``0 · g₀``, converted: a recomputed dropout's mask depends on the
    step's key alone, and untied XLA drew every layer's mask in the forward and kept them all (GPT-2 124M,
    8 × 1024, ``"layers"``: 24.7 GB of temporaries with the key untied, 13.9 GB tied). It costs one elementwise
    pass over the residuals (the layer's inputs and weights, and what the policy saved). A non-finite ``g₀`` makes the recomputed values NaN or the key arbitrary, where the gradients are
    non-finite anyway (the step is skipped).
    """
    saved = jax.checkpoint(fn, policy=_SAVEABLE[policy], prevent_cse=True)

    @jax.custom_vjp
    def call(*args: object) -> R:
        return fn(*args)

    def forward(*args: object) -> tuple[R, Callable[[R], tuple[object, ...]]]:
        return jax.vjp(saved, *args)

    def backward(pullback: Callable[[R], tuple[object, ...]], cotangent: R) -> tuple[object, ...]:
        anchor = _first_float(cotangent)
        if anchor is not None:
            pullback = jax.tree_util.tree_map(lambda residual: _depend(residual, anchor), pullback)
        return pullback(cotangent)

    call.defvjp(forward, backward)
    return call


_SAVEABLE = {
    "layers": jax.checkpoint_policies.nothing_saveable,
    "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _first_float(tree: object) -> jax.Array | None:
    for leaf in jax.tree_util.tree_leaves(tree):
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.size:
            return leaf.ravel()[0]
    return None


def _depend(value: ArrayLike, anchor: jax.Array) -> ArrayLike:
    if not hasattr(value, "dtype"):
        return value
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        data = jax.random.key_data(value)
        return jax.random.wrap_key_data(data + (anchor * 0).astype(data.dtype), impl=jax.random.key_impl(value))
    if jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer):
        return value + (anchor * 0).astype(value.dtype)
    return value

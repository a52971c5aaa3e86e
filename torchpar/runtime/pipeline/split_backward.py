"""A stage's backward split into an input-gradient part B and a weight-gradient part W (ZB-H1).

A stage's backward is one function ``bwd(residuals, cotangents) → (∂θ, ∂x)``: the parameter gradients
and the cotangents of its activation inputs (what the previous stage waits for). Traced once to a jaxpr,
its equations are split by data flow:

    B = the equations that the ∂x outputs depend on (the backward slice from them)
    W = every other equation (those that only the ∂θ outputs need)

B returns ∂x and the *carry*: every value B computes that W reads. For a linear layer ``y = x·θ`` B holds
the chain ``∂y → ∂x = ∂y·θᵀ`` and carries ``∂y``; W computes ``∂θ = xᵀ·∂y`` from it and the forward
residual ``x``. Every equation of the fused backward runs exactly once, in B or in W: the split adds no
FLOPs, only the carry's memory from B to W, a second executable launch, and the fusions XLA can no longer
make across the cut (measured against the fused backward in ``benchmarks/pipeline_schedules.py``).

Calls are inlined first (``jit`` and ``checkpoint`` bodies: :func:`_inline`): an equation that feeds both
∂x and ∂θ lands in B whole, so the split is as fine as the jaxpr's equations. Control flow (``scan``,
``while``, ``cond``) and custom-derivative calls stay whole. The last stage's backward starts from the loss
seed; stage 0's ∂x is empty, so its B computes nothing and its W the whole backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import jax
from jax.extend import core as jcore
from jax.tree_util import PyTreeDef

if TYPE_CHECKING:
    from jax.core import ShapedArray


@dataclass(frozen=True)
class SplitBackward:
    """The two parts of one backward, for one signature of its arguments (both plain, un-jitted functions
    of the same ``*args`` as the fused backward)."""

    input_part: Callable[..., tuple[object, tuple[jax.Array, ...]]]
    """``input_part(*args) → (∂x, carry)``."""
    weight_part: Callable[..., object]
    """``weight_part(*args, carry) → ∂θ`` (the ``args`` a jitted caller does not read are dropped by XLA)."""
    equations: tuple[int, int]
    """How many equations of the traced backward each part runs (B, W)."""
    carry_bytes: int
    """Bytes of the values B hands to W per micro-batch."""


def split_backward(backward: Callable[..., tuple[object, object]], *args: object) -> SplitBackward:
    """Trace ``backward(*args) → (∂θ, ∂x)`` and split it into B and W (see the module docstring)."""
    nested, out_shape = jax.make_jaxpr(backward, return_shape=True)(*args)
    closed = jax.make_jaxpr(lambda *leaves: _inline(nested.jaxpr, nested.consts, leaves))(*jax.tree.leaves(args))
    grads_shape, acts_shape = out_shape
    grads_tree: PyTreeDef = jax.tree.structure(grads_shape)
    acts_tree: PyTreeDef = jax.tree.structure(acts_shape)
    jaxpr = closed.jaxpr
    num_grads = grads_tree.num_leaves
    grad_out, act_out = list(jaxpr.outvars[:num_grads]), list(jaxpr.outvars[num_grads:])

    needed = {v for v in act_out if isinstance(v, jcore.Var)}
    in_b = [False] * len(jaxpr.eqns)
    for index in reversed(range(len(jaxpr.eqns))):
        eqn = jaxpr.eqns[index]
        if any(isinstance(o, jcore.Var) and o in needed for o in eqn.outvars):
            in_b[index] = True
            needed.update(v for v in eqn.invars if isinstance(v, jcore.Var))
    b_eqns = [e for e, b in zip(jaxpr.eqns, in_b) if b]
    w_eqns = [e for e, b in zip(jaxpr.eqns, in_b) if not b]
    made_by_b = {o for e in b_eqns for o in e.outvars}
    carry: list[jcore.Var] = []
    for v in [*(x for e in w_eqns for x in e.invars), *grad_out]:
        if isinstance(v, jcore.Var) and v in made_by_b and v not in carry:
            carry.append(v)

    b_jaxpr = jcore.Jaxpr(jaxpr.constvars, jaxpr.invars, [*act_out, *carry], b_eqns, jaxpr.effects)
    w_jaxpr = jcore.Jaxpr(jaxpr.constvars, [*jaxpr.invars, *carry], grad_out, w_eqns, jaxpr.effects)
    run_b = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(b_jaxpr, closed.consts))
    run_w = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(w_jaxpr, closed.consts))
    num_acts = acts_tree.num_leaves

    def input_part(*call_args: object) -> tuple[object, tuple[jax.Array, ...]]:
        outs = run_b(*jax.tree.leaves(call_args))
        return jax.tree.unflatten(acts_tree, outs[:num_acts]), tuple(outs[num_acts:])

    def weight_part(*call_args: object) -> object:
        *fused_args, carried = call_args
        carried = cast("tuple[jax.Array, ...]", carried)  # the carry input_part returned
        return jax.tree.unflatten(grads_tree, run_w(*jax.tree.leaves(fused_args), *carried))

    carried_avals = (cast("ShapedArray", v.aval) for v in carry)  # carried values are arrays
    carry_bytes = sum(aval.size * aval.dtype.itemsize for aval in carried_avals)
    return SplitBackward(input_part, weight_part, (len(b_eqns), len(w_eqns)), int(carry_bytes))


_CALLS = ("pjit", "jit", "closed_call", "core_call", "checkpoint", "remat", "remat2")
"""Primitives whose body :func:`_inline` evaluates in place (their ``jaxpr`` / ``call_jaxpr`` parameter)."""


def _inline(jaxpr: jcore.Jaxpr, consts: Sequence[object], args: Sequence[object]) -> list[object]:
    """Evaluate ``jaxpr`` on ``args`` (under a trace: re-emit its equations), with the bodies of calls
    (:data:`_CALLS`) evaluated in place rather than bound as one equation."""
    env: dict[jcore.Var, object] = {}

    def read(v: jcore.Var | jcore.Literal) -> object:
        return v.val if isinstance(v, jcore.Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        body = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr")) if eqn.primitive.name in _CALLS else None
        if body is not None:
            inner, inner_consts = (body.jaxpr, body.consts) if isinstance(body, jcore.ClosedJaxpr) else (body, ())
            outs = _inline(inner, inner_consts, values)
        else:
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
            outs = outs if eqn.primitive.multiple_results else [outs]
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]

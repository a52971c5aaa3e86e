r"""SGD, Adam and AdamW in pure JAX, with torch.optim's exact update formulas.

The update is a pure function of (params, grads, state, scalars) so it can be jitted once per
`OptimizerSpec` (a static argument holding only structural, compile-time facts) and reused for every
step: all hyper-parameters, including ones a learning-rate scheduler changes, arrive as runtime
scalars built on the host by `step_scalars`. Nothing here imports torch.

Notation: θ a parameter, g its gradient, t the (1-based) step of the param group, γ lr, λ weight
decay, μ momentum, τ dampening, β₁ β₂ the betas, ε eps. All scalars are rounded to float32 on the
host, as torch rounds a Python float to the tensor's dtype inside its kernels; everything derived
from several hyper-parameters (1 - τ, 1 - β, 1 - γλ, bias corrections) is computed in float64 first,
as torch does in its non-capturable path.

SGD (torch/optim/sgd.py, ``_single_tensor_sgd``)::

    g ← -g                          if maximize
    g ← g + λ·θ
    if μ ≠ 0:
        b ← g                       on the group's first momentum step (torch: grad.clone(), no τ)
        b ← μ·b + (1 - τ)·g         otherwise
        g ← g + μ·b                 if nesterov
        g ← b                       otherwise
    θ ← θ + (-γ)·g

Adam (torch/optim/adam.py, ``_single_tensor_adam``, decoupled_weight_decay=False)::

    g ← -g                          if maximize
    g ← g + λ·θ
    m ← lerp(m, g, 1 - β₁)          torch.lerp: w = 1-β₁; |w| < ½ ? m + w·(g - m) : g - (g - m)·(1 - w)
    v ← β₂·v + ((1 - β₂)·g)·g
    v̂ ← max(v̂, v)                  if amsgrad (state "max_exp_avg_sq"; the denominator uses v̂)
    denom ← √v / √(1 - β₂ᵗ) + ε
    θ ← θ + ((-γ / (1 - β₁ᵗ))·m) / denom

AdamW (torch/optim/adamw.py = Adam with decoupled_weight_decay=True): as Adam, except that the
weight decay multiplies the parameter before anything else and never touches g::

    θ ← θ·(1 - γλ)

Gradient clipping (torch.nn.utils.clip_grad_norm_, norm_type=2)::

    n ← ‖(‖g₁‖₂, …, ‖g_k‖₂)‖₂,   c ← min(max_norm / (n + 1e-6), 1),   gᵢ ← c·gᵢ

The scalars pytree (`step_scalars` output, argument of `apply_updates`) is described in
`torchpar.ir.optimizer`, where it is built, with `OptimizerSpec`.

Math runs in the parameter's dtype promoted to at least float32 (torch's "opmath") and results are
cast back to the parameter's dtype, so bf16 parameters are updated in float32 and rounded once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from torchpar.ir.optimizer import OPTIMIZER_KINDS, OptimizerSpec, Scalars, state_keys, step_scalars

__all__ = [
    "OPTIMIZER_KINDS",
    "OptimizerSpec",
    "init_state",
    "apply_updates",
    "clip_grads_by_global_norm",
    "clip_coefficient",
    "step_scalars",
    "state_keys",
]

Array = jax.Array
Params = dict[str, Array]
State = dict[str, dict[str, Array]]


def init_state(spec: OptimizerSpec, params: Mapping[str, Array]) -> State:
    """Zero state for every parameter in `spec.param_names`; same shape and dtype as the parameter.

    Step counts are per group and live on the host (they enter through `step_scalars`), so the
    state holds tensors only.
    """
    missing = [n for n in spec.param_names if n not in params]
    if missing:
        raise ValueError(f"init_state: params lack optimizer parameters {missing}")
    return {
        name: {key: jnp.zeros_like(params[name]) for key in state_keys(spec, group)}
        for name, group in zip(spec.param_names, spec.group_of_param)
    }


def apply_updates(
    spec: OptimizerSpec,
    params: Mapping[str, Array],
    grads: Mapping[str, Array],
    state: Mapping[str, Mapping[str, Array]],
    scalars: Scalars,
) -> tuple[Params, State]:
    """One optimizer step; pure and jittable with `spec` static. Returns (new_params, new_state).

    Parameters not in `spec.param_names`, and spec parameters absent from `grads` (no gradient this
    step, like a torch parameter whose ``.grad`` is None), are returned unchanged with their state.
    """
    assert len(scalars) == spec.num_groups, (len(scalars), spec.num_groups)
    update = _sgd_update if spec.kind == "sgd" else _adam_update
    new_params = dict(params)
    new_state: State = {}
    for name, group in zip(spec.param_names, spec.group_of_param):
        if name not in grads:  # no gradient this step (PyTorch: .grad is None): leave it alone
            new_state[name] = dict(state[name])
            continue
        new_params[name], new_state[name] = update(
            spec, group, params[name], grads[name], state[name], scalars[group]
        )
    return new_params, new_state


def _opmath(x: Array) -> tuple[Array, Any]:
    """Upcast to at least float32 (torch computes low-precision updates in float32)."""
    dtype = jnp.promote_types(x.dtype, jnp.float32)
    return x.astype(dtype), dtype


def _sgd_update(spec, group, p, g, state, s):
    p_dtype, buf_dtype = p.dtype, state["momentum_buffer"].dtype
    p, dt = _opmath(p)
    g = g.astype(dt)
    buf = state["momentum_buffer"].astype(dt)
    lr, wd, mu, one_minus_damp = (s[k].astype(dt) for k in ("lr", "weight_decay", "momentum", "one_minus_dampening"))

    if spec.maximize[group]:
        g = -g
    g = g + wd * p
    # Operand order matters on CPU: LLVM fuses the *first* product of `x*y + z*w` into an FMA, and
    # torch's buf.mul_(μ).add_(g, alpha=1-τ) is fma(g, 1-τ, round(μ·b)); this order reproduces it.
    new_buf = jnp.where(s["momentum_init"], g, one_minus_damp * g + buf * mu)
    direction = g + mu * new_buf if spec.nesterov[group] else new_buf
    direction = jnp.where(s["momentum_on"], direction, g)
    new_buf = jnp.where(s["momentum_on"], new_buf, buf)  # torch leaves the buffer alone when μ = 0
    new_p = p + (-lr) * direction
    return new_p.astype(p_dtype), {"momentum_buffer": new_buf.astype(buf_dtype)}


def _lerp(start: Array, end: Array, weight: Array) -> Array:
    """torch.lerp's two-sided formula (aten/src/ATen/native/Lerp.h), exact at weight 0 and 1."""
    diff = end - start
    return jnp.where(jnp.abs(weight) < 0.5, start + weight * diff, end - diff * (1 - weight))


def _adam_update(spec, group, p, g, state, s):
    p_dtype = p.dtype
    p, dt = _opmath(p)
    g = g.astype(dt)
    m, v = state["exp_avg"].astype(dt), state["exp_avg_sq"].astype(dt)

    if spec.maximize[group]:
        g = -g
    if spec.kind == "adamw":
        p = p * s["param_scale"].astype(dt)
    else:
        g = g + s["weight_decay"].astype(dt) * p
    m = _lerp(m, g, s["beta1_weight"].astype(dt))
    v = (s["one_minus_beta2"].astype(dt) * g) * g + v * s["beta2"].astype(dt)  # order: see _sgd_update
    new_state = {"exp_avg": m.astype(state["exp_avg"].dtype), "exp_avg_sq": v.astype(state["exp_avg_sq"].dtype)}
    if spec.amsgrad[group]:
        v_max = jnp.maximum(state["max_exp_avg_sq"].astype(dt), v)
        new_state["max_exp_avg_sq"] = v_max.astype(state["max_exp_avg_sq"].dtype)
        v = v_max
    denom = jnp.sqrt(v) / s["bias_correction2_sqrt"].astype(dt) + s["eps"].astype(dt)
    new_p = p + (s["neg_step_size"].astype(dt) * m) / denom
    return new_p.astype(p_dtype), new_state


def clip_grads_by_global_norm(grads: Mapping[str, Array], max_norm: float | Array,
                              complete_sum: Callable[[str, Array], Array] | None = None) -> tuple[dict[str, Array], Array]:
    """torch.nn.utils.clip_grad_norm_(…, max_norm, norm_type=2): returns (clipped grads, total norm).

    Like torch, always multiplies by the clamped coefficient (1 when the norm is below max_norm),
    so there is no data-dependent branch. The total norm is float32 (the norm of per-tensor norms).
    ``complete_sum(name, s)``, inside ``shard_map``: the whole tensor's sum of squares from this device's
    ``s`` (a ``psum`` over the axes sharding that gradient).
    """
    if not grads:
        return dict(grads), jnp.zeros((), jnp.float32)
    complete_sum = complete_sum or (lambda name, s: s)
    norms = [jnp.sqrt(complete_sum(k, jnp.sum(jnp.square(_opmath(g)[0])))) for k, g in grads.items()]
    total_norm = jnp.sqrt(jnp.sum(jnp.square(jnp.stack([n.astype(jnp.float32) for n in norms]))))
    clip_coef = clip_coefficient(total_norm, max_norm)
    clipped = {k: (g * clip_coef.astype(g.dtype)).astype(g.dtype) for k, g in grads.items()}
    return clipped, total_norm


def clip_coefficient(total_norm: Array | float, max_norm: float | Array) -> Array:
    """``clip_grad_norm_``'s factor ``min(max_norm / (total_norm + 1e-6), 1)`` in float32: every gradient is
    multiplied by it (the one clipping formula; a pipeline computes ``total_norm`` across its stages)."""
    return jnp.minimum(jnp.asarray(max_norm, jnp.float32) / (jnp.asarray(total_norm, jnp.float32) + 1e-6), 1.0)

r"""SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam and Adadelta in pure JAX, with torch.optim's exact
update formulas.

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

Every other optimizer starts with ``g ← -g`` if maximize, then ``g ← g + λ·θ`` (coupled weight decay; NAdam and
RAdam with decoupled_weight_decay instead do ``θ ← θ·(1 - γλ)`` and leave g alone), and follows the
``_single_tensor_*`` function of its torch/optim module, operation by operation (addcmul ``a + (c·x)·y``,
addcdiv ``a + (c·x)/y``, lerp as above)::

    Adagrad:  s ← s + g·g;  θ ← θ + (-γ/(1 + (t-1)·lr_decay))·g / (√s + ε)
    RMSprop:  v ← α·v + (1-α)·g·g;  ḡ ← lerp(ḡ, g, 1-α) and d ← √(v - ḡ·ḡ) + ε if centered, else d ← √v + ε
              μ > 0: b ← μ·b + g/d, θ ← θ - γ·b;   else θ ← θ + (-γ·g)/d
    Adamax:   m ← lerp(m, g, 1-β₁);  u ← max(β₂·u, |g| + ε);  θ ← θ + (-γ/(1-β₁ᵗ))·m / u
    NAdam:    μₜ = β₁(1 - ½·0.96^(tψ)), Π ← Π·μₜ (float32 host counter "mu_product");
              m ← lerp(m, g, 1-β₁);  v ← β₂·v + (1-β₂)·g·g;  d ← √(v / (1-β₂ᵗ)) + ε
              θ ← θ + (-γ(1-μₜ)/(1-Π))·g / d;  θ ← θ + (-γμₜ₊₁/(1-Πμₜ₊₁))·m / d
    RAdam:    m, v as NAdam;  m̂ ← m / (1-β₁ᵗ);  ρ∞ = 2/(1-β₂) - 1,  ρₜ = ρ∞ - 2tβ₂ᵗ/(1-β₂ᵗ)
              ρₜ > 5: θ ← θ - ((m̂·γ)·(√(1-β₂ᵗ)·(1/(√v + ε))))·r  (r the rectification term);  else θ ← θ - m̂·γ
    Adadelta: v ← ρ·v + (1-ρ)·g·g;  δ ← (√(a + ε) / √(v + ε))·g;  a ← ρ·a + (1-ρ)·δ·δ;  θ ← θ + (-γ)·δ

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
    state holds tensors only. Adagrad's ``sum`` starts at ``initial_accumulator_value``, which the spec does not
    hold: zeros here are right only for the default 0 (`TorchOptimizerBridge.initial_state` fills it).
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
    update = _UPDATES[spec.kind]
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


def _coupled_grad(spec, group, p, g, s, dt):
    """maximize, then torch's ``grad.add(param, alpha=weight_decay)``."""
    if spec.maximize[group]:
        g = -g
    return g + s["weight_decay"].astype(dt) * p


def _adagrad_update(spec, group, p, g, state, s):
    p_dtype = p.dtype
    p, dt = _opmath(p)
    g = _coupled_grad(spec, group, p, g.astype(dt), s, dt)
    acc = state["sum"].astype(dt)
    acc = acc + g * g  # state_sum.addcmul_(grad, grad, value=1)
    std = jnp.sqrt(acc) + s["eps"].astype(dt)
    new_p = p + (s["neg_clr"].astype(dt) * g) / std
    return new_p.astype(p_dtype), {"sum": acc.astype(state["sum"].dtype)}


def _rmsprop_update(spec, group, p, g, state, s):
    p_dtype = p.dtype
    p, dt = _opmath(p)
    g = _coupled_grad(spec, group, p, g.astype(dt), s, dt)
    sq = state["square_avg"].astype(dt)
    sq = (s["one_minus_alpha"].astype(dt) * g) * g + sq * s["alpha"].astype(dt)  # order: see _sgd_update
    new_state = {"square_avg": sq.astype(state["square_avg"].dtype)}
    if spec.centered[group]:
        grad_avg = _lerp(state["grad_avg"].astype(dt), g, s["one_minus_alpha"].astype(dt))
        new_state["grad_avg"] = grad_avg.astype(state["grad_avg"].dtype)
        avg = jnp.sqrt(sq + (-grad_avg) * grad_avg)  # square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_()
    else:
        avg = jnp.sqrt(sq)
    avg = avg + s["eps"].astype(dt)
    lr = s["lr"].astype(dt)
    if spec.has_momentum[group]:
        buf = g / avg + state["momentum_buffer"].astype(dt) * s["momentum"].astype(dt)  # buf.mul_(μ).addcdiv_(g, avg)
        new_state["momentum_buffer"] = buf.astype(state["momentum_buffer"].dtype)
        new_p = p + (-lr) * buf
    else:
        new_p = p + ((-lr) * g) / avg
    return new_p.astype(p_dtype), {k: new_state[k] for k in state_keys(spec, group)}


def _adamax_update(spec, group, p, g, state, s):
    p_dtype = p.dtype
    p, dt = _opmath(p)
    g = _coupled_grad(spec, group, p, g.astype(dt), s, dt)
    m = _lerp(state["exp_avg"].astype(dt), g, s["beta1_weight"].astype(dt))
    u = jnp.maximum(state["exp_inf"].astype(dt) * s["beta2"].astype(dt), jnp.abs(g) + s["eps"].astype(dt))
    new_p = p + (s["neg_clr"].astype(dt) * m) / u
    return new_p.astype(p_dtype), {"exp_avg": m.astype(state["exp_avg"].dtype),
                                   "exp_inf": u.astype(state["exp_inf"].dtype)}


def _adam_moments(p, g, state, s, dt):
    """NAdam/RAdam: decoupled decay (param_scale is 1 without it), then the two moments as Adam updates them."""
    p = p * s["param_scale"].astype(dt)
    m = _lerp(state["exp_avg"].astype(dt), g, s["beta1_weight"].astype(dt))
    v = (s["one_minus_beta2"].astype(dt) * g) * g + state["exp_avg_sq"].astype(dt) * s["beta2"].astype(dt)
    return p, m, v


def _nadam_update(spec, group, p, g, state, s):
    p_dtype = p.dtype
    p, dt = _opmath(p)
    g = _coupled_grad(spec, group, p, g.astype(dt), s, dt)  # weight_decay is 0 when decoupled
    p, m, v = _adam_moments(p, g, state, s, dt)
    denom = jnp.sqrt(v / s["bias_correction2"].astype(dt)) + s["eps"].astype(dt)
    new_p = p + (s["grad_coef"].astype(dt) * g) / denom
    new_p = new_p + (s["exp_avg_coef"].astype(dt) * m) / denom
    return new_p.astype(p_dtype), {"exp_avg": m.astype(state["exp_avg"].dtype),
                                   "exp_avg_sq": v.astype(state["exp_avg_sq"].dtype)}


def _radam_update(spec, group, p, g, state, s):
    p_dtype = p.dtype
    p, dt = _opmath(p)
    g = _coupled_grad(spec, group, p, g.astype(dt), s, dt)
    p, m, v = _adam_moments(p, g, state, s, dt)
    corrected = (m / s["bias_correction1"].astype(dt)) * s["lr"].astype(dt)
    adaptive = s["bias_correction2_sqrt"].astype(dt) * (1 / (jnp.sqrt(v) + s["eps"].astype(dt)))  # x.reciprocal() * c
    rectified = (corrected * adaptive) * s["rect"].astype(dt)
    new_p = p - jnp.where(s["rectify"], rectified, corrected)
    return new_p.astype(p_dtype), {"exp_avg": m.astype(state["exp_avg"].dtype),
                                   "exp_avg_sq": v.astype(state["exp_avg_sq"].dtype)}


def _adadelta_update(spec, group, p, g, state, s):
    p_dtype = p.dtype
    p, dt = _opmath(p)
    g = _coupled_grad(spec, group, p, g.astype(dt), s, dt)
    rho, one_minus_rho, eps = (s[k].astype(dt) for k in ("rho", "one_minus_rho", "eps"))
    sq = (one_minus_rho * g) * g + state["square_avg"].astype(dt) * rho
    std = jnp.sqrt(sq + eps)
    acc = state["acc_delta"].astype(dt)
    delta = (jnp.sqrt(acc + eps) / std) * g
    acc = (one_minus_rho * delta) * delta + acc * rho
    new_p = p + (-s["lr"].astype(dt)) * delta
    return new_p.astype(p_dtype), {"square_avg": sq.astype(state["square_avg"].dtype),
                                   "acc_delta": acc.astype(state["acc_delta"].dtype)}


_UPDATES = {
    "sgd": _sgd_update,
    "adam": _adam_update,
    "adamw": _adam_update,
    "adagrad": _adagrad_update,
    "rmsprop": _rmsprop_update,
    "adamax": _adamax_update,
    "nadam": _nadam_update,
    "radam": _radam_update,
    "adadelta": _adadelta_update,
}


def global_norm(grads: Mapping[str, Array], complete_sum: Callable[[str, Array], Array] | None = None) -> Array:
    """The L2 norm of all ``grads`` together, in float32, as ``torch.nn.utils.clip_grad_norm_`` computes it (the norm
    of the per-tensor norms); ``0`` for no gradients. ``complete_sum(name, s)``, inside ``shard_map``: the whole
    tensor's sum of squares from this device's ``s`` (a ``psum`` over the axes sharding that gradient)."""
    if not grads:
        return jnp.zeros((), jnp.float32)
    complete_sum = complete_sum or (lambda name, s: s)
    norms = [jnp.sqrt(complete_sum(k, jnp.sum(jnp.square(_opmath(g)[0])))) for k, g in grads.items()]
    return jnp.sqrt(jnp.sum(jnp.square(jnp.stack([n.astype(jnp.float32) for n in norms]))))


def clip_grads_by_global_norm(grads: Mapping[str, Array], max_norm: float | Array,
                              complete_sum: Callable[[str, Array], Array] | None = None) -> tuple[dict[str, Array], Array]:
    """torch.nn.utils.clip_grad_norm_(…, max_norm, norm_type=2): returns (clipped grads, total norm).

    Like torch, always multiplies by the clamped coefficient (1 when the norm is below max_norm),
    so there is no data-dependent branch. The total norm is :func:`global_norm` (``complete_sum`` as there).
    """
    if not grads:
        return dict(grads), jnp.zeros((), jnp.float32)
    total_norm = global_norm(grads, complete_sum)
    clip_coef = clip_coefficient(total_norm, max_norm)
    clipped = {k: (g * clip_coef.astype(g.dtype)).astype(g.dtype) for k, g in grads.items()}
    return clipped, total_norm


def clip_coefficient(total_norm: Array | float, max_norm: float | Array) -> Array:
    """``clip_grad_norm_``'s factor ``min(max_norm / (total_norm + 1e-6), 1)`` in float32: every gradient is
    multiplied by it (the one clipping formula; a pipeline computes ``total_norm`` across its stages)."""
    return jnp.minimum(jnp.asarray(max_norm, jnp.float32) / (jnp.asarray(total_norm, jnp.float32) + 1e-6), 1.0)

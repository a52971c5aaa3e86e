r"""SGD, Adam, AdamW, Adagrad, RMSprop, Adamax, NAdam, RAdam, Adadelta, ASGD, Rprop, Adafactor and Muon in pure JAX,
with torch.optim's exact update formulas.

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
    ASGD:     θ ← θ·(1 - λ_d·η);  θ ← θ + (-η)·g;  ax ← ax + μ·(θ - ax) if μ ≠ 1, else ax ← θ
              (η, μ: the group's float32 host counters, set after step t to γ/(1 + λ_d·γ·t)^α and 1/max(1, t - t₀);
              λ_d is ``lambd``, η starts at γ, μ at 1)

Rprop (no weight decay; the step sizes s start at γ on the first step, γ is not read after it)::

    f ← sign(g·g_prev);  f ← η₊ where f > 0, then η₋ where f < 0, then 1 where f = 0   (in the parameter's dtype)
    s ← clamp(s·f, s_min, s_max);  g ← 0 where f = η₋;  θ ← θ - sign(g)·s;  g_prev ← g

Adafactor (torch/optim/_adafactor.py; no coupled weight decay, maximize as above; RMS(x) = ‖x‖₂/√numel)::

    β̂₂ = 1 - t^δ (δ = beta2_decay: new statistics weigh t^δ),  ρ = min(γ, 1/√t),  α ← max(ε₂, RMS(θ))·ρ
    θ ← θ·(1 - γλ)
    ≥ 2 dims (factored over the last two, R of shape (…, n, 1), C of shape (…, 1, m)):
        R ← lerp(R, mean_last(g²), t^δ);  C ← lerp(C, mean_second_last(g²), t^δ)   (means as ‖·‖²/size)
        V ← (R·C) / max(mean_second_last(R), ε₁)
    otherwise:  V ← lerp(V, g², t^δ)
    u ← g / √max(V, ε₁²);  θ ← θ + (-α / max(1, RMS(u)/d))·u
    (ε₁ = None is torch.finfo(dtype).eps of the group's first parameter, resolved on the host)

Muon (torch/optim/_muon.py; 2-d parameters, no maximize)::

    m ← lerp(m, g, 1 - μ);  u ← lerp(g, m, μ) if nesterov else m      (m: "momentum_buffer")
    X ← bfloat16(u), transposed if it has more rows than columns;  X ← X / max(‖X‖_F, ε)
    k times:  A ← X·Xᵀ;  B ← b·A + c·A·A;  X ← a·X + B·X     ((a, b, c) = ns_coefficients, k = ns_steps; each
              product accumulated in float32, each line rounded once to bfloat16, as torch's CPU addmm)
    θ ← θ·(1 - γλ);  θ ← θ + (-γ·r)·X   with r = √max(1, rows/cols) ("original") or 0.2·√max(rows, cols)
    ("match_rms_adamw")

ASGD, Rprop, and every optimizer above, update each element from the same element of the gradient and the state;
Adafactor and Muon read whole tensors (`torchpar.ir.optimizer.NOT_ELEMENTWISE`): their update of a shard is not the
shard of their update, so the runtime runs them only on whole parameters (or under GSPMD, on global arrays).

Gradient clipping (torch.nn.utils.clip_grad_norm_, norm_type=2)::

    n ← ‖(‖g₁‖₂, …, ‖g_k‖₂)‖₂,   c ← min(max_norm / (n + 1e-6), 1),   gᵢ ← c·gᵢ

The scalars pytree (`step_scalars` output, argument of `apply_updates`) is described in
`torchpar.ir.optimizer`, where it is built, with `OptimizerSpec`.

Math runs in the parameter's dtype promoted to at least float32 (torch's "opmath") and results are
cast back to the parameter's dtype, so bf16 parameters are updated in float32 and rounded once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from torchpar.ir.optimizer import OPTIMIZER_KINDS, OptimizerSpec, Scalars, state_keys, state_shape, step_scalars

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
        name: {
            key: jnp.zeros(state_shape(spec, key, params[name].shape), params[name].dtype)
            for key in state_keys(spec, group, params[name].ndim)
        }
        for name, group in zip(spec.param_names, spec.group_of_param)
    }


def apply_updates(
    spec: OptimizerSpec,
    params: Mapping[str, Array],
    grads: Mapping[str, Array],
    state: Mapping[str, Mapping[str, Array]],
    scalars: Scalars,
    keep: Array | None = None,
) -> tuple[Params, State]:
    """One optimizer step; pure and jittable with `spec` static. Returns (new_params, new_state).

    Parameters not in `spec.param_names`, and spec parameters absent from `grads` (no gradient this
    step, like a torch parameter whose ``.grad`` is None), are returned unchanged with their state.

    ``keep`` (a boolean scalar, the step's finiteness): where it is false every parameter and state is returned as
    given (a skipped step). Adam's moments are kept or replaced *before* the parameter's update reads them
    (:func:`_adam_update`), so XLA updates each moment in place and the update reads the new one; a select after the
    whole update would have the update read the old moments after their in-place write, which XLA resolves by
    copying both moments of every parameter each step.
    """
    assert len(scalars) == spec.num_groups, (len(scalars), spec.num_groups)
    update = _UPDATES[spec.kind]
    new_params = dict(params)
    new_state: State = {}
    for name, group in zip(spec.param_names, spec.group_of_param):
        if name not in grads:  # no gradient this step (PyTorch: .grad is None): leave it alone
            new_state[name] = dict(state[name])
            continue
        p, old = params[name], state[name]
        if update is _adam_update:
            new_p, new_s = _adam_update(spec, group, p, grads[name], old, scalars[group], keep)
        else:
            new_p, new_s = update(spec, group, p, grads[name], old, scalars[group])
            if keep is not None:
                new_s = {key: jnp.where(keep, value, old[key]) for key, value in new_s.items()}
        new_params[name] = new_p if keep is None else jnp.where(keep, new_p, p)
        new_state[name] = new_s
    return new_params, new_state


def _opmath(x: Array) -> tuple[Array, np.dtype]:
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


def _adam_update(spec, group, p, g, state, s, keep=None):
    """Adam and AdamW. ``keep`` (:func:`apply_updates`): the new state is selected against the old and passed through
    an optimization barrier before the parameter's update reads it, so the update reads the stored new moments (not
    a recomputation from the old ones, which XLA would fuse into it)."""
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
    m_old, v_old = m, v
    m = _lerp(m, g, s["beta1_weight"].astype(dt))
    v = (s["one_minus_beta2"].astype(dt) * g) * g + v * s["beta2"].astype(dt)  # order: see _sgd_update
    moments = {"exp_avg": m, "exp_avg_sq": v}
    if spec.amsgrad[group]:
        moments["max_exp_avg_sq"] = jnp.maximum(state["max_exp_avg_sq"].astype(dt), v)
    if keep is not None:
        olds = {"exp_avg": m_old, "exp_avg_sq": v_old, "max_exp_avg_sq": state.get("max_exp_avg_sq")}
        moments = jax.lax.optimization_barrier(
            {key: jnp.where(keep, value, olds[key].astype(dt)) for key, value in moments.items()}
        )
        m = moments["exp_avg"]
    new_state = {key: value.astype(state[key].dtype) for key, value in moments.items()}
    v = moments["max_exp_avg_sq"] if spec.amsgrad[group] else moments["exp_avg_sq"]
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
    return new_p.astype(p_dtype), {
        "exp_avg": m.astype(state["exp_avg"].dtype),
        "exp_inf": u.astype(state["exp_inf"].dtype),
    }


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
    return new_p.astype(p_dtype), {
        "exp_avg": m.astype(state["exp_avg"].dtype),
        "exp_avg_sq": v.astype(state["exp_avg_sq"].dtype),
    }


def _radam_update(spec, group, p, g, state, s):
    p_dtype = p.dtype
    p, dt = _opmath(p)
    g = _coupled_grad(spec, group, p, g.astype(dt), s, dt)
    p, m, v = _adam_moments(p, g, state, s, dt)
    corrected = (m / s["bias_correction1"].astype(dt)) * s["lr"].astype(dt)
    adaptive = s["bias_correction2_sqrt"].astype(dt) * (1 / (jnp.sqrt(v) + s["eps"].astype(dt)))  # x.reciprocal() * c
    rectified = (corrected * adaptive) * s["rect"].astype(dt)
    new_p = p - jnp.where(s["rectify"], rectified, corrected)
    return new_p.astype(p_dtype), {
        "exp_avg": m.astype(state["exp_avg"].dtype),
        "exp_avg_sq": v.astype(state["exp_avg_sq"].dtype),
    }


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
    return new_p.astype(p_dtype), {
        "square_avg": sq.astype(state["square_avg"].dtype),
        "acc_delta": acc.astype(state["acc_delta"].dtype),
    }


def _asgd_update(spec, group, p, g, state, s):
    p_dtype = p.dtype
    p, dt = _opmath(p)
    g = _coupled_grad(spec, group, p, g.astype(dt), s, dt)
    p = s["neg_eta"].astype(dt) * g + p * s["param_scale"].astype(dt)  # order: see _sgd_update
    ax = state["ax"].astype(dt)
    ax = jnp.where(s["average"], ax + (p - ax) * s["mu"].astype(dt), p)  # ax.add_(param.sub(ax).mul_(mu))
    return p.astype(p_dtype), {"ax": ax.astype(state["ax"].dtype)}


def _rprop_update(spec, group, p, g, state, s):
    p_dtype, size_dtype = p.dtype, state["step_size"].dtype
    p, dt = _opmath(p)
    g = g.astype(dt)
    if spec.maximize[group]:
        g = -g
    # torch works in the parameter's dtype here: its factors are η₋, η₊ and 1 rounded to that dtype
    etaminus, etaplus = (s[k].astype(size_dtype).astype(dt) for k in ("etaminus", "etaplus"))
    step_size = jnp.where(s["step_size_init"], s["lr"].astype(size_dtype), state["step_size"]).astype(dt)
    factor = jnp.sign(g * state["prev"].astype(dt))
    factor = jnp.where(factor > 0, etaplus, factor)  # torch assigns the three in this order
    factor = jnp.where(factor < 0, etaminus, factor)
    factor = jnp.where(factor == 0, jnp.ones((), dt), factor)
    step_size = jnp.clip(
        (step_size * factor).astype(size_dtype).astype(dt), s["step_size_min"].astype(dt), s["step_size_max"].astype(dt)
    )
    g = jnp.where(factor == etaminus, jnp.zeros((), dt), g)  # no step where the gradient changed sign
    new_p = p + -jnp.sign(g) * step_size
    return new_p.astype(p_dtype), {"prev": g.astype(state["prev"].dtype), "step_size": step_size.astype(size_dtype)}


def _rms(x: Array) -> Array:
    """‖x‖₂ / √numel (``x.norm(2) / x.numel() ** 0.5``)."""
    return jnp.sqrt(jnp.sum(x * x)) / jnp.sqrt(jnp.asarray(x.size, x.dtype))


def _adafactor_update(spec, group, p, g, state, s):
    p_dtype = p.dtype
    p, dt = _opmath(p)
    g = g.astype(dt)
    if spec.maximize[group]:
        g = -g
    one_minus_beta2, eps1 = s["one_minus_beta2"].astype(dt), s["eps1"].astype(dt)
    alpha = jnp.maximum(s["eps2"].astype(dt), _rms(p)) * s["rho"].astype(dt)  # from θ before the decay
    if p.ndim >= 2:
        row_mean = jnp.square(jnp.sqrt(jnp.sum(g * g, axis=-1, keepdims=True))) / g.shape[-1]
        col_mean = jnp.square(jnp.sqrt(jnp.sum(g * g, axis=-2, keepdims=True))) / g.shape[-2]
        row_var = _lerp(state["row_var"].astype(dt), row_mean, one_minus_beta2)
        col_var = _lerp(state["col_var"].astype(dt), col_mean, one_minus_beta2)
        new_state = {
            "row_var": row_var.astype(state["row_var"].dtype),
            "col_var": col_var.astype(state["col_var"].dtype),
        }
        var_estimate = (row_var * col_var) / jnp.maximum(jnp.mean(row_var, axis=-2, keepdims=True), eps1)
    else:
        var_estimate = _lerp(state["variance"].astype(dt), g * g, one_minus_beta2)
        new_state = {"variance": var_estimate.astype(state["variance"].dtype)}
    update = (1 / jnp.sqrt(jnp.maximum(var_estimate, s["eps1_sq"].astype(dt)))) * g  # rsqrt_() is 1 / sqrt
    denom = jnp.maximum(1, _rms(update) / s["d"].astype(dt))  # max(1, ‖u‖ / (√numel·d))
    new_p = (-alpha / denom) * update + p * s["param_scale"].astype(dt)  # order: see _sgd_update
    return new_p.astype(p_dtype), new_state


def _muon_lr_ratio(adjust_lr_fn: str, shape: tuple[int, ...]) -> float:
    """torch.optim._muon._adjust_lr's factor for a matrix of ``shape``."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


def _bf16_matmul(x: Array, y: Array) -> Array:
    """A bfloat16 matrix product accumulated in float32 (as torch's CPU kernels do), before rounding."""
    return jnp.matmul(x, y, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)


def _newton_schulz(update: Array, s: Mapping[str, Array], ns_steps: int) -> Array:
    """torch.optim._muon._zeropower_via_newtonschulz: in bfloat16, each product accumulated in float32 and each
    ``addmm`` (β·C + α·A·B) rounded once to bfloat16. Returns a bfloat16 matrix."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    a, b, c = (s[k].astype(f32) for k in ("ns_a", "ns_b", "ns_c"))
    x = update.astype(bf16)
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    norm = jnp.sqrt(jnp.sum(jnp.square(x.astype(f32)))).astype(bf16)
    norm = jnp.maximum(norm.astype(f32), s["eps"].astype(f32)).astype(bf16)  # .clamp(min=eps)
    x = (x.astype(f32) / norm.astype(f32)).astype(bf16)
    for _ in range(ns_steps):
        gram = _bf16_matmul(x, x.T).astype(bf16)
        gram_update = (b * gram.astype(f32) + c * _bf16_matmul(gram, gram)).astype(bf16)
        x = (a * x.astype(f32) + _bf16_matmul(gram_update, x)).astype(bf16)
    return x.T if tall else x


def _muon_update(spec, group, p, g, state, s):
    p_dtype = p.dtype
    p, dt = _opmath(p)
    g = g.astype(dt)
    buf = _lerp(state["momentum_buffer"].astype(dt), g, s["one_minus_momentum"].astype(dt))
    update = _lerp(g, buf, s["momentum"].astype(dt)) if spec.nesterov[group] else buf
    update = _newton_schulz(update, s, spec.ns_steps[group]).astype(dt)
    adjusted_lr = s["lr"].astype(dt) * _muon_lr_ratio(spec.adjust_lr_fn[group], p.shape)
    new_p = (-adjusted_lr) * update + p * s["param_scale"].astype(dt)  # order: see _sgd_update
    return new_p.astype(p_dtype), {"momentum_buffer": buf.astype(state["momentum_buffer"].dtype)}


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
    "asgd": _asgd_update,
    "rprop": _rprop_update,
    "adafactor": _adafactor_update,
    "muon": _muon_update,
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


def clip_grads_by_global_norm(
    grads: Mapping[str, Array], max_norm: float | Array, complete_sum: Callable[[str, Array], Array] | None = None
) -> tuple[dict[str, Array], Array]:
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

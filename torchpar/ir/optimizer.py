"""The optimizer as data: its static structure (:class:`OptimizerSpec`) and the per-step scalars built on the
host (:func:`step_scalars`). Plain numpy — no torch, no JAX — so capture (which reads it off a
``torch.optim`` optimizer), the runtime (which ships it to host actors) and the lowering
(``jaxbackend.optim``, which applies it) share one type on the IR floor.

Scalars pytree (`step_scalars` output, argument of `apply_updates`): a tuple with one dict per param
group, each value a 0-d numpy array (float32, flags bool), so its tree structure and avals never
change between steps and jit never retraces:

    sgd:   lr, weight_decay, momentum, one_minus_dampening,
           momentum_on (bool: μ ≠ 0), momentum_init (bool: first momentum step, b ← g)
    adam:  lr, weight_decay, beta1_weight (1 - β₁), beta2, one_minus_beta2, eps,
           bias_correction2_sqrt (√(1 - β₂ᵗ)), neg_step_size (-γ / (1 - β₁ᵗ))
    adamw: as adam, but param_scale (1 - γλ) replaces weight_decay
    adagrad: weight_decay, eps, neg_clr (-γ / (1 + (t - 1)·lr_decay))
    rmsprop: lr, weight_decay, alpha, one_minus_alpha, eps, momentum
    adamax: weight_decay, beta1_weight (1 - β₁), beta2, eps, neg_clr (-γ / (1 - β₁ᵗ))
    nadam:  weight_decay, param_scale (1 - γλ if decoupled else 1), beta1_weight, beta2, one_minus_beta2, eps,
            bias_correction2 (1 - β₂ᵗ), grad_coef (-γ(1 - μₜ) / (1 - Πμ)), exp_avg_coef (-γμₜ₊₁ / (1 - Πμ·μₜ₊₁))
    radam:  lr, weight_decay, param_scale, beta1_weight, beta2, one_minus_beta2, eps, bias_correction1,
            bias_correction2_sqrt, rect (the rectification factor), rectify (bool: ρₜ > 5)
    adadelta: lr, weight_decay, rho, one_minus_rho, eps
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

OPTIMIZER_KINDS = ("sgd", "adam", "adamw", "adagrad", "rmsprop", "adamax", "nadam", "radam", "adadelta")

Scalars = tuple[dict[str, Any], ...]


@dataclasses.dataclass(kw_only=True, frozen=True)
class OptimizerSpec:
    """The compile-time structure of an optimizer; hashable, used as a jit static argument."""

    kind: str
    """One of `OPTIMIZER_KINDS`."""
    param_names: tuple[str, ...]
    """Trainable parameters the optimizer updates, in optimizer order."""
    group_of_param: tuple[int, ...]
    """Param-group index of each entry of `param_names`."""
    nesterov: tuple[bool, ...]
    """Per group: SGD Nesterov momentum (always False for the other kinds)."""
    amsgrad: tuple[bool, ...]
    """Per group: Adam/AdamW AMSGrad variant (always False for the other kinds)."""
    maximize: tuple[bool, ...]
    """Per group: ascend the objective instead of descending it."""
    centered: tuple[bool, ...] = ()
    """Per group: RMSprop's centered variant (state "grad_avg"); () means all False."""
    has_momentum: tuple[bool, ...] = ()
    """Per group: RMSprop momentum > 0 (state "momentum_buffer"); () means all False."""
    decoupled_weight_decay: tuple[bool, ...] = ()
    """Per group: NAdam/RAdam decoupled (AdamW-style) weight decay; () means all False."""

    def __post_init__(self) -> None:
        for field in ("param_names", "group_of_param", "nesterov", "amsgrad", "maximize", *_OPTIONAL_FLAGS):
            value = getattr(self, field)
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise TypeError(f"OptimizerSpec.{field} must be a tuple, got {type(value).__name__}")
            object.__setattr__(self, field, tuple(value))
        if self.kind not in OPTIMIZER_KINDS:
            raise ValueError(f"OptimizerSpec.kind must be one of {OPTIMIZER_KINDS}, got {self.kind!r}")
        num_groups = len(self.nesterov)
        if num_groups == 0:
            raise ValueError("OptimizerSpec needs at least one param group (nesterov/amsgrad/maximize are per group)")
        if len(self.amsgrad) != num_groups or len(self.maximize) != num_groups:
            raise ValueError(
                "OptimizerSpec.nesterov, .amsgrad and .maximize need one entry per param group, got lengths "
                f"{len(self.nesterov)}, {len(self.amsgrad)}, {len(self.maximize)}"
            )
        for field in _OPTIONAL_FLAGS:
            if len(getattr(self, field)) == 0:
                object.__setattr__(self, field, (False,) * num_groups)
            elif len(getattr(self, field)) != num_groups:
                raise ValueError(f"OptimizerSpec.{field} needs one entry per param group ({num_groups}), got "
                                 f"{len(getattr(self, field))}")
        for field in ("nesterov", "amsgrad", "maximize", *_OPTIONAL_FLAGS):
            if not all(isinstance(v, (bool, np.bool_)) for v in getattr(self, field)):
                raise TypeError(f"OptimizerSpec.{field} must hold bools, got {getattr(self, field)}")
            object.__setattr__(self, field, tuple(bool(v) for v in getattr(self, field)))
        if len(self.group_of_param) != len(self.param_names):
            raise ValueError(
                f"OptimizerSpec.group_of_param has {len(self.group_of_param)} entries for "
                f"{len(self.param_names)} param_names"
            )
        if not all(isinstance(n, str) for n in self.param_names):
            raise TypeError(f"OptimizerSpec.param_names must hold str, got {self.param_names}")
        if len(set(self.param_names)) != len(self.param_names):
            dups = sorted({n for n in self.param_names if self.param_names.count(n) > 1})
            raise ValueError(f"OptimizerSpec.param_names has duplicates: {dups}")
        for name, group in zip(self.param_names, self.group_of_param):
            if not isinstance(group, (int, np.integer)) or isinstance(group, bool) or not 0 <= group < num_groups:
                raise ValueError(f"param {name!r} has group {group!r}; groups are 0..{num_groups - 1}")
        object.__setattr__(self, "group_of_param", tuple(int(g) for g in self.group_of_param))
        for field, kinds in _FLAG_KINDS.items():
            if self.kind not in kinds and any(getattr(self, field)):
                raise ValueError(f"{field} is a flag of {'/'.join(kinds)}; {self.kind} groups must have {field}=False")

    @property
    def num_groups(self) -> int:
        return len(self.nesterov)


_OPTIONAL_FLAGS = ("centered", "has_momentum", "decoupled_weight_decay")

_FLAG_KINDS = {
    "nesterov": ("sgd",),
    "amsgrad": ("adam", "adamw"),
    "centered": ("rmsprop",),
    "has_momentum": ("rmsprop",),
    "decoupled_weight_decay": ("nadam", "radam"),
}

STEP_COUNTED_KINDS = tuple(k for k in OPTIMIZER_KINDS if k != "sgd")
"""Kinds whose torch state holds a per-parameter ``step`` (a 0-d float tensor) next to the tensors of `state_keys`."""


def state_keys(spec: OptimizerSpec, group: int) -> tuple[str, ...]:
    """Names of the per-parameter state tensors of a param group (torch's names, in torch's order).

    Each has the parameter's shape. Scalars torch also keeps per parameter (``step``; NAdam's ``mu_product``) are
    per-group host counters here, not state tensors."""
    kind = spec.kind
    if kind == "sgd":
        return ("momentum_buffer",)
    if kind in ("adam", "adamw"):
        if spec.amsgrad[group]:
            return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        return ("exp_avg", "exp_avg_sq")
    if kind == "adagrad":
        return ("sum",)
    if kind == "rmsprop":
        return ("square_avg", *(("momentum_buffer",) if spec.has_momentum[group] else ()),
                *(("grad_avg",) if spec.centered[group] else ()))
    if kind == "adamax":
        return ("exp_avg", "exp_inf")
    if kind in ("nadam", "radam"):
        return ("exp_avg", "exp_avg_sq")
    if kind == "adadelta":
        return ("square_avg", "acc_delta")
    raise AssertionError(kind)


def state_copies(spec: OptimizerSpec) -> float:
    """Optimizer-state tensors per parameter, averaged over groups: 1 for SGD with momentum and Adagrad, 2 for
    Adam/AdamW/Adamax/NAdam/RAdam/Adadelta (3 with amsgrad), 1-3 for RMSprop (square_avg, + momentum_buffer with
    momentum, + grad_avg when centered). Per-parameter 0-d scalars (step, mu_product) are not counted."""
    return sum(len(state_keys(spec, g)) for g in range(spec.num_groups)) / max(spec.num_groups, 1)


def _f32(x: float) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def nadam_mu(beta1: float, momentum_decay: float, step: int) -> float:
    """NAdam's momentum coefficient μₜ = β₁(1 - ½·0.96^(t·ψ)), in float64 as torch computes it."""
    return beta1 * (1.0 - 0.5 * (0.96 ** (step * momentum_decay)))


def nadam_mu_product(previous: float, beta1: float, momentum_decay: float, step: int) -> np.ndarray:
    """torch's ``mu_product *= mu`` on its float32 state: the product after step `step`, as float32."""
    return np.float32(previous) * np.float32(nadam_mu(beta1, momentum_decay, step))


def _betas(hp: Mapping[str, Any]) -> tuple[float, float]:
    if "betas" in hp:
        b1, b2 = hp["betas"]
        return float(b1), float(b2)
    return float(hp["beta1"]), float(hp["beta2"])


def step_scalars(
    spec: OptimizerSpec, group_hparams: Sequence[Mapping[str, Any]], group_steps: Sequence[int],
    mu_products: Sequence[float] | None = None,
) -> Scalars:
    """Runtime scalars for the coming step, from plain-Python per-group hyper-parameters.

    group_hparams[i] uses torch's param_group keys: SGD ``lr, momentum, dampening, weight_decay``;
    Adam/AdamW/Adamax/RAdam ``lr, betas=(β₁, β₂), eps, weight_decay`` (``beta1``/``beta2`` are accepted too);
    NAdam as Adam plus ``momentum_decay``; Adagrad ``lr, lr_decay, eps, weight_decay``; RMSprop ``lr, alpha, eps,
    weight_decay, momentum``; Adadelta ``lr, rho, eps, weight_decay``.
    group_steps[i] is the 1-based step about to run. For all but SGD it is torch's state["step"] after
    the increment (it sets the bias corrections). For SGD it counts momentum steps of the group's
    buffer: 1 means "no buffer yet, initialize it from the gradient" (it is ignored when μ = 0).
    mu_products (NAdam only): each group's ``mu_product`` before this step (torch's float32 state; default: the
    product of μ₁…μₜ₋₁ for the current β₁ and momentum_decay).
    """
    if len(group_hparams) != spec.num_groups or len(group_steps) != spec.num_groups:
        raise ValueError(
            f"step_scalars: spec has {spec.num_groups} param groups, got {len(group_hparams)} hparam dicts "
            f"and {len(group_steps)} steps"
        )
    out = []
    for g, (hp, step) in enumerate(zip(group_hparams, group_steps)):
        step = int(step)
        if step < 1:
            raise ValueError(f"step_scalars: steps are 1-based, got {step}")
        lr, wd = float(hp["lr"]), float(hp["weight_decay"])
        kind = spec.kind
        if kind == "sgd":
            momentum = float(hp["momentum"])
            out.append({
                "lr": _f32(lr),
                "weight_decay": _f32(wd),
                "momentum": _f32(momentum),
                "one_minus_dampening": _f32(1.0 - float(hp["dampening"])),
                "momentum_on": np.asarray(momentum != 0.0),
                "momentum_init": np.asarray(step == 1),
            })
            continue
        if kind == "adagrad":
            out.append({
                "weight_decay": _f32(wd),
                "eps": _f32(float(hp["eps"])),
                "neg_clr": _f32(-(lr / (1.0 + (step - 1) * float(hp["lr_decay"])))),
            })
            continue
        if kind == "rmsprop":
            alpha = float(hp["alpha"])
            out.append({
                "lr": _f32(lr),
                "weight_decay": _f32(wd),
                "alpha": _f32(alpha),
                "one_minus_alpha": _f32(1.0 - alpha),
                "eps": _f32(float(hp["eps"])),
                "momentum": _f32(float(hp["momentum"])),
            })
            continue
        if kind == "adadelta":
            rho = float(hp["rho"])
            out.append({
                "lr": _f32(lr),
                "weight_decay": _f32(wd),
                "rho": _f32(rho),
                "one_minus_rho": _f32(1.0 - rho),
                "eps": _f32(float(hp["eps"])),
            })
            continue
        beta1, beta2 = _betas(hp)
        bias_correction1 = 1.0 - beta1**step  # float64 on the host, like torch's non-capturable path
        bias_correction2 = 1.0 - beta2**step
        if kind == "adamax":
            out.append({
                "weight_decay": _f32(wd),
                "beta1_weight": _f32(1.0 - beta1),
                "beta2": _f32(beta2),
                "eps": _f32(float(hp["eps"])),
                "neg_clr": _f32(-(lr / bias_correction1)),
            })
            continue
        scalars = {
            "beta1_weight": _f32(1.0 - beta1),
            "beta2": _f32(beta2),
            "one_minus_beta2": _f32(1.0 - beta2),
            "eps": _f32(float(hp["eps"])),
        }
        if kind in ("nadam", "radam"):
            decoupled = spec.decoupled_weight_decay[g]
            scalars["weight_decay"] = _f32(0.0 if decoupled else wd)
            scalars["param_scale"] = _f32(1.0 - lr * wd if decoupled else 1.0)
        if kind == "nadam":
            momentum_decay = float(hp["momentum_decay"])
            if mu_products is None:
                previous = np.float32(1.0)
                for t in range(1, step):
                    previous = nadam_mu_product(previous, beta1, momentum_decay, t)
            else:
                previous = np.float32(mu_products[g])
            mu = nadam_mu(beta1, momentum_decay, step)
            mu_next = nadam_mu(beta1, momentum_decay, step + 1)
            mu_product = float(nadam_mu_product(previous, beta1, momentum_decay, step))  # torch's .item()
            mu_product_next = mu_product * mu_next
            scalars.update({
                "bias_correction2": _f32(bias_correction2),
                "grad_coef": _f32(-lr * (1.0 - mu) / (1.0 - mu_product)),
                "exp_avg_coef": _f32((-lr * mu_next) / (1.0 - mu_product_next)),
            })
            out.append(scalars)
            continue
        if kind == "radam":
            rho_inf = 2 / (1 - beta2) - 1
            rho_t = rho_inf - 2 * step * (beta2**step) / bias_correction2
            rectify = rho_t > 5.0
            rect = 1.0  # unused: torch's un-rectified branch (and the formula's root would be imaginary)
            if rectify:
                rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
            scalars.update({
                "lr": _f32(lr),
                "bias_correction1": _f32(bias_correction1),
                "bias_correction2_sqrt": _f32(bias_correction2**0.5),
                "rect": _f32(rect),
                "rectify": np.asarray(rectify),
            })
            out.append(scalars)
            continue
        scalars.update({
            "lr": _f32(lr),
            "bias_correction2_sqrt": _f32(bias_correction2**0.5),
            "neg_step_size": _f32(-(lr / bias_correction1)),
        })
        if kind == "adamw":
            scalars["param_scale"] = _f32(1.0 - lr * wd)
        else:
            scalars["weight_decay"] = _f32(wd)
        out.append(scalars)
    return tuple(out)

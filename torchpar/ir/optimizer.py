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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

OPTIMIZER_KINDS = ("sgd", "adam", "adamw")

Scalars = tuple[dict[str, Any], ...]


@dataclasses.dataclass(kw_only=True, frozen=True)
class OptimizerSpec:
    """The compile-time structure of an optimizer; hashable, used as a jit static argument."""

    kind: str
    """One of "sgd", "adam", "adamw"."""
    param_names: tuple[str, ...]
    """Trainable parameters the optimizer updates, in optimizer order."""
    group_of_param: tuple[int, ...]
    """Param-group index of each entry of `param_names`."""
    nesterov: tuple[bool, ...]
    """Per group: SGD Nesterov momentum (always False for Adam/AdamW)."""
    amsgrad: tuple[bool, ...]
    """Per group: Adam/AdamW AMSGrad variant (always False for SGD)."""
    maximize: tuple[bool, ...]
    """Per group: ascend the objective instead of descending it."""

    def __post_init__(self) -> None:
        for field in ("param_names", "group_of_param", "nesterov", "amsgrad", "maximize"):
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
        for field in ("nesterov", "amsgrad", "maximize"):
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
        if self.kind == "sgd" and any(self.amsgrad):
            raise ValueError("amsgrad is an Adam/AdamW flag; SGD groups must have amsgrad=False")
        if self.kind != "sgd" and any(self.nesterov):
            raise ValueError("nesterov is an SGD flag; Adam/AdamW groups must have nesterov=False")

    @property
    def num_groups(self) -> int:
        return len(self.nesterov)


def state_keys(spec: OptimizerSpec, group: int) -> tuple[str, ...]:
    """Names of the per-parameter state tensors of a param group (torch's names)."""
    if spec.kind == "sgd":
        return ("momentum_buffer",)
    if spec.amsgrad[group]:
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    return ("exp_avg", "exp_avg_sq")


def state_copies(spec: OptimizerSpec) -> float:
    """Optimizer-state tensors per parameter (2 for Adam, 1 for SGD with momentum), averaged over groups."""
    return sum(len(state_keys(spec, g)) for g in range(spec.num_groups)) / max(spec.num_groups, 1)


def _f32(x: float) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def step_scalars(
    spec: OptimizerSpec, group_hparams: Sequence[Mapping[str, Any]], group_steps: Sequence[int]
) -> Scalars:
    """Runtime scalars for the coming step, from plain-Python per-group hyper-parameters.

    group_hparams[i] uses torch's param_group keys: SGD ``lr, momentum, dampening, weight_decay``;
    Adam/AdamW ``lr, betas=(β₁, β₂), eps, weight_decay`` (``beta1``/``beta2`` are accepted too).
    group_steps[i] is the 1-based step about to run. For Adam it is torch's state["step"] after
    the increment (it sets the bias corrections). For SGD it counts momentum steps of the group's
    buffer: 1 means "no buffer yet, initialize it from the gradient" (it is ignored when μ = 0).
    """
    if len(group_hparams) != spec.num_groups or len(group_steps) != spec.num_groups:
        raise ValueError(
            f"step_scalars: spec has {spec.num_groups} param groups, got {len(group_hparams)} hparam dicts "
            f"and {len(group_steps)} steps"
        )
    out = []
    for hp, step in zip(group_hparams, group_steps):
        step = int(step)
        if step < 1:
            raise ValueError(f"step_scalars: steps are 1-based, got {step}")
        lr, wd = float(hp["lr"]), float(hp["weight_decay"])
        if spec.kind == "sgd":
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
        beta1, beta2 = (float(b) for b in hp["betas"]) if "betas" in hp else (float(hp["beta1"]), float(hp["beta2"]))
        bias_correction1 = 1.0 - beta1**step  # float64 on the host, like torch's non-capturable path
        bias_correction2 = 1.0 - beta2**step
        scalars = {
            "lr": _f32(lr),
            "beta1_weight": _f32(1.0 - beta1),
            "beta2": _f32(beta2),
            "one_minus_beta2": _f32(1.0 - beta2),
            "eps": _f32(float(hp["eps"])),
            "bias_correction2_sqrt": _f32(bias_correction2**0.5),
            "neg_step_size": _f32(-(lr / bias_correction1)),
        }
        if spec.kind == "adamw":
            scalars["param_scale"] = _f32(1.0 - lr * wd)
        else:
            scalars["weight_decay"] = _f32(wd)
        out.append(scalars)
    return tuple(out)

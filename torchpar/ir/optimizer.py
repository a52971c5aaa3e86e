"""The optimizer as data: its static structure (:class:`OptimizerSpec`) and the per-step scalars built on the
host (:func:`step_scalars`). Plain numpy — no torch, no JAX — so capture (which reads it off a
``torch.optim`` optimizer), the runtime (which ships it to host actors) and the lowering
(``jaxbackend.optimizer``, which applies it) share one type on the IR floor.

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
    asgd:   weight_decay, param_scale (1 - λη), neg_eta (-η), mu, average (bool: μ ≠ 1, else ax ← θ), with η and μ the
            group's host counters before the step (torch's 0-d state "eta", "mu"; :func:`asgd_eta_mu` advances them)
    rprop:  lr, step_size_init (bool: first step, step_size ← lr), etaminus, etaplus, step_size_min, step_size_max
    adafactor: param_scale (1 - γλ), one_minus_beta2 (t^beta2_decay), rho (min(γ, 1/√t)), eps1, eps1_sq (ε₁²), eps2, d
    muon:   lr, param_scale (1 - γλ), momentum, one_minus_momentum, eps, ns_a, ns_b, ns_c (Newton–Schulz coefficients)

Structure that cannot change without recompiling lives in `OptimizerSpec` instead: per group the flags below, Muon's
``ns_steps`` (a loop count) and ``adjust_lr_fn``. The tensors of the state are named by `state_keys`; they have the
parameter's shape except Adafactor's row and column factors (`state_shape`). Adafactor and Muon are the kinds whose
update is not elementwise (`NOT_ELEMENTWISE`): a program that updates a shard of a parameter must not run them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

OPTIMIZER_KINDS = (
    "sgd",
    "adam",
    "adamw",
    "adagrad",
    "rmsprop",
    "adamax",
    "nadam",
    "radam",
    "adadelta",
    "asgd",
    "rprop",
    "adafactor",
    "muon",
)

NOT_ELEMENTWISE: dict[str, str] = {
    "adafactor": "Adafactor's update is not elementwise (it reduces over whole rows, columns and tensors: its factored "
    "second moment, the parameter's RMS, the update's RMS)",
    "muon": "Muon's update is not elementwise (it orthogonalizes the whole matrix with Newton–Schulz iterations of "
    "matrix products)",
}
"""Kinds whose update of a parameter reads more than the matching elements of its gradient and state → why; the
update of a shard computed from that shard alone would be wrong."""

MUON_ADJUST_LR_FNS = ("original", "match_rms_adamw")
"""Muon's ``adjust_lr_fn`` values (torch's ``None`` is ``"original"``)."""

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
    ns_steps: tuple[int, ...] = ()
    """Per group: Muon's number of Newton–Schulz iterations, 0 ≤ k < 100 (0 for the other kinds); () means all 0."""
    adjust_lr_fn: tuple[str, ...] = ()
    """Per group: Muon's learning-rate adjustment to the matrix shape, one of `MUON_ADJUST_LR_FNS` ("" for the other
    kinds); () means "original" for Muon, "" otherwise."""

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
                raise ValueError(
                    f"OptimizerSpec.{field} needs one entry per param group ({num_groups}), got "
                    f"{len(getattr(self, field))}"
                )
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
        self._check_muon_fields(num_groups)

    def _check_muon_fields(self, num_groups: int) -> None:
        muon = self.kind == "muon"
        for field, default in (("ns_steps", 0), ("adjust_lr_fn", "original" if muon else "")):
            value = getattr(self, field)
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise TypeError(f"OptimizerSpec.{field} must be a tuple, got {type(value).__name__}")
            value = tuple(value) or (default,) * num_groups
            if len(value) != num_groups:
                raise ValueError(
                    f"OptimizerSpec.{field} needs one entry per param group ({num_groups}), got {len(value)}"
                )
            object.__setattr__(self, field, value)
        if not all(isinstance(k, (int, np.integer)) and not isinstance(k, bool) for k in self.ns_steps):
            raise TypeError(f"OptimizerSpec.ns_steps must hold ints, got {self.ns_steps}")
        object.__setattr__(self, "ns_steps", tuple(int(k) for k in self.ns_steps))
        if muon:
            if not all(0 <= k < 100 for k in self.ns_steps):
                raise ValueError(f"OptimizerSpec.ns_steps must be in [0, 100) (torch's limit), got {self.ns_steps}")
            if not all(fn in MUON_ADJUST_LR_FNS for fn in self.adjust_lr_fn):
                raise ValueError(f"OptimizerSpec.adjust_lr_fn must hold {MUON_ADJUST_LR_FNS}, got {self.adjust_lr_fn}")
        elif any(self.ns_steps) or any(self.adjust_lr_fn):
            raise ValueError(
                f'ns_steps and adjust_lr_fn are Muon\'s; {self.kind} groups must have 0 and "", got '
                f"{self.ns_steps} and {self.adjust_lr_fn}"
            )

    @property
    def num_groups(self) -> int:
        return len(self.nesterov)


_OPTIONAL_FLAGS = ("centered", "has_momentum", "decoupled_weight_decay")

_FLAG_KINDS = {
    "nesterov": ("sgd", "muon"),
    "amsgrad": ("adam", "adamw"),
    "centered": ("rmsprop",),
    "has_momentum": ("rmsprop",),
    "decoupled_weight_decay": ("nadam", "radam"),
}

STEP_COUNTED_KINDS = tuple(k for k in OPTIMIZER_KINDS if k not in ("sgd", "muon"))
"""Kinds whose torch state holds a per-parameter ``step`` (a 0-d float tensor) next to the tensors of `state_keys`."""


def state_keys(spec: OptimizerSpec, group: int, ndim: int | None = None) -> tuple[str, ...]:
    """Names of the per-parameter state tensors of a param group (torch's names, in torch's order).

    Each has the parameter's shape but Adafactor's factors (`state_shape`). Scalars torch also keeps per parameter
    (``step``; NAdam's ``mu_product``; ASGD's ``eta`` and ``mu``) are per-group host counters here, not state tensors.
    ``ndim``: the parameter's; Adafactor's keys depend on it (a parameter of ≥ 2 dims keeps ``row_var`` and
    ``col_var``, the others ``variance``), the other kinds' do not."""
    kind = spec.kind
    if kind in ("sgd", "muon"):
        return ("momentum_buffer",)
    if kind == "adafactor":
        if ndim is None:
            raise ValueError(
                "Adafactor's state keys depend on the parameter's ndim (row_var/col_var for ≥ 2 dims, "
                "variance otherwise): pass state_keys(spec, group, ndim)"
            )
        return ("row_var", "col_var") if ndim >= 2 else ("variance",)
    if kind == "asgd":
        return ("ax",)
    if kind == "rprop":
        return ("prev", "step_size")
    if kind in ("adam", "adamw"):
        if spec.amsgrad[group]:
            return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        return ("exp_avg", "exp_avg_sq")
    if kind == "adagrad":
        return ("sum",)
    if kind == "rmsprop":
        return (
            "square_avg",
            *(("momentum_buffer",) if spec.has_momentum[group] else ()),
            *(("grad_avg",) if spec.centered[group] else ()),
        )
    if kind == "adamax":
        return ("exp_avg", "exp_inf")
    if kind in ("nadam", "radam"):
        return ("exp_avg", "exp_avg_sq")
    if kind == "adadelta":
        return ("square_avg", "acc_delta")
    raise AssertionError(kind)


def state_shape(spec: OptimizerSpec, key: str, param_shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of state tensor ``key`` of a parameter of ``param_shape``: the parameter's, but Adafactor's
    ``row_var`` (the last dim 1) and ``col_var`` (the next-to-last dim 1), as torch keeps them."""
    shape = tuple(param_shape)
    if spec.kind == "adafactor" and key == "row_var":
        return (*shape[:-1], 1)
    if spec.kind == "adafactor" and key == "col_var":
        return (*shape[:-2], 1, shape[-1])
    return shape


def state_copies(spec: OptimizerSpec) -> float:
    """Optimizer-state tensors of the parameter's size per parameter, averaged over groups: 1 for SGD with momentum,
    Adagrad, ASGD and Muon, 2 for Adam/AdamW/Adamax/NAdam/RAdam/Adadelta/Rprop (3 with amsgrad), 1-3 for RMSprop
    (square_avg, + momentum_buffer with momentum, + grad_avg when centered), 1 for Adafactor (an upper bound: a
    vector keeps one, a matrix only its row and column factors). Per-parameter 0-d scalars (step, mu_product, eta,
    mu) are not counted."""
    if spec.kind == "adafactor":
        return 1.0
    return sum(len(state_keys(spec, g)) for g in range(spec.num_groups)) / max(spec.num_groups, 1)


def _f32(x: float) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def nadam_mu(beta1: float, momentum_decay: float, step: int) -> float:
    """NAdam's momentum coefficient μₜ = β₁(1 - ½·0.96^(t·ψ)), in float64 as torch computes it."""
    return beta1 * (1.0 - 0.5 * (0.96 ** (step * momentum_decay)))


def nadam_mu_product(previous: float | np.float32, beta1: float, momentum_decay: float, step: int) -> np.float32:
    """torch's ``mu_product *= mu`` on its float32 state: the product after step `step`, as float32."""
    return np.float32(previous) * np.float32(nadam_mu(beta1, momentum_decay, step))


def _betas(hp: Mapping[str, Any]) -> tuple[float, float]:
    if "betas" in hp:
        b1, b2 = hp["betas"]
        return float(b1), float(b2)
    return float(hp["beta1"]), float(hp["beta2"])


def asgd_eta_mu(hp: Mapping[str, Any], step: int) -> tuple[float, float]:
    """The η and μ torch's ASGD stores at the end of step ``step`` for the next one, in float64:
    η = γ / (1 + λγt)^α and μ = 1 / max(1, t - t₀) (``hp``: the group's ``lr, lambd, alpha, t0``). Before the first
    step η = γ and μ = 1."""
    lr = float(hp["lr"])
    return lr / ((1 + float(hp["lambd"]) * lr * step) ** float(hp["alpha"])), 1 / max(1.0, step - float(hp["t0"]))


def step_scalars(
    spec: OptimizerSpec,
    group_hparams: Sequence[Mapping[str, Any]],
    group_steps: Sequence[int],
    counters: Sequence[Mapping[str, float]] | None = None,
) -> Scalars:
    """Runtime scalars for the coming step, from plain-Python per-group hyper-parameters.

    group_hparams[i] uses torch's param_group keys: SGD ``lr, momentum, dampening, weight_decay``;
    Adam/AdamW/Adamax/RAdam ``lr, betas=(β₁, β₂), eps, weight_decay`` (``beta1``/``beta2`` are accepted too);
    NAdam as Adam plus ``momentum_decay``; Adagrad ``lr, lr_decay, eps, weight_decay``; RMSprop ``lr, alpha, eps,
    weight_decay, momentum``; Adadelta ``lr, rho, eps, weight_decay``; ASGD ``lr, lambd, alpha, t0, weight_decay``;
    Rprop ``lr, etas=(η₋, η₊), step_sizes=(min, max)``; Adafactor ``lr, beta2_decay, eps=(ε₁, ε₂), d,
    weight_decay`` (ε₁ resolved: torch's ``None`` is the machine epsilon of the group's first parameter's dtype);
    Muon ``lr, weight_decay, momentum, ns_coefficients=(a, b, c), eps``.
    group_steps[i] is the 1-based step about to run. For all but SGD it is torch's state["step"] after
    the increment (it sets the bias corrections). For SGD it counts momentum steps of the group's
    buffer: 1 means "no buffer yet, initialize it from the gradient" (it is ignored when μ = 0).
    counters: each group's host counters before this step, torch's 0-d float32 state: NAdam ``mu_product``, ASGD
    ``eta`` and ``mu``. Default: the values the current hyper-parameters would have produced (NAdam the product of
    μ₁…μₜ₋₁; ASGD :func:`asgd_eta_mu` of step t - 1).
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
        decoupled = bool(spec.decoupled_weight_decay[g]) if spec.decoupled_weight_decay else False
        group = _GroupStep(hp, step, counters[g] if counters is not None else None, decoupled)
        out.append(_SCALARS[spec.kind](group))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class _GroupStep:
    """One param group's step, what its scalars are computed from (:func:`step_scalars`)."""

    hp: Mapping[str, Any]
    step: int
    counters: Mapping[str, float] | None
    decoupled: bool
    """NAdam / RAdam ``decoupled_weight_decay``."""

    @property
    def lr(self) -> float:
        return float(self.hp["lr"])

    @property
    def wd(self) -> float:
        return float(self.hp["weight_decay"])


def _sgd_scalars(g: _GroupStep) -> dict[str, np.ndarray]:
    momentum = float(g.hp["momentum"])
    return {
        "lr": _f32(g.lr),
        "weight_decay": _f32(g.wd),
        "momentum": _f32(momentum),
        "one_minus_dampening": _f32(1.0 - float(g.hp["dampening"])),
        "momentum_on": np.asarray(momentum != 0.0),
        "momentum_init": np.asarray(g.step == 1),
    }


def _adagrad_scalars(g: _GroupStep) -> dict[str, np.ndarray]:
    return {
        "weight_decay": _f32(g.wd),
        "eps": _f32(float(g.hp["eps"])),
        "neg_clr": _f32(-(g.lr / (1.0 + (g.step - 1) * float(g.hp["lr_decay"])))),
    }


def _rmsprop_scalars(g: _GroupStep) -> dict[str, np.ndarray]:
    alpha = float(g.hp["alpha"])
    return {
        "lr": _f32(g.lr),
        "weight_decay": _f32(g.wd),
        "alpha": _f32(alpha),
        "one_minus_alpha": _f32(1.0 - alpha),
        "eps": _f32(float(g.hp["eps"])),
        "momentum": _f32(float(g.hp["momentum"])),
    }


def _adadelta_scalars(g: _GroupStep) -> dict[str, np.ndarray]:
    rho = float(g.hp["rho"])
    return {
        "lr": _f32(g.lr),
        "weight_decay": _f32(g.wd),
        "rho": _f32(rho),
        "one_minus_rho": _f32(1.0 - rho),
        "eps": _f32(float(g.hp["eps"])),
    }


def _bias_corrections(g: _GroupStep) -> tuple[float, float, float, float]:
    """``β₁, β₂, 1 - β₁ᵗ, 1 - β₂ᵗ`` (float64 on the host, like torch's non-capturable path)."""
    beta1, beta2 = _betas(g.hp)
    return beta1, beta2, 1.0 - beta1**g.step, 1.0 - beta2**g.step


def _adamax_scalars(g: _GroupStep) -> dict[str, np.ndarray]:
    beta1, beta2, bias_correction1, _ = _bias_corrections(g)
    return {
        "weight_decay": _f32(g.wd),
        "beta1_weight": _f32(1.0 - beta1),
        "beta2": _f32(beta2),
        "eps": _f32(float(g.hp["eps"])),
        "neg_clr": _f32(-(g.lr / bias_correction1)),
    }


def _moments(g: _GroupStep) -> dict[str, np.ndarray]:
    """The scalars of Adam's two moments, shared by Adam, AdamW, NAdam and RAdam."""
    beta1, beta2, _, _ = _bias_corrections(g)
    return {
        "beta1_weight": _f32(1.0 - beta1),
        "beta2": _f32(beta2),
        "one_minus_beta2": _f32(1.0 - beta2),
        "eps": _f32(float(g.hp["eps"])),
    }


def _decay(g: _GroupStep) -> dict[str, np.ndarray]:
    """NAdam / RAdam weight decay: L2 (into the gradient) or decoupled (a parameter scale)."""
    return {
        "weight_decay": _f32(0.0 if g.decoupled else g.wd),
        "param_scale": _f32(1.0 - g.lr * g.wd if g.decoupled else 1.0),
    }


def _nadam_scalars(g: _GroupStep) -> dict[str, np.ndarray]:
    beta1, _, _, bias_correction2 = _bias_corrections(g)
    momentum_decay = float(g.hp["momentum_decay"])
    if g.counters is None:
        previous = np.float32(1.0)
        for t in range(1, g.step):
            previous = nadam_mu_product(previous, beta1, momentum_decay, t)
    else:
        previous = np.float32(g.counters["mu_product"])
    mu = nadam_mu(beta1, momentum_decay, g.step)
    mu_next = nadam_mu(beta1, momentum_decay, g.step + 1)
    mu_product = float(nadam_mu_product(previous, beta1, momentum_decay, g.step))  # torch's .item()
    mu_product_next = mu_product * mu_next
    return {
        **_moments(g),
        **_decay(g),
        "bias_correction2": _f32(bias_correction2),
        "grad_coef": _f32(-g.lr * (1.0 - mu) / (1.0 - mu_product)),
        "exp_avg_coef": _f32((-g.lr * mu_next) / (1.0 - mu_product_next)),
    }


def _radam_scalars(g: _GroupStep) -> dict[str, np.ndarray]:
    _, beta2, bias_correction1, bias_correction2 = _bias_corrections(g)
    rho_inf = 2 / (1 - beta2) - 1
    rho_t = rho_inf - 2 * g.step * (beta2**g.step) / bias_correction2
    rectify = rho_t > 5.0
    rect = 1.0  # unused: torch's un-rectified branch (and the formula's root would be imaginary)
    if rectify:
        rect = ((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t)) ** 0.5
    return {
        **_moments(g),
        **_decay(g),
        "lr": _f32(g.lr),
        "bias_correction1": _f32(bias_correction1),
        "bias_correction2_sqrt": _f32(bias_correction2**0.5),
        "rect": _f32(rect),
        "rectify": np.asarray(rectify),
    }


def _adam_scalars(g: _GroupStep, *, decoupled: bool = False) -> dict[str, np.ndarray]:
    """Adam (L2 weight decay into the gradient) and, ``decoupled``, AdamW (a parameter scale)."""
    _, _, bias_correction1, bias_correction2 = _bias_corrections(g)
    decay = {"param_scale": _f32(1.0 - g.lr * g.wd)} if decoupled else {"weight_decay": _f32(g.wd)}
    return {
        **_moments(g),
        "lr": _f32(g.lr),
        "bias_correction2_sqrt": _f32(bias_correction2**0.5),
        "neg_step_size": _f32(-(g.lr / bias_correction1)),
        **decay,
    }


def _asgd_scalars(hp: Mapping[str, Any], step: int, counters: Mapping[str, float] | None) -> dict[str, np.ndarray]:
    if counters is None:
        eta, mu = (float(np.float32(x)) for x in (asgd_eta_mu(hp, step - 1) if step > 1 else (hp["lr"], 1.0)))
    else:
        eta, mu = float(counters["eta"]), float(counters["mu"])
    return {
        "weight_decay": _f32(float(hp["weight_decay"])),
        "param_scale": _f32(1.0 - float(hp["lambd"]) * eta),
        "neg_eta": _f32(-eta),
        "mu": _f32(mu),
        "average": np.asarray(mu != 1.0),  # torch: ax ← θ while μ is 1 (before t₀), else ax ← ax + μ(θ - ax)
    }


def _rprop_scalars(hp: Mapping[str, Any], step: int, counters: Mapping[str, float] | None) -> dict[str, np.ndarray]:
    etaminus, etaplus = (float(e) for e in hp["etas"])
    step_size_min, step_size_max = (float(e) for e in hp["step_sizes"])
    return {
        "lr": _f32(float(hp["lr"])),
        "step_size_init": np.asarray(step == 1),  # torch fills step_size with lr when it creates the state
        "etaminus": _f32(etaminus),
        "etaplus": _f32(etaplus),
        "step_size_min": _f32(step_size_min),
        "step_size_max": _f32(step_size_max),
    }


def _adafactor_scalars(hp: Mapping[str, Any], step: int, counters: Mapping[str, float] | None) -> dict[str, np.ndarray]:
    lr, wd = float(hp["lr"]), float(hp["weight_decay"])
    eps1, eps2 = hp["eps"]
    if eps1 is None:
        raise ValueError(
            "step_scalars: Adafactor's eps1 must be resolved (torch's None is the machine epsilon of the "
            "group's first parameter's dtype)"
        )
    t = float(step)
    return {
        "param_scale": _f32(1.0 - lr * wd),
        "one_minus_beta2": _f32(t ** float(hp["beta2_decay"])),
        "rho": _f32(min(lr, 1 / (t**0.5))),
        "eps1": _f32(float(eps1)),
        "eps1_sq": _f32(float(eps1) * float(eps1)),
        "eps2": _f32(float(eps2)),
        "d": _f32(float(hp["d"])),
    }


def _muon_scalars(hp: Mapping[str, Any], step: int, counters: Mapping[str, float] | None) -> dict[str, np.ndarray]:
    lr, wd, momentum = float(hp["lr"]), float(hp["weight_decay"]), float(hp["momentum"])
    a, b, c = (float(x) for x in hp["ns_coefficients"])
    return {
        "lr": _f32(lr),
        "param_scale": _f32(1.0 - lr * wd),
        "momentum": _f32(momentum),
        "one_minus_momentum": _f32(1.0 - momentum),
        "eps": _f32(float(hp["eps"])),
        "ns_a": _f32(a),
        "ns_b": _f32(b),
        "ns_c": _f32(c),
    }


_SCALARS: dict[str, Callable[[_GroupStep], dict[str, np.ndarray]]] = {
    "sgd": _sgd_scalars,
    "adagrad": _adagrad_scalars,
    "rmsprop": _rmsprop_scalars,
    "adadelta": _adadelta_scalars,
    "adamax": _adamax_scalars,
    "nadam": _nadam_scalars,
    "radam": _radam_scalars,
    "adam": _adam_scalars,
    "adamw": lambda g: _adam_scalars(g, decoupled=True),
    "asgd": lambda g: _asgd_scalars(g.hp, g.step, g.counters),
    "rprop": lambda g: _rprop_scalars(g.hp, g.step, g.counters),
    "adafactor": lambda g: _adafactor_scalars(g.hp, g.step, g.counters),
    "muon": lambda g: _muon_scalars(g.hp, g.step, g.counters),
}
"""Each optimizer kind's runtime scalars of one param group's step (:func:`step_scalars`): one table."""

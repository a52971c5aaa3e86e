"""torch.optim.Optimizer → `torchpar.ir.optimizer.OptimizerSpec`, and the host side of its state.

`TorchOptimizerBridge` is the only object that touches the user's optimizer:

- at compile time it reads the structure (kind, param → group, the per-group flags nesterov, amsgrad,
  maximize, centered, momentum > 0 for RMSprop, decoupled_weight_decay, Muon's ns_steps and adjust_lr_fn) into an
  `OptimizerSpec`, rejecting what jaxbackend does not port (other classes, subclasses overriding the update,
  ``differentiable=True``, ``capturable=True``, a Muon parameter that is not a matrix) with an error naming the
  optimizer and the option;
- every step, `step_scalars()` re-reads `optimizer.param_groups` (so torch LR schedulers, or a user
  editing ``group["lr"]``, take effect without recompiling) and advances per-group step counters;
- `initial_state()` / `write_back()` convert the optimizer state between torch's own format
  (``optimizer.state[p]``) and name-keyed arrays, so training can move between PyTorch and torchpar in
  both directions and keep matching.

Step counters are per param group (torch keeps one per parameter; all parameters of a group step
together here). For every optimizer but SGD and Muon a counter is torch's ``state["step"]``; the other 0-d
tensors torch keeps per parameter are per-group host counters too: NAdam's ``mu_product`` (the product of its
momentum coefficients) and ASGD's ``eta`` and ``mu`` (its step size and averaging weight, recomputed from the
step after each one), float32 as in torch. For SGD it counts the steps
that used the momentum buffer: 0 means "no buffer yet" and the next momentum step sets it to the
gradient. Torch's SGD and Muon states have no step count, so resuming from an existing buffer sets it to 1.

A parameter with ``requires_grad=False`` never gets a gradient, so torch never updates it or creates
its state; the bridge leaves it out of the spec for the same reason.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch
from numpy.typing import ArrayLike

from torchpar.ir.optimizer import (
    MUON_ADJUST_LR_FNS,
    STEP_COUNTED_KINDS,
    OptimizerSpec,
    Scalars,
    asgd_eta_mu,
    nadam_mu_product,
    state_keys,
    state_shape,
)
from torchpar.ir.optimizer import step_scalars as _step_scalars

__all__ = ["SUPPORTED_OPTIMIZERS", "TorchOptimizerBridge"]

log = logging.getLogger(__name__)

# Class → kind; AdamW before its parent Adam (a subclass is matched to its nearest supported base).
_KINDS: tuple[tuple[type[torch.optim.Optimizer], str], ...] = (
    (torch.optim.SGD, "sgd"),
    (torch.optim.AdamW, "adamw"),
    (torch.optim.Adam, "adam"),
    (torch.optim.Adagrad, "adagrad"),
    (torch.optim.RMSprop, "rmsprop"),
    (torch.optim.Adamax, "adamax"),
    (torch.optim.NAdam, "nadam"),
    (torch.optim.RAdam, "radam"),
    (torch.optim.Adadelta, "adadelta"),
    (torch.optim.ASGD, "asgd"),
    (torch.optim.Rprop, "rprop"),
    (torch.optim.Adafactor, "adafactor"),
    (torch.optim.Muon, "muon"),
)

SUPPORTED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(cls for cls, _ in _KINDS)

_SUPPORTED_TEXT = (
    "torchpar compiles torch.optim.SGD (momentum, dampening, nesterov, weight_decay, maximize), "
    "torch.optim.Adam and torch.optim.AdamW (betas, eps, weight_decay, amsgrad, maximize), "
    "torch.optim.Adagrad (lr_decay, weight_decay, initial_accumulator_value, eps, maximize), "
    "torch.optim.RMSprop (alpha, eps, weight_decay, momentum, centered, maximize), "
    "torch.optim.Adamax (betas, eps, weight_decay, maximize), "
    "torch.optim.NAdam (betas, eps, weight_decay, momentum_decay, decoupled_weight_decay, maximize), "
    "torch.optim.RAdam (betas, eps, weight_decay, decoupled_weight_decay, maximize), "
    "torch.optim.Adadelta (lr, rho, eps, weight_decay, maximize), "
    "torch.optim.ASGD (lambd, alpha, t0, weight_decay, maximize), "
    "torch.optim.Rprop (etas, step_sizes, maximize), "
    "torch.optim.Adafactor (beta2_decay, eps, d, weight_decay, maximize) and "
    "torch.optim.Muon (2-d parameters; weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn)"
)

# Hyper-parameters read from param_groups every step (besides lr, and weight_decay where the class has it), per kind.
_HPARAM_KEYS: dict[str, tuple[str, ...]] = {
    "sgd": ("momentum", "dampening"),
    "adam": ("betas", "eps"),
    "adamw": ("betas", "eps"),
    "adagrad": ("lr_decay", "eps"),
    "rmsprop": ("alpha", "eps", "momentum"),
    "adamax": ("betas", "eps"),
    "nadam": ("betas", "eps", "momentum_decay"),
    "radam": ("betas", "eps"),
    "adadelta": ("rho", "eps"),
    "asgd": ("lambd", "alpha", "t0"),
    "rprop": ("etas", "step_sizes"),
    "adafactor": ("beta2_decay", "eps", "d"),
    "muon": ("momentum", "ns_coefficients", "eps"),
}

_COUNTER_KEYS: dict[str, tuple[str, ...]] = {"nadam": ("mu_product",), "asgd": ("eta", "mu")}
"""The 0-d tensors torch keeps per parameter besides ``step``: per-group host counters here."""

_STRUCTURAL = (
    "nesterov",
    "amsgrad",
    "maximize",
    "centered",
    "has_momentum",
    "decoupled_weight_decay",
    "ns_steps",
    "adjust_lr_fn",
)
"""`OptimizerSpec` fields read from the param groups at compile time; changing one later needs a new compile."""


def _base_class(optimizer: torch.optim.Optimizer) -> type[torch.optim.Optimizer]:
    """The supported class `optimizer` behaves as; subclasses that override the update are refused."""
    cls = type(optimizer)
    for base, _ in _KINDS:
        if issubclass(cls, base):
            overriding = [
                c.__name__
                for c in cls.__mro__[: cls.__mro__.index(base)]
                if "step" in vars(c) or "_init_group" in vars(c)
            ]
            if overriding:
                raise NotImplementedError(
                    f"{cls.__name__} subclasses torch.optim.{base.__name__} but overrides its update "
                    f"({', '.join(overriding)} define step/_init_group), which torchpar cannot see. "
                    f"{_SUPPORTED_TEXT}; use the stock class."
                )
            return base
    raise NotImplementedError(
        f"optimizer {cls.__module__}.{cls.__qualname__} is not supported: {_SUPPORTED_TEXT}. "
        "Switch to one of these (their update formulas are ported exactly), or run the optimizer "
        "in PyTorch."
    )


def _scalar_dtype_for_step(group: Mapping[str, object]) -> torch.dtype:
    """torch.optim.optimizer._get_scalar_dtype: the dtype torch gives Adam's state["step"]."""
    if group.get("fused"):
        return torch.float32
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype == torch.bfloat16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return torch.empty((), dtype=dtype).numpy().dtype


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16; jax's ml_dtypes does
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
    return t.numpy().copy()


def _to_torch(a: ArrayLike, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``a`` as a tensor of ``like``'s dtype and device; it must have ``shape``."""
    a = np.asarray(a)
    if a.shape != shape:
        raise ValueError(
            f"state array of shape {a.shape}, expected {shape} for a parameter of shape {tuple(like.shape)}"
        )
    if like.dtype == torch.bfloat16:
        import ml_dtypes

        t = torch.from_numpy(np.array(a.astype(ml_dtypes.bfloat16)).view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.array(a))
    return t.to(device=like.device, dtype=like.dtype)


class TorchOptimizerBridge:
    """Connects a torch optimizer of `SUPPORTED_OPTIMIZERS` to `jaxbackend.optimizer` (see the module docstring)."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, param_names: Mapping[int, str], *, orphans_allowed: bool = False
    ) -> None:
        """`param_names` maps ``id(param)`` → its name in ``model.named_parameters()``. A parameter of the optimizer
        that is not there is an error, unless ``orphans_allowed`` (the model changed after the optimizer was built,
        e.g. a weight tied to another): then, as in PyTorch, it gets no gradient and is not updated."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        base = _base_class(optimizer)
        kind = dict(_KINDS)[base]

        names: list[str] = []
        groups: list[int] = []
        params: list[torch.Tensor] = []
        orphans: list[str] = []
        for gi, group in enumerate(optimizer.param_groups):
            self._check_group(kind, gi, group)
            for pi, p in enumerate(group["params"]):
                name = param_names.get(id(p))
                if name is None:
                    orphans.append(f"param group {gi}, param {pi} (shape {tuple(p.shape)}, {p.dtype})")
                    continue
                if p.is_complex():
                    raise NotImplementedError(
                        f"parameter {name!r} is complex ({p.dtype}); torchpar's optimizers support real "
                        "floating-point parameters only"
                    )
                if not p.is_floating_point():
                    raise ValueError(f"parameter {name!r} has dtype {p.dtype}; optimizers need floating point")
                if kind == "muon" and p.ndim != 2:
                    raise ValueError(
                        f"parameter {name!r} of shape {tuple(p.shape)} is in a torch.optim.Muon param group (group "
                        f"{gi}); Muon updates 2-d matrices only (torch raises at its step): optimize the other "
                        "parameters with a second optimizer such as AdamW"
                    )
                if not p.requires_grad:
                    continue  # never has a grad, so torch never updates it
                names.append(name)
                groups.append(gi)
                params.append(p)

        if orphans and (not orphans_allowed or not names):
            raise ValueError(
                f"optimizer {orphans[0]} is not a parameter of the model (nor of a module the step calls)"
                f"{f' ({len(orphans) - 1} more)' if len(orphans) > 1 else ''}; build the optimizer from "
                "model.parameters() / model.named_parameters()"
            )
        if orphans:  # e.g. a weight replaced by another (tied) after the optimizer was built
            log.warning(
                "torchpar: the optimizer's %s %s not a parameter of the model any more (replaced or tied "
                "after the optimizer was built?): it gets no gradient, so, as in PyTorch, it is not "
                "updated",
                "; ".join(orphans),
                "is" if len(orphans) == 1 else "are",
            )
        if kind in ("adam", "adamw"):
            default = base is torch.optim.AdamW
            decoupled = {bool(g.get("decoupled_weight_decay", default)) for g in optimizer.param_groups}
            if len(decoupled) > 1:
                raise NotImplementedError(
                    "param groups mix decoupled_weight_decay=True and False; torchpar needs one kind per "
                    "optimizer: use two optimizers, or give all groups the same setting"
                )
            kind = "adamw" if decoupled.pop() else "adam"

        self.params: tuple[torch.Tensor, ...] = tuple(params)
        self.spec = OptimizerSpec(
            kind=kind,
            param_names=tuple(names),
            group_of_param=tuple(groups),
            **{key: self._structural(key, kind) for key in _STRUCTURAL},
        )
        self._steps: list[int] = [0] * self.spec.num_groups
        self._counters: list[dict[str, float]] = [self._fresh_counters(g) for g in range(self.spec.num_groups)]
        self._last_advanced: list[tuple[int, dict[str, float]]] = []

    # -- structure ---------------------------------------------------------------------------------

    @staticmethod
    def _check_group(kind: str, gi: int, group: Mapping[str, Any]) -> None:
        name = {k: c.__name__ for c, k in _KINDS}[kind]
        if group.get("differentiable", False):
            raise NotImplementedError(
                f"param group {gi}: {name} with differentiable=True is not supported (torchpar differentiates the "
                "model, not the optimizer step); construct the optimizer with differentiable=False"
            )
        if kind != "sgd" and group.get("capturable", False):
            raise NotImplementedError(
                f"param group {gi}: {name} with capturable=True is not supported (it computes bias corrections "
                "and step-dependent factors in float32 on device; torchpar follows the capturable=False float64 "
                "path); construct the optimizer with capturable=False"
            )
        if kind == "sgd" and group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"param group {gi}: Nesterov momentum requires a momentum and zero dampening")
        if kind == "muon":
            steps = group["ns_steps"]
            if not isinstance(steps, (int, np.integer)) or isinstance(steps, bool) or not 0 <= steps < 100:
                raise ValueError(
                    f"param group {gi}: Muon ns_steps={steps!r}; it must be a whole number of "
                    "Newton–Schulz iterations in [0, 100) (torch's limit)"
                )
            if len(tuple(group["ns_coefficients"])) != 3:
                raise ValueError(
                    f"param group {gi}: Muon ns_coefficients={group['ns_coefficients']!r}; it must be "
                    "the three coefficients (a, b, c) of the Newton–Schulz polynomial"
                )
            if group["adjust_lr_fn"] not in (None, *MUON_ADJUST_LR_FNS):
                raise ValueError(
                    f"param group {gi}: Muon adjust_lr_fn={group['adjust_lr_fn']!r} is not one of "
                    f"None, {', '.join(repr(f) for f in MUON_ADJUST_LR_FNS)}"
                )

    def _flags(self, key: str) -> tuple[bool, ...]:
        return tuple(bool(g.get(key, False)) for g in self.optimizer.param_groups)

    def _structural(self, key: str, kind: str) -> tuple[Any, ...]:
        """The per-group field `key` of `OptimizerSpec` (`_STRUCTURAL`) for an optimizer of `kind` (False, 0 or ""
        where it does not apply)."""
        groups = self.optimizer.param_groups
        if key == "maximize":
            return self._flags(key)
        applies = {
            "nesterov": ("sgd", "muon"),
            "amsgrad": ("adam", "adamw"),
            "centered": ("rmsprop",),
            "has_momentum": ("rmsprop",),
            "decoupled_weight_decay": ("nadam", "radam"),
            "ns_steps": ("muon",),
            "adjust_lr_fn": ("muon",),
        }[key]
        if kind not in applies:
            return ({"ns_steps": 0, "adjust_lr_fn": ""}.get(key, False),) * len(groups)
        if key == "has_momentum":  # RMSprop keeps a momentum_buffer when momentum > 0 at its first step
            return tuple(float(g["momentum"]) > 0 for g in groups)
        if key == "ns_steps":
            return tuple(int(g["ns_steps"]) for g in groups)
        if key == "adjust_lr_fn":
            return tuple(g["adjust_lr_fn"] or "original" for g in groups)
        return self._flags(key)

    def _check_structure_unchanged(self) -> None:
        groups = self.optimizer.param_groups
        if len(groups) != self.spec.num_groups:
            raise ValueError(
                f"the optimizer now has {len(groups)} param groups, it was compiled with "
                f"{self.spec.num_groups}; param groups cannot be added after torchpar.compile"
            )
        if self.spec.kind == "muon":  # its options torch checks at every step
            for gi, group in enumerate(groups):
                self._check_group(self.spec.kind, gi, group)
        for key in _STRUCTURAL:
            now = self._structural(key, self.spec.kind)
            if now != getattr(self.spec, key):
                shown = "momentum > 0" if key == "has_momentum" else key
                raise ValueError(
                    f"param_groups[*][{shown!r}] changed from {getattr(self.spec, key)} to {now} "
                    "after compilation; it is structural (part of the compiled step): compile again"
                )

    # -- per step ----------------------------------------------------------------------------------

    def hparams(self) -> list[dict[str, Any]]:
        """The current per-group hyper-parameters as plain floats, pairs and triples (betas, etas, step_sizes, eps,
        ns_coefficients) as tuples of them (tensors are converted; Adafactor's ``eps1=None`` becomes the machine
        epsilon of the group's first parameter's dtype, as torch resolves it); a ``ValueError`` naming the group and
        the key if one is inf or nan (it would turn every parameter of the group nan)."""
        out = []
        for gi, group in enumerate(self.optimizer.param_groups):
            hp: dict[str, Any] = {"lr": float(group["lr"])}
            if "weight_decay" in group:  # Rprop has none
                hp["weight_decay"] = float(group["weight_decay"])
            for key in _HPARAM_KEYS[self.spec.kind]:
                value = group[key]
                if isinstance(value, (tuple, list)):
                    hp[key] = tuple(self._eps1(gi) if v is None else float(v) for v in value)
                else:
                    hp[key] = float(value)
            for key, value in hp.items():
                if not np.all(np.isfinite(value)):
                    raise ValueError(
                        f"optimizer.param_groups[{gi}][{key!r}] is {value}: the step would make every "
                        f"parameter of the group inf/nan; set a finite {key} (a scheduler or a "
                        "division by zero may have written it)"
                    )
            out.append(hp)
        return out

    def _eps1(self, g: int) -> float:
        """torch's Adafactor ``eps1=None``: ``torch.finfo(dtype).eps`` of the group's first parameter it steps."""
        members = self._params_of_group(g)
        return float(torch.finfo(members[0][1].dtype if members else torch.get_default_dtype()).eps)

    def _fresh_counters(self, g: int) -> dict[str, float]:
        """A group's host counters before its first step (ASGD's are set from lr at that step)."""
        return {"mu_product": 1.0} if self.spec.kind == "nadam" else {}

    def _scalar(self, g: int, value: float) -> float:
        """``value`` rounded as torch's 0-d state tensors of group ``g`` hold it (float32 by default)."""
        return float(np.asarray(value, dtype=_numpy_dtype(_scalar_dtype_for_step(self.optimizer.param_groups[g]))))

    def step_scalars(self) -> Scalars:
        """Scalars for `jaxbackend.optimizer.apply_updates` for the step about to run; advances the counters.

        Reads ``optimizer.param_groups`` now, so a scheduler's ``scheduler.step()`` since the last
        call is honoured. Call exactly once per optimizer step that is then applied.
        """
        self._check_structure_unchanged()
        hparams = self.hparams()
        steps = []
        self._last_advanced = []
        for g, hp in enumerate(hparams):
            if self.spec.kind == "sgd" and hp["momentum"] == 0.0:
                steps.append(self._steps[g] + 1)  # ignored by the update; the buffer is left alone
                continue
            self._last_advanced.append((g, dict(self._counters[g])))
            if self.spec.kind == "asgd" and self._steps[g] == 0:  # torch creates eta = lr, mu = 1 at the first step
                self._counters[g] = {"eta": self._scalar(g, hp["lr"]), "mu": 1.0}
            self._steps[g] += 1
            steps.append(self._steps[g])
        scalars = _step_scalars(self.spec, hparams, steps, counters=self._counters)
        for g, _ in self._last_advanced:
            self._counters[g] = self._advanced_counters(g, hparams[g], steps[g])
        return scalars

    def _advanced_counters(self, g: int, hp: Mapping[str, Any], step: int) -> dict[str, float]:
        """Group ``g``'s host counters after its step ``step`` ran with hyper-parameters ``hp``."""
        if self.spec.kind == "nadam":
            return {
                "mu_product": float(
                    nadam_mu_product(self._counters[g]["mu_product"], hp["betas"][0], hp["momentum_decay"], step)
                )
            }
        if self.spec.kind == "asgd":
            return {key: self._scalar(g, value) for key, value in zip(("eta", "mu"), asgd_eta_mu(hp, step))}
        return self._counters[g]

    def rollback_step(self) -> None:
        """Undo the counters the last :meth:`step_scalars` advanced: its update was skipped (a non-finite step),
        and torch's ``optimizer.step`` would not have run (``GradScaler.step`` skips it)."""
        for g, counters in self._last_advanced:
            self._steps[g] -= 1
            self._counters[g] = counters
        self._last_advanced = []

    # -- state -------------------------------------------------------------------------------------

    def _params_of_group(self, g: int) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p, gi in zip(self.spec.param_names, self.params, self.spec.group_of_param) if gi == g]

    def initial_state(self) -> dict[str, dict[str, np.ndarray]]:
        """Optimizer state as name → {torch state key → array}; sets the host step counters.

        Taken from ``optimizer.state`` where the optimizer has already stepped (resuming), else zeros.
        """
        out: dict[str, dict[str, np.ndarray]] = {}
        for g in range(self.spec.num_groups):
            members = self._params_of_group(g)
            torch_states = [self.optimizer.state.get(p, {}) for _, p in members]
            self._counters[g] = self._fresh_counters(g)
            if self.spec.kind == "sgd":
                has = [st.get("momentum_buffer") is not None for st in torch_states]
            else:  # Adagrad creates its state (step 0, sum = initial_accumulator_value) in its constructor
                has = [len(st) > 0 for st in torch_states]
            if any(has) and not all(has):
                without = [n for (n, _), h in zip(members, has) if not h]
                raise NotImplementedError(
                    f"param group {g}: some parameters have optimizer state and {without} do not (they "
                    "missed steps, e.g. got no gradient); torchpar keeps one step count per param group. "
                    "Resume from a state where all parameters of a group stepped together."
                )
            if not all(has) or not members:
                self._steps[g] = 0
                fill = float(self.optimizer.param_groups[g].get("initial_accumulator_value", 0.0))
                for name, p in members:
                    out[name] = {
                        k: np.full(
                            state_shape(self.spec, k, p.shape), fill if k == "sum" else 0.0, dtype=_numpy_dtype(p.dtype)
                        )
                        for k in state_keys(self.spec, g, p.ndim)
                    }
                continue

            if self.spec.kind not in STEP_COUNTED_KINDS:
                self._steps[g] = 1
            else:
                steps = {float(st["step"]) for st in torch_states}
                if len(steps) != 1:
                    raise NotImplementedError(
                        f"param group {g}: parameters have different {self.spec.kind} step counts {sorted(steps)}; "
                        "torchpar keeps one step count per param group"
                    )
                step = steps.pop()
                if step != int(step) or step < 0:
                    raise ValueError(f"param group {g}: {self.spec.kind} state step {step} is not a whole number")
                self._steps[g] = int(step)
                for key in _COUNTER_KEYS.get(self.spec.kind, ()):
                    values = {float(st[key]) for st in torch_states}
                    if len(values) != 1:
                        raise NotImplementedError(
                            f"param group {g}: parameters have different {self.spec.kind} {key} values "
                            f"{sorted(values)}; torchpar keeps one per param group"
                        )
                    self._counters[g][key] = values.pop()
            for (name, p), st in zip(members, torch_states):
                keys = state_keys(self.spec, g, p.ndim)
                missing = [k for k in keys if k not in st]
                if missing:
                    raise ValueError(
                        f"optimizer state of {name!r} lacks {missing} (has {sorted(st)}); it does not "
                        f"match this {self.spec.kind} param group (state keys {list(keys)})"
                    )
                out[name] = {}
                for k in keys:
                    expected = state_shape(self.spec, k, p.shape)
                    if tuple(st[k].shape) != expected:
                        raise ValueError(
                            f"optimizer state {k!r} of {name!r} has shape {tuple(st[k].shape)}, "
                            f"expected {expected} for the parameter's {tuple(p.shape)}"
                        )
                    out[name][k] = _to_numpy(st[k].to(p.dtype))
        return out

    def write_back(self, state: Mapping[str, Mapping[str, ArrayLike]], trained: Collection[str] | None = None) -> None:
        """Write name-keyed optimizer state into ``optimizer.state[p]`` in torch's own format.

        ``trained``: the parameters the compiled step gives a gradient (default: all of the spec); the others
        never get one, so torch creates no state for them and none is written.

        All but SGD and Muon: ``step`` (0-d float tensor, torch's scalar dtype), NAdam's ``mu_product`` and ASGD's
        ``eta``, ``mu`` (the same), then the tensors of `state_keys` (Adam/AdamW ``exp_avg``, ``exp_avg_sq`` and,
        with amsgrad, ``max_exp_avg_sq``; Adagrad ``sum``; RMSprop ``square_avg`` [``momentum_buffer``]
        [``grad_avg``]; Adamax ``exp_avg``, ``exp_inf``; NAdam/RAdam ``exp_avg``, ``exp_avg_sq``; Adadelta
        ``square_avg``, ``acc_delta``; ASGD ``ax``; Rprop ``prev``, ``step_size``; Adafactor ``row_var``, ``col_var``
        for a parameter of ≥ 2 dims, else ``variance``).
        SGD and Muon: ``momentum_buffer`` once the group has one.
        Groups that have not stepped get no state, as in torch. Existing tensors are updated in place.
        """
        for name, p, g in zip(self.spec.param_names, self.params, self.spec.group_of_param):
            if self._steps[g] == 0 or (trained is not None and name not in trained):
                continue
            if name not in state:
                raise ValueError(f"write_back: state has no entry for parameter {name!r}")
            torch_state = self.optimizer.state[p]
            if self.spec.kind in STEP_COUNTED_KINDS:
                group = self.optimizer.param_groups[g]
                # where torch creates it: ASGD on the parameter's device, fused Adam and capturable Rprop too
                on_device = (
                    self.spec.kind == "asgd"
                    or group.get("fused")
                    or (self.spec.kind == "rprop" and group.get("capturable"))
                )
                dtype, device = _scalar_dtype_for_step(group), p.device if on_device else "cpu"
                self._assign(torch_state, "step", torch.tensor(float(self._steps[g]), dtype=dtype, device=device))
                for key in _COUNTER_KEYS.get(self.spec.kind, ()):
                    self._assign(torch_state, key, torch.tensor(self._counters[g][key], dtype=dtype, device=device))
            for key in state_keys(self.spec, g, p.ndim):
                self._assign(
                    torch_state, key, _to_torch(state[name][key], like=p, shape=state_shape(self.spec, key, p.shape))
                )

    @staticmethod
    def _assign(torch_state: dict, key: str, value: torch.Tensor) -> None:
        old = torch_state.get(key)
        if (
            isinstance(old, torch.Tensor)
            and old.shape == value.shape
            and old.dtype == value.dtype
            and old.device == value.device
        ):
            with torch.no_grad():
                old.copy_(value)
        else:
            torch_state[key] = value

    # -- checkpoint --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, object]:
        """The host counters (the arrays are checkpointed by whoever holds them): ``group_steps`` and, per counter
        of `_COUNTER_KEYS`, ``group_<key>s`` (NAdam ``group_mu_products``; ASGD ``group_etas``, ``group_mus``, None
        for a group that has not stepped)."""
        out: dict[str, object] = {
            "kind": self.spec.kind,
            "param_names": list(self.spec.param_names),
            "group_steps": list(self._steps),
        }
        for key in _COUNTER_KEYS.get(self.spec.kind, ()):
            out[f"group_{key}s"] = [counters.get(key) for counters in self._counters]
        return out

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        if d.get("kind") != self.spec.kind or list(d.get("param_names", ())) != list(self.spec.param_names):
            raise ValueError(
                f"optimizer checkpoint is for a {d.get('kind')!r} optimizer over {len(d.get('param_names', ()))} "
                f"parameters; this one is {self.spec.kind!r} over {len(self.spec.param_names)}"
            )
        steps = [int(s) for s in d["group_steps"]]
        if len(steps) != self.spec.num_groups or any(s < 0 for s in steps):
            raise ValueError(f"optimizer checkpoint group_steps {steps} do not fit {self.spec.num_groups} param groups")
        counters: list[dict[str, float]] = [{} for _ in steps]
        for key in _COUNTER_KEYS.get(self.spec.kind, ()):
            values = list(d.get(f"group_{key}s", ()))
            if len(values) != len(steps):
                raise ValueError(
                    f"{self.spec.kind} optimizer checkpoint group_{key}s {values} do not fit "
                    f"{self.spec.num_groups} param groups"
                )
            for group_counters, value in zip(counters, values):
                if value is not None:
                    group_counters[key] = float(value)
        self._counters = counters
        self._steps = steps


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell torch LR schedulers the optimizer has stepped (the flag ``optimizer.step`` itself sets), so
    ``scheduler.step()`` after ``engine.step`` is not mistaken for a call before the first optimizer step."""
    optimizer._opt_called = True  # type: ignore[attr-defined]  # the flag torch.optim sets itself

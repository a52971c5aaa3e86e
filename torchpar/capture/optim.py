"""torch.optim.Optimizer → `torchpar.ir.optimizer.OptimizerSpec`, and the host side of its state.

`TorchOptimizerBridge` is the only object that touches the user's optimizer:

- at compile time it reads the structure (kind, param → group, the per-group flags nesterov, amsgrad,
  maximize, centered, momentum > 0 for RMSprop, decoupled_weight_decay) into an `OptimizerSpec`, rejecting
  what jaxbackend does not port (other classes, subclasses overriding the update, ``differentiable=True``,
  ``capturable=True``) with an error naming the optimizer and the option;
- every step, `step_scalars()` re-reads `optimizer.param_groups` (so torch LR schedulers, or a user
  editing ``group["lr"]``, take effect without recompiling) and advances per-group step counters;
- `initial_state()` / `write_back()` convert the optimizer state between torch's own format
  (``optimizer.state[p]``) and name-keyed arrays, so training can move between PyTorch and torchpar in
  both directions and keep matching.

Step counters are per param group (torch keeps one per parameter; all parameters of a group step
together here). For every optimizer but SGD a counter is torch's ``state["step"]``; NAdam's per-parameter
``mu_product`` (the product of its momentum coefficients, a float32 0-d tensor in torch) is a per-group host
counter too. For SGD it counts the steps
that used the momentum buffer: 0 means "no buffer yet" and the next momentum step sets it to the
gradient. Torch's SGD state has no step count, so resuming from an existing buffer sets it to 1.

A parameter with ``requires_grad=False`` never gets a gradient, so torch never updates it or creates
its state; the bridge leaves it out of the spec for the same reason.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch

from torchpar.ir.optimizer import OptimizerSpec, nadam_mu_product, state_keys
from torchpar.ir.optimizer import step_scalars as _step_scalars

__all__ = ["SUPPORTED_OPTIMIZERS", "TorchOptimizerBridge"]

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
)

SUPPORTED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = tuple(cls for cls, _ in _KINDS)

_SUPPORTED_TEXT = (
    "torchpar compiles torch.optim.SGD (momentum, dampening, nesterov, weight_decay, maximize), "
    "torch.optim.Adam and torch.optim.AdamW (betas, eps, weight_decay, amsgrad, maximize), "
    "torch.optim.Adagrad (lr_decay, weight_decay, initial_accumulator_value, eps, maximize), "
    "torch.optim.RMSprop (alpha, eps, weight_decay, momentum, centered, maximize), "
    "torch.optim.Adamax (betas, eps, weight_decay, maximize), "
    "torch.optim.NAdam (betas, eps, weight_decay, momentum_decay, decoupled_weight_decay, maximize), "
    "torch.optim.RAdam (betas, eps, weight_decay, decoupled_weight_decay, maximize) and "
    "torch.optim.Adadelta (lr, rho, eps, weight_decay, maximize)"
)

# Hyper-parameters read from param_groups every step (besides lr and weight_decay), per kind.
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
}


def _base_class(optimizer: torch.optim.Optimizer) -> type[torch.optim.Optimizer]:
    """The supported class `optimizer` behaves as; subclasses that override the update are refused."""
    cls = type(optimizer)
    for base, _ in _KINDS:
        if issubclass(cls, base):
            overriding = [c.__name__ for c in cls.__mro__[: cls.__mro__.index(base)]
                          if "step" in vars(c) or "_init_group" in vars(c)]
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


def _scalar_dtype_for_step(group: Mapping[str, Any]) -> torch.dtype:
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


def _to_torch(a: Any, like: torch.Tensor) -> torch.Tensor:
    a = np.asarray(a)
    if a.shape != tuple(like.shape):
        raise ValueError(f"state array of shape {a.shape} for a parameter of shape {tuple(like.shape)}")
    if like.dtype == torch.bfloat16:
        import ml_dtypes

        t = torch.from_numpy(np.array(a.astype(ml_dtypes.bfloat16)).view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(np.array(a))
    return t.to(device=like.device, dtype=like.dtype)


class TorchOptimizerBridge:
    """Connects a torch optimizer of `SUPPORTED_OPTIMIZERS` to `jaxbackend.optim` (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, param_names: Mapping[int, str]) -> None:
        """`param_names` maps ``id(param)`` → its name in ``model.named_parameters()``."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        base = _base_class(optimizer)
        kind = dict(_KINDS)[base]

        names: list[str] = []
        groups: list[int] = []
        params: list[torch.Tensor] = []
        for gi, group in enumerate(optimizer.param_groups):
            self._check_group(kind, gi, group)
            for pi, p in enumerate(group["params"]):
                name = param_names.get(id(p))
                if name is None:
                    raise ValueError(
                        f"optimizer param group {gi}, param {pi} (shape {tuple(p.shape)}, {p.dtype}) is not a "
                        "parameter of the model; build the optimizer from model.parameters() / "
                        "model.named_parameters()"
                    )
                if p.is_complex():
                    raise NotImplementedError(
                        f"parameter {name!r} is complex ({p.dtype}); torchpar's optimizers support real "
                        "floating-point parameters only"
                    )
                if not p.is_floating_point():
                    raise ValueError(f"parameter {name!r} has dtype {p.dtype}; optimizers need floating point")
                if not p.requires_grad:
                    continue  # never has a grad, so torch never updates it
                names.append(name)
                groups.append(gi)
                params.append(p)

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
            maximize=self._flags("maximize"),
            **{key: self._structural(key, kind) for key in ("nesterov", "amsgrad", "centered", "has_momentum",
                                                           "decoupled_weight_decay")},
        )
        self._steps: list[int] = [0] * self.spec.num_groups
        self._mu_products: list[float] = [1.0] * self.spec.num_groups  # NAdam only
        self._last_advanced: list[tuple[int, float]] = []

    # -- structure ---------------------------------------------------------------------------------

    @staticmethod
    def _check_group(kind: str, gi: int, group: Mapping[str, Any]) -> None:
        name = dict((k, c.__name__) for c, k in _KINDS)[kind]
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

    def _flags(self, key: str) -> tuple[bool, ...]:
        return tuple(bool(g.get(key, False)) for g in self.optimizer.param_groups)

    def _structural(self, key: str, kind: str) -> tuple[bool, ...]:
        """The per-group flag `key` of `OptimizerSpec` for an optimizer of `kind` (False where it does not apply)."""
        applies = {"nesterov": ("sgd",), "amsgrad": ("adam", "adamw"), "centered": ("rmsprop",),
                   "has_momentum": ("rmsprop",), "decoupled_weight_decay": ("nadam", "radam")}[key]
        if kind not in applies:
            return (False,) * len(self.optimizer.param_groups)
        if key == "has_momentum":  # RMSprop keeps a momentum_buffer when momentum > 0 at its first step
            return tuple(float(g["momentum"]) > 0 for g in self.optimizer.param_groups)
        return self._flags(key)

    def _check_structure_unchanged(self) -> None:
        groups = self.optimizer.param_groups
        if len(groups) != self.spec.num_groups:
            raise ValueError(
                f"the optimizer now has {len(groups)} param groups, it was compiled with "
                f"{self.spec.num_groups}; param groups cannot be added after torchpar.compile"
            )
        for key in ("nesterov", "amsgrad", "maximize", "centered", "has_momentum", "decoupled_weight_decay"):
            now = self._structural(key, self.spec.kind) if key != "maximize" else self._flags(key)
            if now != getattr(self.spec, key):
                shown = "momentum > 0" if key == "has_momentum" else key
                raise ValueError(
                    f"param_groups[*][{shown!r}] changed from {getattr(self.spec, key)} to {now} "
                    "after compilation; it is structural (part of the compiled step): compile again"
                )

    # -- per step ----------------------------------------------------------------------------------

    def hparams(self) -> list[dict[str, float]]:
        """The current per-group hyper-parameters as plain floats (tensor lr/betas are converted); a ``ValueError``
        naming the group and the key if one is inf or nan (it would turn every parameter of the group nan)."""
        out = []
        for gi, group in enumerate(self.optimizer.param_groups):
            hp = {"lr": float(group["lr"]), "weight_decay": float(group["weight_decay"])}
            for key in _HPARAM_KEYS[self.spec.kind]:
                if key == "betas":
                    hp["betas"] = (float(group["betas"][0]), float(group["betas"][1]))
                else:
                    hp[key] = float(group[key])
            for key, value in hp.items():
                if not np.all(np.isfinite(value)):
                    raise ValueError(f"optimizer.param_groups[{gi}][{key!r}] is {value}: the step would make every "
                                     f"parameter of the group inf/nan; set a finite {key} (a scheduler or a "
                                     "division by zero may have written it)")
            out.append(hp)
        return out

    def step_scalars(self):
        """Scalars for `jaxbackend.optim.apply_updates` for the step about to run; advances the counters.

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
            self._steps[g] += 1
            self._last_advanced.append((g, self._mu_products[g]))
            steps.append(self._steps[g])
        scalars = _step_scalars(self.spec, hparams, steps, mu_products=self._mu_products)
        if self.spec.kind == "nadam":
            for g, _ in self._last_advanced:
                self._mu_products[g] = float(nadam_mu_product(self._mu_products[g], hparams[g]["betas"][0],
                                                              hparams[g]["momentum_decay"], steps[g]))
        return scalars

    def rollback_step(self) -> None:
        """Undo the counters the last :meth:`step_scalars` advanced: its update was skipped (a non-finite step),
        and torch's ``optimizer.step`` would not have run (``GradScaler.step`` skips it)."""
        for g, mu_product in self._last_advanced:
            self._steps[g] -= 1
            self._mu_products[g] = mu_product
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
            keys = state_keys(self.spec, g)
            members = self._params_of_group(g)
            torch_states = [self.optimizer.state[p] if p in self.optimizer.state else {} for _, p in members]
            self._mu_products[g] = 1.0
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
                    out[name] = {k: np.full(tuple(p.shape), fill if k == "sum" else 0.0, dtype=_numpy_dtype(p.dtype))
                                 for k in keys}
                continue

            if self.spec.kind == "sgd":
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
                if self.spec.kind == "nadam":
                    products = {float(st["mu_product"]) for st in torch_states}
                    if len(products) != 1:
                        raise NotImplementedError(
                            f"param group {g}: parameters have different NAdam mu_product values {sorted(products)}; "
                            "torchpar keeps one per param group"
                        )
                    self._mu_products[g] = products.pop()
            for (name, p), st in zip(members, torch_states):
                missing = [k for k in keys if k not in st]
                if missing:
                    raise ValueError(
                        f"optimizer state of {name!r} lacks {missing} (has {sorted(st)}); it does not "
                        f"match this {self.spec.kind} param group (state keys {list(keys)})"
                    )
                out[name] = {}
                for k in keys:
                    if tuple(st[k].shape) != tuple(p.shape):
                        raise ValueError(f"optimizer state {k!r} of {name!r} has shape {tuple(st[k].shape)}, "
                                         f"the parameter {tuple(p.shape)}")
                    out[name][k] = _to_numpy(st[k].to(p.dtype))
        return out

    def write_back(self, state: Mapping[str, Mapping[str, Any]], trained: Collection[str] | None = None) -> None:
        """Write name-keyed optimizer state into ``optimizer.state[p]`` in torch's own format.

        ``trained``: the parameters the compiled step gives a gradient (default: all of the spec); the others
        never get one, so torch creates no state for them and none is written.

        All but SGD: ``step`` (0-d float tensor, torch's scalar dtype), NAdam's ``mu_product`` (the same), then the
        tensors of `state_keys` (Adam/AdamW ``exp_avg``, ``exp_avg_sq`` and, with amsgrad, ``max_exp_avg_sq``;
        Adagrad ``sum``; RMSprop ``square_avg`` [``momentum_buffer``] [``grad_avg``]; Adamax ``exp_avg``,
        ``exp_inf``; NAdam/RAdam ``exp_avg``, ``exp_avg_sq``; Adadelta ``square_avg``, ``acc_delta``).
        SGD: ``momentum_buffer`` once the group has one.
        Groups that have not stepped get no state, as in torch. Existing tensors are updated in place.
        """
        for name, p, g in zip(self.spec.param_names, self.params, self.spec.group_of_param):
            if self._steps[g] == 0 or (trained is not None and name not in trained):
                continue
            if name not in state:
                raise ValueError(f"write_back: state has no entry for parameter {name!r}")
            torch_state = self.optimizer.state[p]
            if self.spec.kind != "sgd":
                group = self.optimizer.param_groups[g]
                step = torch.tensor(float(self._steps[g]), dtype=_scalar_dtype_for_step(group),
                                    device=p.device if group.get("fused") else "cpu")
                self._assign(torch_state, "step", step)
                if self.spec.kind == "nadam":
                    self._assign(torch_state, "mu_product",
                                 torch.tensor(self._mu_products[g], dtype=_scalar_dtype_for_step(group)))
            for key in state_keys(self.spec, g):
                self._assign(torch_state, key, _to_torch(state[name][key], like=p))

    @staticmethod
    def _assign(torch_state: dict, key: str, value: torch.Tensor) -> None:
        old = torch_state.get(key)
        if (isinstance(old, torch.Tensor) and old.shape == value.shape and old.dtype == value.dtype
                and old.device == value.device):
            with torch.no_grad():
                old.copy_(value)
        else:
            torch_state[key] = value

    # -- checkpoint --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The host counters (the arrays are checkpointed by whoever holds them)."""
        out = {"kind": self.spec.kind, "param_names": list(self.spec.param_names), "group_steps": list(self._steps)}
        if self.spec.kind == "nadam":
            out["group_mu_products"] = list(self._mu_products)
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
        if self.spec.kind == "nadam":
            products = [float(m) for m in d.get("group_mu_products", ())]
            if len(products) != len(steps):
                raise ValueError(f"NAdam optimizer checkpoint group_mu_products {products} do not fit "
                                 f"{self.spec.num_groups} param groups")
            self._mu_products = products
        self._steps = steps


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell torch LR schedulers the optimizer has stepped (the flag ``optimizer.step`` itself sets), so
    ``scheduler.step()`` after ``engine.step`` is not mistaken for a call before the first optimizer step."""
    optimizer._opt_called = True  # type: ignore[attr-defined]

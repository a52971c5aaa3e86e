"""torch.optim.Optimizer → `torchpar.ir.optimizer.OptimizerSpec`, and the host side of its state.

`TorchOptimizerBridge` is the only object that touches the user's optimizer:

- at compile time it reads the structure (kind, param → group, nesterov/amsgrad/maximize) into an
  `OptimizerSpec`, rejecting what jaxbackend does not port;
- every step, `step_scalars()` re-reads `optimizer.param_groups` (so torch LR schedulers, or a user
  editing ``group["lr"]``, take effect without recompiling) and advances per-group step counters;
- `initial_state()` / `write_back()` convert the optimizer state between torch's own format
  (``optimizer.state[p]``) and name-keyed arrays, so training can move between PyTorch and torchpar in
  both directions and keep matching.

Step counters are per param group (torch keeps one per parameter; all parameters of a group step
together here). For Adam/AdamW a counter is torch's ``state["step"]``. For SGD it counts the steps
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

from torchpar.ir.optimizer import OptimizerSpec, state_keys
from torchpar.ir.optimizer import step_scalars as _step_scalars

__all__ = ["SUPPORTED_OPTIMIZERS", "TorchOptimizerBridge"]

SUPPORTED_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
)

_SUPPORTED_TEXT = (
    "torchpar compiles torch.optim.SGD (momentum, dampening, nesterov, weight_decay, maximize), "
    "torch.optim.Adam and torch.optim.AdamW (weight_decay, amsgrad, maximize)"
)


def _base_class(optimizer: torch.optim.Optimizer) -> type[torch.optim.Optimizer]:
    """The supported class `optimizer` behaves as; subclasses that override the update are refused."""
    cls = type(optimizer)
    for base in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD):  # AdamW before its parent Adam
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
    """Connects a torch SGD/Adam/AdamW optimizer to `jaxbackend.optim` (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer, param_names: Mapping[int, str]) -> None:
        """`param_names` maps ``id(param)`` → its name in ``model.named_parameters()``."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.optimizer = optimizer
        base = _base_class(optimizer)

        names: list[str] = []
        groups: list[int] = []
        params: list[torch.Tensor] = []
        for gi, group in enumerate(optimizer.param_groups):
            self._check_group(base, gi, group)
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

        if base is torch.optim.SGD:
            kind = "sgd"
        else:
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
            nesterov=self._flags("nesterov") if kind == "sgd" else (False,) * len(optimizer.param_groups),
            amsgrad=self._flags("amsgrad") if kind != "sgd" else (False,) * len(optimizer.param_groups),
            maximize=self._flags("maximize"),
        )
        self._steps: list[int] = [0] * self.spec.num_groups
        self._last_advanced: list[int] = []

    # -- structure ---------------------------------------------------------------------------------

    @staticmethod
    def _check_group(base: type, gi: int, group: Mapping[str, Any]) -> None:
        if group.get("differentiable", False):
            raise NotImplementedError(
                f"param group {gi}: differentiable=True is not supported (torchpar differentiates the "
                "model, not the optimizer step); construct the optimizer with differentiable=False"
            )
        if base is not torch.optim.SGD and group.get("capturable", False):
            raise NotImplementedError(
                f"param group {gi}: capturable=True is not supported (it computes bias corrections in "
                "float32 on device; torchpar follows the capturable=False float64 path); construct "
                "the optimizer with capturable=False"
            )
        if base is torch.optim.SGD and group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(f"param group {gi}: Nesterov momentum requires a momentum and zero dampening")

    def _flags(self, key: str) -> tuple[bool, ...]:
        return tuple(bool(g.get(key, False)) for g in self.optimizer.param_groups)

    def _check_structure_unchanged(self) -> None:
        groups = self.optimizer.param_groups
        if len(groups) != self.spec.num_groups:
            raise ValueError(
                f"the optimizer now has {len(groups)} param groups, it was compiled with "
                f"{self.spec.num_groups}; param groups cannot be added after torchpar.compile"
            )
        for key in ("nesterov", "maximize") if self.spec.kind == "sgd" else ("amsgrad", "maximize"):
            if self._flags(key) != getattr(self.spec, key):
                raise ValueError(
                    f"param_groups[*][{key!r}] changed from {getattr(self.spec, key)} to {self._flags(key)} "
                    "after compilation; it is structural (part of the compiled step): compile again"
                )

    # -- per step ----------------------------------------------------------------------------------

    def hparams(self) -> list[dict[str, float]]:
        """The current per-group hyper-parameters as plain floats (tensor lr/betas are converted); a ``ValueError``
        naming the group and the key if one is inf or nan (it would turn every parameter of the group nan)."""
        out = []
        for gi, group in enumerate(self.optimizer.param_groups):
            hp = {"lr": float(group["lr"]), "weight_decay": float(group["weight_decay"])}
            if self.spec.kind == "sgd":
                hp["momentum"] = float(group["momentum"])
                hp["dampening"] = float(group["dampening"])
            else:
                hp["betas"] = (float(group["betas"][0]), float(group["betas"][1]))
                hp["eps"] = float(group["eps"])
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
            self._last_advanced.append(g)
            steps.append(self._steps[g])
        return _step_scalars(self.spec, hparams, steps)

    def rollback_step(self) -> None:
        """Undo the counters the last :meth:`step_scalars` advanced: its update was skipped (a non-finite step),
        and torch's ``optimizer.step`` would not have run (``GradScaler.step`` skips it)."""
        for g in self._last_advanced:
            self._steps[g] -= 1
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
            if self.spec.kind == "sgd":
                has = [st.get("momentum_buffer") is not None for st in torch_states]
            else:
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
                for name, p in members:
                    out[name] = {k: np.zeros(tuple(p.shape), dtype=_numpy_dtype(p.dtype)) for k in keys}
                continue

            if self.spec.kind == "sgd":
                self._steps[g] = 1
            else:
                steps = {float(st["step"]) for st in torch_states}
                if len(steps) != 1:
                    raise NotImplementedError(
                        f"param group {g}: parameters have different Adam step counts {sorted(steps)}; "
                        "torchpar keeps one step count per param group"
                    )
                step = steps.pop()
                if step != int(step) or step < 0:
                    raise ValueError(f"param group {g}: Adam state step {step} is not a whole number")
                self._steps[g] = int(step)
            for (name, p), st in zip(members, torch_states):
                missing = [k for k in keys if k not in st]
                if missing:
                    raise ValueError(
                        f"optimizer state of {name!r} lacks {missing} (has {sorted(st)}); it does not "
                        f"match this {self.spec.kind} param group (amsgrad={self.spec.amsgrad[g]})"
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

        Adam/AdamW: ``step`` (0-d float tensor, torch's scalar dtype), ``exp_avg``, ``exp_avg_sq``
        and, with amsgrad, ``max_exp_avg_sq``. SGD: ``momentum_buffer`` once the group has one.
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
        return {"kind": self.spec.kind, "param_names": list(self.spec.param_names), "group_steps": list(self._steps)}

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        if d.get("kind") != self.spec.kind or list(d.get("param_names", ())) != list(self.spec.param_names):
            raise ValueError(
                f"optimizer checkpoint is for a {d.get('kind')!r} optimizer over {len(d.get('param_names', ()))} "
                f"parameters; this one is {self.spec.kind!r} over {len(self.spec.param_names)}"
            )
        steps = [int(s) for s in d["group_steps"]]
        if len(steps) != self.spec.num_groups or any(s < 0 for s in steps):
            raise ValueError(f"optimizer checkpoint group_steps {steps} do not fit {self.spec.num_groups} param groups")
        self._steps = steps


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Tell torch LR schedulers the optimizer has stepped (the flag ``optimizer.step`` itself sets), so
    ``scheduler.step()`` after ``engine.step`` is not mistaken for a call before the first optimizer step."""
    optimizer._opt_called = True  # type: ignore[attr-defined]

"""jaxbackend.optim (+ torchpar.capture.optim) against PyTorch's own optimizer test database.

For every ``OptimizerInfo`` of ``torch.testing._internal.common_optimizers.optim_db`` whose class torchpar
supports, every CPU sample configuration runs 5 steps in torch and through `TorchOptimizerBridge` +
`apply_updates`; parameters (every step) and the optimizer state (written back in torch's format) must match.
Each sample also runs with the implementation flags the info lists (``foreach`` and CPU ``fused``: other kernels,
same math) and with ``differentiable=True`` / ``capturable=True``, which torchpar refuses by name. Nothing is
skipped: every sample is either compared or asserted to be refused.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.testing._internal.common_optimizers import optim_db

import torchpar
from jaxbackend.optim import apply_updates
from torchpar.capture.optim import SUPPORTED_OPTIMIZERS, TorchOptimizerBridge, mark_optimizer_stepped
from torchpar.ir.optimizer import state_copies

SHAPES = {"w1": (8, 5), "b1": (5,), "w2": (3, 4, 2), "s": ()}
STEPS = 5
RTOL, ATOL = 1e-6, 1e-7

SUPPORTED_INFOS = [info for info in optim_db if info.optim_cls in SUPPORTED_OPTIMIZERS]
UNSUPPORTED_INFOS = [info for info in optim_db if info.optim_cls not in SUPPORTED_OPTIMIZERS]


def _samples():
    """(id, info, kwargs, variant) for every supported sample and implementation variant."""
    out = []
    for info in SUPPORTED_INFOS:
        name = info.optim_cls.__name__
        for i, sample in enumerate(info.optim_inputs_func(device="cpu")):
            # Every CPU sample of the installed torch builds its own params (sample.params is None); a sample with
            # param groups would need them mapped onto our parameters: fail loudly rather than skip it.
            variants = ["default"]
            if "foreach" in info.supported_impls:
                variants.append("foreach")
            if "fused" in info.supported_impls and "cpu" in info.supports_fused_on:
                variants.append("fused")
            if "differentiable" in info.supported_impls:
                variants.append("differentiable")
            if info.has_capturable_arg or "capturable" in info.optim_cls.__init__.__code__.co_varnames:
                variants.append("capturable")
            for variant in variants:
                out.append(pytest.param(info, sample, variant, id=f"{name}-{i}-{sample.desc}-{variant}"))
    return out


SAMPLES = _samples()


def make_params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.nn.Parameter(torch.randn(s, generator=gen)) for n, s in SHAPES.items()}


def make_grads(step: int, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * seed + step)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def names_by_id(params):
    return {id(p): n for n, p in params.items()}


def _steps(info) -> int:
    """5, but 8 for RAdam: its rectification term only switches on once ρₜ > 5, at step 6 for β₂ = 0.999."""
    return 8 if info.optim_cls is torch.optim.RAdam else STEPS


def _kwargs(sample, variant):
    kwargs = dict(sample.kwargs)
    if variant == "default":
        kwargs.setdefault("foreach", False)  # torch's single-tensor path, the reference of jaxbackend.optim
    elif variant in ("foreach", "fused", "differentiable", "capturable"):
        kwargs[variant] = True
    return kwargs


def _build(info, sample, variant, params):
    return info.optim_cls(list(params.values()), **_kwargs(sample, variant))


def _assert_close(ours, theirs, what):
    np.testing.assert_allclose(np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64),
                               rtol=RTOL, atol=ATOL, err_msg=what)


def test_optim_db_covers_every_supported_optimizer():
    assert {info.optim_cls for info in SUPPORTED_INFOS} == set(SUPPORTED_OPTIMIZERS)
    assert all(sample.params is None for info in SUPPORTED_INFOS for sample in info.optim_inputs_func(device="cpu"))


@pytest.mark.parametrize("info,sample,variant", SAMPLES)
def test_optim_db_sample(info, sample, variant):
    assert sample.params is None, "a sample with its own param groups is not mapped onto the test parameters"
    if variant in ("differentiable", "capturable"):
        params = make_params()
        optimizer = _build(info, sample, variant, params)
        with pytest.raises(NotImplementedError, match=rf"{info.optim_cls.__name__} with {variant}=True"):
            TorchOptimizerBridge(optimizer, names_by_id(params))
        return

    torch_params = make_params()
    torch_opt = _build(info, sample, variant, torch_params)
    params = make_params()
    optimizer = _build(info, sample, variant, params)  # the one the bridge reads and writes back into
    if isinstance(sample.kwargs.get("lr"), torch.Tensor):
        assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)  # a tensor lr is read every step

    bridge = TorchOptimizerBridge(optimizer, names_by_id(params))
    assert bridge.spec.kind == info.optim_cls.__name__.lower() or (
        bridge.spec.kind == "adamw" and info.optim_cls is torch.optim.Adam and sample.kwargs.get(
            "decoupled_weight_decay"))
    jax_params = {n: jnp.asarray(p.detach().numpy()) for n, p in params.items()}
    state = jax.tree.map(jnp.asarray, bridge.initial_state())
    update = jax.jit(apply_updates, static_argnums=0)
    steps = _steps(info)
    for t in range(steps):
        grads = make_grads(t)
        jax_params, state = update(bridge.spec, jax_params, {n: jnp.asarray(g.numpy()) for n, g in grads.items()},
                                   state, bridge.step_scalars())
        for n, p in torch_params.items():
            p.grad = grads[n].clone()
        torch_opt.step()
        for n, p in torch_params.items():
            _assert_close(jax_params[n], p.detach().numpy(), f"step {t}, param {n}")

    with torch.no_grad():
        for n, p in params.items():
            p.copy_(torch.from_numpy(np.array(jax_params[n])))
    bridge.write_back(state)
    for n in SHAPES:
        ours, theirs = optimizer.state[params[n]], torch_opt.state[torch_params[n]]
        assert list(ours) == list(theirs), n
        for k in theirs:
            assert isinstance(ours[k], torch.Tensor), (n, k)
            assert (ours[k].dtype, ours[k].shape, ours[k].device) == (theirs[k].dtype, theirs[k].shape,
                                                                     theirs[k].device), (n, k)
            _assert_close(ours[k].numpy(), theirs[k].numpy(), f"state {k!r} of {n}")
    held = len([k for k in theirs if k not in ("step", "mu_product")])
    if bridge.spec.kind == "sgd" and not sample.kwargs.get("momentum"):
        held = 1  # torchpar keeps a (zero) momentum buffer so momentum can be switched on without recompiling
    assert state_copies(bridge.spec) == held

    # torch resumes from the written-back state exactly as from its own (its state_dict round-trips, too).
    resumed = _build(info, sample, variant, params)
    resumed.load_state_dict(optimizer.state_dict())
    grads = make_grads(steps)
    for opt, ps in ((resumed, params), (torch_opt, torch_params)):
        for n, p in ps.items():
            p.grad = grads[n].clone()
        opt.step()
    for n in SHAPES:
        _assert_close(params[n].detach().numpy(), torch_params[n].detach().numpy(), f"resumed step, param {n}")


# --- beyond optim_db: param groups, schedulers, RAdam's rectified branch, resuming from torch's state ----------

def _run_both(make_opt, steps, scheduler=None, torch_first=0):
    """`torch_first` steps in torch on both sides, then `steps` steps in torch and through the bridge; every
    parameter compared after every step, the written-back state at the end. Returns the bridge."""
    torch_params, params = make_params(), make_params()
    torch_opt, optimizer = make_opt(list(torch_params.values())), make_opt(list(params.values()))
    schedulers = [scheduler(o) for o in (torch_opt, optimizer)] if scheduler else []
    for t in range(torch_first):
        for opt, ps in ((torch_opt, torch_params), (optimizer, params)):
            for n, p in ps.items():
                p.grad = make_grads(t)[n]
            opt.step()
        for s in schedulers:
            s.step()
    bridge = TorchOptimizerBridge(optimizer, names_by_id(params))
    jax_params = {n: jnp.asarray(p.detach().numpy()) for n, p in params.items()}
    state = jax.tree.map(jnp.asarray, bridge.initial_state())
    traces = []

    def counted(spec, params_, grads_, state_, scalars_):
        traces.append(1)
        return apply_updates(spec, params_, grads_, state_, scalars_)

    update = jax.jit(counted, static_argnums=0)
    for t in range(torch_first, torch_first + steps):
        grads = make_grads(t)
        jax_params, state = update(bridge.spec, jax_params, {n: jnp.asarray(g.numpy()) for n, g in grads.items()},
                                   state, bridge.step_scalars())
        for n, p in torch_params.items():
            p.grad = grads[n].clone()
        torch_opt.step()
        mark_optimizer_stepped(optimizer)  # what the engine does: the scheduler knows its optimizer stepped
        for s in schedulers:
            s.step()
        for n, p in torch_params.items():
            _assert_close(jax_params[n], p.detach().numpy(), f"step {t}, param {n}")
    assert len(traces) == 1, "retraced: a per-step hyper-parameter became structural"
    bridge.write_back(state)
    for n in SHAPES:
        ours, theirs = optimizer.state[params[n]], torch_opt.state[torch_params[n]]
        assert list(ours) == list(theirs), n
        for k in theirs:
            assert (ours[k].dtype, ours[k].shape) == (theirs[k].dtype, theirs[k].shape), (n, k)
            _assert_close(ours[k].numpy(), theirs[k].numpy(), f"state {k!r} of {n}")
    return bridge


def _two_groups(cls, first, second, **defaults):
    def make(ps):
        return cls([{"params": ps[:2], **first}, {"params": ps[2:], **second}], **defaults)
    return make


EXTRA = {
    "radam_rectified": lambda ps: torch.optim.RAdam(ps, lr=0.05, betas=(0.8, 0.9), weight_decay=0.1),
    "radam_rectified_decoupled_groups": _two_groups(
        torch.optim.RAdam, {"decoupled_weight_decay": True, "weight_decay": 0.2},
        {"maximize": True, "weight_decay": 0.1, "eps": 1e-4}, lr=0.05, betas=(0.7, 0.85)),
    "nadam_groups": _two_groups(torch.optim.NAdam, {"betas": (0.8, 0.95), "momentum_decay": 0.01},
                                {"decoupled_weight_decay": True, "weight_decay": 0.3, "maximize": True}, lr=0.02),
    "rmsprop_groups": _two_groups(torch.optim.RMSprop, {"centered": True, "momentum": 0.9, "alpha": 0.5},
                                  {"weight_decay": 0.1, "maximize": True}, lr=0.01),
    "adagrad_groups": _two_groups(torch.optim.Adagrad, {"lr_decay": 0.1, "initial_accumulator_value": 0.5},
                                  {"weight_decay": 0.2, "maximize": True, "eps": 1e-3}, lr=0.1),
    "adamax_groups": _two_groups(torch.optim.Adamax, {"betas": (0.5, 0.8)}, {"weight_decay": 0.1, "maximize": True},
                                 lr=0.05),
    "adadelta_groups": _two_groups(torch.optim.Adadelta, {"rho": 0.5, "eps": 1e-4},
                                   {"weight_decay": 0.1, "maximize": True, "lr": 0.5}),
}


@pytest.mark.parametrize("config", list(EXTRA))
def test_new_optimizers_with_groups_and_lr_schedule(config):
    _run_both(EXTRA[config], steps=12, scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1 / (1 + t)))


@pytest.mark.parametrize("config", ["radam_rectified", "nadam_groups", "rmsprop_groups", "adagrad_groups",
                                    "adamax_groups", "adadelta_groups"])
def test_resume_from_torch_state(config):
    bridge = _run_both(EXTRA[config], steps=4, torch_first=3)
    assert set(bridge.state_dict()["group_steps"]) == {7}


def test_nadam_beta1_schedule_feeds_mu_product():
    """OneCycleLR cycles betas[0]: NAdam's mu_product must follow the β₁ of every step, as torch's does."""
    make = lambda ps: torch.optim.NAdam(ps, lr=0.01)  # noqa: E731
    _run_both(make, steps=8, scheduler=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=20))


@pytest.mark.parametrize("info", UNSUPPORTED_INFOS, ids=lambda info: info.optim_cls.__name__)
def test_unsupported_optim_db_classes_are_refused(info):
    params = make_params()
    optimizer = info.optim_cls([params["w1"]])  # a matrix: Muon takes 2-d parameters only
    with pytest.raises(NotImplementedError, match=rf"{info.optim_cls.__name__}.*not supported.*SGD.*Adadelta"):
        TorchOptimizerBridge(optimizer, names_by_id(params))


def test_rmsprop_momentum_switched_off_after_compile_is_refused():
    params = make_params()
    optimizer = torch.optim.RMSprop(list(params.values()), momentum=0.5)
    bridge = TorchOptimizerBridge(optimizer, names_by_id(params))
    bridge.step_scalars()
    optimizer.param_groups[0]["momentum"] = 0.0
    with pytest.raises(ValueError, match="momentum > 0"):
        bridge.step_scalars()


def test_nadam_mu_product_is_a_host_counter_that_rolls_back_and_checkpoints():
    params = make_params()
    optimizer = torch.optim.NAdam(list(params.values()), lr=1e-2)
    bridge = TorchOptimizerBridge(optimizer, names_by_id(params))
    bridge.initial_state()
    for _ in range(3):
        bridge.step_scalars()
    saved = copy.deepcopy(bridge.state_dict())
    assert saved["group_steps"] == [3] and saved["group_mu_products"][0] < 1.0
    bridge.step_scalars()
    bridge.rollback_step()
    assert bridge.state_dict() == saved
    other = TorchOptimizerBridge(optimizer, names_by_id(params))
    other.load_state_dict(saved)
    jax.tree.map(np.testing.assert_array_equal, other.step_scalars(), bridge.step_scalars())


# --- end to end: torchpar.compile ------------------------------------------------------------------

class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.fc2(torch.tanh(self.fc1(x))), y)


E2E = {
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, alpha=0.9, weight_decay=0.01, momentum=0.5,
                                              centered=True),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01, initial_accumulator_value=0.1),
}


@pytest.mark.parametrize("config", list(E2E))
def test_compile_matches_torch_eager(config):
    torch.manual_seed(0)
    model = TinyNet()
    batch = (torch.randn(32, 8), torch.randn(32, 4))
    reference = copy.deepcopy(model)
    ref_opt = E2E[config](list(reference.parameters()))
    optimizer = E2E[config](list(model.parameters()))
    engine = torchpar.compile(model, optimizer, example_batch=batch)
    torch_losses, ours = [], []
    for _ in range(5):
        ref_opt.zero_grad()
        loss = reference(*batch)
        loss.backward()
        ref_opt.step()
        torch_losses.append(loss.item())
        ours.append(engine.step(batch))
    engine.sync_to_torch()
    torch.testing.assert_close(ours, torch_losses, rtol=1e-5, atol=0)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=name)
    ours_sd, theirs_sd = optimizer.state_dict(), ref_opt.state_dict()
    assert ours_sd["param_groups"] == theirs_sd["param_groups"]
    assert sorted(ours_sd["state"]) == sorted(theirs_sd["state"])
    for index, theirs in theirs_sd["state"].items():
        ours = ours_sd["state"][index]
        assert list(ours) == list(theirs)
        for key, value in theirs.items():
            assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, (index, key)
            # atol 1e-5: RMSprop's buffer holds g / RMS(g), O(1) even where g ≈ 0, so the last-bit differences of the
            # model's gradients (XLA's vs torch's matmuls) show there as absolute, not relative, differences.
            torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"state {index} {key}: {m}")

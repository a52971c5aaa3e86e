"""jaxbackend.optimizer (+ torchpar.capture.optimizer) against PyTorch's own optimizer test database.

For every ``OptimizerInfo`` of ``torch.testing._internal.common_optimizers.optim_db`` whose class torchpar
supports, every CPU sample configuration runs 5 steps through `TorchOptimizerBridge` + `apply_updates` once, and in
torch with each implementation the info lists: the default single-tensor loop, ``foreach`` and CPU ``fused`` (other
kernels, same math; one subtest each). Parameters (every step) and the optimizer state (written back in torch's
format, and resumed from by torch) must match each. ``differentiable=True`` / ``capturable=True``, where the class
has them, are subtests asserting torchpar refuses them by name. Nothing is skipped: every sample and variant is
either compared or asserted to be refused. The parameters are a matrix, a vector, a 3-d tensor and a scalar
(Adafactor factors the matrix and the 3-d tensor), or four matrices for Muon, which takes nothing else.

Beyond optim_db: two param groups with different options under an LR schedule for the optimizers added after
SGD/Adam (ASGD averaging, Muon's nesterov=False, ns_steps and adjust_lr_fn included), resuming from torch's own
state, the host counters (NAdam's mu_product, ASGD's eta and mu), refusals, and `torchpar.compile` end to end.
"""

from __future__ import annotations

import copy
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.testing._internal.common_optimizers import optim_db

import torchpar
from jaxbackend.optimizer import apply_updates
from torchpar.capture.optimizer import SUPPORTED_OPTIMIZERS, TorchOptimizerBridge, mark_optimizer_stepped
from torchpar.ir.optimizer import state_copies

SHAPES = {"w1": (8, 5), "b1": (5,), "w2": (3, 4, 2), "s": ()}
MATRIX_SHAPES = {"w1": (8, 5), "w2": (4, 6), "w3": (5, 5), "w4": (7, 3)}
"""Muon's parameters: matrices only (torch refuses others), tall, wide and square (its iteration transposes the tall
ones)."""
STEPS = 5
RTOL, ATOL = 1e-6, 1e-7
SCALAR_STATE = ("step", "mu_product", "eta", "mu")
"""torch's 0-d per-parameter state: per-group host counters in torchpar, not state tensors."""

SUPPORTED_INFOS = [info for info in optim_db if info.optim_cls in SUPPORTED_OPTIMIZERS]
UNSUPPORTED_INFOS = [info for info in optim_db if info.optim_cls not in SUPPORTED_OPTIMIZERS]

_UPDATE = jax.jit(apply_updates, static_argnums=0)
"""One jitted update for the whole module: samples with the same spec and shapes share its compilation."""


def _samples():
    """(info, sample) for every CPU sample of every supported optimizer."""
    out = []
    for info in SUPPORTED_INFOS:
        name = info.optim_cls.__name__
        for i, sample in enumerate(info.optim_inputs_func(device="cpu")):
            # Every CPU sample of the installed torch builds its own params (sample.params is None); a sample with
            # param groups would need them mapped onto our parameters: fail loudly rather than skip it.
            out.append(pytest.param(info, sample, id=f"{name}-{i}-{sample.desc}"))
    return out


SAMPLES = _samples()


def _compared_variants(info) -> list[str]:
    """torch implementations the JAX trajectory is compared with: the single-tensor loop, foreach, CPU fused."""
    variants = ["default"]
    if "foreach" in info.supported_impls:
        variants.append("foreach")
    if "fused" in info.supported_impls and "cpu" in info.supports_fused_on:
        variants.append("fused")
    return variants


def _refused_variants(info) -> list[str]:
    variants = []
    if "differentiable" in info.supported_impls:
        variants.append("differentiable")
    if info.has_capturable_arg or "capturable" in info.optim_cls.__init__.__code__.co_varnames:
        variants.append("capturable")
    return variants


def _shapes(cls) -> dict[str, tuple[int, ...]]:
    return MATRIX_SHAPES if cls is torch.optim.Muon else SHAPES


def make_params(seed: int = 0, shapes=SHAPES) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.nn.Parameter(torch.randn(s, generator=gen)) for n, s in shapes.items()}


def make_grads(step: int, seed: int = 1, shapes=SHAPES) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * seed + step)
    return {n: torch.randn(s, generator=gen) for n, s in shapes.items()}


def names_by_id(params):
    return {id(p): n for n, p in params.items()}


def _steps(info) -> int:
    """5, but 8 for RAdam: its rectification term only switches on once ρₜ > 5, at step 6 for β₂ = 0.999."""
    return 8 if info.optim_cls is torch.optim.RAdam else STEPS


def _kwargs(info, sample, variant):
    kwargs = dict(sample.kwargs)
    if variant == "default":
        if "foreach" in inspect.signature(info.optim_cls).parameters:  # Muon has no foreach implementation
            kwargs.setdefault("foreach", False)  # torch's single-tensor path, the reference of jaxbackend.optimizer
    else:
        kwargs[variant] = True
    return kwargs


def _build(info, sample, variant, params):
    return info.optim_cls(list(params.values()), **_kwargs(info, sample, variant))


def _assert_close(ours, theirs, what):
    np.testing.assert_allclose(np.asarray(ours, dtype=np.float64), np.asarray(theirs, dtype=np.float64),
                               rtol=RTOL, atol=ATOL, err_msg=what)


def test_optim_db_covers_every_supported_optimizer():
    assert {info.optim_cls for info in SUPPORTED_INFOS} == set(SUPPORTED_OPTIMIZERS)
    assert all(sample.params is None for info in SUPPORTED_INFOS for sample in info.optim_inputs_func(device="cpu"))


def _jax_trajectory(info, sample):
    """The sample's steps through the bridge and the jitted update, once: (parameters after each step, final
    name-keyed state, the bridge's host counters, its spec)."""
    shapes = _shapes(info.optim_cls)
    params = make_params(shapes=shapes)
    optimizer = _build(info, sample, "default", params)
    if isinstance(sample.kwargs.get("lr"), torch.Tensor):
        assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)  # a tensor lr is read every step
    bridge = TorchOptimizerBridge(optimizer, names_by_id(params))
    assert bridge.spec.kind == info.optim_cls.__name__.lower() or (
        bridge.spec.kind == "adamw" and info.optim_cls is torch.optim.Adam and sample.kwargs.get(
            "decoupled_weight_decay"))
    jax_params = {n: jnp.asarray(p.detach().numpy()) for n, p in params.items()}
    state = jax.tree.map(jnp.asarray, bridge.initial_state())
    trajectory = []
    for t in range(_steps(info)):
        grads = {n: jnp.asarray(g.numpy()) for n, g in make_grads(t, shapes=shapes).items()}
        jax_params, state = _UPDATE(bridge.spec, jax_params, grads, state, bridge.step_scalars())
        trajectory.append({n: np.asarray(p) for n, p in jax_params.items()})
    return trajectory, jax.tree.map(np.asarray, state), bridge.state_dict(), bridge.spec


@pytest.mark.parametrize("info,sample", SAMPLES)
def test_optim_db_sample(info, sample, subtests):
    assert sample.params is None, "a sample with its own param groups is not mapped onto the test parameters"
    trajectory, state, counters, spec = _jax_trajectory(info, sample)
    for variant in _compared_variants(info):
        with subtests.test(msg=variant):
            _compare_with_torch(info, sample, variant, trajectory, state, counters, spec)
    for variant in _refused_variants(info):
        with subtests.test(msg=variant):
            params = make_params(shapes=_shapes(info.optim_cls))
            optimizer = _build(info, sample, variant, params)
            with pytest.raises(NotImplementedError, match=rf"{info.optim_cls.__name__} with {variant}=True"):
                TorchOptimizerBridge(optimizer, names_by_id(params))


def _compare_with_torch(info, sample, variant, trajectory, state, counters, spec):
    """torch's ``variant`` against the JAX trajectory, step by step; then the JAX state written back through a bridge
    over a ``variant`` optimizer (its spec must be the default's: the variant changes torch's kernel, not ours)
    against torch's, and torch resuming from it."""
    shapes = _shapes(info.optim_cls)
    torch_params = make_params(shapes=shapes)
    torch_opt = _build(info, sample, variant, torch_params)
    for t, ours in enumerate(trajectory):
        grads = make_grads(t, shapes=shapes)
        for n, p in torch_params.items():
            p.grad = grads[n].clone()
        torch_opt.step()
        for n, p in torch_params.items():
            _assert_close(ours[n], p.detach().numpy(), f"step {t}, param {n}")

    params = make_params(shapes=shapes)
    optimizer = _build(info, sample, variant, params)  # the one the bridge writes back into
    bridge = TorchOptimizerBridge(optimizer, names_by_id(params))
    assert bridge.spec == spec
    bridge.load_state_dict(counters)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(torch.from_numpy(np.array(trajectory[-1][n])))
    bridge.write_back(state)
    for n in shapes:
        ours, theirs = optimizer.state[params[n]], torch_opt.state[torch_params[n]]
        assert list(ours) == list(theirs), n
        for k in theirs:
            assert isinstance(ours[k], torch.Tensor), (n, k)
            assert (ours[k].dtype, ours[k].shape, ours[k].device) == (theirs[k].dtype, theirs[k].shape,
                                                                     theirs[k].device), (n, k)
            _assert_close(ours[k].numpy(), theirs[k].numpy(), f"state {k!r} of {n}")
    held = {len([k for k in torch_opt.state[p] if k not in SCALAR_STATE]) for p in torch_params.values()}
    if spec.kind == "sgd" and not sample.kwargs.get("momentum"):
        held = {1}  # torchpar keeps a (zero) momentum buffer so momentum can be switched on without recompiling
    if spec.kind == "adafactor":
        held = {1}  # counted as one copy (an upper bound): a matrix keeps only its row and column factors
    assert {state_copies(spec)} == held

    # torch resumes from the written-back state exactly as from its own (its state_dict round-trips, too).
    resumed = _build(info, sample, variant, params)
    resumed.load_state_dict(optimizer.state_dict())
    grads = make_grads(len(trajectory), shapes=shapes)
    for opt, ps in ((resumed, params), (torch_opt, torch_params)):
        for n, p in ps.items():
            p.grad = grads[n].clone()
        opt.step()
    for n in shapes:
        _assert_close(params[n].detach().numpy(), torch_params[n].detach().numpy(), f"resumed step, param {n}")


# --- beyond optim_db: param groups, schedulers, RAdam's rectified branch, ASGD's averaging, Muon's options,
# resuming from torch's state ------------------------------------------------------------------------------------

def _run_both(make_opt, steps, scheduler=None, torch_first=0, shapes=SHAPES):
    """`torch_first` steps in torch on both sides, then `steps` steps in torch and through the bridge; every
    parameter compared after every step, the written-back state at the end. Returns the bridge."""
    torch_params, params = make_params(shapes=shapes), make_params(shapes=shapes)
    torch_opt, optimizer = make_opt(list(torch_params.values())), make_opt(list(params.values()))
    schedulers = [scheduler(o) for o in (torch_opt, optimizer)] if scheduler else []
    for t in range(torch_first):
        for opt, ps in ((torch_opt, torch_params), (optimizer, params)):
            for n, p in ps.items():
                p.grad = make_grads(t, shapes=shapes)[n]
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
        grads = make_grads(t, shapes=shapes)
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
    for n in shapes:
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
    # t0 = 3 and 0: ASGD starts averaging (μ < 1) within the steps run
    "asgd_groups": _two_groups(torch.optim.ASGD, {"lambd": 0.01, "alpha": 0.5, "t0": 3},
                               {"weight_decay": 0.1, "maximize": True, "t0": 0}, lr=0.05),
    "rprop_groups": _two_groups(torch.optim.Rprop, {"etas": (0.3, 1.7), "step_sizes": (1e-3, 0.05)},
                                {"maximize": True, "lr": 0.02}, lr=0.01),
    "adafactor_groups": _two_groups(torch.optim.Adafactor, {"beta2_decay": -0.5, "eps": (1e-20, 1e-2), "d": 2.0},
                                    {"weight_decay": 0.1, "maximize": True, "lr": 0.05}, lr=0.02),
    "muon_groups": _two_groups(torch.optim.Muon, {"nesterov": False, "adjust_lr_fn": "match_rms_adamw",
                                                  "momentum": 0.9},
                               {"ns_steps": 3, "weight_decay": 0.0, "eps": 1e-5}, lr=0.02),
}
MATRIX_ONLY = ("muon_groups",)


@pytest.mark.parametrize("config", list(EXTRA))
def test_new_optimizers_with_groups_and_lr_schedule(config):
    _run_both(EXTRA[config], steps=12, scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1 / (1 + t)),
              shapes=MATRIX_SHAPES if config in MATRIX_ONLY else SHAPES)


@pytest.mark.parametrize("config", ["radam_rectified", "nadam_groups", "rmsprop_groups", "adagrad_groups",
                                    "adamax_groups", "adadelta_groups", "asgd_groups", "rprop_groups",
                                    "adafactor_groups", "muon_groups"])
def test_resume_from_torch_state(config):
    bridge = _run_both(EXTRA[config], steps=4, torch_first=3, shapes=MATRIX_SHAPES if config in MATRIX_ONLY else SHAPES)
    # torch's Muon state has no step count: resuming from its buffers counts 1
    assert set(bridge.state_dict()["group_steps"]) == ({5} if config in MATRIX_ONLY else {7})


def test_nadam_beta1_schedule_feeds_mu_product():
    """OneCycleLR cycles betas[0]: NAdam's mu_product must follow the β₁ of every step, as torch's does."""
    make = lambda ps: torch.optim.NAdam(ps, lr=0.01)  # noqa: E731
    _run_both(make, steps=8, scheduler=lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.05, total_steps=20))


@pytest.mark.parametrize("info", UNSUPPORTED_INFOS, ids=lambda info: info.optim_cls.__name__)
def test_unsupported_optim_db_classes_are_refused(info):
    params = make_params()
    optimizer = info.optim_cls([params["w1"]])
    with pytest.raises(NotImplementedError, match=rf"{info.optim_cls.__name__}.*not supported.*SGD.*Adafactor.*Muon"):
        TorchOptimizerBridge(optimizer, names_by_id(params))


def test_muon_refuses_what_torch_refuses_at_its_step():
    """A non-matrix parameter added to a Muon group, ns_steps ≥ 100, an unknown adjust_lr_fn: torch raises when it
    steps; torchpar at compile, naming the parameter or the option (and again if a group is edited afterwards)."""
    params = make_params()
    optimizer = torch.optim.Muon([params["w1"]])
    optimizer.add_param_group({"params": [params["b1"]]})  # torch's constructor checks shapes, add_param_group not
    with pytest.raises(ValueError, match=r"'b1' of shape \(5,\).*Muon updates 2-d matrices only"):
        TorchOptimizerBridge(optimizer, names_by_id(params))
    with pytest.raises(ValueError, match=r"ns_steps=100"):
        TorchOptimizerBridge(torch.optim.Muon([params["w1"]], ns_steps=100), names_by_id(params))
    optimizer = torch.optim.Muon([params["w1"]])
    bridge = TorchOptimizerBridge(optimizer, names_by_id(params))
    assert (bridge.spec.ns_steps, bridge.spec.adjust_lr_fn, bridge.spec.nesterov) == ((5,), ("original",), (True,))
    optimizer.param_groups[0]["adjust_lr_fn"] = "sqrt"
    with pytest.raises(ValueError, match=r"adjust_lr_fn='sqrt'"):
        bridge.step_scalars()
    optimizer.param_groups[0]["adjust_lr_fn"] = "match_rms_adamw"
    with pytest.raises(ValueError, match=r"adjust_lr_fn.*changed.*compile again"):
        bridge.step_scalars()


def test_asgd_eta_and_mu_are_host_counters_that_roll_back_and_checkpoint():
    params = make_params()
    optimizer = torch.optim.ASGD(list(params.values()), lr=0.05, t0=1)
    bridge = TorchOptimizerBridge(optimizer, names_by_id(params))
    bridge.initial_state()
    for _ in range(3):
        bridge.step_scalars()
    saved = copy.deepcopy(bridge.state_dict())
    assert saved["group_steps"] == [3] and saved["group_etas"][0] < 0.05 and saved["group_mus"] == [0.5]
    bridge.step_scalars()
    bridge.rollback_step()
    assert bridge.state_dict() == saved
    other = TorchOptimizerBridge(optimizer, names_by_id(params))
    other.load_state_dict(saved)
    jax.tree.map(np.testing.assert_array_equal, other.step_scalars(), bridge.step_scalars())


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
    "asgd": lambda ps: torch.optim.ASGD(ps, lr=0.05, t0=2, weight_decay=0.01),  # eta and mu written back
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
        ours.append(engine.step(batch).item())
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

"""jaxbackend.optimizer (+ torchpar.capture.optimizer) against torch.optim itself, step by step in fp32."""

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxbackend.optimizer import OptimizerSpec, apply_updates, clip_grads_by_global_norm, init_state, step_scalars
from torchpar.capture.optimizer import SUPPORTED_OPTIMIZERS, TorchOptimizerBridge
from torchpar.ir.optimizer import state_copies, state_keys, state_shape

SHAPES = {"w1": (8, 5), "b1": (5,), "w2": (3, 4, 2), "s": ()}
STEPS = 20
RTOL, ATOL = 1e-5, 1e-6


def make_params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.nn.Parameter(torch.randn(s, generator=gen)) for n, s in SHAPES.items()}


def make_grads(step: int, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * seed + step)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def names_by_id(params):
    return {id(p): n for n, p in params.items()}


class JaxSide:
    """The bridge + one jitted apply_updates, counting how often it is traced."""

    def __init__(self, optimizer, params):
        self.bridge = TorchOptimizerBridge(optimizer, names_by_id(params))
        self.params = {n: jnp.asarray(p.detach().numpy()) for n, p in params.items()}
        self.state = jax.tree.map(jnp.asarray, self.bridge.initial_state())
        self.traces = 0

        def update(spec, params, grads, state, scalars):
            self.traces += 1
            return apply_updates(spec, params, grads, state, scalars)

        self._update = jax.jit(update, static_argnums=0)

    def step(self, grads, max_norm=None):
        grads = {n: jnp.asarray(g.numpy()) for n, g in grads.items()}
        if max_norm is not None:
            grads, _ = clip_grads_by_global_norm(grads, max_norm)
        scalars = self.bridge.step_scalars()
        self.params, self.state = self._update(self.bridge.spec, self.params, grads, self.state, scalars)


def torch_step(optimizer, params, grads, max_norm=None):
    for n, p in params.items():
        p.grad = grads[n].clone()
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm)
    optimizer.step()


def assert_params_match(jax_params, torch_params, where):
    for n, p in torch_params.items():
        np.testing.assert_allclose(np.asarray(jax_params[n]), p.detach().numpy(), rtol=RTOL, atol=ATOL,
                                   err_msg=f"{where}, param {n}")


def run_and_compare(optimizer, params, steps=STEPS, scheduler=None, max_norm=None, first_step=0):
    jax_side = JaxSide(optimizer, params)
    for t in range(first_step, first_step + steps):
        grads = make_grads(t)
        jax_side.step(grads, max_norm)
        torch_step(optimizer, params, grads, max_norm)
        if scheduler is not None:
            scheduler.step()
        assert_params_match(jax_side.params, params, f"step {t}")
    assert jax_side.traces == 1
    return jax_side


CONFIGS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.3),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
    "sgd_weight_decay": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.5, weight_decay=0.1),
    "sgd_maximize": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, maximize=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam_weight_decay": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adam_all_flags": lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-6, weight_decay=0.05, amsgrad=True,
                                                  maximize=True),
    "adam_beta1_small": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.3, 0.9)),  # lerp's other branch
    "adam_decoupled": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw_amsgrad_maximize": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.2, amsgrad=True,
                                                           maximize=True),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_matches_torch(config):
    params = make_params()
    optimizer = CONFIGS[config](list(params.values()))
    jax_side = run_and_compare(optimizer, params)
    decoupled = "decoupled" in config or "adamw" in config
    expected_kind = "sgd" if config.startswith("sgd") else "adamw" if decoupled else "adam"
    assert jax_side.bridge.spec.kind == expected_kind


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_two_param_groups(kind):
    params = make_params()
    first = [params["w1"], params["b1"]]
    second = [params["w2"], params["s"]]
    if kind == "sgd":
        optimizer = torch.optim.SGD([
            {"params": first, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
            {"params": second, "lr": 0.2, "momentum": 0.5, "dampening": 0.5, "maximize": True},
        ], lr=0.05)
    else:
        optimizer = torch.optim.Adam([
            {"params": first, "amsgrad": True, "weight_decay": 0.1},
            {"params": second, "lr": 3e-2, "betas": (0.5, 0.9), "eps": 1e-5},
        ], lr=1e-2)
    jax_side = run_and_compare(optimizer, params)
    assert jax_side.bridge.spec.group_of_param == (0, 0, 1, 1)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_lr_scheduler_without_recompiling(kind):
    params = make_params()
    if kind == "sgd":
        optimizer = torch.optim.SGD(list(params.values()), lr=0.1, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    else:
        optimizer = torch.optim.AdamW(list(params.values()), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda t: 1.0 / (1 + t))
    run_and_compare(optimizer, params, scheduler=scheduler)  # asserts a single trace
    assert optimizer.param_groups[0]["lr"] < (0.1 if kind == "sgd" else 1e-2) / 10


def test_sgd_momentum_switched_on_later():
    """Torch creates the buffer (b = g, no dampening) on the first step with momentum ≠ 0."""
    params = make_params()
    optimizer = torch.optim.SGD(list(params.values()), lr=0.1, momentum=0.0, dampening=0.5)
    jax_side = JaxSide(optimizer, params)
    for t in range(8):
        optimizer.param_groups[0]["momentum"] = 0.0 if t < 3 else 0.9
        grads = make_grads(t)
        jax_side.step(grads)
        torch_step(optimizer, params, grads)
        assert_params_match(jax_side.params, params, f"step {t}")
    assert jax_side.traces == 1


def test_clip_grads_matches_clip_grad_norm():
    for scale, max_norm in [(1.0, 0.5), (1e-3, 1.0), (3.0, 2.0)]:
        grads = {n: g * scale for n, g in make_grads(0).items()}
        torch_grads = [g.clone() for g in grads.values()]
        holders = [torch.nn.Parameter(torch.zeros_like(g)) for g in torch_grads]
        for h, g in zip(holders, torch_grads):
            h.grad = g
        torch_norm = torch.nn.utils.clip_grad_norm_(holders, max_norm)
        clipped, norm = jax.jit(clip_grads_by_global_norm)({n: jnp.asarray(g.numpy()) for n, g in grads.items()},
                                                           max_norm)
        np.testing.assert_allclose(float(norm), float(torch_norm), rtol=RTOL)
        for (n, _), h in zip(grads.items(), holders):
            np.testing.assert_allclose(np.asarray(clipped[n]), h.grad.numpy(), rtol=RTOL, atol=ATOL)


def test_training_with_clipping():
    params = make_params()
    optimizer = torch.optim.Adam(list(params.values()), lr=1e-2)
    run_and_compare(optimizer, params, max_norm=1.0)


@pytest.mark.parametrize("config", ["sgd_dampening", "adam_all_flags", "adamw"])
def test_write_back_then_continue_in_torch(config):
    reference_params = make_params()
    reference = CONFIGS[config](list(reference_params.values()))
    for t in range(STEPS):
        torch_step(reference, reference_params, make_grads(t))

    params = make_params()
    optimizer = CONFIGS[config](list(params.values()))
    jax_side = JaxSide(optimizer, params)
    for t in range(STEPS // 2):
        jax_side.step(make_grads(t))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(torch.from_numpy(np.array(jax_side.params[n])))
    jax_side.bridge.write_back(jax_side.state)

    # Torch's own format: same keys, dtypes and shapes as an optimizer that stepped in torch.
    mid_params = make_params()
    mid = CONFIGS[config](list(mid_params.values()))
    for t in range(STEPS // 2):
        torch_step(mid, mid_params, make_grads(t))
    for p, p_mid in zip(params.values(), mid_params.values()):
        ours, theirs = optimizer.state[p], mid.state[p_mid]
        assert list(ours) == list(theirs)
        for k in theirs:
            assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape, k
            assert ours[k].device == theirs[k].device, k
            np.testing.assert_allclose(ours[k].numpy(), theirs[k].numpy(), rtol=RTOL, atol=ATOL, err_msg=k)

    for t in range(STEPS // 2, STEPS):
        torch_step(optimizer, params, make_grads(t))
    assert_params_match({n: p.detach().numpy() for n, p in params.items()}, reference_params, "after write_back")


@pytest.mark.parametrize("config", ["sgd_nesterov", "adam_all_flags"])
def test_resume_from_torch_state(config):
    params = make_params()
    optimizer = CONFIGS[config](list(params.values()))
    for t in range(5):
        torch_step(optimizer, params, make_grads(t))
    jax_side = run_and_compare(optimizer, params, steps=10, first_step=5)
    expected_steps = [1 + 10] if config.startswith("sgd") else [5 + 10]  # SGD: resumed buffer counts as 1
    assert jax_side.bridge.state_dict()["group_steps"] == expected_steps


def test_resume_with_mixed_steps_is_refused():
    params = make_params()
    optimizer = torch.optim.Adam(list(params.values()), lr=1e-2)
    torch_step(optimizer, params, make_grads(0))
    optimizer.state[params["b1"]]["step"] += 1
    bridge = TorchOptimizerBridge(optimizer, names_by_id(params))
    with pytest.raises(NotImplementedError, match="step count"):
        bridge.initial_state()


def test_bridge_state_dict_round_trips():
    params = make_params()
    optimizer = torch.optim.Adam(list(params.values()), lr=1e-2)
    bridge = TorchOptimizerBridge(optimizer, names_by_id(params))
    bridge.initial_state()
    for _ in range(3):
        bridge.step_scalars()
    saved = bridge.state_dict()
    other = TorchOptimizerBridge(optimizer, names_by_id(params))
    other.load_state_dict(copy.deepcopy(saved))
    assert other.state_dict() == saved == {"kind": "adam", "param_names": list(SHAPES), "group_steps": [3]}
    jax.tree.map(np.testing.assert_array_equal, other.step_scalars(), bridge.step_scalars())


def test_unsupported_optimizers_are_refused():
    params = make_params()
    for unsupported in (torch.optim.LBFGS, torch.optim.SparseAdam):
        with pytest.raises(NotImplementedError, match=rf"{unsupported.__name__}.*SGD.*Adam.*AdamW.*Adagrad.*RMSprop"
                                                      r".*Adamax.*NAdam.*RAdam.*Adadelta.*ASGD.*Rprop"
                                                      r".*Adafactor.*Muon"):
            TorchOptimizerBridge(unsupported(list(params.values())), names_by_id(params))
    with pytest.raises(NotImplementedError, match="capturable"):
        TorchOptimizerBridge(torch.optim.Adam(list(params.values()), capturable=True), names_by_id(params))

    class LoggingSGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    with pytest.raises(NotImplementedError, match="overrides"):
        TorchOptimizerBridge(LoggingSGD(list(params.values()), lr=0.1), names_by_id(params))
    stranger = torch.nn.Parameter(torch.zeros(7, 3))
    with pytest.raises(ValueError, match=r"not a parameter of the model.*\(7, 3\)|\(7, 3\).*not a parameter"):
        TorchOptimizerBridge(torch.optim.SGD([*params.values(), stranger], lr=0.1), names_by_id(params))
    assert set(SUPPORTED_OPTIMIZERS) == {torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                                         torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
                                         torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop,
                                         torch.optim.Adafactor, torch.optim.Muon}


def test_structural_change_after_compile_is_refused():
    params = make_params()
    optimizer = torch.optim.Adam(list(params.values()))
    bridge = TorchOptimizerBridge(optimizer, names_by_id(params))
    optimizer.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        bridge.step_scalars()


def test_spec_is_hashable_and_validated():
    spec = OptimizerSpec(kind="adam", param_names=("a", "b"), group_of_param=(0, 0),
                         nesterov=(False,), amsgrad=(True,), maximize=(False,))
    assert hash(spec) == hash(OptimizerSpec(kind="adam", param_names=("a", "b"), group_of_param=(0, 0),
                                            nesterov=(False,), amsgrad=(True,), maximize=(False,)))
    state = init_state(spec, {"a": jnp.ones((2,)), "b": jnp.ones(()), "frozen": jnp.ones(3)})
    assert set(state) == {"a", "b"} and set(state["a"]) == {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
    scalars = step_scalars(spec, [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}], [1])
    params = {"a": jnp.ones((2,)), "b": jnp.ones(()), "frozen": jnp.full((3,), 5.0)}
    new_params, _ = apply_updates(spec, params, {"a": jnp.ones((2,)), "b": jnp.ones(())}, state, scalars)
    np.testing.assert_array_equal(new_params["frozen"], params["frozen"])

    bad = dict(kind="adam", param_names=("a",), group_of_param=(0,), nesterov=(False,), amsgrad=(False,),
               maximize=(False,))
    for change in [dict(kind="lbfgs"), dict(centered=(True,)), dict(ns_steps=(5,)), dict(adjust_lr_fn=("original",)),
                   dict(decoupled_weight_decay=(True, True)),
                   dict(group_of_param=(1,)), dict(param_names=("a", "a"), group_of_param=(0, 0)),
                   dict(nesterov=(True,)), dict(amsgrad=(False, False)), dict(group_of_param=())]:
        with pytest.raises(ValueError):
            OptimizerSpec(**{**bad, **change})


def test_muon_spec_fields_and_adafactor_state_shapes():
    muon = dict(kind="muon", param_names=("w",), group_of_param=(0,), nesterov=(True,), amsgrad=(False,),
                maximize=(False,))
    spec = OptimizerSpec(**muon, ns_steps=(5,))
    assert spec.adjust_lr_fn == ("original",) and state_copies(spec) == 1
    for change in [dict(ns_steps=(100,)), dict(ns_steps=(5, 5)), dict(adjust_lr_fn=("sqrt",))]:
        with pytest.raises(ValueError):
            OptimizerSpec(**{**muon, "ns_steps": (5,), **change})

    spec = OptimizerSpec(kind="adafactor", param_names=("w", "b"), group_of_param=(0, 0), nesterov=(False,),
                         amsgrad=(False,), maximize=(False,))
    with pytest.raises(ValueError, match="ndim"):
        state_keys(spec, 0)
    state = init_state(spec, {"w": jnp.ones((3, 4, 2)), "b": jnp.ones((2,))})
    assert {k: v.shape for k, v in state["w"].items()} == {"row_var": (3, 4, 1), "col_var": (3, 1, 2)}
    assert {k: v.shape for k, v in state["b"].items()} == {"variance": (2,)}
    assert state_shape(spec, "col_var", (4, 2)) == (1, 2) and state_copies(spec) == 1


KEPT_CONFIGS = {**CONFIGS, "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
                "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-1)}


@pytest.mark.parametrize("config", list(KEPT_CONFIGS))
def test_a_kept_step_equals_the_unguarded_one_and_a_skipped_step_changes_nothing(config):
    """``apply_updates(keep=...)``: the finite-step guard inside the optimizer (Adam's moments selected before the
    parameter reads them) computes the unguarded step where ``keep`` is true and returns the inputs where false."""
    params = make_params()
    jax_side = JaxSide(KEPT_CONFIGS[config](list(params.values())), params)
    spec, scalars = jax_side.bridge.spec, jax_side.bridge.step_scalars()
    state = jax_side.state
    for t in range(3):
        grads = {n: jnp.asarray(g.numpy()) for n, g in make_grads(t).items()}
        plain = jax.jit(apply_updates, static_argnums=0)(spec, jax_side.params, grads, state, scalars)
        kept = jax.jit(apply_updates, static_argnums=0)(spec, jax_side.params, grads, state, scalars, jnp.bool_(True))
        skipped = jax.jit(apply_updates, static_argnums=0)(spec, jax_side.params, grads, state, scalars,
                                                           jnp.bool_(False))
        for got, want in zip(jax.tree.leaves(kept), jax.tree.leaves(plain)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        for got, want in zip(jax.tree.leaves(skipped), jax.tree.leaves((jax_side.params, state))):
            np.testing.assert_array_equal(got, want)
        jax_side.params, state = plain


def test_the_guarded_adam_step_copies_no_moment():
    """With the finite-step guard (the engine's default) XLA updates AdamW's moments in place: the compiled step's
    entry computation copies none of its optimizer-state arguments (it copied both moments of every parameter when
    the guard selected after the whole update)."""
    import re

    import torchpar
    from torchpar.harness import zoo

    torch.manual_seed(0)
    model, batch = zoo.build("gpt2", {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64}, batch_size=2,
                             seq_len=8)
    with torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), example_batch=batch) as engine:
        engine.step(batch)
        hlo = engine.executor.worker._last.compiled.as_text()
    entry = hlo[hlo.index("\nENTRY"):]
    state_args = set(re.findall(r"%(o__\S+) = \S+ parameter\(", entry))
    assert len(state_args) > 20  # exp_avg and exp_avg_sq of every parameter
    copied = [arg for arg in re.findall(r" copy\(%([^)\s]+)\)", entry) if arg in state_args]
    assert copied == []

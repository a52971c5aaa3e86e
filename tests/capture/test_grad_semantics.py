"""PyTorch's autograd semantics, not only its arithmetic (issue 27): stop-gradients (``detach``, ``no_grad``,
``set_grad_enabled(False)``, ``inference_mode``, a tensor made under ``no_grad`` and used later), gradient hooks
refused by name, each submodule's train/eval mode as the user left it (and left so by ``compile``), and changes
after compile (``requires_grad``, modes, param groups) recompiled at the next step; a loss without a gradient
raises as PyTorch's ``backward`` does.

Every training case runs 3 steps beside PyTorch eager on one device, DataParallel on 4 devices and a 2-stage
pipeline; SGD with momentum and weight decay, so a parameter wrongly given a gradient (or wrongly updated without
one) shows in the parameters.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torchpar
from torchpar.capture.semantics.grad_semantics import UnsupportedAutogradError, module_modes

STEPS = 3
TOL = 1e-6  # fp32; measured ≤ 3e-7 (only the order of float32 sums differs)


@pytest.fixture(scope="module", autouse=True)
def session_cluster():
    torchpar.init(cluster="local", num_devices=8)


class StopGradientNet(torch.nn.Module):
    """Three linear layers; ``kind`` picks where PyTorch stops the gradient. A pipeline boundary after the
    second layer splits it into two stages."""

    def __init__(self, kind: str, width: int = 8):
        super().__init__()
        self.kind = kind
        self.a, self.b, self.c = (torch.nn.Linear(width, width) for _ in range(3))

    def forward(self, x, y):
        h = torch.tanh(self.a(x))
        if self.kind == "detach":
            g = self.b(h.detach()) + h  # a gets its gradient through the second term only
        elif self.kind == "data":
            g = self.b(h.data) + h  # .data: the values outside autograd, as detach
        elif self.kind == "detach_":
            t = self.b(h).clone()
            t.detach_()
            g = t * h  # b gets no gradient
        elif self.kind == "no_grad":
            with torch.no_grad():
                t = self.b(h)  # b gets no gradient; t is a constant for a
            g = h * t
        elif self.kind == "set_grad_enabled":
            with torch.set_grad_enabled(False):
                t = h * h
            g = self.b(h) + t
        elif self.kind == "inference_mode":
            with torch.inference_mode():
                t = self.b(h)
            g = h + t.clone()
        elif self.kind == "made_under_no_grad":
            with torch.no_grad():
                scale = self.a.weight.abs().mean()  # built here, used two lines later
            g = self.b(h) * scale
        else:
            raise ValueError(self.kind)
        g = torchpar.mark_pipeline_boundary(g)
        return F.mse_loss(self.c(torch.relu(g)), y)


def _pipeline(micro: int = 2) -> torchpar.PipeshardParallel:
    return torchpar.PipeshardParallel(
        num_micro_batches=micro, layer_option="manual", schedule="1f1b",
        stage_option=torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)),
                                                submesh_physical_shapes=((1, 4), (1, 4)),
                                                submesh_logical_shapes=((1, 4), (1, 4))))


METHODS = {"one_device": lambda: None, "data_parallel": torchpar.DataParallel, "pipeline": _pipeline}


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def _compare(model: torch.nn.Module, batch, method, *, steps: int = STEPS, between=None, make_optimizer=None,
             **options):
    """Train ``model`` with torchpar and a copy with PyTorch side by side; the losses, parameters and buffers must
    agree within TOL. ``between(model, optimizer, step)`` runs on both sides before each step (a change after
    compile)."""
    make_optimizer = make_optimizer or _optimizer
    reference = copy.deepcopy(model)
    ref_opt = make_optimizer(reference)
    optimizer = make_optimizer(model)
    engine = torchpar.compile(model, optimizer, example_batch=batch, method=method, **options)
    try:
        for step in range(steps):
            if between is not None:
                between(model, optimizer, step)
                between(reference, ref_opt, step)
            ref_opt.zero_grad()
            expected = reference(*batch)
            expected.backward()
            ref_opt.step()
            assert engine.step(batch) == pytest.approx(expected.item(), rel=TOL, abs=TOL), f"step {step}"
        engine.sync_to_torch()
    finally:
        engine.close()
    for (name, want), got in zip(reference.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=TOL, atol=TOL, msg=name)
    return engine


def _batch(width: int = 8, rows: int = 8):
    torch.manual_seed(1)
    return torch.randn(rows, width), torch.randn(rows, width)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("kind", ["detach", "data", "detach_", "no_grad", "set_grad_enabled", "inference_mode",
                                  "made_under_no_grad"])
def test_stop_gradients_train_as_pytorch(kind, method):
    torch.manual_seed(0)
    model = StopGradientNet(kind)
    _compare(model, _batch(), METHODS[method]())


def test_detached_branch_leaves_its_parameters_untouched():
    """The issue's example: ``b(a(x).detach()).pow(2).mean()`` — one SGD step at lr 1 moves ``a`` not at all."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x).detach()).pow(2).mean()

    torch.manual_seed(0)
    model = Net()
    before = model.a.weight.detach().clone()
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=1.0), example_batch=torch.randn(8, 4)) as engine:
        assert engine.graph.nodes and any(n.target == "torchpar.stop_gradient" for n in engine.graph.nodes)
        engine.step(torch.randn(8, 4))
        engine.sync_to_torch()
    assert torch.equal(model.a.weight, before)
    assert "data" not in vars(torch.Tensor)  # the capture's reading of x.data as detach() is undone


# --- module modes -----------------------------------------------------------------------------------------------

class ModeNet(torch.nn.Module):
    """Linear → BatchNorm1d → ReLU → Dropout → (boundary) → Linear, mean squared error."""

    def __init__(self, width: int = 8, p: float = 0.5):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.drop = torch.nn.Dropout(p)
        self.c = torch.nn.Linear(width, width)

    def forward(self, x, y):
        h = self.drop(torch.relu(self.bn(self.a(x))))
        return F.mse_loss(self.c(torchpar.mark_pipeline_boundary(h)), y)


def _whole_model_eval(model):
    model.eval()


def _bn_eval(model):  # fine-tuning with frozen batch norm; dropout p=0 keeps the run deterministic
    model.drop.p = 0.0
    model.train()
    model.bn.eval()


def _dropout_eval(model):  # batch norm trains (batch statistics, running stats updated), dropout off
    model.train()
    model.drop.eval()


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("set_modes", [_whole_model_eval, _bn_eval, _dropout_eval], ids=lambda f: f.__name__[1:])
def test_module_modes_as_the_user_left_them(set_modes, method):
    torch.manual_seed(0)
    model = ModeNet()
    with torch.no_grad():  # running statistics away from their initial 0 / 1, so using them shows
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    set_modes(model)
    modes = module_modes(model)
    micro = 1 if method == "pipeline" and set_modes is _dropout_eval else 2  # batch statistics: one micro-batch
    _compare(model, _batch(), METHODS[method]() if method != "pipeline" else _pipeline(micro))
    assert module_modes(model) == modes  # compile, step and sync leave every flag as it was


def test_compile_and_forward_leave_the_users_flags_unchanged():
    torch.manual_seed(0)
    model = ModeNet()
    _bn_eval(model)
    modes = module_modes(model)
    x, y = _batch()
    with torchpar.compile(model, _optimizer(model), example_batch=(x, y)) as engine:
        assert module_modes(model) == modes
        engine.forward((x, y))  # its own eval capture
        assert module_modes(model) == modes
        engine.step((x, y))
    assert module_modes(model) == modes
    assert model.bn.training is False and model.training is True


# --- changes after compile -----------------------------------------------------------------------------------------

def _freeze_a_after_first_step(model, optimizer, step):
    if step == 1:
        model.a.requires_grad_(False)


def _eval_after_first_step(model, optimizer, step):
    if step == 1:
        model.eval()


def _param_group_added_after_first_step(model, optimizer, step):
    if step == 1:
        optimizer.add_param_group({"params": list(model.bn.parameters()), "lr": 0.05})


def _without_bn(model):
    return torch.optim.SGD([*model.a.parameters(), *model.c.parameters()], lr=0.1, momentum=0.9, weight_decay=0.01)


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("change", [_freeze_a_after_first_step, _eval_after_first_step,
                                    _param_group_added_after_first_step], ids=lambda f: f.__name__[1:])
def test_changes_after_compile_recompile_at_the_next_step(change, method, caplog):
    torch.manual_seed(0)
    model = ModeNet(p=0.0)
    grouped = change is _param_group_added_after_first_step
    with caplog.at_level("WARNING", logger="torchpar.api"):
        # batch statistics: the pipeline runs one micro-batch, the whole batch as PyTorch does
        _compare(model, _batch(), _pipeline(1) if method == "pipeline" else METHODS[method](), between=change,
                 make_optimizer=_without_bn if grouped else None)
    assert "changed since compile; recompiling" in caplog.text


def test_detached_loss_raises_like_backward():
    torch.manual_seed(0)
    model = StopGradientNet("detach")
    with pytest.raises(ValueError, match="the loss has no gradient"):
        torchpar.compile(model, _optimizer(model), example_batch=_batch(),
                         step_fn=lambda m, batch: m(*batch).detach())


def test_all_parameters_frozen_raises():
    torch.manual_seed(0)
    model = StopGradientNet("detach").requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad=False"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=_batch())


# --- hooks ---------------------------------------------------------------------------------------------------------

def test_parameter_and_module_hooks_refused_by_owner():
    torch.manual_seed(0)
    model = StopGradientNet("detach")
    handles = [model.a.weight.register_hook(lambda g: g * 2),
               model.c.register_full_backward_hook(lambda module, gin, gout: None)]
    with pytest.raises(UnsupportedAutogradError, match=r"parameter 'a.weight'.*module 'c'"):
        torchpar.compile(model, _optimizer(model), example_batch=_batch())
    for handle in handles:
        handle.remove()
    with torchpar.compile(model, _optimizer(model), example_batch=_batch()) as engine:
        engine.step(_batch())


def test_tensor_hook_in_forward_refused_with_its_line():
    class Hooked(StopGradientNet):
        def forward(self, x, y):
            h = self.a(x)
            h.register_hook(lambda g: -g)
            return F.mse_loss(self.c(h), y)

    torch.manual_seed(0)
    model = Hooked("detach")
    with pytest.raises(Exception, match=r"register_hook.*test_grad_semantics.py:\d+"):
        torchpar.compile(model, _optimizer(model), example_batch=_batch())

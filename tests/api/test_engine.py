"""Engine behaviour on small hand-written models: calling conventions, losses, buffers, frozen and
unused parameters, gradient clipping, plan and HLO, and the errors a user can cause."""

from __future__ import annotations

import copy
import json

import pytest
import torch

import torchpar
from torchpar.planner.plan import Plan

LOSS_RTOL = 1e-4
PARAM_RTOL, PARAM_ATOL = 1e-4, 1e-6


class TinyNet(torch.nn.Module):
    """Linear → BatchNorm → ReLU → Linear with an MSE loss; has running-stat buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16, bias=False)  # a bias before BatchNorm has zero gradient
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, 4)
        self.unused = torch.nn.Linear(4, 4)  # never called: gets no gradient, must not move

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.fc2(torch.relu(self.bn(self.fc1(x)))), y)


def _train_both(model, batch, make_opt, steps=5, **compile_kwargs):
    reference = copy.deepcopy(model)
    ref_opt = make_opt(reference)
    engine = torchpar.compile(model, make_opt(model), example_batch=batch, **compile_kwargs)
    torch_losses, ours = [], []
    for _ in range(steps):
        ref_opt.zero_grad()
        loss = reference(*batch) if isinstance(batch, tuple) else reference(batch)
        loss.backward()
        if compile_kwargs.get("grad_clip_norm"):
            torch.nn.utils.clip_grad_norm_(reference.parameters(), compile_kwargs["grad_clip_norm"])
        ref_opt.step()
        torch_losses.append(loss.item())
        ours.append(engine.step(batch))
    engine.sync_to_torch()
    return reference, engine, torch_losses, ours


def test_tuple_batch_buffers_and_unused_params_match_torch():
    torch.manual_seed(0)
    model = TinyNet()
    batch = (torch.randn(32, 8), torch.randn(32, 4))
    unused_before = model.unused.weight.detach().clone()
    reference, engine, torch_losses, ours = _train_both(
        model, batch, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2))
    torch.testing.assert_close(ours, torch_losses, rtol=LOSS_RTOL, atol=0)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)
    for (name, b), c in zip(reference.named_buffers(), model.buffers()):
        torch.testing.assert_close(c, b, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)
    assert model.bn.num_batches_tracked.item() == 5
    torch.testing.assert_close(model.unused.weight, unused_before, rtol=0, atol=0)


def test_tensor_batch_with_loss_fn_and_frozen_param():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    model[0].bias.requires_grad_(False)
    frozen = model[0].bias.detach().clone()
    x = torch.randn(10, 6)
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=x,
                              loss_fn=lambda out, batch: (out ** 2).mean() + batch.sum() * 0)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        ref_opt.zero_grad()
        loss = (reference(x) ** 2).mean()
        loss.backward()
        ref_opt.step()
        assert engine.step(x) == pytest.approx(loss.item(), rel=LOSS_RTOL)
    engine.sync_to_torch()
    torch.testing.assert_close(model[0].bias, frozen, rtol=0, atol=0)
    torch.testing.assert_close(model[2].weight, reference[2].weight, rtol=PARAM_RTOL, atol=PARAM_ATOL)


def test_grad_clipping_matches_clip_grad_norm():
    torch.manual_seed(0)
    model = TinyNet()
    batch = (torch.randn(16, 8) * 10, torch.randn(16, 4))
    reference, _, torch_losses, ours = _train_both(
        model, batch, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), grad_clip_norm=0.5)
    torch.testing.assert_close(ours, torch_losses, rtol=LOSS_RTOL, atol=0)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)


def test_plan_and_hlo_for_one_device():
    torch.manual_seed(0)
    model = TinyNet()
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch)
    engine.step(batch)
    plan = engine.plan
    data = plan.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert Plan.from_dict(data).to_dict() == data
    (stage,) = data["stages"]
    assert stage["submesh_shape"] == [1, 1] and stage["logical_mesh_shape"] == [1, 1]
    assert stage["params"]["fc1.weight"] == [None, None]
    assert set(data["timings"]) >= {"capture", "lower", "xla_compile"}
    assert "fc1.weight" in plan.summary()
    (hlo,) = engine.hlo_text()
    assert hlo.startswith("HloModule") and "dot(" in hlo


def test_mark_pipeline_boundary_is_identity_in_both_worlds():
    class Marked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.b(torchpar.mark_pipeline_boundary(torch.relu(self.a(x)))).sum()

    torch.manual_seed(0)
    model = Marked()
    x = torch.randn(3, 4)
    eager = model(x)
    eager.backward()  # differentiable in PyTorch too
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.0), example_batch=x)
    assert "torchpar.pipeline_boundary" in engine.graph.op_counts()
    assert engine.step(x) == pytest.approx(eager.item(), rel=1e-6)


# --- errors ----------------------------------------------------------------------------------------

def test_unsupported_optimizer_names_the_supported_ones():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(NotImplementedError, match=r"(?s)RMSprop.*(SGD|Adam)"):
        torchpar.compile(model, torch.optim.RMSprop(model.parameters()), example_batch=torch.randn(1, 2),
                         loss_fn=lambda out, batch: out.sum())


def test_unsupported_ops_are_all_reported_with_shapes_and_source(monkeypatch):
    from jaxbackend.ops import registry

    registry.get("aten.tanh.default")  # load the registry, then hide two lowerings
    monkeypatch.delitem(registry._REGISTRY, "aten.tanh.default")
    monkeypatch.delitem(registry._REGISTRY, "aten.sigmoid.default")

    class UsesMissingOps(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(5))

        def forward(self, x):
            y = torch.tanh(x)  # the error must point at this line
            y = y * self.scale
            return torch.sigmoid(y).sum()

    model = UsesMissingOps()
    with pytest.raises(NotImplementedError) as info:
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(3, 5))
    message = str(info.value)
    assert "2 op(s)" in message
    assert "aten.tanh.default(float32[3, 5])" in message
    assert "aten.sigmoid.default(float32[3, 5])" in message
    assert "test_engine.py" in message and "torch.tanh(x)" in message


def test_optimizer_param_not_in_model_is_a_clear_error():
    model = torch.nn.Linear(2, 2)
    stray = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not a parameter of the model|not in the model"):
        torchpar.compile(model, torch.optim.SGD([*model.parameters(), stray], lr=0.1),
                         example_batch=torch.randn(1, 2), loss_fn=lambda out, batch: out.sum())


def test_batch_structure_and_dtype_mismatch_are_value_errors():
    torch.manual_seed(0)
    model = TinyNet()
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch)
    with pytest.raises(ValueError, match="structure"):
        engine.step((torch.randn(4, 8),))
    with pytest.raises(ValueError, match="float64"):
        engine.step((torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 4)))


def test_loss_must_be_found():
    model = torch.nn.Linear(2, 3)
    with pytest.raises(ValueError, match="loss_fn"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(4, 2))


def test_option_validation():
    with pytest.raises(ValueError):
        torchpar.ShardParallel(mesh_shape=(0, 2))
    with pytest.raises(ValueError):
        torchpar.PipeshardParallel(num_micro_batches=0)
    with pytest.raises(ValueError):
        torchpar.AutoLayerOption(layer_num=0)
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="grad_clip_norm"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(4, 2),
                         loss_fn=lambda out, batch: out.sum(), grad_clip_norm=-1.0)

"""``torchpar.capture_step(...).plan(method).compile()``: the three stages, each inspectable, and ``torchpar.plan`` /
``torchpar.compile`` as shortcuts over the same objects — one code path, so a plan inspected with ``torchpar.plan``
is the plan ``torchpar.compile`` runs."""

from __future__ import annotations

import copy

import pytest
import torch

import torchpar
from torchpar.engine import step_capture
from torchpar.ir.graph import Graph
from torchpar.planner.plan import Plan


class TwoLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(16, 8, generator=generator), torch.randn(16, 4, generator=generator)


@pytest.fixture
def planning_calls(monkeypatch):
    """Every call of the one planning road (:meth:`StepCapture.plan`) and the object it returned."""
    calls = []
    original = step_capture.StepCapture.plan

    def spy(self, method, *, explain=False):
        planned = original(self, method, explain=explain)
        calls.append((method, planned))
        return planned

    monkeypatch.setattr(step_capture.StepCapture, "plan", spy)
    return calls


def _layouts(plan: Plan) -> list:
    """What a plan decides (stages, meshes, layouts), without its timings and explanations."""
    return [(s.layers, s.logical_mesh_shape, s.params, s.grads, s.optimizer_state, s.inputs, s.activations,
             s.strategies) for s in plan.stages]


def test_plan_and_compile_share_one_road_and_agree(planning_calls):
    torch.manual_seed(0)
    model = TwoLayer()
    method = torchpar.DataParallel()
    planned = torchpar.plan(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=_batch(),
                            method=method, explain=False)
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=_batch(),
                          method=method) as engine:
        compiled = engine.plan
    assert [m for m, _ in planning_calls] == [method, method]  # both shortcuts planned through StepCapture.plan
    assert type(planned) is type(compiled) is Plan
    assert planning_calls[0][1].plan is planned and planning_calls[1][1].plan is compiled
    assert planned is not compiled and _layouts(planned) == _layouts(compiled)
    assert planned.method == compiled.method and planned.estimated_step_s == pytest.approx(compiled.estimated_step_s)


def test_each_stage_is_inspectable_and_the_chain_trains_as_compile_does():
    torch.manual_seed(0)
    model = TwoLayer()
    reference = copy.deepcopy(model)
    batch = _batch()
    captured = torchpar.capture_step(model, torch.optim.Adam(model.parameters(), lr=1e-2), example_batch=batch)
    assert isinstance(captured, torchpar.Captured)
    assert isinstance(captured.graph, Graph)
    assert {i.target for i in captured.graph.inputs if i.kind == "param"} == {n for n, _ in model.named_parameters()}
    planned = captured.plan(torchpar.DataParallel())
    assert isinstance(planned, torchpar.Planned) and isinstance(planned.plan, Plan)
    assert planned.plan.method == "data_parallel" and isinstance(planned.graph, Graph)
    with planned.compile() as engine:
        ours = [engine.step(batch).item() for _ in range(3)]
    for again in (planned, captured.plan(torchpar.DataParallel())):  # one engine per capture: it owns the state
        with pytest.raises(RuntimeError, match="compiled already"):
            again.compile()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    theirs = []
    for _ in range(3):
        ref_opt.zero_grad()
        loss = reference(*batch)
        loss.backward()
        ref_opt.step()
        theirs.append(loss.item())
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=0)
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)


def test_a_meta_model_plans_but_does_not_compile():
    with torch.device("meta"):
        model = TwoLayer()
    batch = tuple(t.to("meta") for t in _batch())
    planned = torchpar.capture_step(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch).plan()
    assert planned.plan.stages
    with pytest.raises(ValueError, match="meta device"):
        planned.compile()


def test_a_method_class_is_refused_at_the_plan_stage():
    model = TwoLayer()
    captured = torchpar.capture_step(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=_batch())
    with pytest.raises(TypeError, match="pass an instance"):
        captured.plan(torchpar.DataParallel)

"""Custom ``torch.autograd.Function`` backwards are honoured (or refused by name), never replaced silently.

Each Function sits inside a tiny model trained 3 SGD steps beside PyTorch eager (losses and parameters within
1e-6, fp32) on one device, data parallel on 4 devices and a 2-stage pipeline (the Function inside a stage);
PyTorch's own ``autograd_function_db`` is swept: the gradient of ``sum(f(x) * w)`` matches PyTorch's for every
traceable Function, and ``compile`` refuses the NumPy-based ones naming the class.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import pytest
import torch
from torch.testing._internal.autograd_function_db import autograd_function_db

import torchpar
from tests.runtime.ray_helpers import local_cluster
from torchpar.capture.errors import CaptureError
from torchpar.capture.export import capture_train_step
from torchpar.ir.function_regions import FUNCTION_INPUT, FUNCTION_OUTPUT, function_regions

TOL = 1e-6
STEPS = 3


class GradReverse(torch.autograd.Function):
    """Identity forward, negated gradient (domain-adversarial training)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class StraightThroughRound(torch.autograd.Function):
    """``round`` forward, identity backward (quantization-aware training); ``setup_context`` style."""

    @staticmethod
    def forward(x, scale):
        return torch.round(x * scale) / scale

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.scale = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ScaledTanhMul(torch.autograd.Function):
    """``x * tanh(w)`` with saved tensors and ``needs_input_grad`` (x is the batch: it needs none)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.seen = ctx.needs_input_grad
        return x * torch.tanh(w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grad * torch.tanh(w)
        if ctx.needs_input_grad[1]:
            grad_w = (grad * x * (1 - torch.tanh(w) ** 2)).sum(0)  # summed to w's shape by hand
        return grad_x, grad_w


class NoGradForSecond(torch.autograd.Function):
    """``2x + y`` whose backward gives ``y`` no gradient (``None``)."""

    @staticmethod
    def forward(ctx, x, y):
        return 2 * x + y

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad, None


def _apply(kind: str, h: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if kind == "grad_reverse":
        return GradReverse.apply(h)
    if kind == "straight_through":
        return StraightThroughRound.apply(h, 4.0)
    if kind == "saved_needs_grad":
        return h + ScaledTanhMul.apply(x, w)
    return NoGradForSecond.apply(h, torch.sin(h))


class FunctionModel(torch.nn.Module):
    """Linear → the Function → ReLU → boundary → Linear, an MSE loss."""

    def __init__(self, kind: str, width: int = 8):
        super().__init__()
        self.kind = kind
        self.first = torch.nn.Linear(width, width)
        self.w = torch.nn.Parameter(torch.randn(width) * 0.5)
        self.second = torch.nn.Linear(width, width)

    def forward(self, x, y):
        h = _apply(self.kind, self.first(x), x, self.w)
        h = torchpar.mark_pipeline_boundary(torch.relu(h))
        return torch.nn.functional.mse_loss(self.second(h), y)


KINDS = ["grad_reverse", "straight_through", "saved_needs_grad", "none_gradient"]


def _method(name: str):
    if name == "one_device":
        return None
    if name == "data_parallel":
        return torchpar.DataParallel(mesh_shape=(1, 4))
    stage_option = torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)),
                                              submesh_physical_shapes=((1, 1), (1, 1)),
                                              submesh_logical_shapes=((1, 1), (1, 1)))
    return torchpar.PipeshardParallel(num_micro_batches=2, layer_option="manual", stage_option=stage_option)


@pytest.mark.parametrize("method", ["one_device", "data_parallel", "pipeline"])
@pytest.mark.parametrize("kind", KINDS)
def test_custom_backward_trains_like_pytorch(kind, method):
    torch.manual_seed(0)
    model = FunctionModel(kind)
    reference = copy.deepcopy(model)
    batch = (torch.randn(8, 8), torch.randn(8, 8))
    make_opt = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)  # noqa: E731
    ref_opt = make_opt(reference)
    cluster = local_cluster(num_hosts=2, devices_per_host=1) if method == "pipeline" else contextlib.nullcontext()
    with cluster, torchpar.compile(model, make_opt(model), example_batch=batch, method=_method(method)) as engine:
        assert len(engine.plan.stages) == (2 if method == "pipeline" else 1)
        _train_beside(engine, reference, ref_opt, batch)
    _assert_same_parameters(model, reference, f"{kind}/{method}")


def _train_beside(engine, reference, ref_opt, batch) -> None:
    """STEPS steps of ``engine`` and of the PyTorch ``reference`` on ``batch``; the losses within TOL."""
    for _ in range(STEPS):
        ref_opt.zero_grad()
        loss = reference(*batch)
        loss.backward()
        ref_opt.step()
        assert abs(engine.step(batch) - loss.item()) <= TOL
    engine.sync_to_torch()


def _assert_same_parameters(model, reference, label: str) -> None:
    for (name, expected), got in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(got, expected, rtol=0, atol=TOL, msg=f"{label}: {name}")


def test_the_gradient_is_the_functions_not_the_forwards_derivative():
    """Without the Function's backward the first layer would move the other way (reversal) / not at all (round)."""
    torch.manual_seed(0)
    for kind in ("grad_reverse", "straight_through"):
        model = FunctionModel(kind)
        derived = copy.deepcopy(model)
        batch = (torch.randn(8, 8), torch.randn(8, 8))
        with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch) as engine:
            engine.step(batch)
            engine.sync_to_torch()
        before = derived.first.weight.detach().clone()
        derived.kind = "plain"
        h = derived.first(batch[0])
        h = h.view_as(h) if kind == "grad_reverse" else torch.round(h * 4.0) / 4.0
        loss = torch.nn.functional.mse_loss(derived.second(torch.relu(h)), batch[1])
        loss.backward()
        plain_step = -0.1 * derived.first.weight.grad
        taken = model.first.weight.detach() - before
        if kind == "grad_reverse":
            torch.testing.assert_close(taken, -plain_step, rtol=0, atol=TOL)
        else:
            assert plain_step.abs().max() == 0 and taken.abs().max() > 1e-3


def test_capture_brackets_the_function_and_keeps_its_backward():
    torch.manual_seed(0)
    model = FunctionModel("saved_needs_grad")
    graph = capture_train_step(model, (torch.randn(4, 8), torch.randn(4, 8))).graph
    (region,) = function_regions(graph)
    assert [graph.nodes[region.start].target, graph.nodes[region.stop - 1].target] == [FUNCTION_INPUT, FUNCTION_OUTPUT]
    assert len(region.saved) == 2 and [p for p, _ in region.inputs] == [0, 1]
    backward = graph.custom_backwards[region.call]
    assert [o.value is not None for o in backward.outputs] == [False, True]  # x is the batch: needs no gradient
    assert "aten.tanh.default" in backward.op_counts()


def test_a_remat_group_never_splits_a_function():
    from jaxbackend.lower import _segments
    from jaxbackend.remat import Remat

    graph = capture_train_step(FunctionModel("grad_reverse"), (torch.randn(4, 8), torch.randn(4, 8))).graph
    (region,) = function_regions(graph)
    names = [n.name for n in graph.nodes]
    half = Remat("layers", (tuple(names[: region.start + 1]), tuple(names[region.start + 1:])))
    segments = _segments(graph, half, [region])
    assert not [s for s in segments if region.start < s.start < region.stop]  # nothing starts inside the region
    assert any(s.start == region.start and s.stop == region.stop and not s.checkpointed for s in segments)


class _Block(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.linear = torch.nn.Linear(8, 8)
        self.w = torch.nn.Parameter(torch.randn(8) * 0.5)

    def forward(self, h):
        return torch.tanh(_apply(self.kind, self.linear(h), h, self.w))


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block(kind) for kind in ("grad_reverse", "saved_needs_grad"))

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return torch.nn.functional.mse_loss(x, y)


@pytest.mark.parametrize("remat", ["layers", "selective"])
def test_functions_inside_remat_layers_train_like_pytorch(remat):
    torch.manual_seed(0)
    model = _Stack()
    reference = copy.deepcopy(model)
    batch = (torch.randn(8, 8), torch.randn(8, 8))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                          remat=remat) as engine:
        _train_beside(engine, reference, ref_opt, batch)
    _assert_same_parameters(model, reference, f"remat={remat}")


def test_a_stage_cut_inside_a_function_is_refused():
    from torchpar.planner.pipeline.slicing import slice_stages

    graph = capture_train_step(FunctionModel("grad_reverse"), (torch.randn(4, 8), torch.randn(4, 8))).graph
    (region,) = function_regions(graph)
    stage_of = {n.name: int(i > region.start) for i, n in enumerate(graph.nodes)}
    with pytest.raises(ValueError, match="GradReverse|autograd.Function"):
        slice_stages(graph, stage_of)


# --- PyTorch's autograd_function_db ------------------------------------------------------------------------------

NUMPY_BASED = {"NumpyCubeAutogradFunction": "NumpyCube", "NumpyExpMarkDirtyAutogradFunction": "NumpyExp_",
               "NumpyMulAutogradFunction": "NumpyMul", "NumpyCubeNotComposableAutogradFunction": "NumpyCubeNotComposable",
               "NumpySortAutogradFunction": "NumpySort", "NumpyTakeAutogradFunction": "NumpyTake"}


class _OpModel(torch.nn.Module):
    """``sum(f(x, *args)[0] * w)`` with ``x`` a parameter (its gradient is what the Function's backward gives)."""

    def __init__(self, op, sample):
        super().__init__()
        self.op = op
        self.x = torch.nn.Parameter(sample.input.detach().clone())
        self.args = sample.args
        self.kwargs = sample.kwargs

    def forward(self, w):
        out = self.op(self.x, *self.args, **self.kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return (out * w).sum()


@pytest.mark.parametrize("info", autograd_function_db, ids=[info.name for info in autograd_function_db])
def test_autograd_function_db(info):
    torch.manual_seed(0)
    sample = next(iter(info.sample_inputs("cpu", torch.float32, requires_grad=False)))
    model = _OpModel(info.op, sample)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        out = reference.op(reference.x, *reference.args, **reference.kwargs)
    w = torch.randn_like(out[0] if isinstance(out, tuple) else out)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    if info.name in NUMPY_BASED:
        with pytest.raises(CaptureError, match=rf"torch.autograd.Function {NUMPY_BASED[info.name]}\b.*called at "):
            torchpar.compile(model, opt, example_batch=w)
        return
    reference(w).backward()
    expected = reference.x.grad
    with torchpar.compile(model, opt, example_batch=w) as engine:
        engine.step(w)
        engine.sync_to_torch()
    got = reference.x.detach() - model.x.detach()  # one SGD step with lr=1 moves x by its gradient
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=0, atol=TOL, err_msg=info.name)


def test_a_backward_reading_a_parameter_directly_is_refused_by_name():
    """A backward closing over a module's weight would keep its compile-time value in the captured graph."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            net = self

            class ScaledByWeight(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x):
                    return x * 2

                @staticmethod
                def backward(ctx, grad):
                    return grad * net.a.weight.sum()

            self.scaled = ScaledByWeight

        def forward(self, x):
            return self.scaled.apply(self.a(x)).pow(2).mean()

    model = Net()
    with pytest.raises(CaptureError, match=r"ScaledByWeight.*backward reads a.weight directly"):
        capture_train_step(model, torch.randn(2, 4))

"""``compile(step_fn=...)`` and ``forward_fn``: a model called its own way (a torchvision-style classifier whose
``forward(x)`` returns logits, the loss computed outside it) trains as PyTorch does, on one device and under
DataParallel, keeps its parameter names, and evaluates with ``engine.forward``; misuse is a clear error."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import torchpar

LOSS_RTOL = 1e-4
STEPS = 10


@pytest.fixture(scope="module", autouse=True)
def session_cluster():
    """The session's local cluster of 8 devices, whatever an earlier module of this worker left."""
    torchpar.init(cluster="local", num_devices=8)


class SmallCNN(torch.nn.Module):
    """conv → batch norm → SiLU → strided conv → SiLU → linear: ``forward(x)`` returns logits, as torchvision's.

    SiLU (EfficientNet's activation), not ReLU: a ReLU whose input lies within float32 rounding of 0 passes the
    gradient in one framework and blocks it in the other (their convolutions sum in different orders), a
    legitimate difference of a few percent in one channel's gradient that the 1e-4 loss bar cannot absorb
    (seen with another seed of this model)."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8), torch.nn.SiLU(),
            torch.nn.Conv2d(8, 16, 3, stride=2, padding=1), torch.nn.SiLU())
        self.classifier = torch.nn.Linear(16 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def cross_entropy_step(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    images, labels = batch
    return F.cross_entropy(model(images), labels)


def logits_only(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return model(batch[0])


def _data(rows: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(rows, 3, 8, 8, generator=generator), torch.randint(0, 10, (rows,), generator=generator)


@pytest.mark.parametrize("method", [None, torchpar.DataParallel()], ids=["one_device", "data_parallel"])
def test_step_fn_trains_like_torch_and_forward_fn_evaluates(method):
    torch.manual_seed(0)
    model = SmallCNN()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    batch = _data()
    engine = torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-2), example_batch=batch,
                              step_fn=cross_entropy_step, forward_fn=logits_only, method=method)
    ours, theirs = [], []
    for _ in range(STEPS):
        ref_opt.zero_grad()
        loss = cross_entropy_step(reference, batch)
        loss.backward()
        ref_opt.step()
        theirs.append(loss.item())
        ours.append(engine.step(batch).item())
    torch.testing.assert_close(ours, theirs, rtol=LOSS_RTOL, atol=0)
    names = [n for n, _ in model.named_parameters()]
    assert set(engine.plan.stages[0].params) == set(names)  # the model's own names, no wrapper prefix
    assert len(engine.plan.stages[0].devices()) == (1 if method is None else 8)
    engine.sync_to_torch()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6, msg=name)
    assert set(engine.state_dict()["params"]) == set(names)
    reference.eval()
    with torch.no_grad():
        expected = reference(batch[0])
    logits = engine.forward(batch)
    assert isinstance(logits, torch.Tensor) and logits.shape == (16, 10)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    engine.close()


def test_plan_takes_step_fn():
    model = SmallCNN()
    plan = torchpar.plan(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=_data(),
                         step_fn=cross_entropy_step, method=torchpar.DataParallel(), explain=False)
    assert set(plan.stages[0].params) == {n for n, _ in model.named_parameters()}


# --- misuse ---------------------------------------------------------------------------------------------------------

def _compile(**kwargs):
    model = SmallCNN()
    return torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=_data(), **kwargs)


@pytest.mark.parametrize("fn", [lambda model: model, lambda model, x, y: x, lambda: 0],
                         ids=["one", "three", "none"])
def test_step_fn_of_wrong_arity_is_a_type_error(fn):
    with pytest.raises(TypeError, match=r"step_fn must take exactly two positional arguments \(model, batch\)"):
        _compile(step_fn=fn)


def test_forward_fn_of_wrong_arity_and_a_non_callable_are_type_errors():
    with pytest.raises(TypeError, match=r"forward_fn must take exactly two positional arguments \(model, batch\)"):
        _compile(forward_fn=lambda model: model)
    with pytest.raises(TypeError, match="step_fn must be a function"):
        _compile(step_fn="cross_entropy")


def test_step_fn_with_loss_fn_is_an_error():
    with pytest.raises(ValueError, match="step_fn or loss_fn, not both"):
        _compile(step_fn=cross_entropy_step, loss_fn=lambda outputs, batch: outputs.sum())


def test_step_fn_returning_a_non_scalar_names_its_shape():
    def per_sample(model, batch):
        return F.cross_entropy(model(batch[0]), batch[1], reduction="none")

    with pytest.raises(ValueError, match=r"step_fn must return a scalar loss, got a tensor of shape \[16\]"):
        _compile(step_fn=per_sample)


def test_step_fn_returning_a_non_tensor_is_a_type_error():
    with pytest.raises(TypeError, match="step_fn must return the loss as a scalar torch.Tensor, got a dict"):
        _compile(step_fn=lambda model, batch: {"loss": model(batch[0]).sum()})


def test_step_fn_calling_the_model_wrongly_says_the_call_is_its_own():
    with pytest.raises(TypeError, match=r"(?s)SmallCNN.forward\(\).*step_fn / forward_fn calls the model itself"):
        _compile(step_fn=lambda model, batch: F.cross_entropy(model(*batch), batch[1]))


def test_step_fn_gets_the_batch_as_it_is():
    """A namedtuple batch reaches step_fn as that namedtuple (torchpar flattens it and builds it back)."""
    import collections

    Batch = collections.namedtuple("Batch", "images labels")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    batch = Batch(torch.randn(8, 4), torch.randint(0, 3, (8,)))
    expected = F.cross_entropy(model(batch.images), batch.labels).item()
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                          step_fn=lambda m, b: F.cross_entropy(m(b.images), b.labels)) as engine:
        assert engine.step(batch) == pytest.approx(expected, rel=1e-6)

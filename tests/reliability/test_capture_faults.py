"""torch.export failures become errors that say what to do: the model's source line, why, and the fix.

Each case is a tiny model that export cannot trace for torchpar (Python control flow on tensor values,
data-dependent shapes, code fake tensors cannot run, a batch that does not fit ``forward``), captured with
``capture_train_step``; the error must be a :class:`CaptureError` naming the line in this file, with the
original torch error as its ``__cause__``. Errors that are not export problems propagate unchanged.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import DataDependentOutputException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from torchpar.capture import errors
from torchpar.capture.export import capture_train_step


class _Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


class DataDependentBranch(_Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:
            return y.mean()
        return -y.mean()


class ItemBranch(_Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        s = y.sum().item()
        if s > 0:
            return y.mean()
        return -y.mean()


class TensorEqualBranch(_Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if torch.equal(y, x):
            return y.mean()
        return y.sum()


class MaskIndexing(_Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y[y > 0].sum()


class NonZero(_Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        rows = torch.nonzero(y > 0)[:, 0]
        return y[rows].sum()


class IntFromTensor(_Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        n = int(x.abs().sum().item()) % 2 + 1
        return y[:n].mean()


class ToNumpy(_Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        scale = float(y.detach().numpy().sum())
        return y.mean() * scale


class Regression(_Linear):
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ((self.lin(input_ids) - labels) ** 2).mean()


class Classifier(_Linear):
    """A model that returns logits: the loss is the caller's (``step_fn``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class WrongCallInside(_Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x, 3).mean()


class RaisesValueError(_Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("the model's own check failed")


def _x() -> torch.Tensor:
    return torch.randn(2, 4)


def _line_of(model_cls: type[nn.Module], code: str) -> int:
    """The line number, in this file, of the line of ``model_cls.forward`` whose text is ``code``."""
    lines, start = inspect.getsourcelines(model_cls.forward)
    return start + next(i for i, line in enumerate(lines) if line.strip() == code)


@dataclasses.dataclass(frozen=True)
class Fault:
    """A model that export cannot trace; ``keywords`` are regexes the message must contain, ``line`` the
    code of the forward line the message must name, ``cause`` the type of the chained torch error."""

    id: str
    model: type[nn.Module]
    batch: Callable[[], Any]
    keywords: tuple[str, ...]
    line: str | None
    cause: type[BaseException] | None


FAULTS = [
    Fault("if-tensor-sum", DataDependentBranch, _x, (r"torch\.cond", r"forward", r"torch\._check", r"torch\.where"),
          "if y.sum() > 0:", GuardOnDataDependentSymNode),
    Fault("item-in-if", ItemBranch, _x, (r"torch\.cond", r"depends on a tensor's value", r"\.item\(\)"),
          "if s > 0:", GuardOnDataDependentSymNode),
    Fault("torch-equal-in-if", TensorEqualBranch, _x, (r"torch\.cond", r"aten\.equal"),
          "if torch.equal(y, x):", DataDependentOutputException),
    Fault("boolean-mask-indexing", MaskIndexing, _x,
          (r"shape of a tensor depends on tensor values", r"aten\.index\.Tensor", r"torch\.where", r"torch\._check"),
          "return y[y > 0].sum()", None),
    Fault("nonzero", NonZero, _x, (r"shape of a tensor depends on tensor values", r"aten\.nonzero", r"nonzero_static"),
          "rows = torch.nonzero(y > 0)[:, 0]", None),
    Fault("int-of-tensor-as-size", IntFromTensor, _x, (r"depends on tensor values", r"torch\._check"),
          "n = int(x.abs().sum().item()) % 2 + 1", GuardOnDataDependentSymNode),
    Fault("numpy-in-forward", ToNumpy, _x, (r"torch\.export cannot trace ToNumpy", r"numpy\(\) is not supported"),
          "scale = float(y.detach().numpy().sum())", RuntimeError),
    Fault("missing-batch-key", Regression, lambda: {"input_ids": _x()},
          (r"missing the required argument 'labels'", r"model\(\*\*batch\)", r"keys 'input_ids'",
           r"forward\(input_ids, labels\)", r"add 'labels' to the batch"),
          None, TypeError),
    Fault("extra-batch-key", Regression, lambda: {"input_ids": _x(), "labels": _x(), "mask": _x()},
          (r"does not take the argument 'mask'", r"model\(\*\*batch\)", r"remove 'mask' from the batch"),
          None, TypeError),
    Fault("renamed-batch-key", Regression, lambda: {"input_ids": _x(), "label": _x()},
          (r"does not take the argument 'label'", r"rename the batch key 'label' to 'labels'"), None, TypeError),
    Fault("too-few-tuple-entries", Regression, lambda: (_x(),),
          (r"missing the required argument 'labels'", r"model\(\*batch\)", r"1 entry"), None, TypeError),
    Fault("logits-model-given-targets", Classifier, lambda: (_x(), torch.tensor([0, 3])),
          (r"takes 2 positional arguments but 3 were given", r"model\(\*batch\)",
           re.escape("step_fn=lambda model, batch: torch.nn.functional.cross_entropy(model(*batch[:-1]), batch[-1])")),
          None, TypeError),
]


@pytest.mark.parametrize("fault", FAULTS, ids=[f.id for f in FAULTS])
def test_export_failure_says_what_to_do(fault: Fault) -> None:
    keywords = list(fault.keywords)
    if fault.line is not None:
        keywords += [re.escape(f"test_capture_faults.py:{_line_of(fault.model, fault.line)}"), re.escape(fault.line)]
    with pytest.raises(errors.CaptureError, match="(?s)" + "".join(f"(?=.*{k})" for k in keywords)) as info:
        capture_train_step(fault.model(), fault.batch())
    if fault.cause is None:
        assert info.value.__cause__ is None
    else:
        assert type(info.value.__cause__) is fault.cause, repr(info.value.__cause__)
    assert "TreeSpec" not in str(info.value)


def test_a_model_returning_logits_is_told_to_pass_a_step_fn() -> None:
    """The commonest first mistake: ``forward`` returns logits and no ``step_fn`` says how to make the loss."""
    with pytest.raises(ValueError, match=r"(?s)returned a tensor of shape \[2, 4\], not a scalar loss.*step_fn=lambda "
                                         r"model, batch: torch\.nn\.functional\.cross_entropy") as info:
        capture_train_step(Classifier(), _x())
    assert len(str(info.value).splitlines()) <= 15


@pytest.mark.parametrize(("model", "error", "match"), [
    (WrongCallInside, TypeError, r"^Linear\.forward\(\) takes 2 positional arguments but 3 were given$"),
    (RaisesValueError, ValueError, r"^the model's own check failed$"),
], ids=["type-error-inside-forward", "value-error-inside-forward"])
def test_errors_of_the_model_itself_propagate_unchanged(model: type[nn.Module], error: type[Exception],
                                                        match: str) -> None:
    with pytest.raises(error, match=match) as info:
        capture_train_step(model(), _x())
    assert not isinstance(info.value, errors.CaptureError)
    assert errors.translate_export_error(info.value, model()) is None


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize(("expected", "got", "keywords"), [
    ({"input_ids": _t(2, 3), "labels": _t(2, 3)}, {"input_ids": _t(2, 3)},
     (r"this batch lacks the key 'labels' of the example batch",)),
    ({"input_ids": _t(2, 3)}, {"input_ids": _t(2, 3), "mask": _t(2, 3)},
     (r"this batch has the extra key 'mask' that the example batch does not have",)),
    ({"input_ids": _t(2, 3), "labels": _t(2, 3)}, {"input_ids": _t(2, 3), "label": _t(2, 3)},
     (r"renamed\? 'labels' → 'label'",)),
    ({"a": _t(1), "b": _t(1), "c": _t(1)}, {"a": _t(1), "d": _t(1), "e": _t(1)},
     (r"lacks the keys 'b' and 'c'", r"extra keys 'd' and 'e'")),
    ((_t(2), _t(2), _t(2)), (_t(2), _t(2)), (r"the example batch has 3 entries, this one 2",)),
    ({"x": _t(2)}, (_t(2),), (r"the example batch is a dict, this one a tuple",)),
    ({"a": {"b": _t(2), "c": _t(2)}}, {"a": {"b": _t(2)}},
     (r"batch\['a'\] in this batch lacks the key 'c'",)),
    ({"a": {"b": [_t(2), _t(2)]}}, {"a": {"b": [_t(2)]}},
     (r"batch\['a'\]\['b'\] has 2 entries in the example batch, 1 in this one",)),
    ({"a": [_t(2), {"b": _t(2)}]}, {"a": [_t(2), _t(2)]},
     (r"batch\['a'\]\[1\] is a dict in the example batch, a tensor in this one",)),
    ({"x": _t(2, 3)}, {"x": _t(2, 4, dtype=torch.int64)},
     (r"batch\['x'\] is a float32 tensor of shape \(2, 3\) in the example batch, an int64 tensor",)),
    ({"x": _t(2)}, {"x": _t(2)}, (r"same structure",)),
], ids=["missing-labels", "extra-key", "renamed-key", "several-missing-and-extra", "tuple-length",
        "dict-vs-tuple", "nested-dict-missing-key", "nested-list-length", "nested-type", "shape-and-dtype", "same"])
def test_describe_batch_mismatch(expected: Any, got: Any, keywords: tuple[str, ...]) -> None:
    sentence = errors.describe_batch_mismatch(expected, got)
    for keyword in keywords:
        assert re.search(keyword, sentence), sentence
    assert "TreeSpec" not in sentence and "\n" not in sentence
    assert sentence.endswith(".")

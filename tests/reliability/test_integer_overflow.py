"""int64 arithmetic that can leave int32's range is refused before the step, never wrapped (JAX runs int64 as int32).

The interval rules (:mod:`torchpar.ir.integer_ranges`) are checked against PyTorch itself: for each integer
expression, PyTorch's int64 result on a batch must lie inside the interval computed for that batch (soundness),
and the interval must be known (the rule exists). The refusal names the op, the line and the batch's ranges; an
in-range batch of the same model trains like PyTorch under one device, DataParallel and a 2-stage pipeline.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import torchpar
from tests.capture.beside_pytorch import assert_trains_as_pytorch
from torchpar.capture.export import capture_train_step
from torchpar.ir.integer_ranges import IntegerOverflowError, integer_ranges
from torchpar.runtime.host_loading import HostDataError

EXPRESSIONS = {
    "mul_add": lambda ids, k: ids * 3 + 7,
    "sub_alpha": lambda ids, k: torch.sub(ids, k, alpha=2),
    "rsub": lambda ids, k: 5 - ids,
    "floor_div": lambda ids, k: ids // 7,
    "floor_div_tensor": lambda ids, k: ids // k,
    "trunc_div": lambda ids, k: torch.div(ids, -3, rounding_mode="trunc"),
    "remainder": lambda ids, k: ids % 13,
    "remainder_negative": lambda ids, k: ids % -5,
    "fmod": lambda ids, k: torch.fmod(ids, 13),
    "abs_neg": lambda ids, k: -ids.abs(),
    "pow": lambda ids, k: ids.pow(2),
    "clamp": lambda ids, k: ids.clamp(0, 100) * 2,
    "clamp_min": lambda ids, k: ids.clamp_min(3) - 1,
    "maximum": lambda ids, k: torch.maximum(ids, k) * 2,
    "sum": lambda ids, k: ids.sum(),
    "sum_dim": lambda ids, k: ids.sum(-1),
    "cumsum": lambda ids, k: ids.cumsum(0),
    "prod_small": lambda ids, k: k.prod(-1),
    "argmax": lambda ids, k: ids.argmax(-1) * 2,
    "sort_indices": lambda ids, k: ids.sort(-1).indices * 2,
    "topk_indices": lambda ids, k: ids.topk(2).indices * 2,
    "max_values": lambda ids, k: ids.max(-1).values * 2,
    "arange": lambda ids, k: torch.arange(10) * 3 + ids[:1, :1],
    "full": lambda ids, k: torch.full((5,), 7) * ids[0],
    "where": lambda ids, k: torch.where(ids > 0, ids, 0) * 3,
    "masked_fill": lambda ids, k: ids.masked_fill(ids < 0, 99) * 3,
    "cat": lambda ids, k: torch.cat([ids, ids * 2]) + 1,
    "shifts": lambda ids, k: (ids.abs() << 2) + (ids.abs() >> 1),
    "bitwise": lambda ids, k: (ids.abs() & 255) + (ids.abs() | 3),
    "bool_sum": lambda ids, k: (ids > 5).sum(-1) * 2,
    "int16_wraps_alike": lambda ids, k: ids.to(torch.int16) * 100 + ids[:1, :1],
    "view_slice": lambda ids, k: ids.view(-1)[::2] * k[0, 0],
}


class Expression(nn.Module):
    """A loss that reads ``fn(ids, k)`` (an int64 tensor) through one float cast."""

    def __init__(self, fn):
        super().__init__()
        self.fn, self.w = fn, nn.Parameter(torch.ones(()))

    def forward(self, ids, k):
        return (self.w * (self.fn(ids, k) + 0).float()).mean()


def _batch(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(-50, 1000, (6, 5), generator=generator)
    return ids, torch.randint(1, 8, (6, 5), generator=generator)


@pytest.mark.parametrize("name", list(EXPRESSIONS))
def test_intervals_hold_pytorch_int64_results(name):
    fn = EXPRESSIONS[name]
    generator = torch.Generator().manual_seed(0)
    graph = capture_train_step(Expression(fn), _batch(generator)).graph
    ranges = integer_ranges(graph)
    cast = next(n for n in graph.nodes if n.target == "aten._to_copy.default" and n.out.dtype == "float32")
    for _ in range(3):
        ids, k = _batch(generator)
        interval = ranges.intervals([ids.numpy(), k.numpy()], ["ids", "k"])[cast.args[0].name]
        result = fn(ids, k)
        assert interval is not None, f"{name}: no interval rule reached the result"
        assert interval[0] <= int(result.min()) and int(result.max()) <= interval[1], (name, interval)


class Hashed(nn.Module):
    """The hashing trick in two pipeline layers: ``(ids * 1000003 + 12345) % 97`` picks a row of a 97-row table."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(97, 4)
        self.proj, self.fc = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, ids):
        rows = self.emb((ids * 1000003 + 12345) % 97)  # the multiply that leaves int32 for ids ≥ 2148
        rows = torchpar.mark_pipeline_boundary(self.proj(rows))
        return self.fc(rows).pow(2).mean()


def test_the_hashing_trick_beyond_int32_is_refused_naming_the_op_the_line_and_the_batch():
    model = Hashed()
    small = torch.randint(0, 2000, (8, 3))
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=small) as engine:
        engine.step(small)
        before = [p.detach().clone() for p in model.parameters()]
        with pytest.raises(IntegerOverflowError, match=r"(?s)aten\.mul\.Tensor .*can produce int64 values in "
                                                       r"\[\d+, \d+\].*outside int32's range.*x64 off.*"
                                                       r"test_integer_overflow.py:\d+, in forward.*ids \* 1000003.*"
                                                       r"the batch in \[\d+, 99999\].*data pipeline"):
            engine.step(torch.cat([small, torch.tensor([[99999, 5, 6]])]))
        engine.sync_to_torch()
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # refused before it ran


@pytest.mark.parametrize("method", [None, "data_parallel", "pipeline"])
def test_the_hashing_trick_inside_int32_trains_like_pytorch(method):
    torch.manual_seed(0)
    model = Hashed()
    reference = Hashed()
    reference.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 2000, (8, 3), generator=generator) for _ in range(3)]
    assert_trains_as_pytorch(model, reference, batches, lambda p: torch.optim.SGD(p, lr=0.1), method=method)


def test_check_inputs_false_leaves_the_arithmetic_unchecked():
    model = Hashed()
    big = torch.full((8, 3), 99999)
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=big,
                          check_inputs=False) as engine:
        assert np.isfinite(engine.step(big).item())  # wrapped as int32 would: the documented opt-out


def test_host_loaded_data_is_checked_where_it_is_loaded():
    model = Hashed()
    rows = torch.randint(0, 2000, (16, 3))
    rows[12, 0] = 99999
    dataset = torch.utils.data.TensorDataset(rows)
    data = torchpar.HostData(dataset, batch_size=4, shuffle=False)
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), data=data,
                          step_fn=lambda m, batch: m(batch[0])) as engine:
        for _ in range(3):
            engine.step()
        with pytest.raises(HostDataError, match=r"(?s)step 3's rows 0:4: IntegerOverflowError: aten\.mul\.Tensor .*can "
                                                r"produce int64 values.*batch\[0\] in \[\d+, 99999\]"):
            engine.step()

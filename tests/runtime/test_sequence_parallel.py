"""Megatron sequence parallelism (``MegatronParallel(sequence_parallel=True)``) on 4 fake CPU devices, against
PyTorch eager: GPT-2's gradients (one SGD step at lr 1 moves each parameter by its gradient) and losses, and the
compiled step's forward — told from the backward by XLA's op metadata (JAX names backward ops ``transpose(…)``) —
with two reduce-scatters and two all-gathers of the tokens per layer on the tensor axis and no all-reduce of an
activation, where the plan without it all-reduces twice per layer."""

from __future__ import annotations

import math
import re

import pytest
import torch
import transformers

import torchpar
from torchpar.report.hlo import collectives

LAYERS, WIDTH, LENGTH = 2, 64, 128
GRAD_ATOL = 1e-5


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_positions=LENGTH, n_embd=WIDTH, n_layer=LAYERS, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


def _batch() -> dict:
    ids = torch.randint(0, 128, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def _forward_collectives(hlo: str) -> list:
    """Collectives of the step's forward: those whose op metadata is not a backward (``transpose``) op."""
    forward = []
    for collective in collectives(hlo):
        name = re.search(r'op_name="([^"]*)"', collective.line)
        if name and "transpose(" not in name.group(1):
            forward.append(collective)
    return forward


def _activation_sized(collective) -> bool:
    """Moves (a device's share of) a [tokens, hidden] activation rather than a per-token statistic."""
    return any(math.prod(shape) >= LENGTH * WIDTH // 4 for _, shape in collective.shapes)


def _sgd_step(method):
    model = _gpt2()
    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=1.0), example_batch=_batch(),
                              method=method)
    loss = engine.step(_batch())
    return loss, engine.export_torch_state_dict(), engine


@pytest.fixture(scope="module")
def pytorch_step():
    model = _gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loss = model(**_batch()).loss
    loss.backward()
    optimizer.step()
    return loss.item(), {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "tp"])
def test_tensor_parallel_gpt2_with_and_without_sequence_parallelism(sequence_parallel, pytorch_step):
    loss, params, engine = _sgd_step(torchpar.MegatronParallel(mesh_shape=(1, 4), sequence_parallel=sequence_parallel))
    expected_loss, expected_params = pytorch_step
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    for name, value in expected_params.items():  # lr 1: the step moved each parameter by its gradient
        torch.testing.assert_close(params[name], value, atol=GRAD_ATOL, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    strategies = [s.split(": ")[1] for s in engine.plan.stages[0].strategies.values()]
    forward = _forward_collectives(engine.hlo_text()[0])
    scatters = [c for c in forward if c.kind == "reduce-scatter"]
    gathers = [c for c in forward if c.kind == "all-gather" and _activation_sized(c)]
    reduces = [c for c in forward if c.kind == "all-reduce" and _activation_sized(c)]
    if sequence_parallel:
        assert strategies.count("k@1>m@1") == 2 * LAYERS  # attention out and fc2: rows scattered
        assert len(scatters) == 2 * LAYERS
        # 2 per layer, before attention's and the MLP's column-split layers; one more before the LM head
        assert 2 * LAYERS <= len(gathers) <= 2 * LAYERS + 2, [c.shapes for c in gathers]
        assert not reduces, [c.shapes for c in reduces]
    else:
        assert not scatters and len(reduces) == 2 * LAYERS, [c.shapes for c in reduces]

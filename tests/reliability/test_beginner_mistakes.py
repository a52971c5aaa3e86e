"""The first mistakes of a new user (``docs/debugging.md``, "First mistakes"): each ends in one message that says
what is wrong and the line to write instead (the first of them, a classifier returning logits without
``step_fn``, is ``test_capture_faults.py::test_a_model_returning_logits_is_told_to_pass_a_step_fn``)."""

from __future__ import annotations

import pytest
import torch
import transformers

import torchpar


def _linear():
    return torch.nn.Linear(4, 1)


def _mean(outputs, batch):
    return outputs.mean()


def test_a_language_model_batch_without_labels_says_to_pass_them():
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100))
    ids = torch.randint(0, 100, (4, 8))
    with pytest.raises(ValueError, match=r"cannot find the loss.*for HF models pass labels in the batch.*loss_fn="):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch={"input_ids": ids})


def test_init_after_jax_has_its_devices_says_to_call_it_first():
    """The session's JAX already has its 8 devices: asking for 16 is what ``import jax`` before ``init`` gives."""
    with pytest.raises(RuntimeError, match=r"asked for 16 devices but JAX has 8.*call torchpar.init first.*XLA_FLAGS="):
        torchpar.init(cluster="local", num_devices=16)
    torchpar.init(cluster="local", num_devices=8)


def test_an_example_batch_the_devices_cannot_split_names_the_sizes_that_would():
    torchpar.init(cluster="local", num_devices=4)
    try:
        model = _linear()
        with pytest.raises(ValueError, match=r"6 rows over 4 devices: give an example batch of a multiple of 4 rows.*"
                                             r"mesh_shape=\(1, 2\)"):
            torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=torch.randn(6, 4),
                             loss_fn=_mean, method=torchpar.DataParallel())
    finally:
        torchpar.init(cluster="local", num_devices=8)


def test_an_optimizer_over_another_models_parameters_is_named():
    model, other = _linear(), _linear()
    with pytest.raises(ValueError, match=r"is not a parameter of the model.*build the optimizer from "
                                         r"model.parameters\(\)"):
        torchpar.compile(model, torch.optim.SGD(other.parameters(), lr=0.1), example_batch=torch.randn(8, 4),
                         loss_fn=_mean)


def test_a_batch_of_another_dtype_than_the_example_is_named():
    model = torch.nn.Embedding(10, 4)
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          example_batch=torch.randint(0, 10, (8,)), loss_fn=_mean) as engine:
        with pytest.raises(ValueError, match=r"the batch is float32\[8\] but the example batch has int64\[8\]"):
            engine.step(torch.randint(0, 10, (8,)).float())


def test_backward_and_optimizer_step_after_the_engine_step_are_named():
    """``engine.step`` ran the backward and the update: its loss has no graph (PyTorch's own error if ``backward``
    is called), and a leftover ``optimizer.step()`` reads a ``.grad`` stand-in that says to remove it."""
    model = _linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with torchpar.compile(model, optimizer, example_batch=torch.randn(8, 4), loss_fn=_mean) as engine:
        loss = engine.step(torch.randn(8, 4))
        assert not loss.requires_grad
        with pytest.raises(RuntimeError, match="does not require grad"):
            loss.backward()
        with pytest.raises(RuntimeError, match=r"read the .grad of .*applied inside engine.step.*remove an "
                                               r"optimizer.step\(\)"):
            optimizer.step()


def test_a_float64_model_is_refused_with_the_reason():
    """JAX runs with 64-bit types off: a ``model.double()`` would train in float32 and come back rounded."""
    model = _linear().double()
    with pytest.raises(ValueError, match=r"holds float64 tensors \(weight, bias\).*64-bit types off.*model.float\(\)"):
        torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1),
                         example_batch=torch.randn(8, 4, dtype=torch.float64), loss_fn=_mean)

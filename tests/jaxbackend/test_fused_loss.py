"""The LM head and the cross-entropy in chunks of rows (``jaxbackend.rewrites.fuse_linear_cross_entropy``,
``jaxbackend.ops.fused_loss``): found in language models, exact against PyTorch (fp32, 1e-6) and against the unfused
lowering, left alone where the logits have another reader or the plan splits them, and XLA's temporaries fall."""

from __future__ import annotations

import copy
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import torchpar
from jaxbackend import rewrites
from jaxbackend.lower import lower
from jaxbackend.ops.fused_loss import FUSED_LOSS_TARGET
from torchpar.capture.export import capture_train_step
from torchpar.harness import zoo

SMALL = {
    "gpt2": {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 384, "n_positions": 32},
    "llama": {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
              "num_key_value_heads": 1, "vocab_size": 384},
    "bert": {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2,
             "vocab_size": 384},
}
FUSED_MESSAGE = "computed in chunks"


@pytest.fixture
def always_fused(monkeypatch):
    """Fuse every loss chain, in chunks of 8 rows (several chunks and a ragged last one for the batches here)."""
    monkeypatch.setattr(rewrites, "FUSED_LOSS_MIN_BYTES", 0)
    monkeypatch.setattr(rewrites, "FUSED_LOSS_CHUNK_BYTES", 8 * 384 * 4)


def _model(family: str, batch: int = 2, seq: int = 13):
    torch.manual_seed(0)
    model, example = zoo.build(family, SMALL[family], batch_size=batch, seq_len=seq)
    return model, example


def _lowered_step(graph, model, example, *, min_bytes: int):
    """``(loss, grads)`` of the lowered step with the loss chain fused when its logits hold ``min_bytes``."""
    params = {n: jnp.asarray(p.detach().numpy()) for n, p in model.named_parameters()}
    buffers = {n: jnp.asarray(b.numpy()) for n, b in model.named_buffers()}
    inputs = [jnp.asarray(v.numpy()) for v in example.values()]
    saved = rewrites.FUSED_LOSS_MIN_BYTES
    rewrites.FUSED_LOSS_MIN_BYTES = min_bytes
    try:
        run = lower(graph)
    finally:
        rewrites.FUSED_LOSS_MIN_BYTES = saved
    return jax.value_and_grad(lambda p: run(p, buffers, inputs, jax.random.key(0))[0][0])(params)


@pytest.mark.parametrize("family, matmul", [("gpt2", "aten.mm.default"), ("llama", "aten.mm.default"),
                                            ("bert", "aten.addmm.default")])
def test_each_language_model_has_one_loss_chain_and_it_fuses(family, matmul, always_fused):
    model, example = _model(family)
    graph = capture_train_step(model, example).graph
    chains = rewrites._loss_chains(graph)
    assert [chain.matmul.target for chain in chains] == [matmul]
    fused = rewrites.fuse_linear_cross_entropy(graph)
    targets = [node.target for node in fused.nodes]
    assert targets.count(FUSED_LOSS_TARGET) == 1 and "aten._log_softmax.default" not in targets
    node = next(node for node in fused.nodes if node.target == FUSED_LOSS_TARGET)
    assert node.name == chains[0].gather.name and node.kwargs["rows_per_chunk"] == 8
    assert len(fused.nodes) < len(graph.nodes)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_the_fused_step_equals_the_unfused_one(family, always_fused):
    model, example = _model(family)
    graph = capture_train_step(model, example).graph
    loss, grads = _lowered_step(graph, model, example, min_bytes=0)
    loss_ref, grads_ref = _lowered_step(graph, model, example, min_bytes=1 << 62)
    assert float(loss) == pytest.approx(float(loss_ref), rel=1e-6)
    for name in grads_ref:
        np.testing.assert_allclose(grads[name], grads_ref[name], rtol=1e-6, atol=1e-7, err_msg=name)


def _ignored_labels(example):
    labels = example["labels"].clone()
    labels[0, :5] = -100  # ignore_index rows: their gradient is zero, the mean divides by the others
    return {**example, "labels": labels}


def test_gpt2_trains_as_pytorch_with_the_loss_in_chunks(always_fused, caplog):
    model, example = _model("gpt2", batch=3, seq=11)  # 33 rows: four chunks of 8 and one of 1
    reference = copy.deepcopy(model)
    batches = [_ignored_labels(example), example, _ignored_labels(example)]
    # SGD: the weights' difference is the gradients' (Adam would magnify the rounding noise of gradients that are
    # zero in exact arithmetic, e.g. the attention's key bias)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    caplog.set_level(logging.DEBUG, logger=rewrites.__name__)
    with torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9), example_batch=example) as engine:
        for batch in batches:
            optimizer.zero_grad()
            expected = reference(**batch).loss
            expected.backward()
            optimizer.step()
            assert engine.step(batch).item() == pytest.approx(expected.item(), rel=1e-6)
    assert FUSED_MESSAGE in caplog.text
    for (name, got), want in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda text, name=name: f"{name}: {text}")


def test_a_summed_loss_and_bf16_autocast_fuse_like_the_unfused_step(always_fused):
    model, example = _model("gpt2")

    def summed(model, batch):  # the next token's label, the last position ignored (as HF's causal LM loss)
        logits = model(input_ids=batch["input_ids"]).logits
        labels = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                                 reduction="sum")

    graph = capture_train_step(model, _ignored_labels(example), step_fn=summed).graph
    assert len(rewrites._loss_chains(graph)) == 1
    loss, grads = _lowered_step(graph, model, _ignored_labels(example), min_bytes=0)
    loss_ref, grads_ref = _lowered_step(graph, model, _ignored_labels(example), min_bytes=1 << 62)
    assert float(loss) == pytest.approx(float(loss_ref), rel=1e-6)
    for name in grads_ref:
        np.testing.assert_allclose(grads[name], grads_ref[name], rtol=1e-5, atol=1e-6, err_msg=name)

    low = capture_train_step(model, example, autocast=torch.bfloat16).graph
    [chain] = rewrites._loss_chains(low)
    assert chain.matmul.out.dtype == "bfloat16" and chain.log_softmax.out.dtype == "float32"
    loss, grads = _lowered_step(low, model, example, min_bytes=0)
    loss_ref, grads_ref = _lowered_step(low, model, example, min_bytes=1 << 62)
    assert float(loss) == pytest.approx(float(loss_ref), rel=1e-3)
    for name in grads_ref:
        scale = float(jnp.max(jnp.abs(grads_ref[name]))) + 1e-12
        assert float(jnp.max(jnp.abs(grads[name] - grads_ref[name]))) <= 2e-2 * scale, name


def test_logits_read_elsewhere_are_not_fused(always_fused):
    model, example = _model("gpt2")

    def with_logits(model, batch):
        out = model(**batch)
        return out.loss, {"logit_mean": out.logits.detach().mean()}

    graph = capture_train_step(model, example, step_fn=with_logits).graph
    assert rewrites._loss_chains(graph) == []
    assert rewrites.fuse_linear_cross_entropy(graph) is graph


def test_a_plan_that_splits_the_chain_keeps_it_unfused(always_fused):
    model, example = _model("gpt2")
    graph = capture_train_step(model, example).graph
    [chain] = rewrites._loss_chains(graph)
    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    by_rows = NamedSharding(mesh, PartitionSpec("x", None))
    whole = NamedSharding(mesh, PartitionSpec())
    assert rewrites.fuse_linear_cross_entropy(graph, {chain.log_softmax.name: by_rows}) is graph
    assert rewrites.fuse_linear_cross_entropy(graph, {}, {chain.matmul.name: (by_rows, whole)}) is graph
    assert rewrites.fuse_linear_cross_entropy(graph, {}, {}, {chain.matmul.name: {"scatter": "rows"}}) is graph
    replicated = rewrites.fuse_linear_cross_entropy(graph, {chain.log_softmax.name: whole})
    assert FUSED_LOSS_TARGET in {node.target for node in replicated.nodes}


def test_small_logits_stay_unfused_by_default():
    model, example = _model("gpt2")
    graph = capture_train_step(model, example).graph
    assert rewrites.fuse_linear_cross_entropy(graph) is graph  # 26 × 384 floats: far below FUSED_LOSS_MIN_BYTES


def test_xla_temporaries_of_the_step_fall(monkeypatch):
    """Compiled, not run: a vocabulary of 8,192 at 1,024 rows (32 MiB of logits) in chunks of 128 rows."""
    monkeypatch.setattr(rewrites, "FUSED_LOSS_CHUNK_BYTES", 4 << 20)
    torch.manual_seed(0)
    overrides = {"n_layer": 1, "n_embd": 64, "n_head": 2, "vocab_size": 8192, "n_positions": 128}
    model, example = zoo.build("gpt2", overrides, batch_size=8, seq_len=128)
    graph = capture_train_step(model, example).graph
    params = {n: jax.ShapeDtypeStruct(tuple(p.shape), jnp.float32) for n, p in model.named_parameters()}
    inputs = [jax.ShapeDtypeStruct(tuple(v.shape), jnp.int32) for v in example.values()]
    temps = {}
    for min_bytes in (1 << 62, 0):
        monkeypatch.setattr(rewrites, "FUSED_LOSS_MIN_BYTES", min_bytes)
        run = lower(graph)
        step = jax.jit(jax.grad(lambda p, i, run=run: run(p, {}, i, jax.random.key(0))[0][0]))
        temps[min_bytes] = step.lower(params, inputs).compile().memory_analysis().temp_size_in_bytes
    assert temps[0] <= 0.6 * temps[1 << 62], temps

"""Constant attention masks become ``scaled_dot_product_attention``'s flags at capture
(``torchpar/capture/semantics/attention_masks.py``), so HuggingFace models reach the fused attention path on a GPU.

Checked on the captured graphs (what the call receives, what is left of the mask's subgraph), on the lowering
for a CUDA platform (which ``jax.nn.dot_product_attention`` implementation the step asks for) and on losses
against PyTorch; masks that carry information (padding from the batch, windows, additive biases) stay."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch

import torchpar
from jaxbackend import precision
from jaxbackend.lower import lower
from tests.models import hf_configs
from torchpar.capture.semantics.attention_masks import classify_mask
from torchpar.capture.export import capture_forward, capture_train_step

SDPA = "aten.scaled_dot_product_attention.default"


def _attention_calls(graph) -> list:
    return [node for node in graph.nodes if node.target == SDPA]


def _mask_and_causal(node) -> tuple:
    """The call's ``attn_mask`` and ``is_causal`` (positional or keyword, defaults where absent)."""
    args = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), node.args)) | node.kwargs
    return args.get("attn_mask"), args.get("is_causal", False)


@pytest.mark.parametrize("family, causal", [("gpt2", True), ("llama", True), ("vit", False)])
@pytest.mark.parametrize("capture", ["train", "forward"])
def test_a_models_own_constant_mask_becomes_the_causal_flag(family, causal, capture):
    torch.manual_seed(0)
    model, batch = getattr(hf_configs, family)()
    graph = (capture_train_step(model, batch) if capture == "train" else capture_forward(model, batch)).graph
    calls = _attention_calls(graph)
    assert len(calls) == 2  # one per layer
    assert all(_mask_and_causal(node) == (None, causal) for node in calls)
    seq = calls[0].out.shape[-2]
    used = {ref for node in graph.nodes if "assert" not in node.target for ref in node.refs()}
    used |= {output.value.name for output in graph.outputs if output.value is not None}
    leftover = [n.name for n in graph.nodes
                if n.name in used and getattr(n.out, "dtype", None) == "bool" and n.out.shape[-2:] == (seq, seq)]
    assert leftover == []  # the mask's subgraph is gone (export's metadata asserts may keep pieces it checks)


def test_a_padding_mask_from_the_batch_stays():
    """BERT's batch has padding: the mask depends on an input, so the call keeps it."""
    torch.manual_seed(0)
    model, batch = hf_configs.bert()
    calls = _attention_calls(capture_train_step(model, batch).graph)
    assert calls and all(_mask_and_causal(node)[0] is not None for node in calls)


class WindowedAttention(torch.nn.Module):
    """Attention with a mask built in ``forward`` from shapes alone; ``kind`` picks which."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.proj = torch.nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.proj(x).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)  # 3 × [B, heads, L, 4]
        length = x.shape[1]
        rows = torch.arange(length)[:, None]
        cols = torch.arange(length)[None, :]
        mask = {"causal_float": torch.zeros(length, length).masked_fill(cols > rows, float("-inf")),
                "window": (cols <= rows) & (cols > rows - 3),
                "bias": -(rows - cols).abs().float()}[self.kind]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).square().mean()


@pytest.mark.parametrize("kind, folded", [("causal_float", True), ("window", False), ("bias", False)])
def test_only_masks_the_flags_can_express_are_folded(kind, folded):
    torch.manual_seed(0)
    model = WindowedAttention(kind)
    batch = torch.randn(2, 6, 8)
    (call,) = _attention_calls(capture_train_step(model, batch, lambda out, _: out).graph)
    mask, causal = _mask_and_causal(call)
    assert (mask is None, causal) == ((True, True) if folded else (False, False))

    engine = torchpar.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), example_batch=batch,
                              loss_fn=lambda out, _: out)
    reference = WindowedAttention(kind)
    reference.load_state_dict(model.state_dict())
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        torch_opt.zero_grad()
        want = reference(batch)
        want.backward()
        torch_opt.step()
        assert engine.step(batch) == pytest.approx(want.item(), rel=1e-5)


def test_classify_mask():
    tril = torch.ones(4, 4, dtype=torch.bool).tril()
    assert classify_mask(tril, 4, 4) == "causal"
    assert classify_mask(tril.expand(2, 1, 4, 4), 4, 4) == "causal"
    assert classify_mask(torch.ones(3, 5, dtype=torch.bool).tril(), 3, 5) == "causal"  # top-left aligned, as torch
    assert classify_mask(torch.ones(1, 1, dtype=torch.bool), 4, 4) == "full"  # broadcasts
    low = torch.finfo(torch.bfloat16).min
    assert classify_mask(torch.zeros(4, 4, dtype=torch.bfloat16).masked_fill(~tril, low), 4, 4) == "causal"
    assert classify_mask(torch.zeros(4, 4), 4, 4) == "full"
    assert classify_mask(tril.clone().fill_diagonal_(False), 4, 4) is None
    assert classify_mask(torch.ones(4, 4, dtype=torch.bool).triu(), 4, 4) is None
    assert classify_mask(torch.zeros(4, 4).masked_fill(~tril, -1e4), 4, 4) is None  # a bias, not a mask
    assert classify_mask(torch.ones(4, 4, dtype=torch.int64), 4, 4) is None
    assert classify_mask(tril, 4, 5) is None  # does not broadcast


def test_hf_gpt2_asks_for_cudnn_on_a_gpu(monkeypatch):
    """GPT-2 in bf16 without dropout, lowered as for a CUDA GPU, asks for cuDNN's fused kernel in every layer
    (this machine has no cuDNN, so the call falls back to the composition while tracing)."""
    implementations = []
    real = jax.nn.dot_product_attention

    def recording(*args, implementation=None, **kwargs):
        implementations.append(implementation)
        return real(*args, implementation=implementation, **kwargs)

    monkeypatch.setattr(jax.nn, "dot_product_attention", recording)
    torch.manual_seed(0)
    model, batch = hf_configs.gpt2()
    model = model.to(torch.bfloat16)
    graph = capture_train_step(model, batch).graph
    run = lower(graph, numerics=precision.Numerics(platform="cuda"))
    params = {name: jnp.zeros(tuple(p.shape), jnp.bfloat16) for name, p in model.named_parameters()}
    buffers = {name: jnp.asarray(b.float().numpy()).astype(b.dtype == torch.bfloat16 and jnp.bfloat16 or jnp.float32)
               for name, b in model.named_buffers()}
    inputs = [jnp.asarray(batch["input_ids"].numpy(), jnp.int32)] * 2
    loss = lambda p: run(p, buffers, inputs, jax.random.key(0))[0][0]  # noqa: E731
    jax.eval_shape(jax.grad(loss), params)
    assert implementations == ["cudnn", "cudnn"]


@pytest.mark.parametrize("kind, folded", [("causal_float", True), ("window", False)])
def test_a_mask_past_the_size_limit_is_checked_in_row_blocks(kind, folded, monkeypatch):
    """Over the limit a mask is never materialized whole (a 32k-token one is 1 Gi entries): it is checked one block
    of query rows at a time, every entry still checked — a window that looks causal in its first rows stays."""
    from torchpar.capture.semantics import attention_masks

    monkeypatch.setattr(attention_masks, "_MAX_FOLD_ELEMENTS", 8)  # the 6 × 6 mask: blocks of one row
    evaluated = []
    rows = attention_masks._RowBlocks.rows
    monkeypatch.setattr(attention_masks._RowBlocks, "rows",
                        lambda self, a, b: evaluated.append(b - a) or rows(self, a, b))
    (call,) = _attention_calls(capture_train_step(WindowedAttention(kind), torch.randn(2, 6, 8),
                                                  lambda out, _: out).graph)
    assert (_mask_and_causal(call)[0] is None) == folded
    assert evaluated and max(evaluated) == 1


def test_a_model_on_the_meta_device_has_its_causal_mask_folded():
    """Planning a model built on the meta device: the mask reads no placeholder, so it is computed on the CPU."""
    with torch.device("meta"):
        model, batch = hf_configs.llama()
    calls = _attention_calls(capture_train_step(model, batch).graph)
    assert len(calls) == 2 and all(_mask_and_causal(node) == (None, True) for node in calls)

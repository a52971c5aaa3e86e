"""A meta model's deep stack of identical blocks is traced on three blocks and repeated: the IR must be the one a
whole capture gives, op for op and name for name (a plan made on it applies to the model with weights) — GPT-2 in
fp32, Mixtral (Llama's attention, with experts) under bf16 autocast — and a stack that is not one program must be
captured whole."""

from __future__ import annotations

import pytest
import torch
import transformers

import torchpar.capture.repeated_blocks as repeated
from torchpar.capture.export import capture_train_step

transformers.logging.set_verbosity_error()
LAYERS = 7


def _model(family: str, **overrides) -> torch.nn.Module:
    small = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=96, num_hidden_layers=LAYERS)
    configs = {
        "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=LAYERS, n_embd=32, n_head=4, n_positions=16, vocab_size=96, **overrides)),
        "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**small, **overrides)),
        "mixtral": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **small, num_local_experts=4, num_experts_per_tok=2, **overrides)),
    }
    with torch.device("meta"):
        return configs[family]()


def _captures(model: torch.nn.Module, autocast: torch.dtype | None, monkeypatch) -> tuple:
    with torch.device("meta"):
        ids = torch.zeros(2, 16, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}
    repeated_graph = capture_train_step(model, batch, autocast=autocast).graph
    monkeypatch.setattr(repeated, "MIN_BLOCKS", 10**9)
    return repeated_graph, capture_train_step(model, batch, autocast=autocast).graph


def _assert_same_graph(ours, whole) -> None:
    assert [i.name for i in ours.inputs] == [i.name for i in whole.inputs]
    assert ours.inputs == whole.inputs
    for mine, theirs in zip(ours.nodes, whole.nodes, strict=True):
        assert mine == theirs
    assert ours.outputs == whole.outputs
    assert ours.constants.keys() == whole.constants.keys()


@pytest.mark.parametrize("family, autocast", [("gpt2", None), ("mixtral", torch.bfloat16)])
def test_repeated_blocks_give_the_whole_capture(family, autocast, monkeypatch, caplog):
    model = _model(family)
    path = "transformer.h" if family == "gpt2" else "model.layers"
    assert repeated.find_block_stack(model) == repeated.BlockStack(path, LAYERS)
    with caplog.at_level("INFO", logger="torchpar.capture.export"):
        ours, whole = _captures(model, autocast, monkeypatch)
    assert f"captured 3 of the {LAYERS} identical blocks" in caplog.text
    _assert_same_graph(ours, whole)
    assert len(model.get_submodule(path)) == LAYERS  # the stack is restored


class _Block(torch.nn.Module):
    def __init__(self, index: int):
        super().__init__()
        self.index = index  # the block's place: left out of the signature, as HF's layer_idx
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return x + self.linear(x) / (self.index + 1)  # … but the program depends on it


class _Stack(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(i) for i in range(LAYERS))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_a_layer_dependent_program_is_captured_whole(monkeypatch, caplog):
    """The blocks look alike but each divides by its own index: the trace shows it and the stack is captured whole
    (GPT-2's ``scale_attn_by_inverse_layer_idx`` differs already in an attribute, ``scaling``)."""
    with torch.device("meta"):
        model = _Stack()
        x = torch.zeros(4, 8)
    assert repeated.find_block_stack(model) == repeated.BlockStack("blocks", LAYERS)
    assert repeated.find_block_stack(_model("gpt2", scale_attn_by_inverse_layer_idx=True)) is None
    with caplog.at_level("INFO", logger="torchpar.capture.export"):
        ours = capture_train_step(model, x).graph
        monkeypatch.setattr(repeated, "MIN_BLOCKS", 10**9)
        whole = capture_train_step(model, x).graph
    assert "not one repeatable program" in caplog.text
    _assert_same_graph(ours, whole)


def test_stacks_that_differ_are_not_repeated():
    model = _model("gpt2")
    model.transformer.h[3].attn.register_forward_hook(lambda *args: None)
    assert repeated.find_block_stack(model) is None
    model = _model("llama")
    model.model.layers[5].self_attn.scaling = 0.5  # one block's attribute differs
    assert repeated.find_block_stack(model) is None
    model = _model("gpt2")
    model.transformer.h[4].mlp.c_fc.weight = model.transformer.h[1].mlp.c_fc.weight  # shared weights
    assert repeated.find_block_stack(model) is None
    with torch.device("meta"):  # with weights it is never used (a real capture is what compile runs)
        shallow = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=5, n_embd=32, n_head=4, vocab_size=96))
    assert repeated.find_block_stack(shallow) is None  # under MIN_BLOCKS

"""Shared set-up of the ``TorchparTrainer`` tests: tiny HF models (dropout 0), token datasets with ignored labels,
the acceptance's ``TrainingArguments`` and the torchpar methods they run under."""

from __future__ import annotations

from typing import Any

import torch
import transformers

import torchpar

VOCAB = 128
SEQ = 32


class Tokens(torch.utils.data.Dataset):
    """``n`` rows of ``SEQ`` random token ids; their labels are the ids with about 30% set to -100 (ignored), so
    micro-batches hold different numbers of counted tokens."""

    def __init__(self, n: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
        self.labels = self.ids.clone()
        self.labels[torch.rand(n, SEQ, generator=generator) < 0.3] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


def causal_lm(family: str) -> torch.nn.Module:
    """A 2-layer GPT-2 or Llama with dropout 0, its weights drawn from seed 0."""
    torch.manual_seed(0)
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def training_args(output_dir: str, **overrides: Any) -> transformers.TrainingArguments:
    """The acceptance's arguments: 30 steps, gradient accumulation 2, cosine schedule with warmup, clipping at 1.0,
    a log every 5 steps and an evaluation every 10."""
    values = dict(max_steps=30, per_device_train_batch_size=4, per_device_eval_batch_size=8,
                  gradient_accumulation_steps=2, learning_rate=1e-3, lr_scheduler_type="cosine", warmup_steps=5,
                  weight_decay=0.01, max_grad_norm=1.0, logging_steps=5, eval_strategy="steps", eval_steps=10,
                  save_strategy="no", report_to=[], seed=0, disable_tqdm=True)
    values.update(overrides)
    return transformers.TrainingArguments(output_dir, **values)


def datasets() -> tuple[Tokens, Tokens]:
    return Tokens(200, seed=1), Tokens(24, seed=2)


def two_stage_pipeline() -> torchpar.PipeshardParallel:
    """Layer 0 on devices 0–1, layer 1 on devices 2–3 (each stage data parallel over its two)."""
    stages = torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)),
                                        submesh_physical_shapes=((1, 2), (1, 2)),
                                        submesh_logical_shapes=((1, 2), (1, 2)))
    return torchpar.PipeshardParallel(layer_option=torchpar.AutoLayerOption(layer_num=2), stage_option=stages)


METHODS = {"one_device": lambda: None,
           "data_parallel": lambda: torchpar.DataParallel(mesh_shape=(1, 4)),
           "pipeline": two_stage_pipeline}

LOGGED = ("loss", "grad_norm", "learning_rate", "eval_loss")


def logged_values(history: list[dict[str, Any]]) -> list[tuple[int, str, float]]:
    """``(step, key, value)`` of every training and eval log entry's compared values."""
    return [(entry["step"], key, entry[key]) for entry in history for key in LOGGED if key in entry]

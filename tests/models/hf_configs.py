"""Tiny HuggingFace models built from configs (no downloads), with a matching example batch.

Each builder returns ``(model, batch)``; ``dropout`` sets every dropout probability of the config.
Deterministic for a given ``torch.manual_seed``.
"""

from __future__ import annotations

from typing import Callable

import torch
import transformers

BATCH, SEQ, VOCAB = 2, 16, 128


def _ids(vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ))


def gpt2(dropout: float = 0.0) -> tuple[torch.nn.Module, dict]:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=dropout,
        embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    ids = _ids()
    return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


def llama(dropout: float = 0.0) -> tuple[torch.nn.Module, dict]:
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, attention_dropout=dropout)
    ids = _ids()
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def bert(dropout: float = 0.0) -> tuple[torch.nn.Module, dict]:
    config = transformers.BertConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    ids = _ids()
    labels = ids.clone()
    labels[:, ::3] = -100  # only some positions are masked-LM targets
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # padding in the second sequence
    return transformers.BertForMaskedLM(config), {"input_ids": ids, "attention_mask": mask, "labels": labels}


def vit(dropout: float = 0.0) -> tuple[torch.nn.Module, dict]:
    config = transformers.ViTConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, image_size=32,
        patch_size=8, num_labels=10, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    return (transformers.ViTForImageClassification(config),
            {"pixel_values": torch.randn(BATCH, 3, 32, 32), "labels": torch.randint(0, 10, (BATCH,))})


def resnet(dropout: float = 0.0) -> tuple[torch.nn.Module, dict]:
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
    return (transformers.ResNetForImageClassification(config),
            {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.randint(0, 10, (4,))})


FAMILIES: dict[str, Callable[..., tuple[torch.nn.Module, dict]]] = {
    "gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit, "resnet": resnet,
}

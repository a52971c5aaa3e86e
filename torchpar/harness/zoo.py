"""Models built from configs with random weights (nothing is downloaded), with a matching batch.

For the examples, the benchmarks and the command line: ``build("gpt2", {"n_layer": 4}, batch_size=8,
seq_len=128)`` returns ``(model, batch)`` where ``model(**batch).loss`` is the training loss.
Families: ``gpt2``, ``llama``, ``bert`` (masked LM), ``vit``, ``resnet`` (HuggingFace transformers) and
``mlp`` (a plain PyTorch MLP with an MSE loss), ``moe`` (one top-k mixture-of-experts layer, dense dispatch) and
``mixtral`` (HF Mixtral: top-2 routed experts through transformers' ``grouped_mm`` path, router loss included).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch

FAMILIES = ("gpt2", "llama", "bert", "vit", "resnet", "mlp", "moe", "mixtral")

Batch = dict[str, torch.Tensor] | tuple[torch.Tensor, torch.Tensor]
"""A family's batch: keyword tensors for the HF models, ``(x, y)`` for ``mlp`` and ``moe``."""


class MLP(torch.nn.Module):
    """``depth`` bias-free Linear layers with ReLU between them; ``forward(x, y)`` returns the MSE loss."""

    def __init__(self, width: int = 256, depth: int = 4, bias: bool = False):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=bias) for _ in range(depth))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            x = layer(x)
            if index < len(self.layers) - 1:
                x = torch.relu(x)
        return torch.nn.functional.mse_loss(x, y)


class MoELayer(torch.nn.Module):
    """One mixture-of-experts feed-forward layer with top-k routing and static shapes.

    ``x_BTD`` → router logits → softmax → top-k gates (renormalized) → every expert's FFN on every token
    (``einsum`` over expert-stacked weights ``w_in_EDF``/``w_out_EFD``), combined with the sparse gates.
    Dense dispatch keeps shapes static (no data-dependent token lists), so it exports and shards; it
    computes all experts, trading FLOPs for simplicity. ``forward(x, y)`` returns the MSE loss plus the
    usual load-balancing auxiliary loss.
    """

    def __init__(self, width: int = 64, hidden: int = 128, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.router = torch.nn.Linear(width, experts, bias=False)
        self.w_in_EDF = torch.nn.Parameter(torch.randn(experts, width, hidden) * width**-0.5)
        self.w_out_EFD = torch.nn.Parameter(torch.randn(experts, hidden, width) * hidden**-0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        probs_BTE = torch.softmax(self.router(x), dim=-1)
        top_p, top_i = torch.topk(probs_BTE, self.top_k, dim=-1)
        gates_BTE = torch.zeros_like(probs_BTE).scatter(-1, top_i, top_p / top_p.sum(-1, keepdim=True))
        hidden_EBTF = torch.relu(torch.einsum("btd,edf->ebtf", x, self.w_in_EDF))
        out_EBTD = torch.einsum("ebtf,efd->ebtd", hidden_EBTF, self.w_out_EFD)
        out_BTD = torch.einsum("ebtd,bte->btd", out_EBTD, gates_BTE)
        load_E = (gates_BTE > 0).float().mean(dim=(0, 1))
        aux = (load_E * probs_BTE.mean(dim=(0, 1))).sum() * probs_BTE.shape[-1]
        return torch.nn.functional.mse_loss(out_BTD, y) + 0.01 * aux


def build(
    family: str,
    overrides: dict[str, Any] | None = None,
    *,
    batch_size: int = 2,
    seq_len: int = 16,
    dropout: float = 0.0,
) -> tuple[torch.nn.Module, Batch]:
    """A randomly initialised model of ``family`` and a random batch for it.

    ``overrides`` are config fields (HF config attributes, or ``width``/``depth`` for ``mlp``) applied on
    top of a tiny default config. ``dropout`` sets every dropout probability of the config.
    """
    if family not in _BUILDERS:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    check_overrides(family, overrides or {})
    return _BUILDERS[family](dict(overrides or {}), batch_size, seq_len, dropout)


_CONFIG_CLASSES = {
    "gpt2": "GPT2Config",
    "llama": "LlamaConfig",
    "bert": "BertConfig",
    "vit": "ViTConfig",
    "resnet": "ResNetConfig",
    "mixtral": "MixtralConfig",
}
"""The transformers config class whose fields each HF family's overrides set."""


def config_keys(family: str) -> tuple[str, set[str]]:
    """What ``family``'s overrides configure (a name for messages) and the keys it accepts: for HF families the
    config class's constructor arguments, attributes and aliases (``attribute_map``, e.g. ``hidden_size`` for
    GPT-2's ``n_embd``); for ``mlp``/``moe`` the module's constructor arguments."""
    import inspect

    if family not in _CONFIG_CLASSES:
        module: type[torch.nn.Module] = {"mlp": MLP, "moe": MoELayer}[family]
        return module.__name__, set(inspect.signature(module.__init__).parameters) - {"self"}
    import transformers

    config_class = getattr(transformers, _CONFIG_CLASSES[family])
    default = config_class()
    keys = {
        name
        for name, parameter in inspect.signature(config_class.__init__).parameters.items()
        if name != "self" and parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL)
    }
    keys |= set(default.to_dict()) | set(getattr(config_class, "attribute_map", {}))
    keys |= {
        name
        for klass in config_class.__mro__
        for name, value in vars(klass).items()  # e.g. num_labels
        if isinstance(value, property) and value.fset is not None and not name.startswith("_")
    }
    return f"transformers.{config_class.__name__}", keys


def check_overrides(family: str, overrides: Mapping[str, object]) -> None:
    """Raise ``ValueError`` naming every override key that ``family``'s config does not have, with the nearest
    valid keys (a misspelled key would otherwise be set as an unused attribute and silently ignored)."""
    import difflib

    source, keys = config_keys(family)
    unknown = [key for key in overrides if key not in keys]
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), sorted(keys), n=3, cutoff=0.6)
        hints.append(f"{key!r} (nearest valid keys: {', '.join(close)})" if close else f"{key!r} (no similar key)")
    raise ValueError(f"unknown config key(s) for model family {family} ({source}): {'; '.join(hints)}")


def _token_batch(vocab: int, batch_size: int, seq_len: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch_size, seq_len))


def _gpt2(
    overrides: dict, batch_size: int, seq_len: int, dropout: float
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers

    fields = dict(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=128,
        n_positions=max(64, seq_len),
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    config = transformers.GPT2Config(**{**fields, **overrides})
    ids = _token_batch(config.vocab_size, batch_size, seq_len)
    return transformers.GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


def _llama(
    overrides: dict, batch_size: int, seq_len: int, dropout: float
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers

    fields = dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=max(64, seq_len),
        attention_dropout=dropout,
    )
    config = transformers.LlamaConfig(**{**fields, **overrides})
    ids = _token_batch(config.vocab_size, batch_size, seq_len)
    return transformers.LlamaForCausalLM(config), {"input_ids": ids, "labels": ids}


def _mixtral(
    overrides: dict, batch_size: int, seq_len: int, dropout: float
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers

    fields = dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=max(64, seq_len),
        num_local_experts=8,
        num_experts_per_tok=2,
        output_router_logits=True,
        attention_dropout=dropout,
    )
    config = transformers.MixtralConfig(**{**fields, **overrides})
    ids = _token_batch(config.vocab_size, batch_size, seq_len)
    return transformers.MixtralForCausalLM(config), {"input_ids": ids, "labels": ids}


def _bert(
    overrides: dict, batch_size: int, seq_len: int, dropout: float
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers

    fields = dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        vocab_size=128,
        max_position_embeddings=max(64, seq_len),
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    config = transformers.BertConfig(**{**fields, **overrides})
    ids = _token_batch(config.vocab_size, batch_size, seq_len)
    labels = ids.clone()
    labels[:, ::3] = -100
    return transformers.BertForMaskedLM(config), {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "labels": labels,
    }


def _vit(
    overrides: dict, batch_size: int, seq_len: int, dropout: float
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers

    fields = dict(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        image_size=32,
        patch_size=8,
        num_labels=10,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    config = transformers.ViTConfig(**{**fields, **overrides})
    size = cast(int, config.image_size)  # one int: a square image
    pixels = torch.randn(batch_size, config.num_channels, size, size)
    labels = torch.randint(0, cast(int, config.num_labels), (batch_size,))  # set above
    return transformers.ViTForImageClassification(config), {"pixel_values": pixels, "labels": labels}


def _resnet(
    overrides: dict, batch_size: int, seq_len: int, dropout: float
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import transformers

    fields = dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)
    config = transformers.ResNetConfig(**{**fields, **overrides})
    pixels = torch.randn(batch_size, config.num_channels, 32, 32)
    labels = torch.randint(0, cast(int, config.num_labels), (batch_size,))  # set above
    return transformers.ResNetForImageClassification(config), {"pixel_values": pixels, "labels": labels}


def _mlp(
    overrides: dict, batch_size: int, seq_len: int, dropout: float
) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    model = MLP(**{"width": 64, "depth": 4, **overrides})
    width = cast(torch.nn.Linear, model.layers[0]).in_features
    return model, (torch.randn(batch_size, width), torch.randn(batch_size, width))


def _moe(
    overrides: dict, batch_size: int, seq_len: int, dropout: float
) -> tuple[torch.nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    model = MoELayer(**{"width": 64, "hidden": 128, "experts": 4, "top_k": 2, **overrides})
    width = model.router.in_features
    return model, (torch.randn(batch_size, seq_len, width), torch.randn(batch_size, seq_len, width))


_BUILDERS: dict[str, Callable[[dict, int, int, float], tuple[torch.nn.Module, Batch]]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "bert": _bert,
    "vit": _vit,
    "resnet": _resnet,
    "mlp": _mlp,
    "moe": _moe,
    "mixtral": _mixtral,
}

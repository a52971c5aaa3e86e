"""The lowering's IR rewrites (``jaxbackend/rewrites.py``): HF's grouped matmuls read their expert weights in place,
not through a transposed copy, and train exactly as before (``tests/jaxbackend/test_ops_extra.py`` has the same
models against PyTorch)."""

from __future__ import annotations

import re

import torch
import transformers
from jax.sharding import PartitionSpec

import torchpar
from jaxbackend import lower as lower_module
from jaxbackend.rewrites import fold_transposed_weights
from jaxbackend.sharding import make_mesh, named_sharding
from torchpar.ir.graph import Ref
from torchpar.ir.op_families import GROUPED_MATMULS

EXPERTS, HIDDEN, EXPERT_HIDDEN = 4, 32, 48


def _engine() -> torchpar.Engine:
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=EXPERT_HIDDEN, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, num_local_experts=EXPERTS, num_experts_per_tok=2))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    engine = torchpar.compile(model, torch.optim.AdamW(model.parameters(), lr=1e-3), example_batch=batch)
    engine.step(batch)
    return engine, batch


def test_grouped_matmuls_read_the_untransposed_expert_weights():
    engine, batch = _engine()
    graph = engine.graph
    grouped = [node for node in graph.nodes if node.target in GROUPED_MATMULS]
    folded_graph, _ = fold_transposed_weights(graph)
    folded = {node.name: node for node in folded_graph.nodes}
    assert len(grouped) == 2
    for node in grouped:
        rewritten = folded[node.name]
        assert rewritten.kwargs == {"weight_transposed": True}
        assert isinstance(rewritten.args[1], Ref) and rewritten.args[1].name.endswith(("gate_up_proj", "down_proj"))
    mesh = make_mesh((2, 2))
    pinned = (None, named_sharding(mesh, ((0,), None, (1,))), None)  # experts over axis 0, [E, K, N]'s N over 1
    _, shardings = fold_transposed_weights(graph, {grouped[0].name: pinned})
    assert shardings[grouped[0].name][1].spec == PartitionSpec("d0", "d1", None)  # the stored [E, N, K]'s N
    # the compiled step holds no transposed copy of an expert weight ([E, in, out] from HF's [E, out, in])
    transposed_shapes = {f"f32[{EXPERTS},{HIDDEN},{2 * EXPERT_HIDDEN}]", f"f32[{EXPERTS},{EXPERT_HIDDEN},{HIDDEN}]"}
    hlo = engine.hlo_text()[0]
    assert not [line for line in hlo.splitlines()
                if re.search(r"= (f32\[[\d,]+\])\{[^}]*\} (transpose|copy)\(", line)
                and re.search(r"= (f32\[[\d,]+\])", line).group(1) in transposed_shapes]


def test_the_folded_step_trains_like_the_unfolded_one(monkeypatch):
    engine, batch = _engine()
    folded = [float(engine.step(batch)) for _ in range(2)]
    monkeypatch.setattr(lower_module, "fold_transposed_weights", lambda graph, shardings=None: (graph, shardings or {}))
    unfolded_engine, _ = _engine()
    unfolded = [float(unfolded_engine.step(batch)) for _ in range(2)]
    assert folded == unfolded or max(abs(a - b) for a, b in zip(folded, unfolded)) < 1e-6

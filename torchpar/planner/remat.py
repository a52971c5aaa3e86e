"""Which nodes activation checkpointing recomputes: one group per model layer.

A layer is what a model repeats: the nodes whose module path (``Node.module_path``, from ``nn_module_stack``)
runs through the same numbered child of a container — ``transformer.h.3`` in GPT-2, ``model.layers.3`` in
Llama, ``encoder.layer.3`` in BERT and ViT, ``3`` in an ``nn.Sequential``. Each layer's consecutive nodes form
one group that :mod:`jaxbackend.remat` computes under ``jax.checkpoint``; embeddings, the final norm, the head
and the loss are outside every layer and keep their activations (they run once and are cheap to keep relative
to the stack of layers).

``remat`` options (``torchpar.compile(..., remat=...)``):

| option | effect |
|---|---|
| ``"none"`` | keep every activation the backward reads (default) |
| ``"layers"`` | keep each layer's input, recompute the layer's forward in its backward |
| ``"selective"`` | keep each layer's input and its linear layers' outputs, recompute the rest |
"""

from __future__ import annotations

import re

from torchpar.ir.graph import Graph

REMAT_OPTIONS = ("none", "layers", "selective")
_NUMBERED = re.compile(r"^(.*?(?:^|\.)\d+)(?:\.|$)")


def check_remat(remat: str) -> str:
    """``remat`` if it is one of :data:`REMAT_OPTIONS`, else a ``ValueError`` naming them."""
    if remat not in REMAT_OPTIONS:
        raise ValueError(f"remat must be one of {REMAT_OPTIONS}, got {remat!r}")
    return remat


def layer_of(module_path: str) -> str | None:
    """The layer a module path belongs to: its prefix up to the first numbered component (``"transformer.h.0"``
    for ``"transformer.h.0.attn.c_proj"``), ``None`` outside numbered children."""
    match = _NUMBERED.match(module_path.lstrip("."))
    return match.group(1) if match else None


def layer_groups(graph: Graph) -> tuple[tuple[str, ...], ...]:
    """Node names of each run of consecutive nodes in one layer (:func:`layer_of`), in graph order; a layer whose
    nodes are interrupted by others' forms one group per run."""
    groups: list[list[str]] = []
    current: str | None = None
    for node in graph.nodes:
        layer = layer_of(node.module_path)
        if layer is None:
            current = None
            continue
        if layer != current:
            groups.append([])
            current = layer
        groups[-1].append(node.name)
    return tuple(tuple(group) for group in groups)

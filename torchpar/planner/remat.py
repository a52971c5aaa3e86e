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
| ``"auto"`` | the planner picks one of the above (:func:`choose_remat`); ``plan.remat`` says which and why |

What each option keeps is priced by :func:`remat_memory`, the one description the sharding ILP's memory and
compute (``sharding/solver_graph.py``), the pipeline stage DP's (``stage_cost.py``) and the single-device plan's
read. It starts from the values a compiled step materializes (:func:`materialized`: not views, not the inside of
a chain of elementwise ops, which XLA fuses into one kernel), and of those:

- kept until the backward, per micro-batch: every output of a node outside the layers, and of a layer's node
  that is read outside its group (the group's outputs: the next layer's input); under ``"selective"`` also its
  2-D matmuls' outputs (``mm``/``addmm``: the linear layers; JAX's ``dots_with_no_batch_dims_saveable``);
- live again while one layer is recomputed (once, not per micro-batch): the other outputs of the group with
  the most activation bytes;
- live in the backward besides what is kept (once, not per micro-batch): :data:`BACKWARD_WORKING_COPIES` copies
  of the largest materialized output — while the backward passes that op, its output's cotangent and its input's
  (about as large) are live at once; measured on a ResNet against XLA's memory analysis this working set was a
  third of the step's peak;
- recomputed: the forward FLOPs of the nodes not kept (``"layers"``: every layer's; ``"selective"``: those of
  the non-matmul nodes, which the cost model counts as ~0: their time is memory traffic, not FLOPs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torchpar.ir.graph import Graph
from torchpar.ir.op_families import POINTWISE, REDUCTIONS, VIEWS

BACKWARD_WORKING_COPIES = 2
"""Copies of the largest materialized output the backward holds besides the kept activations (its cotangent and
its input's); the sharding ILP prices them in that output's layout, the stage DP at its fully sharded size."""
REMAT_OPTIONS = ("none", "layers", "selective")
"""What a compiled step runs with."""
REMAT_CHOICES = (*REMAT_OPTIONS, "auto")
"""What ``compile`` / ``plan`` accept: an option, or ``"auto"`` for the planner to pick one."""
SAVED_BY_SELECTIVE = frozenset({"aten.mm.default", "aten.addmm.default"})
"""Ops whose outputs ``"selective"`` keeps (matmuls without batch dimensions: the linear layers)."""
FUSED_READERS = POINTWISE | REDUCTIONS
"""Ops XLA fuses an elementwise producer into (loop fusion, and input fusion into a reduction): a value only they
read is never materialized."""
_NUMBERED = re.compile(r"^(.*?(?:^|\.)\d+)(?:\.|$)")


def check_remat(remat: str, *, allow_auto: bool = False) -> str:
    """``remat`` if it is one of :data:`REMAT_OPTIONS` (or ``"auto"`` with ``allow_auto``), else a ``ValueError``
    naming them."""
    allowed = REMAT_CHOICES if allow_auto else REMAT_OPTIONS
    if remat not in allowed:
        raise ValueError(f"remat must be one of {allowed}, got {remat!r}")
    return remat


@dataclass(frozen=True)
class RematMemory:
    """What ``remat`` keeps of a graph's activations (module docstring): node names."""

    remat: str
    kept: frozenset[str]
    """Outputs live from the forward to the backward (per micro-batch)."""
    peak_layer: frozenset[str] = frozenset()
    """Outputs live again while the largest layer is recomputed (once per step, not per micro-batch)."""
    recomputed: frozenset[str] = frozenset()
    """Nodes whose forward runs again in the backward."""
    dropped_groups: tuple[frozenset[str], ...] = ()
    """Per layer group, the outputs it does not keep (live again while that layer is recomputed)."""
    working: frozenset[str] = frozenset()
    """The largest materialized output, whose size the backward's working set is priced at
    (:data:`BACKWARD_WORKING_COPIES` copies, once per step)."""


def materialized(graph: Graph) -> frozenset[str]:
    """Nodes whose outputs a compiled step holds in memory (its activations): all but views (they alias an operand)
    and elementwise ops (:data:`torchpar.ir.op_families.POINTWISE`) whose every reader is elementwise or a reduction
    (:data:`FUSED_READERS`) — the inside of a chain that XLA fuses into one kernel (a norm's ``pow`` into its
    ``mean``), whose backward recomputes it from the chain's inputs. A chain's last value is materialized, and so
    is any value the graph returns."""
    readers: dict[str, list[str]] = {}
    for node in graph.nodes:
        for ref in node.refs():
            readers.setdefault(ref, []).append(node.target)
    returned = {out.value.name for out in graph.outputs if out.value is not None}
    live = set()
    for node in graph.nodes:
        if node.target in VIEWS:
            continue
        if (
            node.target in POINTWISE
            and node.name not in returned
            and all(target in FUSED_READERS for target in readers.get(node.name, ()))
        ):
            continue
        live.add(node.name)
    return frozenset(live)


def remat_memory(graph: Graph, remat: str) -> RematMemory:
    """What ``remat`` (one of :data:`REMAT_OPTIONS`) keeps and recomputes of ``graph`` (module docstring). A graph
    without layers keeps every materialized value whatever ``remat`` says, as the lowering does."""
    check_remat(remat)
    live = materialized(graph)
    nodes = {node.name: node for node in graph.nodes}
    working = frozenset([max(live, key=lambda name: (nodes[name].out_bytes, name))] if live else [])
    groups = layer_groups(graph) if remat != "none" else ()
    if not groups:
        return RematMemory(remat, live, working=working)
    group_of = {name: index for index, group in enumerate(groups) for name in group}
    read_outside = {out.value.name for out in graph.outputs if out.value is not None}
    for node in graph.nodes:
        for ref in node.refs():
            if ref in group_of and group_of.get(node.name) != group_of[ref]:
                read_outside.add(ref)
    kept = {
        name
        for name in live
        if name not in group_of
        or name in read_outside
        or (remat == "selective" and nodes[name].target in SAVED_BY_SELECTIVE)
    }
    dropped = [[name for name in group if name in live and name not in kept] for group in groups]
    largest = max(dropped, key=lambda names: sum(nodes[n].out_bytes for n in names))
    # the whole group runs again (its outputs too), except what the policy saved
    recomputed = {name for name in group_of if not (remat == "selective" and nodes[name].target in SAVED_BY_SELECTIVE)}
    return RematMemory(
        remat,
        frozenset(kept),
        frozenset(largest),
        frozenset(recomputed),
        tuple(frozenset(names) for names in dropped),
        working,
    )


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

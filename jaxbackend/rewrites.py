"""Rewrites of the IR the lowering applies before it traces a graph: an op that can read its operand's producer's
input directly does, so XLA never materializes the producer's result for it.

- **Grouped matmuls reading a transposed weight.** HF stores expert weights like ``nn.Linear`` (``[E, out, in]``)
  and calls ``_grouped_mm(x, w.transpose(-2, -1), offs)`` (captured as ``aten.permute(w, [0, 2, 1])``). The grouped
  matmul's loop over row blocks (:mod:`.ops.grouped_matmul`) needs its weight as one buffer, so XLA would copy
  every expert's weights into the transposed layout before the loop, and the gradient back after it, every step.
  :func:`fold_transposed_weights` makes the matmul read ``w`` itself (``weight_transposed=True``); the permute
  stays in the graph for its other readers, if any (XLA drops it otherwise).

Where the plan pins the op's operand layouts (GSPMD ``operand_shardings``), the weight's is permuted alike: a
grouped matmul split over devices reads each device's shard of the stored weight in place too. Per-device programs
(``spmd="shard_map"``) are not rewritten: they read each operand in its planned layout by name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from jax.sharding import NamedSharding, PartitionSpec

from jaxbackend.ops.expert_parallel import swap_weight_dims
from torchpar.ir.graph import Graph, Node, Ref, TensorMeta
from torchpar.ir.op_families import GROUPED_MATMULS

_SWAPS_LAST_TWO = {
    "aten.permute.default": lambda args: [d % 3 for d in args[1]] == [0, 2, 1],
    "aten.transpose.int": lambda args: {d % 3 for d in args[1:3]} == {1, 2},
}
"""For each op that can swap dims: whether its arguments (a 3-D input) swap exactly the last two."""


def fold_transposed_weights(
    graph: Graph, operand_shardings: Mapping[str, Sequence[NamedSharding | None]] | None = None
) -> tuple[Graph, dict[str, Sequence[NamedSharding | None]]]:
    """``graph`` with every grouped matmul whose weight is a swap of the last two dims of a 3-D value reading that
    value with ``weight_transposed=True`` (``graph`` itself if there is none), and ``operand_shardings`` with those
    ops' weight shardings permuted to the stored value's dims."""
    producers = {node.name: node for node in graph.nodes}
    shardings = dict(operand_shardings or {})
    nodes: list[Node] = []
    changed = False
    for node in graph.nodes:
        source = _transposed_source(node, producers) if node.target in GROUPED_MATMULS else None
        if source is None:
            nodes.append(node)
            continue
        args = (node.args[0], source, *node.args[2:])
        nodes.append(dataclasses.replace(node, args=args, kwargs={**node.kwargs, "weight_transposed": True}))
        if node.name in shardings:
            pinned = list(shardings[node.name])
            pinned[1] = _swap_last_two(pinned[1])
            shardings[node.name] = tuple(pinned)
        changed = True
    return (dataclasses.replace(graph, nodes=nodes) if changed else graph), shardings


def _swap_last_two(sharding: NamedSharding | None) -> NamedSharding | None:
    if sharding is None:
        return None
    return NamedSharding(sharding.mesh, PartitionSpec(*swap_weight_dims(tuple(sharding.spec))))


def _transposed_source(node: Node, producers: dict[str, Node]) -> Ref | None:
    weight = node.args[1] if len(node.args) > 1 else None
    producer = producers.get(weight.name) if isinstance(weight, Ref) else None
    if producer is None or producer.target not in _SWAPS_LAST_TWO or not isinstance(producer.args[0], Ref):
        return None
    out = producer.out
    if not isinstance(out, TensorMeta) or len(out.shape) != 3 or not _SWAPS_LAST_TWO[producer.target](producer.args):
        return None
    return producer.args[0]

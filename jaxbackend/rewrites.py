"""Rewrites of the IR the lowering applies before it traces a graph: an op that can read its operand's producer's
input directly does, so XLA never materializes the producer's result for it.

- **Grouped matmuls reading a transposed weight.** HF stores expert weights like ``nn.Linear`` (``[E, out, in]``)
  and calls ``_grouped_mm(x, w.transpose(-2, -1), offs)`` (captured as ``aten.permute(w, [0, 2, 1])``). The grouped
  matmul's loop over row blocks (:mod:`.ops.grouped_matmul`) needs its weight as one buffer, so XLA would copy
  every expert's weights into the transposed layout before the loop, and the gradient back after it, every step.
  :func:`fold_transposed_weights` makes the matmul read ``w`` itself (``weight_transposed=True``); the permute
  stays in the graph for its other readers, if any (XLA drops it otherwise).

Where the plan pins the op's operand layouts (GSPMD ``operand_shardings``), the weight's is permuted alike: a
grouped matmul split over devices reads each device's shard of the stored weight in place too.
- **The LM head and the cross-entropy in chunks of rows.** A language model's loss is ``mm`` (or ``addmm``) → views
  and dtype casts → ``_log_softmax`` → ``gather`` of the labels' entries: the ``[rows, vocab]`` logits, their
  log-softmax and its gradient are the largest tensors of the step (GPT-2 124M at batch 8 × 1024: 1.6 GB each in
  float32). :func:`fuse_linear_cross_entropy` replaces that chain by one
  :func:`~jaxbackend.ops.fused_loss.linear_log_softmax_gather` node, computed chunk by chunk, where none of the
  chain's values has another reader, the logits hold at least :data:`FUSED_LOSS_MIN_BYTES` and the plan leaves the
  chain whole on every device (no split of its values, no option of its matmul). What follows the ``gather`` (the
  ignore-index masking, the sum, the division) is untouched, so every reduction PyTorch's ``cross_entropy`` has is
  kept as captured.

Per-device programs (``spmd="shard_map"``) are not rewritten: they read each operand in its planned layout by name.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

from jax.sharding import NamedSharding, PartitionSpec

from jaxbackend.ops.expert_parallel import swap_weight_dims
from jaxbackend.ops.fused_loss import FUSED_LOSS_TARGET
from torchpar.ir.graph import DTYPE_BYTES, Graph, Node, Ref, TensorMeta
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


# --- the LM head and the cross-entropy in chunks ----------------------------------------------------------------------

logger = logging.getLogger(__name__)

FUSED_LOSS_MIN_BYTES = 1 << 30
"""The smallest logits (``rows × vocab`` values in the log-softmax's dtype) whose loss is computed in chunks (1 GiB:
GPT-2's vocabulary from about 5,300 tokens a step). Below it the unfused ops run: they are faster, because the
chunked backward recomputes the logits (on 2 CPU cores a 2-layer GPT-2-width step at 4 × 256 tokens took 2.7 s in one
chunk, 3.0 s in seven, against 2.07 s unfused); above it the memory matters more (the logits, their log-softmax and
its gradient are each this size)."""
FUSED_LOSS_CHUNK_BYTES = 256 << 20
"""About how many bytes of logits one chunk holds: ``C = ⌊bytes / (vocab × itemsize)⌋`` rows, a multiple of 8 (at
least 8, at most all rows)."""

_MATMULS = ("aten.mm.default", "aten.addmm.default")
_ROW_KEEPING = frozenset(
    {
        "aten.view.default",
        "aten._unsafe_view.default",
        "aten.reshape.default",
        "aten.alias.default",
        "aten.clone.default",
        "aten.contiguous.default",
        "aten._to_copy.default",
    }
)
"""Ops the chain may pass between the matmul and the log-softmax: views that keep the vocabulary as the last dim (so
rows stay rows, in order) and copies, of which ``_to_copy`` may change the dtype."""
_NOT_READERS = frozenset({"aten._assert_tensor_metadata.default"})
"""Nodes that read a value without using it (export's metadata assertions; they lower to nothing)."""


@dataclasses.dataclass(frozen=True)
class _LossChain:
    """One matched chain: ``matmul`` → ``between`` (views and casts) → ``log_softmax`` → ``gather``, and the
    assertions reading its values (``dropped``)."""

    matmul: Node
    between: tuple[Node, ...]
    log_softmax: Node
    gather: Node
    dropped: tuple[Node, ...]
    logits: TensorMeta
    """The log-softmax's result, ``[rows, vocab]``."""

    @property
    def removed(self) -> set[str]:
        nodes = (self.matmul, *self.between, self.log_softmax, *self.dropped)
        return {node.name for node in nodes}

    def fused(self) -> Node:
        """The :data:`~jaxbackend.ops.fused_loss.FUSED_LOSS_TARGET` node taking the ``gather``'s name and place."""
        matmul = self.matmul
        bias, a, b = (None, *matmul.args[:2]) if matmul.target == "aten.mm.default" else tuple(matmul.args[:3])
        rows, vocab = self.logits.shape
        chunk = max(8, min(rows, FUSED_LOSS_CHUNK_BYTES // (vocab * DTYPE_BYTES.get(self.logits.dtype, 4))) // 8 * 8)
        casts = tuple(_dtype(node) for node in self.between if node.target == "aten._to_copy.default")
        kwargs: dict[str, object] = {
            "logits_dtype": _dtype(matmul),
            "casts": casts,
            "log_softmax_dtype": self.logits.dtype,
            "half_to_float": bool(self.log_softmax.args[2]) if len(self.log_softmax.args) > 2 else False,
            "rows_per_chunk": chunk,
        }
        if matmul.target == "aten.addmm.default":
            kwargs["beta"] = matmul.args[3] if len(matmul.args) > 3 else matmul.kwargs.get("beta", 1)
            kwargs["alpha"] = matmul.args[4] if len(matmul.args) > 4 else matmul.kwargs.get("alpha", 1)
        return dataclasses.replace(
            self.gather,
            target=FUSED_LOSS_TARGET,
            args=(a, b, bias, self.gather.args[2]),
            kwargs=kwargs,
            flops=matmul.flops + self.log_softmax.flops + self.gather.flops,
            source=matmul.source or self.gather.source,
            module_path=matmul.module_path or self.gather.module_path,
        )


def fuse_linear_cross_entropy(
    graph: Graph,
    value_shardings: Mapping[str, NamedSharding | None] | None = None,
    operand_shardings: Mapping[str, Sequence[NamedSharding | None]] | None = None,
    op_options: Mapping[str, Mapping[str, object]] | None = None,
) -> Graph:
    """``graph`` with every LM-head-and-cross-entropy chain (module docstring) of at least
    :data:`FUSED_LOSS_MIN_BYTES` of logits computed in chunks (``graph`` itself if none is). A chain is left as it
    is where the plan splits any of its values or operands, or sets options of its matmul (the chunks would break
    the layout), and in graphs with custom autograd.Functions (their regions are node ranges)."""
    if graph.custom_backwards:
        return graph
    chains = [chain for chain in _loss_chains(graph) if chain.logits.nbytes >= FUSED_LOSS_MIN_BYTES]
    pinned = _pinned_names(value_shardings or {}, operand_shardings or {}, op_options or {})
    chains = [chain for chain in chains if not (chain.removed | {chain.gather.name}) & pinned]
    if not chains:
        return graph
    removed = set().union(*(chain.removed for chain in chains))
    replaced = {chain.gather.name: chain.fused() for chain in chains}
    for chain in chains:
        logger.debug(
            "LM head and cross-entropy at %s computed in chunks of %d rows (logits %s)",
            chain.matmul.source or chain.matmul.name,
            replaced[chain.gather.name].kwargs["rows_per_chunk"],
            chain.log_softmax.out,
        )
    nodes = [replaced.get(node.name, node) for node in graph.nodes if node.name not in removed]
    return dataclasses.replace(graph, nodes=nodes)


def _pinned_names(
    value_shardings: Mapping[str, NamedSharding | None],
    operand_shardings: Mapping[str, Sequence[NamedSharding | None]],
    op_options: Mapping[str, Mapping[str, object]],
) -> set[str]:
    """Names of the values and ops the plan splits or configures (a replicated pin is no constraint)."""
    split = lambda sharding: sharding is not None and not sharding.is_fully_replicated
    names = {name for name, sharding in value_shardings.items() if split(sharding)}
    names |= {name for name, shardings in operand_shardings.items() if any(split(s) for s in shardings)}
    return names | {name for name, options in op_options.items() if options}


def _loss_chains(graph: Graph) -> list[_LossChain]:
    """Every ``matmul → views/casts → _log_softmax → gather`` chain whose values have no other reader."""
    producers = {node.name: node for node in graph.nodes}
    metas = graph.metas()
    readers: dict[str, list[Node]] = {}
    for node in graph.nodes:
        for name in dict.fromkeys(node.refs()):
            readers.setdefault(name, []).append(node)
    outputs = {output.value.name for output in graph.outputs if output.value is not None}
    chains = []
    for node in graph.nodes:
        if node.target == "aten._log_softmax.default":
            chain = _chain_at(node, producers, metas, readers, outputs)
            if chain is not None:
                chains.append(chain)
    return chains


def _chain_at(
    log_softmax: Node,
    producers: Mapping[str, Node],
    metas: Mapping[str, object],
    readers: Mapping[str, list[Node]],
    outputs: set[str],
) -> _LossChain | None:
    out = log_softmax.out
    if not isinstance(out, TensorMeta) or len(out.shape) != 2 or log_softmax.args[1] not in (1, -1):
        return None
    rows, vocab = out.shape
    dropped: list[Node] = []

    def only_reader(name: str) -> Node | None:
        users = readers.get(name, [])
        dropped.extend(user for user in users if user.target in _NOT_READERS)
        used = [user for user in users if user.target not in _NOT_READERS]
        return used[0] if len(used) == 1 and name not in outputs else None

    gather = only_reader(log_softmax.name)
    if gather is None or gather.target != "aten.gather.default" or gather.args[1] not in (1, -1):
        return None
    if gather.args[0] != Ref(log_softmax.name):
        return None
    if not isinstance(gather.out, TensorMeta) or gather.out.shape != (rows, 1):
        return None
    if _shape(gather.args[2], metas) != (rows, 1):
        return None
    between: list[Node] = []
    value = log_softmax.args[0]
    while True:
        producer = producers.get(value.name) if isinstance(value, Ref) else None
        if producer is None or not isinstance(producer.out, TensorMeta) or producer.out.shape[-1:] != (vocab,):
            return None
        if only_reader(producer.name) is not (between[-1] if between else log_softmax):
            return None
        if producer.target in _MATMULS:
            break
        if producer.target not in _ROW_KEEPING:
            return None
        between.append(producer)
        value = producer.args[0]
    matmul = producer
    bias, a, b = (None, *matmul.args[:2]) if matmul.target == "aten.mm.default" else tuple(matmul.args[:3])
    a_shape, b_shape = _shape(a, metas), _shape(b, metas)
    if _shape(Ref(matmul.name), metas) != (rows, vocab) or a_shape is None or b_shape is None or len(a_shape) != 2:
        return None
    if b_shape != (a_shape[1], vocab) or (bias is not None and _shape(bias, metas) != (vocab,)):
        return None
    return _LossChain(matmul, tuple(reversed(between)), log_softmax, gather, tuple(dropped), out)


def _dtype(node: Node) -> str:
    """The dtype of a node with one tensor result."""
    assert isinstance(node.out, TensorMeta), f"{node.name} has one tensor result"
    return node.out.dtype


def _shape(value: object, metas: Mapping[str, object]) -> tuple[int, ...] | None:
    """The shape of a tensor argument (a :class:`Ref` to a tensor), else ``None``."""
    meta = metas.get(value.name) if isinstance(value, Ref) else None
    return meta.shape if isinstance(meta, TensorMeta) else None

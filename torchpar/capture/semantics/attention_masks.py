"""Fold attention masks that are the same for every batch into ``scaled_dot_product_attention``'s flags.

HuggingFace models build their attention mask inside ``forward`` and pass it to
``scaled_dot_product_attention`` as a materialized boolean tensor ``[B, 1, L, S]``, also when no padding mask
was given: causal (``tril``) for GPT-2 and Llama, all True for BERT and ViT. Computed from shapes alone
(``arange``, comparisons, ``expand``), such a mask is a constant of the captured graph, but a lowering that
receives a tensor must treat it as data: JAX's fused attention (cuDNN's flash kernel,
:mod:`jaxbackend.ops.attention`) is only taken without a mask, and the mask is materialized in memory.

:func:`fold_static_attention_masks` evaluates every such mask once at capture time (the subgraph that
computes it must depend on no placeholder: no input, parameter, buffer or lifted constant) and rewrites the
call when the mask says nothing that the flags cannot:

| mask, broadcast to ``[..., L, S]`` | rewritten to |
|---|---|
| every entry attends (bool True; float 0) | no mask |
| exactly ``tril(ones(L, S))`` attends (float: 0 there, ``-inf`` or the dtype's lowest value elsewhere) | no mask, ``is_causal=True`` |
| anything else (padding, sliding windows, a mask from the batch) | unchanged |

The rewrite is exact: PyTorch's ``is_causal`` is the top-left aligned ``tril`` mask, and a float mask's
lowest value gives the same zero weights as ``-inf`` after the softmax wherever a row keeps a key (a causal
row always keeps its diagonal). Nodes that only fed a folded mask are removed from the graph.

Long sequences. A mask of ``L × S`` entries is never materialized whole when it is large (over
:data:`_MAX_FOLD_ELEMENTS`): HF builds it from small index vectors (``arange``, ``unsqueeze``) by one
broadcasting comparison and an ``expand``, so a value past the limit made by broadcasting elementwise ops or
``expand`` is kept as a :class:`_RowBlocks` and checked block by block of query rows, every entry still checked
(a 32k-token mask: 1 Gi entries, in blocks of at most 64 Mi). A model on the meta device has its mask computed on
the CPU (the subgraph reads no placeholder, so it has no meta data to miss).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Container
from typing import Any, cast

import torch
import torch.fx

from torchpar.capture.meta_models import is_without_data

log = logging.getLogger(__name__)

SDPA = torch.ops.aten.scaled_dot_product_attention.default
_MASK_POSITION = 3
_CAUSAL_POSITION = 5
_MAX_FOLD_ELEMENTS = 1 << 26  # materialize values of at most 64 Mi entries at capture time (a 8k × 8k mask is 64 Mi)
_EXPAND = torch.ops.aten.expand.default
_BROADCASTING = {
    torch.ops.aten.le.Tensor,
    torch.ops.aten.lt.Tensor,
    torch.ops.aten.ge.Tensor,
    torch.ops.aten.gt.Tensor,
    torch.ops.aten.eq.Tensor,
    torch.ops.aten.ne.Tensor,
    torch.ops.aten.le.Scalar,
    torch.ops.aten.lt.Scalar,
    torch.ops.aten.ge.Scalar,
    torch.ops.aten.gt.Scalar,
    torch.ops.aten.eq.Scalar,
    torch.ops.aten.ne.Scalar,
    torch.ops.aten.logical_and.default,
    torch.ops.aten.logical_or.default,
    torch.ops.aten.logical_not.default,
    torch.ops.aten.bitwise_and.Tensor,
    torch.ops.aten.bitwise_or.Tensor,
    torch.ops.aten.bitwise_not.default,
    torch.ops.aten.__and__.Tensor,
    torch.ops.aten.__or__.Tensor,
    torch.ops.aten.add.Tensor,
    torch.ops.aten.sub.Tensor,
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.where.self,
}
_FILLS = {torch.ops.aten.zeros.default, torch.ops.aten.ones.default, torch.ops.aten.full.default}
_BLOCKWISE = _BROADCASTING | _FILLS | {_EXPAND}
"""Ops whose result, past the size limit, is kept as row blocks (:class:`_RowBlocks`): elementwise with
broadcasting, ``expand``, and tensors filled with one value."""


def fold_static_attention_masks(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph``'s attention calls whose mask is a causal or all-attending constant (module docstring);
    returns how many calls were rewritten. ``graph`` is modified in place."""
    folded = 0
    values: dict[torch.fx.Node, torch.Tensor | _RowBlocks] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not SDPA:
            continue
        mask = _mask_arg(node)
        if not isinstance(mask, torch.fx.Node) or _depends_on_placeholder(mask):
            continue
        value = _evaluate(mask, values)
        if value is None:
            continue
        query, key = node.args[0], node.args[1]
        q_len, k_len = _meta_shape(query)[-2], _meta_shape(key)[-2]
        kind = classify_mask(value, q_len, k_len)
        if kind is None:
            continue
        _rewrite(node, causal=kind == "causal" or _is_causal_arg(node))
        folded += 1
        log.debug("attention %s: constant %s mask %s folded into the call's flags", node.name, kind, tuple(value.shape))
    if folded:
        _remove_unused(graph, values)
        graph.lint()
    return folded


def classify_mask(mask: torch.Tensor | _RowBlocks, q_len: int, k_len: int) -> str | None:
    """``"full"`` if every query attends every key, ``"causal"`` if exactly ``tril(ones(q_len, k_len))``
    attends (for each leading index), ``None`` for any other mask or one that does not broadcast to
    ``[..., q_len, k_len]``, or a mask without data (a model on the meta device: planning only). A
    :class:`_RowBlocks` mask is checked one block of query rows at a time."""
    if isinstance(mask, torch.Tensor) and is_without_data(mask):
        return None
    shape = tuple(mask.shape)
    if len(shape) < 2 or shape[-2] not in (1, q_len) or shape[-1] not in (1, k_len):
        return None
    rows = shape[-2]
    step = max(1, _MAX_FOLD_ELEMENTS // max(1, math.prod(shape) // rows))
    full = causal = True
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        block = mask.rows(start, stop) if isinstance(mask, _RowBlocks) else mask[..., start:stop, :]
        attends = _attends(block)
        if attends is None:
            return None
        queries = q_len if rows == 1 else stop - start
        attends = attends.expand(*attends.shape[:-2], queries, k_len)
        first = 0 if rows == 1 else start
        full = full and bool(attends.all())
        tril = torch.arange(k_len)[None, :] <= torch.arange(first, first + queries)[:, None]
        causal = causal and bool((attends == tril).all())
        if not (full or causal):
            return None
    return "full" if full else "causal" if causal else None


class _RowBlocks:
    """A large mask value left unmaterialized: ``target(*args, **kwargs)`` of a broadcasting elementwise op, an
    ``expand`` or a fill (module docstring), whose arguments are tensors, scalars or other ``_RowBlocks``.
    ``rows(a, b)`` is the value's query rows ``a:b`` (dim −2), computed from its arguments' rows ``a:b`` (those with
    the same rows; an argument with one row, or fewer dims, broadcasts whole)."""

    def __init__(
        self, target: Callable[..., torch.Tensor], args: tuple, kwargs: dict, shape: tuple[int, ...], dtype: torch.dtype
    ):
        self.target, self.args, self.kwargs, self.shape, self.dtype = target, args, kwargs, shape, dtype

    def rows(self, start: int, stop: int) -> torch.Tensor:
        count = self.shape[-2]
        args = tuple(_rows_of(a, start, stop, count) for a in self.args)
        if self.target is _EXPAND or self.target in _FILLS:
            position = 1 if self.target is _EXPAND else 0
            sizes = list(args[position])
            sizes[-2] = stop - start if sizes[-2] in (-1, count) else sizes[-2]
            if self.target in _FILLS:
                with torch.no_grad():
                    return self.target(sizes, *args[1:], **self.kwargs)
            return args[0].expand(*sizes)
        with torch.no_grad():
            return self.target(*args, **self.kwargs)


def _rows_of(value: object, start: int, stop: int, count: int) -> Any:
    if isinstance(value, _RowBlocks):
        return value.rows(start, stop) if value.shape[-2] == count else value.rows(0, value.shape[-2])
    if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[-2] == count and count > 1:
        return value[..., start:stop, :]
    return value


def _attends(mask: torch.Tensor) -> torch.Tensor | None:
    """Where the mask lets a query see a key; ``None`` for a float mask with values other than 0 and masked."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    masked = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
    if not bool(((mask == 0) | masked).all()):
        return None  # an additive bias (ALiBi, relative positions): not a mask the flags can express
    return ~masked


def _mask_arg(node: torch.fx.Node) -> torch.fx.node.Argument:
    if len(node.args) > _MASK_POSITION:
        return node.args[_MASK_POSITION]
    return node.kwargs.get("attn_mask")


def _is_causal_arg(node: torch.fx.Node) -> bool:
    if len(node.args) > _CAUSAL_POSITION:
        return bool(node.args[_CAUSAL_POSITION])
    return bool(node.kwargs.get("is_causal", False))


def _rewrite(node: torch.fx.Node, *, causal: bool) -> None:
    """The call with ``attn_mask=None`` and ``is_causal=causal``, its other arguments unchanged."""
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
    bound = dict(zip(names, node.args)) | dict(node.kwargs)
    bound["attn_mask"], bound["is_causal"] = None, causal
    bound.setdefault("dropout_p", 0.0)
    node.args = tuple(bound.pop(name) for name in names)
    node.kwargs = bound


def _meta_shape(node: Any) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _depends_on_placeholder(node: torch.fx.Node) -> bool:
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        if current.op != "call_function":
            return True  # a placeholder (input, parameter, buffer, lifted constant) or a submodule
        stack.extend(current.all_input_nodes)
    return False


def _evaluate(
    node: torch.fx.Node, values: dict[torch.fx.Node, torch.Tensor | _RowBlocks]
) -> torch.Tensor | _RowBlocks | None:
    """The node's value computed with torch on the CPU, its inputs first — past the size limit, a broadcasting
    elementwise op or ``expand`` as :class:`_RowBlocks` (``None`` if a node on the way is random, too large for
    either, or fails to run: the mask is then left as data)."""
    if node in values:
        return values[node]
    if _is_random(node.target):
        return None
    value = node.meta.get("val")
    large = isinstance(value, torch.Tensor) and value.numel() > _MAX_FOLD_ELEMENTS
    if large and (node.target not in _BLOCKWISE or cast(torch.Tensor, value).ndim < 2):  # large: a tensor
        return None
    inputs = {n: _evaluate(n, values) for n in node.all_input_nodes}
    if any(v is None for v in inputs.values()):
        return None
    # map_arg puts what the function returns in place of each node: any value, though torch types it as an fx Argument
    args = torch.fx.node.map_arg(node.args, inputs.__getitem__)  # type: ignore[arg-type]  # torch: fn -> Argument
    kwargs = torch.fx.node.map_arg(node.kwargs, inputs.__getitem__)  # type: ignore[arg-type]  # torch: fn -> Argument
    if kwargs.get("device") is not None and torch.device(cast("torch.device | str", kwargs["device"])).type == "meta":
        kwargs = {**kwargs, "device": torch.device("cpu")}  # a model built on the meta device: the mask on the CPU
    if large or any(isinstance(v, _RowBlocks) for v in inputs.values()):
        if node.target not in _BLOCKWISE or value is None or value.ndim < 2:
            return None
        op = cast("Callable[..., torch.Tensor]", node.target)  # a blockwise ATen op
        values[node] = _RowBlocks(op, tuple(args), dict(kwargs), tuple(value.shape), value.dtype)
        return values[node]
    try:
        with torch.no_grad():
            result = cast("Callable[..., object]", node.target)(*args, **kwargs)  # a call_function node's op
    except Exception as error:
        log.debug("attention mask not folded: %s (%s) raised %r", node.name, node.target, error)
        return None
    if not isinstance(result, torch.Tensor):
        return None
    values[node] = result
    return result


def _is_random(target: object) -> bool:
    """Random or mutating ops (``rand*``, ``bernoulli``, dropout, in-place ops) are never evaluated."""
    schema = getattr(target, "_schema", None)
    if schema is not None and schema.is_mutable:
        return True
    name = str(target)
    return any(word in name for word in ("rand", "bernoulli", "dropout", "normal", "uniform", "multinomial"))


def _remove_unused(graph: torch.fx.Graph, candidates: Container[torch.fx.Node]) -> None:
    """Erase the evaluated mask nodes left without users (latest first, so chains go in one pass)."""
    for node in reversed(list(graph.nodes)):
        if node in candidates and not node.users:
            graph.erase_node(node)

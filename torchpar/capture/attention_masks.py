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
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx

from torchpar.capture.meta_models import is_without_data

log = logging.getLogger(__name__)

SDPA = torch.ops.aten.scaled_dot_product_attention.default
_MASK_POSITION = 3
_CAUSAL_POSITION = 5
_MAX_FOLD_ELEMENTS = 1 << 26  # evaluate masks of at most 64 Mi entries at capture time (a 8k × 8k mask is 64 Mi)


def fold_static_attention_masks(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph``'s attention calls whose mask is a causal or all-attending constant (module docstring);
    returns how many calls were rewritten. ``graph`` is modified in place."""
    folded = 0
    values: dict[torch.fx.Node, torch.Tensor] = {}
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
        log.debug("attention %s: constant %s mask %s folded into the call's flags", node.name, kind,
                  tuple(value.shape))
    if folded:
        _remove_unused(graph, values)
        graph.lint()
    return folded


def classify_mask(mask: torch.Tensor, q_len: int, k_len: int) -> str | None:
    """``"full"`` if every query attends every key, ``"causal"`` if exactly ``tril(ones(q_len, k_len))``
    attends (for each leading index), ``None`` for any other mask or one that does not broadcast to
    ``[..., q_len, k_len]``, or a mask without data (a model on the meta device: planning only)."""
    if is_without_data(mask):
        return None
    if mask.ndim < 2 or mask.shape[-2] not in (1, q_len) or mask.shape[-1] not in (1, k_len):
        return None
    attends = _attends(mask)
    if attends is None:
        return None
    attends = attends.expand(*attends.shape[:-2], q_len, k_len)
    if bool(attends.all()):
        return "full"
    if bool((attends == torch.ones(q_len, k_len, dtype=torch.bool).tril()).all()):
        return "causal"
    return None


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


def _mask_arg(node: torch.fx.Node) -> Any:
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


def _evaluate(node: torch.fx.Node, values: dict[torch.fx.Node, torch.Tensor]) -> torch.Tensor | None:
    """The node's value computed with torch on the CPU, its inputs first (``None`` if a node on the way is
    random, too large or fails to run: the mask is then left as data)."""
    if node in values:
        return values[node]
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor) and value.numel() > _MAX_FOLD_ELEMENTS:
        return None
    if _is_random(node.target):
        return None
    inputs = {n: _evaluate(n, values) for n in node.all_input_nodes}
    if any(v is None for v in inputs.values()):
        return None
    args = torch.fx.node.map_arg(node.args, inputs.__getitem__)
    kwargs = torch.fx.node.map_arg(node.kwargs, inputs.__getitem__)
    try:
        with torch.no_grad():
            result = node.target(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 (an op that cannot run eagerly leaves the mask as data)
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


def _remove_unused(graph: torch.fx.Graph, candidates: dict[torch.fx.Node, Any]) -> None:
    """Erase the evaluated mask nodes left without users (latest first, so chains go in one pass)."""
    for node in reversed(list(graph.nodes)):
        if node in candidates and not node.users:
            graph.erase_node(node)

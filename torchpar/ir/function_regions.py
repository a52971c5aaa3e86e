"""Regions of a graph that a custom ``torch.autograd.Function`` computed, whose backward is the Function's own.

Capture (:mod:`torchpar.capture.semantics.autograd_functions`) brackets each call ``F.apply(*args)`` of a Function with
a user-defined backward by identity marker ops: one ``autograd_function_input`` per tensor argument (the Function's
``call`` id and the argument's ``position``) and one ``autograd_function_output`` per tensor result (its position
among the tensor results, and the tensors the Function saved for its backward as extra operands, so they are
graph values). The nodes from the first marker of a call to its last output marker are the Function's forward;
``Graph.custom_backwards[call]`` is its backward as a graph of its own:

- inputs: the saved tensors (in the order of the output markers' saved operands), then one cotangent per tensor
  result of the forward (by position);
- outputs: one per argument of ``apply`` (by position), ``None`` where the backward returns no gradient.

The lowering evaluates a region as one ``jax.custom_vjp`` function whose backward is that graph
(:mod:`jaxbackend.lower`); every pass that cuts a graph (remat groups, pipeline layers and stages) keeps a region
whole. Outside a region (an input marker whose region PyTorch's export pruned) a marker is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

from torchpar.ir.graph import Graph, Ref

FUNCTION_INPUT = "torchpar.autograd_function_input"
"""IR target of a Function's tensor argument: ``(x, call, position)`` → ``x``."""
FUNCTION_OUTPUT = "torchpar.autograd_function_output"
"""IR target of a Function's tensor result: ``(x, saved, call, position)`` → ``x``."""
MARKERS = frozenset({FUNCTION_INPUT, FUNCTION_OUTPUT})


@dataclass(frozen=True)
class FunctionRegion:
    """Nodes ``start:stop`` of a graph: the forward of the Function call ``call``.

    ``inputs``: (argument position, value name) of each tensor argument (the operand of its input marker);
    ``outputs``: (result position, output marker name) of each tensor result still in the graph;
    ``saved``: the value names of the tensors saved for the backward (residuals).
    """

    call: int
    start: int
    stop: int
    inputs: tuple[tuple[int, str], ...]
    outputs: tuple[tuple[int, str], ...]
    saved: tuple[str, ...]

    def node_range(self) -> range:
        return range(self.start, self.stop)


def function_regions(graph: Graph) -> list[FunctionRegion]:
    """The Function regions of ``graph`` in graph order (a call whose output markers are all gone has none).

    Raises ``ValueError`` if two regions overlap (capture never nests them) or a region's backward graph is
    missing."""
    first: dict[int, int] = {}
    last_output: dict[int, int] = {}
    inputs: dict[int, list[tuple[int, str]]] = {}
    outputs: dict[int, list[tuple[int, str]]] = {}
    saved: dict[int, tuple[str, ...]] = {}
    for index, node in enumerate(graph.nodes):
        if node.target not in MARKERS:
            continue
        call, position = int(node.args[-2]), int(node.args[-1])
        first.setdefault(call, index)
        operand = node.args[0]
        assert isinstance(operand, Ref), f"{node.name}: a Function marker reads a tensor"
        if node.target == FUNCTION_INPUT:
            inputs.setdefault(call, []).append((position, operand.name))
        else:
            last_output[call] = index
            outputs.setdefault(call, []).append((position, node.name))
            saved[call] = tuple(ref.name for ref in node.args[1])
    regions = [
        FunctionRegion(call, first[call], stop + 1, tuple(inputs.get(call, ())), tuple(outputs[call]), saved[call])
        for call, stop in last_output.items()
    ]
    regions.sort(key=lambda region: region.start)
    for before, after in zip(regions, regions[1:]):
        if after.start < before.stop:
            raise ValueError(
                f"the regions of autograd.Function calls {before.call} and {after.call} overlap "
                f"(nodes {before.start}:{before.stop} and {after.start}:{after.stop})"
            )
    for region in regions:
        if region.call not in graph.custom_backwards:
            raise ValueError(f"autograd.Function call {region.call} has no backward graph")
    return regions

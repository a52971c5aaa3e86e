"""Cut the IR into pipeline stages: one sub-graph per stage, with activations crossing the cuts.

``slice_stages(graph, stage_of)`` takes a stage index for every node (non-decreasing in graph order)
and returns one :class:`StageGraph` per stage. A stage graph's inputs are the parameters, buffers,
constants and batch inputs its ops read, plus *activations*: values computed by an earlier stage
(IR input kind ``"activation"``, target = the value's name). Its outputs are the activations later
stages read (output kind ``"activation"``), the loss and its reduction mark (``"loss_den"``,
:mod:`torchpar.ir.loss_parts`; both in the last stage, the denominator passed on to it if an earlier stage computes
it), the buffer mutations it computes, and the ``step_fn`` aux values it computes (an aux value that is a batch
input as it is: the last stage's).
Activations only move between neighbouring stages: a value read two stages later passes through the
stage in between (an input that is also an output), so its cotangent flows back the same way.
A parameter read by several stages (tied weights) is an input of each of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from torchpar.ir.function_regions import function_regions
from torchpar.ir.graph import Graph, Input, Node, Output, Ref, TensorMeta


@dataclass
class StageGraph:
    """One stage's sub-graph and what crosses its boundaries."""

    index: int
    graph: Graph
    activation_inputs: tuple[str, ...]
    activation_outputs: tuple[str, ...]
    params: tuple[str, ...]
    batch_inputs: tuple[int, ...]

    @property
    def has_loss(self) -> bool:
        return any(o.kind == "loss" for o in self.graph.outputs)

    def summary(self) -> str:
        flops = self.graph.total_flops
        return (
            f"stage {self.index}: {len(self.graph.nodes)} ops, {flops / 1e9:.3f} GFLOP, params {len(self.params)}, "
            f"in {list(self.activation_inputs)}, out {list(self.activation_outputs)}"
        )


def stage_of_nodes(graph: Graph, layer_of: dict[str, int], stage_layers: list[list[int]]) -> dict[str, int]:
    """Stage index of every node, from its layer and the layers of each stage."""
    stage_of_layer = {layer: s for s, layers in enumerate(stage_layers) for layer in layers}
    missing = set(layer_of.values()) - set(stage_of_layer)
    if missing:
        raise ValueError(f"layers {sorted(missing)} are in no stage")
    return {name: stage_of_layer[layer] for name, layer in layer_of.items()}


def slice_stages(graph: Graph, stage_of: dict[str, int]) -> list[StageGraph]:
    """Split ``graph`` by ``stage_of`` (node name → stage); see the module docstring."""
    stage_of = dict(stage_of)
    producers = {n.name: n for n in graph.nodes}
    for node in graph.nodes:  # a tuple's elements stay with the op that makes the tuple
        if node.target == "getitem":
            source = node.args[0]
            if isinstance(source, Ref) and source.name in producers:
                stage_of[node.name] = stage_of[source.name]
    num_stages = max(stage_of.values()) + 1
    inputs_by_name = {i.name: i for i in graph.inputs}
    metas = graph.metas()
    previous = -1
    for node in graph.nodes:
        stage = stage_of[node.name]
        if stage < previous and node.target != "getitem":
            raise ValueError(
                f"node {node.name} is in stage {stage} after a node of stage {previous}: "
                "stages must be contiguous in graph order"
            )
        previous = max(previous, stage)
        for ref in node.refs():
            if ref in producers and stage_of[ref] > stage:
                raise ValueError(f"{node.name} (stage {stage}) reads {ref} from a later stage {stage_of[ref]}")
    regions = function_regions(graph)
    for region in regions:  # a custom autograd.Function's forward and its own backward stay in one stage
        stages_of_region = {stage_of[graph.nodes[index].name] for index in region.node_range()}
        if len(stages_of_region) > 1:
            node = graph.nodes[region.start]
            raise ValueError(
                f"a pipeline stage boundary falls inside a custom torch.autograd.Function (at "
                f"{node.source or 'an unknown line'}; nodes {region.start}:{region.stop} are in stages "
                f"{sorted(stages_of_region)}): its backward runs as one piece, so the Function must lie "
                "within one stage; move mark_pipeline_boundary out of its forward"
            )
    consumers: dict[str, set[int]] = {}
    for node in graph.nodes:
        for ref in node.refs():
            consumers.setdefault(ref, set()).add(stage_of[node.name])
    # the loss's reduction mark goes with the loss: its denominator is read by the last stage
    marks = [o for o in graph.outputs if o.kind == "loss_den"]
    for mark in marks:
        if mark.value is not None:
            consumers.setdefault(mark.value.name, set()).add(num_stages - 1)
    outputs_by_value: dict[str, list[Output]] = {}
    for out in graph.outputs:
        if out.value is not None and out.kind != "loss_den":
            outputs_by_value.setdefault(out.value.name, []).append(out)
    loss_value = next((o.value.name for o in graph.outputs if o.kind == "loss" and o.value is not None), None)
    if loss_value is not None and loss_value in producers and stage_of[loss_value] != num_stages - 1:
        raise ValueError("the loss must be computed in the last stage")
    defined_in = {n.name: stage_of[n.name] for n in graph.nodes}
    last_use = {name: max(used) for name, used in consumers.items()}
    stages = []
    for s in range(num_stages):
        nodes: list[Node] = [n for n in graph.nodes if stage_of[n.name] == s]
        # activations enter a stage from the one before it; values that skip stages pass through
        activations_in = [v for v, d in defined_in.items() if d < s and last_use.get(v, -1) >= s]
        activations_out = [v for v, d in defined_in.items() if d <= s and last_use.get(v, -1) > s]
        # a tuple's elements stay with its op (getitem above): what crosses stages is a tensor
        stage_inputs: list[Input] = [Input(v, "activation", v, cast(TensorMeta, metas[v])) for v in activations_in]
        seen = set(activations_in)
        for node in nodes:
            for ref in node.refs():
                if ref in inputs_by_name and ref not in seen:
                    seen.add(ref)
                    stage_inputs.append(inputs_by_name[ref])
        outputs: list[Output] = [Output("activation", Ref(name), name) for name in activations_out]
        defined = {n.name for n in nodes}
        for name in defined:
            outputs.extend(outputs_by_value.get(name, []))
        if s == num_stages - 1:  # buffer "mutations" and aux values passing an input through unchanged; the loss's mark
            for out in graph.outputs:
                passes_input = out.value is not None and out.value.name in inputs_by_name
                if (out.kind in ("buffer", "aux") and passes_input) or out.kind == "loss_den":
                    outputs.append(out)
                    if passes_input and out.value is not None and out.value.name not in seen:
                        seen.add(out.value.name)
                        stage_inputs.append(inputs_by_name[out.value.name])
        constants = {i.target: graph.constants[i.target] for i in stage_inputs if i.kind == "constant"}
        backwards = {
            region.call: graph.custom_backwards[region.call]
            for region in regions
            if stage_of[graph.nodes[region.start].name] == s
        }
        sub = Graph(inputs=stage_inputs, nodes=nodes, outputs=outputs, constants=constants, custom_backwards=backwards)
        sub.validate()
        stages.append(
            StageGraph(
                index=s,
                graph=sub,
                activation_inputs=tuple(activations_in),
                activation_outputs=tuple(activations_out),
                params=tuple(dict.fromkeys(i.target for i in stage_inputs if i.kind == "param")),
                batch_inputs=tuple(sorted({int(i.target) for i in stage_inputs if i.kind == "input"})),
            )
        )
    return stages

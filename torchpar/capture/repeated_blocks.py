"""Capturing a deep stack of identical blocks once: trace a few blocks, repeat their IR for the rest.

``torch.export`` and the core-ATen decomposition cost time in proportion to the ops traced: GPT-3 175B (96
blocks) takes 25–65 s on a 2-core machine, most of a planning run, although blocks 1 … 95 are one program applied
to other weights. For a model built on the meta device (planned, never run: :mod:`.meta_models`) with an
``nn.ModuleList`` of at least :data:`MIN_BLOCKS` blocks that are the same program, the model is captured with
only its first :data:`CAPTURED_BLOCKS` blocks and the IR of the missing blocks is written from the captured ones:

- **Same program.** The blocks are one class with the same submodule tree, parameter and buffer shapes, dtypes
  and ``requires_grad``, the same plain attributes (an attribute equal to the block's own index, like HF's
  ``layer_idx``, may differ), no hooks and no shared tensors (:func:`find_block_stack`). The trace then checks
  it: captured blocks 1 and 2 must be the same ops with the same arguments once every reference is mapped
  (block 2's ops read block 1's where block 1's read block 0's, its own weights where block 1 read its own, and
  the same values otherwise), with no layer-dependent scalar between them.
- **Names.** Every name the IR holds follows torch.fx's counters: a node ``view_27`` of block 2 that was
  ``view_14`` in block 1 is ``view_{14 + 13·(j−1)}`` in block ``j``; a parameter ``p_model_h_2_ln_1_weight`` is
  ``p_model_h_{j}_ln_1_weight``; a lifted constant's counter advances by its stride the same way; ops after the
  blocks shift their counters by the ops the missing blocks add. The result is the graph a whole capture gives,
  names included, so a plan made on it applies to the model with weights (``Plan.layer_of_node``);
  ``tests/capture/test_repeated_blocks.py`` compares the two graphs op by op on GPT-2, Llama and Mixtral.

Anything outside that shape (ops between blocks, an op after the blocks reading an early block, a block that
reads two blocks back, a constant after the blocks, custom ``autograd.Function`` calls) makes
:func:`expand_blocks` return ``None`` and the caller captures the whole model as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator, Sequence
from typing import cast

import torch

from torchpar.ir.graph import Graph, Input, Node, Ref, map_refs

MIN_BLOCKS = 6
"""Stacks at least this deep are captured from :data:`CAPTURED_BLOCKS` blocks (shallower ones gain little)."""
CAPTURED_BLOCKS = 3
"""Blocks traced: block 0 feeds block 1, block 1 feeds block 2, so blocks 1 → 2 show how block j−1 → j reads."""

_DIGITS = re.compile(r"(\d+)")
_SUFFIX = re.compile(r"^(.*)_(\d+)$")
_PLAIN = (bool, int, float, str, type(None))


@dataclasses.dataclass(frozen=True)
class BlockStack:
    """``model.get_submodule(path)`` is an ``nn.ModuleList`` of ``count`` blocks that are one program."""

    path: str
    count: int


def find_block_stack(model: torch.nn.Module) -> BlockStack | None:
    """The ``nn.ModuleList`` of at least :data:`MIN_BLOCKS` same-program blocks (module docstring) holding the
    most parameters, or ``None``."""
    best: tuple[int, BlockStack] | None = None
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < MIN_BLOCKS:
            continue
        blocks = list(module)
        attributes: Sequence[dict[tuple[str, str], object] | None] = [_attributes(block) for block in blocks]
        if any(a is None for a in attributes):
            continue
        attributes = cast("Sequence[dict[tuple[str, str], object]]", attributes)  # none is None: checked above
        index_keys = {
            key
            for key in attributes[0]
            if all(type(a.get(key)) is int and a[key] == i for i, a in enumerate(attributes))
        }
        signatures = [_signature(block, a, index_keys) for block, a in zip(blocks, attributes)]
        if any(s != signatures[0] for s in signatures):
            continue
        tensors = [id(t) for block in blocks for t in (*block.parameters(), *block.buffers())]
        if len(set(tensors)) != len(tensors):
            continue  # blocks share weights: a whole capture lists them once
        size = sum(p.numel() for p in module.parameters())
        if best is None or size > best[0]:
            best = (size, BlockStack(path, len(blocks)))
    return None if best is None else best[1]


def _attributes(block: torch.nn.Module) -> dict[tuple[str, str], object] | None:
    """Every plain attribute of ``block`` and its submodules by (submodule name, attribute), or ``None`` if a
    submodule has hooks."""
    found: dict[tuple[str, str], object] = {}
    for name, module in block.named_modules():
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
            return None
        found.update(
            ((name, key), value)
            for key, value in vars(module).items()
            if not key.startswith("_") and isinstance(value, _PLAIN)
        )
    return found


def _signature(block: torch.nn.Module, attributes: dict[tuple[str, str], object], index_keys: set) -> tuple:
    """What makes ``block`` the program it is: submodule classes, plain attributes (those in ``index_keys``, the
    block's place in the stack like HF's ``layer_idx``, left out), parameter and buffer shapes."""
    return (
        tuple((name, type(module).__qualname__) for name, module in block.named_modules()),
        tuple(sorted((key, repr(value)) for key, value in attributes.items() if key not in index_keys)),
        tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in block.named_parameters()),
        tuple((name, tuple(b.shape), b.dtype) for name, b in block.named_buffers()),
    )


@contextlib.contextmanager
def truncated(model: torch.nn.Module, stack: BlockStack, keep: int = CAPTURED_BLOCKS) -> Iterator[None]:
    """Inside: the stack holds only its first ``keep`` blocks; on exit all of them again."""
    parent_path, _, name = stack.path.rpartition(".")
    parent = model.get_submodule(parent_path)
    whole = getattr(parent, name)
    setattr(parent, name, torch.nn.ModuleList(list(whole)[:keep]))
    try:
        yield
    finally:
        setattr(parent, name, whole)


def expand_blocks(graph: Graph, stack: BlockStack) -> Graph | None:
    """The graph of the whole stack from ``graph``, captured with its first :data:`CAPTURED_BLOCKS` blocks; ``None``
    when the captured graph is not in the shape the module docstring states (the caller then captures everything)."""
    if graph.custom_backwards or stack.count <= CAPTURED_BLOCKS:
        return None
    try:
        return _Expansion(graph, stack).run()
    except _NotRepeatable:
        return None


class _NotRepeatable(Exception):
    """The captured graph is not a repeatable stack (internal: :func:`expand_blocks` returns ``None``)."""


def _require(condition: bool) -> None:
    if not condition:
        raise _NotRepeatable


def _extrapolate(first: str, second: str, steps: int) -> str:
    """``second`` advanced ``steps`` more times by what changed from ``first`` to it, number by number
    (``"h_1_ln_1"``, ``"h_2_ln_1"``, 3 → ``"h_5_ln_1"``)."""
    a, b = _DIGITS.split(first), _DIGITS.split(second)
    _require(len(a) == len(b) and a[0::2] == b[0::2])
    out = list(b)
    for i in range(1, len(b), 2):
        value = int(b[i]) + steps * (int(b[i]) - int(a[i]))
        _require(
            value >= 0 and (a[i] == b[i] or (len(a[i]) == len(str(int(a[i]))) and len(b[i]) == len(str(int(b[i])))))
        )
        out[i] = str(value)
    return "".join(out)


class _Expansion:
    def __init__(self, graph: Graph, stack: BlockStack):
        self.graph, self.stack = graph, stack
        self.missing = stack.count - CAPTURED_BLOCKS  # blocks 3 … count−1

    def _block_of_path(self, path: str) -> int | None:
        prefix = self.stack.path + "."
        if not path.startswith(prefix):
            return None
        head = path[len(prefix) :].split(".", 1)[0]
        return int(head) if head.isdigit() else None

    def run(self) -> Graph:
        graph = self.graph
        block_of = [self._block_of_path(n.module_path) for n in graph.nodes]
        positions = [i for i, b in enumerate(block_of) if b is not None]
        _require(bool(positions))
        start, stop = positions[0], positions[-1] + 1
        runs = block_of[start:stop]
        _require(
            all(b is not None for b in runs) and runs == sorted(cast("list[int]", runs)) and set(runs) == {0, 1, 2}
        )
        pre, post = graph.nodes[:start], graph.nodes[stop:]
        blocks = [[n for n, b in zip(graph.nodes[start:stop], runs) if b == k] for k in range(3)]
        _require(len(blocks[1]) == len(blocks[2]))
        inputs = [[i for i in graph.inputs if self._block_of_path(i.target) == k] for k in range(3)]
        _require(len(inputs[1]) == len(inputs[2]) and all(i.kind != "input" for k in inputs for i in k))
        node_pos = [{n.name: p for p, n in enumerate(nodes)} for nodes in blocks]
        input_pos = [{i.name: p for p, i in enumerate(items)} for items in inputs]

        def role(name: str, block: int) -> tuple:
            """How a reference made from block ``block`` reads ``name``, relative to that block."""
            if name in node_pos[block]:
                return ("own", node_pos[block][name])
            if block > 0 and name in node_pos[block - 1]:
                return ("previous", node_pos[block - 1][name])
            if name in input_pos[block]:
                return ("weight", input_pos[block][name])
            _require(not any(name in table for table in (*node_pos, *input_pos)))
            return ("shared", name)

        def pattern(value: object, block: int) -> object:
            return map_refs(value, lambda ref: role(ref.name, block))

        for one, two in zip(blocks[1], blocks[2]):
            _require(
                one.target == two.target and one.out == two.out and one.source == two.source and one.flops == two.flops
            )
            _require(pattern(one.args, 1) == pattern(two.args, 2) and pattern(one.kwargs, 1) == pattern(two.kwargs, 2))
            _require(_extrapolate(one.module_path, two.module_path, 0) == two.module_path)
        for one_input, two_input in zip(inputs[1], inputs[2]):
            _require(one_input.kind == two_input.kind and one_input.meta == two_input.meta)

        # torch.fx name counters: the stride of each base name per block, from block 1 → 2
        stride: dict[str, int] = {}
        for one, two in zip(blocks[1], blocks[2]):
            a, b = _SUFFIX.match(one.name), _SUFFIX.match(two.name)
            _require(a is not None and b is not None and a.group(1) == b.group(1))
            assert a is not None and b is not None  # required just above
            step = int(b.group(2)) - int(a.group(2))
            _require(stride.setdefault(a.group(1), step) == step and step > 0)

        # blocks 3 … count−1: block 2 advanced, reading the block before it
        names = [{n.name: n.name for n in blocks[2]}]  # per block from 2: captured name → that block's name
        new_inputs: list[list[Input]] = []
        new_nodes: list[Node] = []
        constants = dict(graph.constants)
        for steps in range(1, self.missing + 1):
            weight_names: dict[str, str] = {}
            block_inputs = []
            for one_input, two_input in zip(inputs[1], inputs[2]):
                made = dataclasses.replace(
                    two_input,
                    name=_extrapolate(one_input.name, two_input.name, steps),
                    target=_extrapolate(one_input.target, two_input.target, steps),
                )
                if two_input.kind == "constant":
                    constants[made.target] = graph.constants[two_input.target]
                weight_names[two_input.name] = made.name
                block_inputs.append(made)
            new_inputs.append(block_inputs)
            node_names = {two.name: _extrapolate(one.name, two.name, steps) for one, two in zip(blocks[1], blocks[2])}
            previous = names[-1]

            def advanced(ref: Ref, node_names=node_names, weight_names=weight_names, previous=previous) -> Ref:
                """A reference of block 2 as this block makes it."""
                if ref.name in node_names:
                    return Ref(node_names[ref.name])
                if ref.name in node_pos[1]:  # block 1's op: the block before this one
                    return Ref(previous[blocks[2][node_pos[1][ref.name]].name])
                return Ref(weight_names.get(ref.name, ref.name))

            for one, two in zip(blocks[1], blocks[2]):
                new_nodes.append(
                    dataclasses.replace(
                        two,
                        name=node_names[two.name],
                        args=map_refs(two.args, advanced),
                        kwargs=map_refs(two.kwargs, advanced),
                        module_path=_extrapolate(one.module_path, two.module_path, steps),
                    )
                )
            names.append(node_names)

        # after the blocks: names shifted past the added ops; reads of block 2 read the last block
        last = names[-1]
        block_names = {n.name for k in range(3) for n in blocks[k]}
        shifted: dict[str, str] = {}
        for node in post:
            match = _SUFFIX.match(node.name)
            base = match.group(1) if match else node.name
            if base in stride:
                _require(match is not None)
                assert match is not None  # required just above
                shifted[node.name] = f"{base}_{int(match.group(2)) + self.missing * stride[base]}"
            else:
                shifted[node.name] = node.name

        def after(ref: Ref) -> Ref:
            """A reference made after the blocks, in the whole graph."""
            if ref.name in shifted:
                return Ref(shifted[ref.name])
            if ref.name in block_names:
                _require(ref.name in last)
                return Ref(last[ref.name])
            return ref

        post_nodes = [
            dataclasses.replace(n, name=shifted[n.name], args=map_refs(n.args, after), kwargs=map_refs(n.kwargs, after))
            for n in post
        ]
        _require(all(self._block_of_path(o.target) is None for o in graph.outputs))  # a block's buffer update
        outputs = [dataclasses.replace(o, value=map_refs(o.value, after)) for o in graph.outputs]
        block_input_names = {i.name for k in inputs for i in k}
        for item in graph.inputs:  # a lifted constant outside the blocks would need its counter shifted: not handled
            _require(item.kind != "constant" or item.name in block_input_names)

        # inputs: each kind's added blocks after block 2's last input of that kind
        ordered: list[Input] = []
        last_of_kind = {i.kind: i.name for i in inputs[2]}
        for item in graph.inputs:
            ordered.append(item)
            if last_of_kind.get(item.kind) == item.name:
                ordered.extend(i for block in new_inputs for i in block if i.kind == item.kind)
        nodes = [*pre, *graph.nodes[start:stop], *new_nodes, *post_nodes]
        _require(len({n.name for n in nodes}) == len(nodes))
        expanded = graph.replace(inputs=ordered, nodes=nodes, outputs=outputs, constants=constants)
        expanded.validate()
        return expanded

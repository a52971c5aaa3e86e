"""The reduction of an exported program to core ATen (:func:`decompose`): PyTorch's decomposition table split once per
process instead of once per capture, and a program already reduced in this process not retraced again.

``ExportedProgram.run_decompositions(table)`` does two things: it splits ``table`` into the CompositeImplicitAutograd
(CIA) ops it overrides and the Python decompositions AOT dispatch applies — materializing the table and walking every
op namespace of the dispatcher, about 0.1 s of fixed cost — and then retraces the program with them
(``_decompose_exported_program``). The split depends only on the ops and decompositions registered in this process,
not on the program, so :func:`decompose` computes it once per registry state (:func:`_registry_state`: op namespaces,
CIA kernels, decompositions) and retraces with a copy of it: the same two calls ``run_decompositions`` makes, in the
same order, so the same graph (``tests/capture/test_decompositions.py`` compares them op by op). A torch whose private
functions are not those this module calls takes the public ``run_decompositions`` path.

The retrace (seconds for a transformer) is a function of the program's graph — every node's op, target, arguments and
metadata, the placeholders' fake tensors included — its signature and call graph, the registry state and the ambient
autocast and grad modes; not of the values of its parameters, buffers or constants, which it carries through as they
are. So :func:`decompose` keys each retraced graph by a fingerprint of all of that (:func:`_fingerprint`) and keeps
the last :data:`DECOMPOSED_KEPT`: an export with the same fingerprint (the same model captured again on the same batch
shapes: a second engine, the eval forward of a fresh copy, a test's reference) gets a copy of the kept graph with its
own state and constants, the program the retrace would have returned. Programs the fingerprint cannot vouch for —
a ``get_attr`` (a subgraph or tensor held by the graph module) or a retrace that lifted new constants — are retraced
every time. What is kept is the graph and its signature, never a parameter or buffer.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import logging
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import ExportGraphSignature

log = logging.getLogger(__name__)

KEEP_UNDECOMPOSED = ("scaled_dot_product_attention.default",)
"""Ops kept whole instead of decomposed to core ATen (each has a direct lowering)."""

OpTable = dict[torch._ops.OperatorBase, Callable]


@dataclass(frozen=True)
class _Split:
    """The decomposition table split as ``run_decompositions`` splits it, and the registry state it was made in."""

    state: tuple[int, ...]
    cia_to_decomp: OpTable
    python_table: OpTable


_cached: list[_Split] = []  # at most one: the split of the current registry state


def decompose(exported: ExportedProgram) -> ExportedProgram:
    """``exported`` reduced to core ATen by PyTorch's default decompositions, except :data:`KEEP_UNDECOMPOSED`; the
    result ``exported.run_decompositions(table)`` returns for that table. The caller owns the returned graph (it may
    rewrite it in place): a kept graph is handed out as a copy."""
    with warnings.catch_warnings():  # torch's own deprecation inside run_decompositions (torch 2.13), not the user's
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
        )
        private = _private_functions()
        if private is None:
            return exported.run_decompositions(_table())
        split_table, decompose_program = private
        split = _split(split_table)
        key = _fingerprint(exported, split.state)
        kept = _kept(key) if key is not None else None
        if kept is not None:
            log.debug("core ATen graph of fingerprint %s reused (%d nodes)", key, len(kept.graph.nodes))
            return kept.program(exported)
        decomposed = _retraced(exported, split, decompose_program)
        if key is not None and _keepable(decomposed, exported):
            _keep(key, _Decomposed.of(decomposed))
        return decomposed


def _retraced(
    exported: ExportedProgram, split: _Split, decompose_program: Callable[..., ExportedProgram]
) -> ExportedProgram:
    """``run_decompositions``' retrace of ``exported`` with the process's split of the table."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # as run_decompositions' decorator
        return decompose_program(
            exported,
            cia_to_decomp=dict(split.cia_to_decomp),
            python_decomp_table=dict(split.python_table),
            joint_loss_index=None,
            decompose_custom_triton_ops=False,
        )


DECOMPOSED_KEPT = 16
"""Retraced graphs kept per process (the least recently used is dropped first)."""


@dataclass(frozen=True)
class _Decomposed:
    """A retraced graph without the state it was retraced with; :meth:`program` binds it to an export's state."""

    graph_module: torch.fx.GraphModule
    signature: ExportGraphSignature
    range_constraints: dict
    module_call_graph: list
    verifiers: list

    @property
    def graph(self) -> torch.fx.Graph:
        return self.graph_module.graph

    @classmethod
    def of(cls, program: ExportedProgram) -> _Decomposed:
        graph_module = torch.fx.GraphModule(program.graph_module, copy.deepcopy(program.graph))
        return cls(
            graph_module,
            copy.deepcopy(program.graph_signature),
            dict(program.range_constraints),
            copy.deepcopy(program.module_call_graph),
            list(program.verifiers),
        )

    def program(self, exported: ExportedProgram) -> ExportedProgram:
        """The kept graph (a copy: nodes new, their metadata shared) over ``exported``'s parameters, buffers and
        constants: what retracing ``exported`` returns."""
        graph_module = torch.fx.GraphModule(self.graph_module, copy.deepcopy(self.graph))
        return ExportedProgram(
            root=graph_module,
            graph=graph_module.graph,
            graph_signature=copy.deepcopy(self.signature),
            state_dict=exported.state_dict,
            range_constraints=dict(self.range_constraints),
            module_call_graph=copy.deepcopy(self.module_call_graph),
            example_inputs=exported.example_inputs,
            constants=exported.constants,
            verifiers=list(self.verifiers),
        )


_decomposed: OrderedDict[str, _Decomposed] = OrderedDict()  # by fingerprint, least recently used first
_decomposed_lock = threading.Lock()  # captures may run on several threads (an engine's forward, a trainer's)


def _kept(key: str) -> _Decomposed | None:
    with _decomposed_lock:
        kept = _decomposed.get(key)
        if kept is not None:
            _decomposed.move_to_end(key)
        return kept


def _keep(key: str, decomposed: _Decomposed) -> None:
    with _decomposed_lock:
        _decomposed[key] = decomposed
        while len(_decomposed) > DECOMPOSED_KEPT:
            _decomposed.popitem(last=False)


def _keepable(decomposed: ExportedProgram, exported: ExportedProgram) -> bool:
    """Whether ``decomposed`` is bound to ``exported``'s state only through its signature: no ``get_attr`` in its
    graph, and the constants it carries are the export's (the retrace lifted none)."""
    no_attributes = all(node.op != "get_attr" for node in decomposed.graph.nodes)
    return no_attributes and set(decomposed.constants) == set(exported.constants)


def _fingerprint(exported: ExportedProgram, registry_state: tuple[int, ...]) -> str | None:
    """A digest of everything the retrace of ``exported`` with the split made in ``registry_state`` depends on (module
    docstring), or ``None`` when the graph holds a ``get_attr`` (its target's contents are not in the digest)."""
    digest = hashlib.blake2b(digest_size=20)

    def put(part: object) -> None:
        digest.update(repr(part).encode())
        digest.update(b"\0")

    put(registry_state)
    put(_ambient_modes())
    put(str(exported.graph_signature))
    put(exported.range_constraints)
    put([(entry.fqn, str(entry.signature)) for entry in exported.module_call_graph])
    for node in exported.graph.nodes:
        if node.op == "get_attr":
            return None
        put((node.op, node.name, _target_identity(node.target), _described(node.args), _described(node.kwargs)))
        put(sorted((key, _described(value)) for key, value in node.meta.items()))
    return digest.hexdigest()


def _ambient_modes() -> tuple[object, ...]:
    """Grad mode and, per device type, whether autocast is on and to which dtype: the retrace runs under them."""
    autocast = tuple(
        (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
    )
    return (torch.is_grad_enabled(), autocast)


def _target_identity(target: object) -> str:
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', None) or target}"


def _described(value: object) -> object:
    """``value`` with nodes named and tensors (fake or real) described by their metadata, recursively through
    containers; other values as they are (their ``repr`` goes into the digest)."""
    if isinstance(value, torch.fx.Node):
        return ("node", value.name)
    if isinstance(value, torch.Tensor):
        return (
            type(value).__name__,
            tuple(value.shape),
            value.dtype,
            value.layout,
            value.device,
            value.stride() if value.layout == torch.strided else None,
            value.storage_offset() if value.layout == torch.strided else None,
            value.requires_grad,
        )
    if isinstance(value, dict):
        return tuple((key, _described(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_described(item) for item in value))
    return value


def _table() -> OpTable:
    """PyTorch's default (core ATen) decompositions, materialized, without :data:`KEEP_UNDECOMPOSED`."""
    table = torch.export.default_decompositions()
    for op in list(table):
        if str(op).removeprefix("aten.") in KEEP_UNDECOMPOSED:
            del table[op]
    return dict(table.items())


def _split(split_table: Callable[[OpTable], tuple[OpTable, OpTable]]) -> _Split:
    state = _registry_state()
    while not _cached or _cached[0].state != state:
        # splitting names op namespaces the dispatcher had not named yet: split until it names none
        cia_to_decomp, python_table = split_table(_table())
        _cached[:] = [_Split(state, cia_to_decomp, python_table)]
        state = _registry_state()
        log.debug(
            "core ATen decompositions split: %d CIA ops, %d Python decompositions",
            len(cia_to_decomp),
            len(python_table),
        )
    return _cached[0]


def _registry_state() -> tuple[int, ...]:
    """What the split depends on, counted: the dispatcher's op namespaces, its CompositeImplicitAutograd kernels and
    PyTorch's registered decompositions. Registering a custom op or a decomposition changes it."""
    cia_kernels = torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")
    return (len(torch.ops._dir), len(cia_kernels), len(torch._decomp.global_decomposition_table["post_autograd"]))


@functools.cache
def _private_functions() -> tuple[Callable, Callable] | None:
    """``run_decompositions``' two steps, if this torch has them with the parameters :func:`decompose` passes."""
    try:
        from torch.export.exported_program import (
            _decompose_exported_program,
            _split_decomp_table_to_cia_and_python_decomp,
        )
    except ImportError:
        return None
    wanted = {"cia_to_decomp", "python_decomp_table", "joint_loss_index", "decompose_custom_triton_ops"}
    if not wanted <= set(inspect.signature(_decompose_exported_program).parameters):
        return None
    return _split_decomp_table_to_cia_and_python_decomp, _decompose_exported_program

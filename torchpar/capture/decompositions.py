"""The reduction of an exported program to core ATen (:func:`decompose`), with PyTorch's decomposition table split
once per process instead of once per capture.

``ExportedProgram.run_decompositions(table)`` does two things: it splits ``table`` into the CompositeImplicitAutograd
(CIA) ops it overrides and the Python decompositions AOT dispatch applies — materializing the table and walking every
op namespace of the dispatcher, about 0.1 s of fixed cost — and then retraces the program with them
(``_decompose_exported_program``). The split depends only on the ops and decompositions registered in this process,
not on the program, so :func:`decompose` computes it once per registry state (:func:`_registry_state`: op namespaces,
CIA kernels, decompositions) and retraces with a copy of it: the same two calls ``run_decompositions`` makes, in the
same order, so the same graph (``tests/capture/test_decompositions.py`` compares them op by op). A torch whose private
functions are not those this module calls takes the public ``run_decompositions`` path.
"""

from __future__ import annotations

import functools
import inspect
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.export import ExportedProgram

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
    result ``exported.run_decompositions(table)`` returns for that table."""
    with warnings.catch_warnings():  # torch's own deprecation inside run_decompositions (torch 2.13), not the user's
        warnings.filterwarnings(
            "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
        )
        private = _private_functions()
        if private is None:
            return exported.run_decompositions(_table())
        split_table, decompose_program = private
        split = _split(split_table)
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # as run_decompositions' decorator
            return decompose_program(
                exported,
                cia_to_decomp=dict(split.cia_to_decomp),
                python_decomp_table=dict(split.python_table),
                joint_loss_index=None,
                decompose_custom_triton_ops=False,
            )


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

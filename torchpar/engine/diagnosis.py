"""Where a non-finite step came from, asked from the driver: ``engine.locate_nonfinite(batch)`` and the automatic
diagnosis behind ``on_nonfinite="raise"``. The re-run itself (state exported from the workers, the step's graph
run op by op on this process) is :func:`torchpar.runtime.nonfinite.locate_nonfinite`; this module feeds it one
micro-batch at a time and decides whether the state is small enough to re-run without being asked."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from torchpar.engine.batches import call_leaves, split_leaves
from torchpar.engine.guard import leaf_names
from torchpar.engine.host_arrays import host_tensor
from torchpar.ir.graph import Graph
from torchpar.runtime.nonfinite import AUTO_DIAGNOSIS_BYTES, locate_nonfinite

if TYPE_CHECKING:
    import jax

    from torchpar.runtime.state import HostState


def locate(
    graph: Graph, trainable: Sequence[str], state: HostState, batch: object, key: jax.Array, num_micro_batches: int
) -> str:
    """Re-run the step ``graph`` on each of ``batch``'s ``num_micro_batches`` micro-batches with ``state`` (a
    :class:`~torchpar.runtime.state.HostState`) and PRNG ``key``; the first culprit's description, or that the
    re-run is finite."""
    leaves = [host_tensor(leaf) for leaf in call_leaves(batch)]
    names = leaf_names(batch)
    for micro in split_leaves(leaves, num_micro_batches):
        culprit = locate_nonfinite(graph, trainable, state.params, state.buffers, micro, names, key)
        if culprit is not None:
            return culprit.text
    return "the re-run on this process is finite (the inf/nan did not reproduce)"


def culprit(params: Mapping[str, torch.Tensor], rerun: Callable[[], str]) -> str:
    """The diagnostic re-run's answer (``rerun()``), when the state (``params``' bytes) is small enough to re-run on
    the driver; else how to ask for it."""
    state_bytes = sum(p.numel() * p.element_size() for p in params.values())
    if state_bytes > AUTO_DIAGNOSIS_BYTES:
        return (
            f"the state ({state_bytes / 2**30:.1f} GiB) is too large for an automatic re-run on the driver: "
            "call engine.locate_nonfinite(batch) to find the first op"
        )
    return rerun()

"""The training state on the host: what goes into an executor and what comes back out.

:class:`HostState` is the state as numpy arrays (what ``engine.state_dict`` and ``sync_to_torch`` read and
``load_state_dict`` writes). Workers export their share of it as :class:`Exported` entries — a whole
array, or the pieces of a sharded one that this process owns (:mod:`.arrays`) — and
:func:`collect_state` puts every process's entries together. A parameter held by several pipeline stages
(tied weights) is taken from the first stage holding it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias, cast

import numpy as np

from torchpar.runtime.arrays import Piece, assemble, put, to_host

if TYPE_CHECKING:
    import jax

EntryName: TypeAlias = str | tuple[str, str]
"""A state entry's name: a parameter's or buffer's, or ``(parameter, state key)`` for optimizer state."""


@dataclass
class HostState:
    """Parameters and buffers by name, optimizer state by parameter name and state key, as host arrays."""

    params: dict[str, np.ndarray] = field(default_factory=dict)
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    opt_state: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

    def place(self, kind: str, name: EntryName, sharding: jax.sharding.Sharding) -> jax.Array:
        """One array laid out as ``sharding`` (what ``Worker.load`` calls; a checkpoint on disk answers the same
        call, reading only its devices' slices: :class:`~.checkpoint_io.CheckpointSource`)."""
        if kind == "param":
            return put(self.params[cast(str, name)], sharding)
        if kind == "buffer":
            return put(self.buffers[cast(str, name)], sharding)
        return put(self.opt_state[name[0]][name[1]], sharding)


@dataclass(frozen=True)
class Exported:
    """One array of one stage, as held by one process: ``kind`` is ``"param"``, ``"buffer"`` or ``"state"``
    (``name`` is then ``(parameter, key)``); ``payload`` the whole array or this process's pieces."""

    stage: int
    kind: str
    name: EntryName
    shape: tuple[int, ...]
    dtype: np.dtype
    payload: np.ndarray | list[Piece]


def export_arrays(
    stage: int,
    params: Mapping[str, jax.Array],
    buffers: Mapping[str, jax.Array],
    opt_state: Mapping[str, Mapping[str, jax.Array]],
    kinds: tuple[str, ...] = ("param", "buffer", "state"),
) -> list[Exported]:
    """This process's share of one stage's state (see :class:`Exported`), of the ``kinds`` asked for."""
    entries = [
        Exported(stage, "param", n, tuple(v.shape), v.dtype, to_host(v)) for n, v in params.items() if "param" in kinds
    ]
    entries += [
        Exported(stage, "buffer", n, tuple(v.shape), v.dtype, to_host(v))
        for n, v in buffers.items()
        if "buffer" in kinds
    ]
    entries += [
        Exported(stage, "state", (n, k), tuple(v.shape), v.dtype, to_host(v))
        for n, keys in opt_state.items()
        for k, v in keys.items()
        if "state" in kinds
    ]
    return entries


def collect_state(entries: Iterable[Exported]) -> HostState:
    """Every process's :class:`Exported` entries → one :class:`HostState`."""
    first_stage: dict[tuple[str, EntryName], int] = {}
    grouped: dict[tuple[int, str, EntryName], list[Exported]] = {}
    for entry in entries:
        key = (entry.kind, entry.name)
        first_stage[key] = min(first_stage.get(key, entry.stage), entry.stage)
        grouped.setdefault((entry.stage, entry.kind, entry.name), []).append(entry)
    state = HostState()
    for (kind, name), stage in first_stage.items():
        parts = grouped[(stage, kind, name)]
        whole = next((p.payload for p in parts if isinstance(p.payload, np.ndarray)), None)
        value = (
            whole
            if whole is not None
            else assemble(parts[0].shape, parts[0].dtype, [piece for p in parts for piece in p.payload])
        )
        if kind == "param":
            state.params[cast(str, name)] = value
        elif kind == "buffer":
            state.buffers[cast(str, name)] = value
        else:
            state.opt_state.setdefault(name[0], {})[name[1]] = value
    return state

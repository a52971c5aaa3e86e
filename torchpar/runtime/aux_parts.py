"""The whole batch's auxiliary outputs (a ``step_fn``'s ``aux`` dict) from the batch's parts, for every way a step
cuts the batch.

Each aux output of a graph carries its combination rule (``Output.combine``, :mod:`torchpar.ir.aux_parts`):
``"rows"`` concatenates the parts' rows in batch order, ``"mean"`` / ``"sum"`` average / add the parts' scalars,
``"same"`` keeps the first part's; ``""`` (one part) keeps the value as it is. Where the parts' rows lie decides how:

- one-stage gradient accumulation (:func:`.train_step.accumulate`): micro-batch ``m`` holds rows ``m, m+M, m+2M, …``
  (:func:`.train_step.micro_batches`), so ``"rows"`` interleaves the stacked ``[M, B/M, …]`` values back into
  ``[B, …]`` (:meth:`AuxOutputs.over_micro_batches`, inside the executable);
- data replicas (:func:`.train_step.over_data_replicas`): replica ``r`` holds the ``r``-th block of rows, so
  ``"rows"`` is a tiled all-gather, ``"mean"`` a ``pmean``, ``"sum"`` a ``psum`` (:meth:`AuxOutputs.over_replicas`);
- pipelines: micro-batch ``m`` is the ``m``-th block of rows (:func:`.executor.split_micro_batches`); each stage
  returns the aux values it computes, per micro-batch, and the driver combines host copies (:func:`combine_blocks`).

Means are taken in float32 (float64 on the host) and cast back to the value's dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from torchpar.ir.aux_parts import AUX
from torchpar.ir.graph import Graph

if TYPE_CHECKING:
    import jax


@dataclass(frozen=True)
class AuxOutputs:
    """A lowered graph's aux outputs: each key, its position among the lowered function's (non-buffer) outputs and
    its combination rule."""

    keys: tuple[str, ...] = ()
    positions: tuple[int, ...] = ()
    rules: tuple[str, ...] = ()

    @classmethod
    def of(cls, graph: Graph) -> AuxOutputs:
        values = [o for o in graph.outputs if o.kind != "buffer"]
        entries = [(o.target, i, o.combine) for i, o in enumerate(values) if o.kind == AUX]
        return cls(*(tuple(column) for column in zip(*entries))) if entries else cls()

    def pick(self, outputs: Sequence[jax.Array]) -> dict[str, jax.Array]:
        """The aux values among the lowered outputs, by key."""
        return {key: outputs[position] for key, position in zip(self.keys, self.positions)}

    # --- in the executables (JAX) ---------------------------------------------------------------------------

    def over_micro_batches(self, stacked: Mapping[str, jax.Array], num_micro_batches: int) -> dict[str, jax.Array]:
        """The whole batch's values from each key's ``[M, …]`` stack of micro-batch values (micro-batch ``m`` holding
        rows ``m, m+M, …``)."""
        import jax.numpy as jnp

        out = {}
        for key, rule in zip(self.keys, self.rules):
            x = stacked[key]
            if rule == "rows":
                out[key] = x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])
            elif rule == "mean":
                out[key] = (jnp.sum(x.astype(jnp.float32), axis=0) / num_micro_batches).astype(x.dtype)
            elif rule == "sum":
                out[key] = _sum(x)
            else:
                assert rule == "same", f"aux[{key!r}] over {num_micro_batches} micro-batches has no rule ({rule!r})"
                out[key] = x[0]
        return out

    def over_replicas(self, aux: Mapping[str, jax.Array], axis: str) -> dict[str, jax.Array]:
        """The whole batch's values from each data replica's (inside a ``shard_map`` manual over ``axis``, replica ``r``
        holding the ``r``-th block of the rows)."""
        import jax
        import jax.numpy as jnp

        out = {}
        for key, rule in zip(self.keys, self.rules):
            x = aux[key]
            if rule == "rows":
                out[key] = jax.lax.all_gather(x, axis, tiled=True)
            elif rule == "mean":
                out[key] = jax.lax.pmean(x.astype(jnp.float32), axis).astype(x.dtype)
            elif rule == "sum":
                out[key] = jax.lax.psum(x, axis)
            else:
                assert rule == "same", f"aux[{key!r}] over data replicas has no rule ({rule!r})"
                out[key] = x
        return out


def _sum(x: jax.Array) -> jax.Array:
    import jax.numpy as jnp

    if jnp.issubdtype(x.dtype, jnp.floating):
        return jnp.sum(x.astype(jnp.float32), axis=0).astype(x.dtype)
    return jnp.sum(x, axis=0, dtype=x.dtype)


# --- on the host (pipelines) -------------------------------------------------------------------------------------


def combine_blocks(rules: Mapping[str, str], parts: Mapping[str, Sequence[np.ndarray]]) -> dict[str, np.ndarray]:
    """The whole batch's values from each key's per-micro-batch host values, micro-batch ``m`` holding the ``m``-th
    block of rows (a pipeline's); one part is returned as it is."""
    out = {}
    for key, values in parts.items():
        rule = rules[key]
        if len(values) == 1:
            out[key] = np.asarray(values[0])
        elif rule == "rows":
            out[key] = np.concatenate(values, axis=0)
        elif rule in ("mean", "sum"):
            dtype = np.asarray(values[0]).dtype
            wide = np.float64 if np.issubdtype(dtype, np.floating) or dtype.name == "bfloat16" else None
            stacked = np.stack([np.asarray(v, dtype=wide) for v in values])
            total = stacked.mean(axis=0) if rule == "mean" else stacked.sum(axis=0)
            out[key] = np.asarray(total).astype(dtype)
        else:
            assert rule == "same", f"aux[{key!r}] over {len(values)} micro-batches has no rule ({rule!r})"
            out[key] = np.asarray(values[0])
    return out


__all__ = ["AuxOutputs", "combine_blocks"]

"""Finishing a pipeline's gradients across stages: tied parameters and the global clipping norm.

After its last backward every stage holds the gradients it accumulated. Two things need other stages:

- a parameter held by several stages (tied weights, e.g. GPT-2's embedding and LM head) gets the sum of
  their gradients: :func:`exchange_tied_gradients` sends each stage's part to the others holding it and
  adds the parts in stage order, so every copy of the total — and of the updated parameter — is bitwise
  the same;
- clipping by the global norm needs ``Σ‖g‖²`` over all parameters, each counted once (a tied one by the
  first stage holding it): :func:`owned_squared_norm` per stage, :func:`clip_scale` over all of them,
  with the one clipping formula (:func:`jaxbackend.optimizer.clip_coefficient`).

One-stage programs clip inside their step (:func:`torchpar.runtime.train_step.optimizer_tail`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import jax

from torchpar.runtime.arrays import local_scalar
from torchpar.runtime.pipeline.transport import Transport

TIED = "tied"


def shared_parameters(stage_params: Mapping[int, Iterable[str]]) -> dict[str, tuple[int, ...]]:
    """Parameters that several stages train → those stages, ascending."""
    users: dict[str, list[int]] = {}
    for stage in sorted(stage_params):
        for name in stage_params[stage]:
            users.setdefault(name, []).append(stage)
    return {name: tuple(stages) for name, stages in users.items() if len(stages) > 1}


def exchange_tied_gradients(
    index: int,
    grads: dict[str, jax.Array],
    shared: Mapping[str, Sequence[int]],
    transport: Transport,
    layout: Callable[[int, str], jax.sharding.Sharding],
) -> dict[str, jax.Array]:
    """``grads`` of stage ``index`` with every tied parameter's gradient replaced by the sum over the stages
    holding it, added in stage order. ``layout(stage, name)`` is the sharding ``stage`` holds the gradient in."""
    mine = {name: stages for name, stages in shared.items() if index in stages and name in grads}
    if not mine:
        return grads
    peers = sorted({s for stages in mine.values() for s in stages if s != index})
    for peer in peers:
        names = [n for n, stages in mine.items() if peer in stages]
        transport.send(TIED, index, peer, 0, {n: grads[n] for n in names}, {n: layout(peer, n) for n in names})
    parts: dict[int, dict[str, jax.Array]] = {index: grads}
    for peer in peers:
        names = [n for n, stages in mine.items() if peer in stages]
        parts[peer] = transport.receive(TIED, peer, index, 0, {n: layout(index, n) for n in names})
    total = dict(grads)
    for name, stages in mine.items():
        value = parts[stages[0]][name]
        for stage in stages[1:]:
            value = value + parts[stage][name]
        total[name] = value
    return total


def owned_squared_norm(
    index: int,
    grads: Mapping[str, jax.Array],
    shared: Mapping[str, Sequence[int]],
    squared_norm: Callable[[dict[str, jax.Array]], jax.Array],
) -> float:
    """``Σ‖g‖²`` over the gradients stage ``index`` counts: its own, and tied ones it is the first holder of."""
    owned = {n: g for n, g in grads.items() if n not in shared or shared[n][0] == index}
    return local_scalar(squared_norm(owned)) if owned else 0.0


def owned_nonfinite_count(
    index: int,
    grads: Mapping[str, jax.Array],
    shared: Mapping[str, Sequence[int]],
    nonfinite_count: Callable[[dict[str, jax.Array]], jax.Array],
) -> int:
    """How many elements of the gradients stage ``index`` counts (as :func:`owned_squared_norm`) are inf/nan."""
    owned = {n: g for n, g in grads.items() if n not in shared or shared[n][0] == index}
    return int(local_scalar(nonfinite_count(owned))) if owned else 0


def clip_scale(squared_norms: Iterable[float], max_norm: float) -> float:
    """The factor every gradient is multiplied by: ``clip_coefficient(√Σ‖g‖², max_norm)``."""
    from jaxbackend.optimizer import clip_coefficient

    total = math.sqrt(max(sum(squared_norms), 0.0))
    return float(clip_coefficient(total, max_norm))

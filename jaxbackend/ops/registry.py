"""The op registry: ATen overload name → JAX function (a leaf: the families import it, it imports none of them;
:func:`jaxbackend.ops.get` looks a lowering up once the package has imported every family).

A lowering is registered with ``@lowers("aten.add.Tensor", ...)`` and called with the op's own
arguments in ATen order, where tensors are ``jax.Array``, dtypes are JAX dtypes, and everything else
(ints, floats, lists, ``None``, strings for devices/layouts) is passed through. Lowerings of random
ops are registered with ``random=True`` and receive a ``key=`` PRNG key keyword. Lowerings registered with
``sharded=True`` partition themselves under GSPMD: when the plan pins the layouts their operands are read in,
they receive ``shardings=`` (one ``NamedSharding`` or ``None`` per tensor operand) and may run a ``shard_map``.

The caller (:mod:`jaxbackend.lower`) casts every tensor result to the dtype PyTorch reported for the
node, so a lowering may leave type promotion to JAX where the two agree in value.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

LoweringFn = Callable[..., object]
"""A lowering: called with the op's arguments (module docstring); returns its result(s)."""
F = TypeVar("F", bound=LoweringFn)


@dataclasses.dataclass(frozen=True)
class Lowering:
    """How to run one ATen overload in JAX."""

    target: str
    fn: LoweringFn
    random: bool = False
    sharded: bool = False


_REGISTRY: dict[str, Lowering] = {}


def lowers(*targets: str, random: bool = False, sharded: bool = False) -> Callable[[F], F]:
    """Register ``fn`` as the lowering of each of ``targets`` (e.g. ``"aten.mm.default"``)."""

    def register(fn: F) -> F:
        for target in targets:
            assert target not in _REGISTRY, f"{target} registered twice"
            _REGISTRY[target] = Lowering(target, fn, random, sharded)
        return fn

    return register


def registered(target: str) -> Lowering | None:
    """The lowering registered for ``target`` so far, or ``None`` (:func:`jaxbackend.ops.get` after every family)."""
    return _REGISTRY.get(target)

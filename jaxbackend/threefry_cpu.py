"""Threefry-2x32 random bits on the CPU as one fused elementwise pass, bit-identical to JAX's own.

JAX lowers its ``threefry2x32`` primitive for the CPU as a rolled loop — a ``while`` of five iterations of four
rounds — to keep compile times short. XLA cannot fuse a loop into what consumes the bits, so every iteration reads
and writes both uint32 words of every element, and the words live as temporaries. Measured (2-core x86, jax 0.10.2,
``where(bernoulli(key, 0.9, shape), x / 0.9, 0)``): ``[8, 4, 128, 128]`` (a BERT-medium attention dropout) 2.0 →
0.67 ms; ``[8, 12, 1024, 1024]`` (GPT-2 124M's attention at 8 × 1024) 1085 → 180 ms, and 1.2 GB of temporaries →
none.

:func:`install` registers the twenty rounds unrolled as the primitive's CPU lowering (its other platforms keep
theirs). It is the same function of the same inputs — Threefry-2x32 with 20 rounds (Salmon et al., "Parallel
random numbers: as easy as 1, 2, 3", SC 2011), key schedule and rotations as JAX's — so every random bit a program
draws (dropout masks, ``torch.rand`` in ``forward``) is unchanged; ``tests/jaxbackend/test_threefry_cpu.py`` checks
the published known answers and JAX's own lowering in a process without it. Each random op's hash is inlined where
it is used, so compiling takes a little longer. The registration is process-wide: JAX code of the user's in the same
process gets the fused lowering too (with the same bits).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p
from jax.interpreters import mlir

ROUNDS_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
"""The rotation distances of the four rounds of even and odd blocks (five blocks of four rounds)."""
KEY_PARITY = np.uint32(0x1BD11BDA)
"""The key schedule's third word is ``key1 ^ key2 ^ KEY_PARITY``."""


def threefry2x32(key1: jax.Array, key2: jax.Array, x1: jax.Array, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 (20 rounds) of the counter words ``(x1, x2)`` under the key ``(key1, key2)``, elementwise
    (uint32 arrays that broadcast together)."""
    schedule = (key1, key2, key1 ^ key2 ^ KEY_PARITY)
    a, b = x1 + schedule[0], x2 + schedule[1]
    for block in range(5):
        for distance in ROUNDS_ROTATIONS[block % 2]:
            a = a + b
            b = a ^ _rotate_left(b, distance)
        a = a + schedule[(block + 1) % 3]
        b = b + schedule[(block + 2) % 3] + np.uint32(block + 1)
    return a, b


def _rotate_left(x: jax.Array, distance: int) -> jax.Array:
    return jax.lax.shift_left(x, np.uint32(distance)) | jax.lax.shift_right_logical(x, np.uint32(32 - distance))


def _lowering(key1: jax.Array, key2: jax.Array, x1: jax.Array, x2: jax.Array) -> tuple[jax.Array, jax.Array]:
    shape = jnp.broadcast_shapes(key1.shape, key2.shape, x1.shape, x2.shape)
    return threefry2x32(*(jnp.broadcast_to(v, shape) for v in (key1, key2, x1, x2)))


@functools.cache
def install() -> None:
    """Lower ``threefry2x32`` for the CPU with the rounds unrolled (module docstring); once per process."""
    mlir.register_lowering(threefry2x32_p, mlir.lower_fun(_lowering, multiple_results=True), platform="cpu")

"""``jax.lax.ragged_all_to_all`` emulated from dense collectives, for the CPU (XLA:CPU does not implement it): the
tests run the ragged exchanges through it (``tests/jaxbackend/test_expert_parallel.py`` checks it on the
collective's documented example)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """``jax.lax.ragged_all_to_all`` as its docstring's pseudocode states it, from dense collectives: slice ``i`` of
    ``operand`` (``send_sizes[i]`` rows from ``input_offsets[i]``) goes to device ``i // (N / P)``; the slices received
    are written at ``all_to_all(output_offsets)`` with sizes ``recv_sizes``; the rest of ``output`` is kept."""
    most = operand.shape[0]
    step = jnp.arange(most, dtype=jnp.int32)
    rows = jnp.clip(input_offsets[:, None] + step[None, :], 0, most - 1)
    sending = (step[None, :] < send_sizes[:, None]).reshape(*rows.shape, *(1,) * (operand.ndim - 1))
    send = jnp.where(sending, operand[rows], jnp.zeros((), operand.dtype))
    received = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)  # [N, most, ...]: slice i from device i
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    places = jnp.where(step[None, :] < recv_sizes[:, None], offsets[:, None] + step[None, :], output.shape[0])
    return output.at[places.reshape(-1)].set(received.reshape(-1, *operand.shape[1:]), mode="drop")

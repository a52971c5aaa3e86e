"""The collective that moves rows between devices in the expert exchange (:mod:`.expert_parallel`) and the row
exchange (:mod:`.row_exchange`).

Both build, on each device, slots of up to ``T`` rows per peer of which only the first few are real (``sent[p]``
rows for peer ``p``; ``came[s]`` arrive from peer ``s``). ``all_to_all`` moves whole slots, padding included;
``jax.lax.ragged_all_to_all`` moves only the real rows, each slice from where it lies in the sender's buffer to
where the receiver reads it — the traffic follows the routing, not the slot size (``T`` is up to twice a balanced
share on the fast path and a whole chunk on the exact one). XLA implements ``ragged-all-to-all`` on GPUs; XLA:CPU
does not (``UNIMPLEMENTED``), so the CPU keeps ``all_to_all`` (:data:`EXCHANGE`). Rows a slot cannot hold are
dropped the same way by both, and the buffers they fill are the same, so the code around the collective is shared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxbackend import precision

EXCHANGE: str | None = None
"""``"ragged"``, ``"dense"``, or ``None``: ragged on the platforms of :data:`RAGGED_PLATFORMS`, dense elsewhere."""
RAGGED_PLATFORMS = ("cuda", "rocm")
"""The platforms whose XLA implements ``ragged-all-to-all``."""
COLLECTIVE = jax.lax.ragged_all_to_all
"""The ragged collective called (the tests swap in an emulation the CPU can run)."""


def ragged() -> bool:
    """Whether an exchange in the program being traced moves its rows by ``ragged_all_to_all``."""
    if EXCHANGE not in (None, "ragged", "dense"):
        raise ValueError(f"exchange_collective.EXCHANGE must be None, 'ragged' or 'dense', got {EXCHANGE!r}")
    if EXCHANGE is not None:
        return EXCHANGE == "ragged"
    return precision.current().platform in RAGGED_PLATFORMS


def ragged_all_to_all(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    axes: str | tuple[str, ...],
) -> jax.Array:
    """``jax.lax.ragged_all_to_all`` over the mesh axes ``axes`` (one slice per peer; offsets and sizes int32)."""
    sizes = (input_offsets, send_sizes, output_offsets, recv_sizes)
    return COLLECTIVE(operand, output, *(s.astype(jnp.int32) for s in sizes), axis_name=axes)


def slots_all_to_all(send: jax.Array, sent: jax.Array, came: jax.Array, axes: str | tuple[str, ...]) -> jax.Array:
    """``send [P, T, …]`` (slot ``p``: rows for peer ``p``, the first ``sent[p]`` real, the rest zeros) →
    ``[P, T, …]`` (slot ``s``: rows from peer ``s``, the first ``came[s]`` real, the rest zeros); by
    ``all_to_all``, or ragged (:func:`ragged`) moving only the real rows."""
    if not ragged():
        return jax.lax.all_to_all(send, axes, 0, 0, tiled=True)
    peers, slot = send.shape[:2]
    flat = send.reshape(peers * slot, *send.shape[2:])
    starts = jnp.arange(peers, dtype=jnp.int32) * slot
    mine = jax.lax.axis_index(axes) * slot * jnp.ones((peers,), jnp.int32)
    return ragged_all_to_all(flat, jnp.zeros_like(flat), starts, sent, mine, came, axes).reshape(send.shape)

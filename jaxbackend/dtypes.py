"""torch dtype names ↔ JAX dtypes.

JAX runs with 64-bit types off (``jax_enable_x64=False``, its fast default): ``int64`` tensors become
``int32`` and ``float64`` become ``float32``. Indices past 2**31 would overflow; torchpar's models do
not have them. Everything else maps one to one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_BY_NAME: dict[str, jnp.dtype] = {
    "bool": jnp.bool_,
    "uint8": jnp.uint8,
    "int8": jnp.int8,
    "int16": jnp.int16,
    "int32": jnp.int32,
    "int64": jnp.int64,
    "uint16": jnp.uint16,
    "uint32": jnp.uint32,
    "uint64": jnp.uint64,
    "float16": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "float32": jnp.float32,
    "float64": jnp.float64,
    "complex64": jnp.complex64,
    "complex128": jnp.complex128,
}


def to_jax(name: str) -> jnp.dtype:
    """The JAX dtype that holds a torch dtype called ``name`` (``"int64"`` → int32 when x64 is off)."""
    try:
        dtype = np.dtype(_BY_NAME[name])
    except KeyError:
        raise NotImplementedError(f"torch dtype {name} has no JAX equivalent in torchpar") from None
    return jax.dtypes.canonicalize_dtype(dtype)

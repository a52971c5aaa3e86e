"""Python scalar arguments as JAX holds them with 64-bit types off.

torch code uses int64 extremes as sentinels (``torch.iinfo(torch.long).max`` as a mask fill or clamp
bound). With ``jax_enable_x64`` off such an int does not fit the int32 array it meets: JAX raises, and
``jnp.full`` silently wraps it. :func:`fit` clips it to int32's range, so a sentinel stays the extreme
value of its dtype.
"""

from __future__ import annotations

import jax

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def fit(value):
    """``value`` unchanged, unless it is a Python int outside int32 while x64 is off: then clipped."""
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and not jax.config.jax_enable_x64
        and not _INT32_MIN <= value <= _INT32_MAX
    ):
        return max(_INT32_MIN, min(_INT32_MAX, value))
    return value

"""ATen op lowerings, one module per op family; see :mod:`jaxbackend.ops.registry`."""

"""ATen → JAX lowering, torch.optim ports and sharding application.

Nothing here imports torch's runtime or torchpar's planner/runtime; it reads the IR
(:mod:`torchpar.ir`) and plain data.
"""

"""Random ops. Each receives ``key``: a PRNG key unique to the node (``fold_in(step_key, node_index)``),
so a seed reproduces a run exactly; samples follow torch's distributions but not its bit stream."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxbackend.ops.registry import lowers


@lowers("aten.native_dropout.default", random=True)
def native_dropout(x, p, train, *, key):
    """Returns ``(out, mask)``: ``out = x·mask/(1-p)`` with ``mask ~ Bernoulli(1-p)`` when training."""
    if train is False or p == 0.0:
        return x, jnp.ones(x.shape, jnp.bool_)
    if p >= 1.0:
        return jnp.zeros_like(x), jnp.zeros(x.shape, jnp.bool_)
    keep = jax.random.bernoulli(key, 1.0 - p, x.shape)
    return jnp.where(keep, x * (1.0 / (1.0 - p)), 0.0), keep


@lowers("aten.rand.default", random=True)
def rand(size, dtype=None, layout=None, device=None, pin_memory=None, *, key):
    return jax.random.uniform(key, tuple(size), dtype or jnp.float32)


@lowers("aten.randn.default", random=True)
def randn(size, dtype=None, layout=None, device=None, pin_memory=None, *, key):
    return jax.random.normal(key, tuple(size), dtype or jnp.float32)


@lowers("aten.rand_like.default", random=True)
def rand_like(x, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, *, key):
    return jax.random.uniform(key, x.shape, dtype or x.dtype)


@lowers("aten.randn_like.default", random=True)
def randn_like(x, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None, *, key):
    return jax.random.normal(key, x.shape, dtype or x.dtype)


@lowers("aten.bernoulli.default", random=True)
def bernoulli(x, generator=None, *, key):
    return jax.random.bernoulli(key, x).astype(x.dtype)


@lowers("aten.bernoulli.p", random=True)
def bernoulli_p(x, p=0.5, generator=None, *, key):
    return jax.random.bernoulli(key, p, x.shape).astype(x.dtype)


@lowers("aten.randint.low", random=True)
def randint_low(low, high, size, dtype=None, layout=None, device=None, pin_memory=None, *, key):
    return jax.random.randint(key, tuple(size), low, high, dtype or jnp.int32)


@lowers("aten.randint.default", random=True)
def randint(high, size, dtype=None, layout=None, device=None, pin_memory=None, *, key):
    return jax.random.randint(key, tuple(size), 0, high, dtype or jnp.int32)


@lowers("aten.randperm.default", random=True)
def randperm(n, dtype=None, layout=None, device=None, pin_memory=None, *, key):
    return jax.random.permutation(key, n).astype(dtype or jnp.int32)


def _sample(key, sampler, shape, dtype):
    """``sampler(key, shape)`` drawn in float32 (or wider) and cast to ``dtype``: a bf16 / fp16 tensor's samples are
    rounded from float32 draws, as torch's CPU kernels compute them."""
    wide = jnp.promote_types(dtype, jnp.float32)
    return sampler(key, tuple(shape), wide).astype(dtype)


@lowers("aten.normal_functional.default", random=True)
def normal_functional(x, mean=0.0, std=1.0, generator=None, *, key):
    """``x.normal_(mean, std)`` made functional (``torch.distributions.Normal.rsample``, ``randn``-initialised
    noise): samples of N(mean, std²) in ``x``'s shape and dtype."""
    return (mean + std * _sample(key, jax.random.normal, x.shape, jnp.float32)).astype(x.dtype)


@lowers("aten.normal.Tensor_Tensor", random=True)
def normal_tensor_tensor(mean, std, generator=None, *, key):
    shape = jnp.broadcast_shapes(mean.shape, std.shape)
    return mean + std * _sample(key, jax.random.normal, shape, jnp.result_type(mean, std))


@lowers("aten.normal.Tensor_float", random=True)
def normal_tensor_float(mean, std=1.0, generator=None, *, key):
    return mean + std * _sample(key, jax.random.normal, mean.shape, mean.dtype)


@lowers("aten.normal.float_Tensor", random=True)
def normal_float_tensor(mean, std, generator=None, *, key):
    return mean + std * _sample(key, jax.random.normal, std.shape, std.dtype)


@lowers("aten.normal.float_float", random=True)
def normal_float_float(mean, std, size, generator=None, dtype=None, layout=None, device=None, pin_memory=None, *, key):
    return mean + std * _sample(key, jax.random.normal, size, dtype or jnp.float32)


@lowers("aten.uniform.default", random=True)
def uniform(x, low=0.0, high=1.0, generator=None, *, key):
    """``x.uniform_(low, high)`` made functional (``Laplace.rsample``, ``nn.init.uniform_`` in ``forward``)."""
    return (low + (high - low) * _sample(key, jax.random.uniform, x.shape, jnp.float32)).astype(x.dtype)


@lowers("aten.exponential.default", random=True)
def exponential(x, lambd=1.0, generator=None, *, key):
    """``x.exponential_(lambd)`` made functional: samples of Exp(lambd)."""
    return (_sample(key, jax.random.exponential, x.shape, jnp.float32) / lambd).astype(x.dtype)

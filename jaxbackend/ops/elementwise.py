"""Elementwise ATen ops: arithmetic, comparisons, logic, activations, math functions.

Python scalars stay weakly typed in JAX, so ``int_tensor * 0.5`` promotes like torch; the caller
casts every result to torch's result dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxbackend.ops.registry import lowers


def _scaled(other, alpha):
    return other if alpha == 1 else other * alpha


@lowers("aten.add.Tensor", "aten.add.Scalar")
def add(x, other, alpha=1):
    return jnp.add(x, _scaled(other, alpha))


@lowers("aten.sub.Tensor", "aten.sub.Scalar")
def sub(x, other, alpha=1):
    return jnp.subtract(x, _scaled(other, alpha))


@lowers("aten.rsub.Scalar", "aten.rsub.Tensor")
def rsub(x, other, alpha=1):
    return jnp.subtract(other, _scaled(x, alpha))


@lowers("aten.mul.Tensor", "aten.mul.Scalar")
def mul(x, other):
    return jnp.multiply(x, other)


@lowers("aten.div.Tensor", "aten.div.Scalar")
def div(x, other):
    return jnp.true_divide(x, other)


@lowers("aten.div.Tensor_mode", "aten.div.Scalar_mode")
def div_mode(x, other, rounding_mode=None):
    if rounding_mode is None:
        return jnp.true_divide(x, other)
    integer = jnp.issubdtype(jnp.result_type(x, other), jnp.integer)
    if rounding_mode == "floor":
        return jnp.floor_divide(x, other) if integer else jnp.floor(jnp.true_divide(x, other))
    if rounding_mode == "trunc":
        if integer:
            q = jnp.floor_divide(jnp.abs(x), jnp.abs(other))
            return jnp.where(jnp.sign(x) * jnp.sign(other) < 0, -q, q)
        return jnp.trunc(jnp.true_divide(x, other))
    raise ValueError(f"div: unknown rounding_mode {rounding_mode!r}")


@lowers("aten.remainder.Tensor", "aten.remainder.Scalar")
def remainder(x, other):
    return jnp.remainder(x, other)


@lowers("aten.fmod.Tensor", "aten.fmod.Scalar")
def fmod(x, other):
    return jnp.fmod(x, other)


@lowers("aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor", "aten.pow.Scalar")
def pow_(x, exponent):
    if isinstance(exponent, (int, float)) and not isinstance(exponent, bool):
        if exponent == 2:
            return x * x
        if exponent == 0.5:
            return jnp.sqrt(x)
        if float(exponent).is_integer() and jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
            return jax.lax.integer_pow(x, int(exponent))
    return jnp.power(x, exponent)


def _unary(target: str, fn) -> None:
    lowers(target)(lambda x: fn(x))


for _name, _fn in {
    "neg": jnp.negative, "abs": jnp.abs, "exp": jnp.exp, "exp2": jnp.exp2, "expm1": jnp.expm1,
    "log": jnp.log, "log2": jnp.log2, "log10": jnp.log10, "log1p": jnp.log1p, "sqrt": jnp.sqrt,
    "rsqrt": jax.lax.rsqrt, "reciprocal": jnp.reciprocal, "sin": jnp.sin, "cos": jnp.cos,
    "tan": jnp.tan, "asin": jnp.arcsin, "acos": jnp.arccos, "atan": jnp.arctan, "sinh": jnp.sinh,
    "cosh": jnp.cosh, "tanh": jnp.tanh, "asinh": jnp.arcsinh, "acosh": jnp.arccosh,
    "atanh": jnp.arctanh, "erf": jax.scipy.special.erf, "erfc": jax.scipy.special.erfc,
    "erfinv": jax.scipy.special.erfinv, "sigmoid": jax.nn.sigmoid, "floor": jnp.floor,
    "ceil": jnp.ceil, "trunc": jnp.trunc, "round": jnp.round, "sign": jnp.sign,
    "logical_not": jnp.logical_not, "bitwise_not": jnp.invert, "isnan": jnp.isnan,
    "isinf": jnp.isinf, "relu": jax.nn.relu, "lgamma": jax.scipy.special.gammaln,
    "digamma": jax.scipy.special.digamma, "sgn": jnp.sign, "frac": lambda x: x - jnp.trunc(x),
    "signbit": jnp.signbit,
}.items():
    _unary(f"aten.{_name}.default", _fn)


@lowers("aten.isfinite.default")
def isfinite(x):
    return jnp.isfinite(x)


@lowers("aten.atan2.default")
def atan2(x, other):
    return jnp.arctan2(x, other)


@lowers("aten.hypot.default")
def hypot(x, other):
    return jnp.hypot(x, other)


@lowers("aten.round.decimals")
def round_decimals(x, decimals=0):
    return jnp.round(x, decimals)


def _binary(target: str, fn) -> None:
    lowers(target)(lambda x, other: fn(x, other))


for _name, _fn in {
    "eq": jnp.equal, "ne": jnp.not_equal, "lt": jnp.less, "le": jnp.less_equal, "gt": jnp.greater,
    "ge": jnp.greater_equal,
}.items():
    _binary(f"aten.{_name}.Tensor", _fn)
    _binary(f"aten.{_name}.Scalar", _fn)

for _name, _fn in {
    "logical_and": jnp.logical_and, "logical_or": jnp.logical_or, "logical_xor": jnp.logical_xor,
    "maximum": jnp.maximum, "minimum": jnp.minimum, "fmax": jnp.fmax, "fmin": jnp.fmin,
    "copysign": jnp.copysign, "nextafter": jnp.nextafter,
}.items():
    _binary(f"aten.{_name}.default", _fn)

for _name, _fn in {
    "bitwise_and": jnp.bitwise_and, "bitwise_or": jnp.bitwise_or, "bitwise_xor": jnp.bitwise_xor,
}.items():
    _binary(f"aten.{_name}.Tensor", _fn)
    _binary(f"aten.{_name}.Scalar", _fn)


@lowers("aten.where.self", "aten.where.ScalarSelf", "aten.where.ScalarOther", "aten.where.Scalar")
def where(condition, x, other):
    return jnp.where(condition, x, other)


@lowers("aten.clamp.default", "aten.clamp.Tensor")
def clamp(x, min=None, max=None):
    if min is not None:
        x = jnp.maximum(x, min)
    if max is not None:
        x = jnp.minimum(x, max)
    return x


@lowers("aten.clamp_min.default", "aten.clamp_min.Tensor")
def clamp_min(x, min):
    return jnp.maximum(x, min)


@lowers("aten.clamp_max.default", "aten.clamp_max.Tensor")
def clamp_max(x, max):
    return jnp.minimum(x, max)


@lowers("aten.gelu.default")
def gelu(x, approximate="none"):
    if approximate == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
        return 0.5 * x * (1.0 + jnp.tanh(inner))
    return 0.5 * x * (1.0 + jax.scipy.special.erf(x * (1.0 / math.sqrt(2.0))))


@lowers("aten.silu.default")
def silu(x):
    return x * jax.nn.sigmoid(x)


@lowers("aten.mish.default")
def mish(x):
    return x * jnp.tanh(jax.nn.softplus(x))


@lowers("aten.hardtanh.default")
def hardtanh(x, min_val=-1.0, max_val=1.0):
    return jnp.clip(x, min_val, max_val)


@lowers("aten.hardsigmoid.default")
def hardsigmoid(x):
    return jnp.clip(x / 6.0 + 0.5, 0.0, 1.0)


@lowers("aten.hardswish.default")
def hardswish(x):
    return x * jnp.clip(x / 6.0 + 0.5, 0.0, 1.0)


@lowers("aten.leaky_relu.default")
def leaky_relu(x, negative_slope=0.01):
    return jnp.where(x > 0, x, x * negative_slope)


@lowers("aten.elu.default")
def elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    return scale * jnp.where(x > 0, x, alpha * jnp.expm1(x * input_scale))


@lowers("aten.softplus.default")
def softplus(x, beta=1.0, threshold=20.0):
    scaled = x * beta
    return jnp.where(scaled > threshold, x, jnp.log1p(jnp.exp(jnp.minimum(scaled, threshold))) / beta)


@lowers("aten.logit.default")
def logit(x, eps=None):
    if eps is not None:
        x = jnp.clip(x, eps, 1.0 - eps)
    return jnp.log(x / (1.0 - x))


@lowers("aten.xlogy.Tensor")
def xlogy(x, y):
    return jax.scipy.special.xlogy(x, y)


@lowers("aten.lerp.Scalar", "aten.lerp.Tensor")
def lerp(x, end, weight):
    return x + weight * (end - x)


@lowers("aten.addcmul.default")
def addcmul(x, t1, t2, value=1):
    return x + value * t1 * t2


@lowers("aten.addcdiv.default")
def addcdiv(x, t1, t2, value=1):
    return x + value * t1 / t2

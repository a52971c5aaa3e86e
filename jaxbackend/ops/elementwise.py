"""Elementwise ATen ops: arithmetic, comparisons, logic, activations, math functions.

Python scalars stay weakly typed in JAX, so ``int_tensor * 0.5`` promotes like torch; the caller
casts every result to torch's result dtype. Float-valued math (``exp``, ``sigmoid``, ...) on integer
tensors computes in float32, torch's default dtype, since several JAX functions reject integers.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxbackend.ops.registry import lowers
from jaxbackend.ops.scalars import fit


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


def _float(x):
    """Integer and bool tensors as float32: torch's float-valued math promotes them to the default dtype."""
    x = jnp.asarray(x)
    return x if jnp.issubdtype(x.dtype, jnp.inexact) else x.astype(jnp.float32)


def _float_only(fn):
    """``fn`` on floats; the identity on integers (rounding an integer tensor keeps it, as in torch)."""
    return lambda x: fn(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x


@jax.custom_jvp
def _digamma(x):
    return jnp.where(x == 0, -jnp.inf, jax.scipy.special.digamma(x))


@_digamma.defjvp
def _digamma_jvp(primals, tangents):
    """d/dx digamma = trigamma; JAX's ``polygamma(1, x)`` is inaccurate for x < 0, so reflect there:
    ``trigamma(x) = π² / sin²(πx) − trigamma(1 − x)``."""
    (x,), (t,) = primals, tangents
    negative = x < 0
    positive_x = jnp.where(negative, 1.0 - x, x)
    trigamma = jax.scipy.special.polygamma(1, positive_x)
    trigamma = jnp.where(negative, (math.pi / jnp.sin(math.pi * x)) ** 2 - trigamma, trigamma)
    return _digamma(x), t * trigamma


# Value-preserving on integers (torch keeps the input dtype).
for _name, _fn in {
    "neg": jnp.negative,
    "abs": jnp.abs,
    "floor": _float_only(jnp.floor),
    "ceil": _float_only(jnp.ceil),
    "trunc": _float_only(jnp.trunc),
    "round": _float_only(jnp.round),
    "sign": jnp.sign,
    "sgn": jnp.sign,
    "logical_not": jnp.logical_not,
    "bitwise_not": jnp.invert,
    "isnan": jnp.isnan,
    "isinf": jnp.isinf,
    "relu": jax.nn.relu,
    "frac": lambda x: x - jnp.trunc(x),
    "signbit": jnp.signbit,
}.items():
    _unary(f"aten.{_name}.default", _fn)

# Float-valued math: integer inputs compute in float32.
for _name, _fn in {
    "exp": jnp.exp,
    "exp2": jnp.exp2,
    "expm1": jnp.expm1,
    "log": jnp.log,
    "log2": jnp.log2,
    "log10": jnp.log10,
    "log1p": jnp.log1p,
    "sqrt": jnp.sqrt,
    "rsqrt": jax.lax.rsqrt,
    "reciprocal": jnp.reciprocal,
    "sin": jnp.sin,
    "cos": jnp.cos,
    "tan": jnp.tan,
    "asin": jnp.arcsin,
    "acos": jnp.arccos,
    "atan": jnp.arctan,
    "sinh": jnp.sinh,
    "cosh": jnp.cosh,
    "tanh": jnp.tanh,
    "asinh": jnp.arcsinh,
    "acosh": jnp.arccosh,
    "atanh": jnp.arctanh,
    "erf": jax.scipy.special.erf,
    "erfc": jax.scipy.special.erfc,
    "erfinv": jax.scipy.special.erfinv,
    "sigmoid": jax.nn.sigmoid,
    "lgamma": jax.scipy.special.gammaln,
    "digamma": _digamma,
}.items():
    _unary(f"aten.{_name}.default", lambda x, fn=_fn: fn(_float(x)))


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
    lowers(target)(lambda x, other: fn(x, fit(other)))


for _name, _fn in {
    "eq": jnp.equal,
    "ne": jnp.not_equal,
    "lt": jnp.less,
    "le": jnp.less_equal,
    "gt": jnp.greater,
    "ge": jnp.greater_equal,
}.items():
    _binary(f"aten.{_name}.Tensor", _fn)
    _binary(f"aten.{_name}.Scalar", _fn)

for _name, _fn in {
    "logical_and": jnp.logical_and,
    "logical_or": jnp.logical_or,
    "logical_xor": jnp.logical_xor,
    "maximum": jnp.maximum,
    "minimum": jnp.minimum,
    "fmax": jnp.fmax,
    "fmin": jnp.fmin,
    "nextafter": jnp.nextafter,
}.items():
    _binary(f"aten.{_name}.default", _fn)


@lowers("aten.copysign.Tensor", "aten.copysign.Scalar")
def copysign(x, other):
    return jnp.copysign(_float(x), other)


for _name, _fn in {
    "bitwise_and": jnp.bitwise_and,
    "bitwise_or": jnp.bitwise_or,
    "bitwise_xor": jnp.bitwise_xor,
}.items():
    _binary(f"aten.{_name}.Tensor", _fn)
    _binary(f"aten.{_name}.Scalar", _fn)


@lowers(
    "aten.bitwise_left_shift.Tensor",
    "aten.bitwise_left_shift.Tensor_Scalar",
    "aten.bitwise_left_shift.Scalar_Tensor",
    "aten.__lshift__.Scalar",
    "aten.__lshift__.Tensor",
)
def bitwise_left_shift(x, other):
    return jnp.left_shift(x, other)


@lowers(
    "aten.bitwise_right_shift.Tensor",
    "aten.bitwise_right_shift.Tensor_Scalar",
    "aten.bitwise_right_shift.Scalar_Tensor",
    "aten.__rshift__.Scalar",
    "aten.__rshift__.Tensor",
)
def bitwise_right_shift(x, other):
    return jnp.right_shift(x, other)


@lowers("aten.where.self", "aten.where.ScalarSelf", "aten.where.ScalarOther", "aten.where.Scalar")
def where(condition, x, other):
    return jnp.where(condition, fit(x), fit(other))


@lowers("aten.clamp.default", "aten.clamp.Tensor")
def clamp(x, min=None, max=None):
    if min is not None:
        x = jnp.maximum(x, fit(min))
    if max is not None:
        x = jnp.minimum(x, fit(max))
    return x


@lowers("aten.clamp_min.default", "aten.clamp_min.Tensor")
def clamp_min(x, min):
    return jnp.maximum(x, fit(min))


@lowers("aten.clamp_max.default", "aten.clamp_max.Tensor")
def clamp_max(x, max):
    return jnp.minimum(x, fit(max))


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

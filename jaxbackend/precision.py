"""Precision of matrix products and convolutions, as PyTorch's float32 matmul settings define it.

PyTorch names three precisions for float32 products (``torch.set_float32_matmul_precision``):

==========  ==========================================  =============================================
name        PyTorch on a GPU                            here, on a GPU (``jax.lax``)
==========  ==========================================  =============================================
highest     full fp32 products                          ``Precision.HIGHEST``
high        TF32 (``allow_tf32 = True``)                ``DotAlgorithmPreset.TF32_TF32_F32``
medium      bf16 products, fp32 accumulation            ``DotAlgorithmPreset.BF16_BF16_F32``
==========  ==========================================  =============================================

The mapping applies to products whose operands are all float32. Products of bf16/fp16 operands (a bf16
model, autocast regions) run natively in their dtype with fp32 accumulation, as cuBLAS does
(``Precision.DEFAULT``). Convolutions follow ``torch.backends.cudnn.allow_tf32`` (on by default in
PyTorch): TF32 is XLA's default GPU convolution (``Precision.DEFAULT``), ``"highest"`` is fp32.

On the CPU backend nothing changes: every product is ``Precision.HIGHEST`` (XLA's CPU dots are fp32, and it
rejects the TF32 algorithm), whatever is asked.

A :class:`Numerics` is data the lowering receives (``jaxbackend.lower.lower(..., numerics=...)``); the op
lowerings read it through :func:`dot_precision` / :func:`conv_precision` while the graph is traced. The
platform is the backend the program is lowered for: ``None`` means JAX's default backend at trace time.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp

MATMUL_PRECISIONS: tuple[str, ...] = ("highest", "high", "medium")


@dataclasses.dataclass(frozen=True)
class Numerics:
    """How float32 products and convolutions are computed.

    ``matmul``: one of :data:`MATMUL_PRECISIONS` for float32 matrix products (mm, bmm, addmm, einsum-like
    contractions, attention). ``conv``: ``"highest"`` (fp32) or ``"high"`` (TF32) for float32 convolutions.
    ``platform``: the backend the program is lowered for (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``);
    ``None`` = JAX's default backend when the program is traced.
    """

    matmul: str = "highest"
    conv: str = "highest"
    platform: str | None = None

    def __post_init__(self) -> None:
        for field, value in (("matmul", self.matmul), ("conv", self.conv)):
            if value not in MATMUL_PRECISIONS:
                raise ValueError(f"{field} precision must be one of {MATMUL_PRECISIONS}, got {value!r}")

    def effective(self) -> Numerics:
        """What the products really use on this platform (CPU: always ``"highest"``)."""
        platform = self.platform or jax.default_backend()
        if platform == "cpu":
            return Numerics("highest", "highest", platform)
        return dataclasses.replace(self, platform=platform)

    def describe(self) -> str:
        """One line for plans and logs, e.g. ``"fp32 products: tf32 (high); convolutions: tf32"``."""
        names = {"highest": "fp32", "high": "tf32", "medium": "bf16"}
        return f"fp32 products: {names[self.matmul]} ({self.matmul}); convolutions: {names[self.conv]}"


FULL_FP32 = Numerics()

_current: contextvars.ContextVar[Numerics] = contextvars.ContextVar("torchpar_numerics", default=FULL_FP32)


@contextlib.contextmanager
def using(numerics: Numerics | None) -> Iterator[None]:
    """Make ``numerics`` the one the op lowerings read while tracing inside this block."""
    token = _current.set(numerics or FULL_FP32)
    try:
        yield
    finally:
        _current.reset(token)


def current() -> Numerics:
    """The numerics of the program being traced, resolved for its platform."""
    return _current.get().effective()


def dot_precision(*operands: jax.typing.ArrayLike) -> jax.lax.Precision | jax.lax.DotAlgorithmPreset:
    """The ``precision=`` argument of a matrix product of ``operands`` (see the module docstring)."""
    numerics = current()
    if numerics.platform == "cpu":
        return jax.lax.Precision.HIGHEST
    if not all(jnp.result_type(x) == jnp.float32 for x in operands):
        return jax.lax.Precision.DEFAULT
    if numerics.matmul == "high":
        return jax.lax.DotAlgorithmPreset.TF32_TF32_F32
    if numerics.matmul == "medium":
        return jax.lax.DotAlgorithmPreset.BF16_BF16_F32
    return jax.lax.Precision.HIGHEST


def conv_precision(*operands: jax.typing.ArrayLike) -> jax.lax.Precision:
    """The ``precision=`` argument of a convolution of ``operands``."""
    numerics = current()
    if numerics.platform == "cpu":
        return jax.lax.Precision.HIGHEST
    if not all(jnp.result_type(x) == jnp.float32 for x in operands) or numerics.conv != "highest":
        return jax.lax.Precision.DEFAULT
    return jax.lax.Precision.HIGHEST


__all__ = ["FULL_FP32", "MATMUL_PRECISIONS", "Numerics", "conv_precision", "current", "dot_precision", "using"]

"""The alpha-beta communication cost model on a 2-D logical mesh.

For mesh axis ``a`` with ``n`` devices, latency ``α_a`` (s) and inverse bandwidth ``β_a`` (s/byte),
and ``B`` the bytes of the collective's full (unsharded along ``a``) buffer:

    all-reduce      AR_a(B) = α_a + 2·β_a·(n−1)/n·B
    all-gather      AG_a(B) = α_a +   β_a·(n−1)/n·B      (B = gathered size)
    reduce-scatter  RS_a(B) = α_a +   β_a·(n−1)/n·B      (B = size before scattering)
    all-to-all      A2A_a(B) = α_a +  β_a·(n−1)/n·B/n    (B = local buffer size)

A collective over both axes runs hierarchically (axis 1, then axis 0) and costs the sum. Axes of
size 1 cost nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from torchpar.ir.layout import MeshShape, Spec, num_shards


@dataclass(kw_only=True, frozen=True)
class LogicalMesh:
    """A logical 2-D mesh with per-axis link constants."""

    shape: MeshShape
    """Devices along axis 0 and axis 1."""
    alpha: tuple[float, float] = (1e-4, 1e-5)
    """Latency per collective on each axis, seconds (axis 1 is the fast, inner axis)."""
    beta: tuple[float, float] = (1e-9, 1e-10)
    """Seconds per byte on each axis (inverse bandwidth)."""
    device_flops: float = 5e10
    """FLOP/s of one device, for compute costs."""

    def __post_init__(self) -> None:
        if len(self.shape) != 2 or any(int(d) < 1 for d in self.shape):
            raise ValueError(f"a logical mesh shape is two positive ints, got {self.shape}")
        if any(a < 0 for a in self.alpha) or any(b < 0 for b in self.beta):
            raise ValueError("alpha and beta must be non-negative")

    @property
    def num_devices(self) -> int:
        return self.shape[0] * self.shape[1]

    def _factor(self, axis: int) -> tuple[int, float, float]:
        return self.shape[axis], self.alpha[axis], self.beta[axis]

    def all_reduce(self, nbytes: float, axes: Sequence[int]) -> float:
        return sum(_ar(nbytes, *self._factor(a)) for a in axes)

    def all_gather(self, nbytes: float, axes: Sequence[int]) -> float:
        return sum(_ag(nbytes, *self._factor(a)) for a in axes)

    def reduce_scatter(self, nbytes: float, axes: Sequence[int]) -> float:
        return sum(_ag(nbytes, *self._factor(a)) for a in axes)

    def all_to_all(self, nbytes: float, axes: Sequence[int]) -> float:
        total = 0.0
        for a in axes:
            n, alpha, beta = self._factor(a)
            total += 0.0 if n == 1 else alpha + beta * (n - 1) / n * nbytes / n
        return total

    def compute(self, flops: float, shards: int = 1) -> float:
        return flops / shards / self.device_flops

    def resharding(self, nbytes: float, src: Spec, dst: Spec) -> float:
        """Cost of turning a tensor of ``nbytes`` (full size) laid out as ``src`` into ``dst``.

        Per mesh axis: split → replicated is an all-gather, replicated → split a free local slice,
        split on one dim → split on another an all-to-all. All-gathers run first, on the local size
        they produce. (Memoized: a solver graph asks for the same few millions of times.)
        """
        if src == dst:
            return 0.0
        return _resharding(self, nbytes, tuple(src), tuple(dst))

    def _resharding(self, nbytes: float, src: Spec, dst: Spec) -> float:
        src_dim = _axis_dims(src)
        dst_dim = _axis_dims(dst)
        cost = 0.0
        current = list(src)
        for axis in (0, 1):
            s, d = src_dim.get(axis), dst_dim.get(axis)
            if s == d and (s is None or _order_same(src, dst, s)):
                continue
            if self.shape[axis] == 1:
                continue
            local = nbytes / num_shards(tuple(current), self.shape)
            if d is None:  # gather this axis
                assert s is not None  # s == d == None continued above
                current[s] = _without(current[s], axis)
                cost += self.all_gather(local * self.shape[axis], [axis])
            elif s is None:  # slice: free
                continue
            else:
                cost += self.all_to_all(local, [axis])
        return cost


@functools.lru_cache(maxsize=1 << 16)
def _resharding(mesh: LogicalMesh, nbytes: float, src: Spec, dst: Spec) -> float:
    return mesh._resharding(nbytes, src, dst)


def _ar(nbytes: float, n: int, alpha: float, beta: float) -> float:
    return 0.0 if n == 1 else alpha + 2.0 * beta * (n - 1) / n * nbytes


def _ag(nbytes: float, n: int, alpha: float, beta: float) -> float:
    return 0.0 if n == 1 else alpha + beta * (n - 1) / n * nbytes


def _axis_dims(spec: Spec) -> dict[int, int]:
    return {axis: dim for dim, entry in enumerate(spec) if entry for axis in entry}


def _order_same(src: Spec, dst: Spec, dim: int) -> bool:
    return src[dim] == dst[dim]


def _without(entry: tuple[int, ...] | None, axis: int) -> tuple[int, ...] | None:
    rest = tuple(a for a in (entry or ()) if a != axis)
    return rest or None

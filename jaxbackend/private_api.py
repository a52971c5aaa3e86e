"""Every private JAX name torchpar relies on, in one list: where it is used, why, and what to do when it moves.

JAX makes no promise about ``jax._src``: a release may rename, move or re-sign anything in it. torchpar keeps
such uses few and lists each one here; ``tests/api/test_jax_private_api.py`` imports every entry, binds the
call torchpar makes to its signature, and fails naming the name, the torchpar file and the JAX version when
one moved. The same test fails if a ``jax._src`` import appears in ``torchpar/`` or ``jaxbackend/`` without an
entry here. The uses stay where they are (an entry documents them; it is not an import shim).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True)
class PrivateUse:
    """One private JAX name and how torchpar uses it."""

    module: str
    """The module it lives in, e.g. ``"jax._src.xla_bridge"``."""
    name: str
    """The attribute path inside ``module``: ``"backends_are_initialized"``, ``"ShapedArray.manual_axis_type"``."""
    call: tuple[int, tuple[str, ...]] | None
    """How torchpar calls it: (number of positional arguments, keyword names); ``None``: read, not called."""
    used_in: str
    """The torchpar file that uses it (relative to the repository root)."""
    why: str
    """What torchpar needs it for."""
    if_moved: str
    """What to do when a JAX release moves it."""

    def __post_init__(self) -> None:
        if not self.module.startswith("jax"):
            raise ValueError(f"a private JAX name lives in a jax module, got {self.module!r}")

    @property
    def symbol(self) -> str:
        return f"{self.module}.{self.name}"


PRIVATE_USES: tuple[PrivateUse, ...] = (
    PrivateUse(
        module="jax._src.xla_bridge",
        name="backends_are_initialized",
        call=(0, ()),
        used_in="torchpar/cluster.py",
        why="_keep_driver_off_accelerators: the Ray driver may pin its own JAX to the CPU only before JAX created "
        "a backend; no public function says whether it has",
        if_moved="find the new home of backends_are_initialized in jax/_src/xla_bridge.py (or compare "
        "jax.config.jax_platforms with the devices in use)",
    ),
    PrivateUse(
        module="jax._src.lax.parallel",
        name="all_gather_invariant",
        call=(2, ("axis", "tiled")),
        used_in="jaxbackend/spmd.py",
        why="an all-gather whose result is typed invariant along the gathered mesh axes (its transpose is a local "
        "slice), for per-device shard_map programs",
        if_moved="JAX 0.10 also exposes it publicly as jax.lax.all_gather(x, axes, axis=..., tiled=..., "
        "to='invarying'): switch spmd._all_gather_invariant to that and drop this entry",
    ),
    PrivateUse(
        module="jax._src.core",
        name="ShapedArray.manual_axis_type",
        call=None,
        used_in="jaxbackend/spmd.py",
        why="require_invariant reads jax.typeof(loss).manual_axis_type.varying to refuse a loss that is not "
        "reduced across devices; were the attribute gone, the check would pass silently",
        if_moved="read the mesh axes a value varies along from wherever jax.typeof(x) now keeps them (the "
        "'vma' of shard_map's docs)",
    ),
    PrivateUse(
        module="jax._src.core",
        name="ManualAxisType.varying",
        call=None,
        used_in="jaxbackend/spmd.py",
        why="the mesh axes along which a value inside shard_map differs between devices (see the entry above)",
        if_moved="as for ShapedArray.manual_axis_type",
    ),
)
"""The private JAX names torchpar relies on."""

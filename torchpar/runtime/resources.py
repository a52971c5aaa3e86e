"""Device out-of-memory, in words a user can act on.

XLA reports an allocation it cannot make as ``RESOURCE_EXHAUSTED: Out of memory while trying to allocate N
bytes`` (at compile time when the program's buffers cannot fit, at run time when they do not fit next to
what is already resident). :func:`as_device_memory_error` turns such an error — raised here or inside a Ray
host actor — into a :class:`DeviceMemoryError` naming what was running, the plan's per-device estimate for
each stage, what the device has, and the options that lower the footprint.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchpar.planner.plan import Plan

_OOM = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|OOM when allocating")
_ALLOCATION = re.compile(r"allocate\s+([0-9.]+\s*[KMGT]?i?B|\d+\s*bytes)")


class DeviceMemoryError(MemoryError):
    """A compiled program did not fit in device memory (XLA's ``RESOURCE_EXHAUSTED``); the message names the
    stage, the plan's estimate, the device's memory and what to try. The XLA error is chained."""


def is_device_oom(error: BaseException | None) -> bool:
    """Whether ``error`` (or an error it wraps) is XLA's out-of-memory."""
    seen = 0
    while error is not None and seen < 8:
        if _OOM.search(str(error)):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


def as_device_memory_error(
    error: BaseException, plan: Plan, *, what: str, device_memory_bytes: int | None, device_kind: str = ""
) -> DeviceMemoryError | None:
    """A :class:`DeviceMemoryError` for ``error`` if it is an out-of-memory (else ``None``). ``what`` says what
    was running (``"compiling the training step"``); ``plan`` is the :class:`~torchpar.planner.plan.Plan`."""
    if not is_device_oom(error):
        return None
    wanted = _ALLOCATION.search(str(error))
    lines = [
        f"the device ran out of memory while {what}"
        + (f" (XLA could not allocate {wanted.group(1)})" if wanted else "")
        + "."
    ]
    for index, stage in enumerate(plan.stages):
        devices = stage.devices()
        estimate = stage.estimated_memory_bytes
        lines.append(
            f"  stage {index} on device(s) {_ranges(devices)}: the plan estimated "
            f"{_gib(estimate) if estimate else 'no figure'} per device"
        )
    if device_memory_bytes:
        lines.append(f"  each device has {_gib(device_memory_bytes)}{' (' + device_kind + ')' if device_kind else ''}")
    lines.append(
        "Try, from the cheapest: a smaller batch or more micro-batches "
        "(PipeshardParallel(num_micro_batches=...)); shard the optimizer state and gradients "
        "(Zero2Parallel() / Zero3Parallel()); tensor or pipeline parallelism over more devices "
        "(ShardParallel(), PipeshardParallel()); a tighter planner budget "
        "(ShardParallel(memory_budget=bytes)) so the plan keeps within what the device has. "
        "See docs/debugging.md (out of memory)."
    )
    return DeviceMemoryError("\n".join(lines))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _ranges(devices: list[int]) -> str:
    if devices and devices == list(range(devices[0], devices[-1] + 1)) and len(devices) > 2:
        return f"{devices[0]}–{devices[-1]}"
    return ", ".join(str(d) for d in devices)


def executable_peak_bytes(stats: dict[str, int]) -> int:
    """Per-device bytes one stage's executables hold at once by XLA's memory analysis (``engine.memory_stats()``'s
    entry of a stage): ``arguments + outputs − aliased + temporaries``, the largest over its executables (a pipeline
    stage's ``forward_`` and ``backward_`` programs). A pipeline stage's other in-flight micro-batches' residuals are
    not counted."""
    prefixes = {key[: -len("argument_bytes")] for key in stats if key.endswith("argument_bytes")}
    return max(
        (
            stats.get(f"{p}argument_bytes", 0)
            + stats.get(f"{p}output_bytes", 0)
            - stats.get(f"{p}alias_bytes", 0)
            + stats.get(f"{p}temp_bytes", 0)
            for p in prefixes
        ),
        default=0,
    )

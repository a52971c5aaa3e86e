"""The C heap of a process that runs XLA:CPU steps: freed memory kept for the next step.

XLA:CPU allocates an execution's temporaries as one buffer (``temp_bytes`` of :meth:`Engine.memory_stats`: 118 MB
for a ViT-medium step) and frees it when the execution ends. glibc's malloc serves a request that large with a fresh
``mmap`` and gives it back with ``munmap`` — from a worker thread's arena it does so whatever ``M_MMAP_MAX`` says
(such an arena's heaps are at most 64 MiB) — so every step touches every page of its temporaries for the first time:
a minor page fault per 4 KiB page, the kernel zeroing each (ViT-medium: 32,200 faults a step; Mixtral-medium 53,600).

:func:`keep_freed_memory` sets malloc to one arena (the main one, which grows with ``brk`` and can hold a buffer of
any size), no ``mmap``, and a trim threshold of 2 GiB: the buffer a step frees is the one the next step is given,
already mapped. Measured on a 2-core x86 (torchpar step, medium configs of ``benchmarks/single_device.py``): ViT
170 → 137 ms, Mixtral 280 → 225 ms, ResNet 17.1 → 14.8 ms; faults per step → 0.

What it costs: the process keeps the memory it freed (up to 2 GiB of it at the top of the heap) rather than giving
it back between steps — an engine's step about one more copy of its temporaries (an MLP step of 277 MB: resident
memory 957 → 1,208 MB, steady over 40 steps), but a heap without ``mmap`` fragments, and other programs in the
process may keep more (a loop of one plain jitted function with 174 MB of temporaries settled 1.4 GB above the
system heap's after ten calls) — and the malloc calls of all threads share one arena (compiling takes about a
tenth longer: a GPT-2 4×128 compile and first step 3.7 → 4.0 s). It changes the malloc of the
whole process; ``TORCHPAR_HOST_HEAP=system`` leaves malloc as it was. It must run before threads other than the main
one have allocated (each takes an arena of its own on its first allocation and keeps it): :func:`torchpar.init`
calls it first, before JAX starts its threads; Ray host actors start with the same settings in their environment
(:func:`environment`). Only glibc on Linux is changed; elsewhere this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import platform

log = logging.getLogger("torchpar")

ENV = "TORCHPAR_HOST_HEAP"
"""``system``: leave the process's malloc as it is; ``keep`` (the default): :func:`keep_freed_memory`."""
TRIM_THRESHOLD_BYTES = 2**31 - 1
"""Free memory at the top of the heap beyond this is returned to the system (the largest value mallopt takes)."""

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


@functools.cache
def keep_freed_memory() -> bool:
    """Set this process's malloc to keep what it frees (module docstring), once; whether it did (False: not glibc on
    Linux, or ``TORCHPAR_HOST_HEAP=system``)."""
    setting = os.environ.get(ENV, "keep").strip().lower()
    if setting not in ("keep", "system"):
        raise ValueError(f"{ENV} must be 'keep' or 'system', got {os.environ[ENV]!r}")
    if setting == "system" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    done = all(
        libc.mallopt(parameter, value) == 1
        for parameter, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
    )
    if not done:
        log.warning("torchpar: glibc's mallopt refused a setting; XLA:CPU steps may page-fault their temporaries")
    log.debug("torchpar: malloc keeps freed memory (one arena, no mmap, trim above %d bytes)", TRIM_THRESHOLD_BYTES)
    return done


def environment() -> dict[str, str]:
    """The environment variables that give a process started with them the malloc of :func:`keep_freed_memory`
    from its first allocation on (glibc reads them at start-up; for Ray host actors); empty with
    ``TORCHPAR_HOST_HEAP=system``."""
    if os.environ.get(ENV, "keep").strip().lower() == "system":
        return {ENV: "system"}
    return {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_BYTES)}

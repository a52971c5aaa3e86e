"""Human-readable seconds, bytes and FLOPs: one spelling for the plan summary, the CLI and the reports."""

from __future__ import annotations


def format_seconds(seconds: float) -> str:
    """``0.0123`` → ``"12.3 ms"`` (3 significant digits, in s, ms or µs)."""
    seconds = float(seconds)
    if seconds == 0:
        return "0 s"
    if abs(seconds) >= 1:
        return f"{seconds:.3g} s"
    if abs(seconds) >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    if abs(seconds) >= 1e-6:
        return f"{seconds * 1e6:.3g} µs"
    return f"{seconds * 1e9:.3g} ns"


def format_bytes(count: float) -> str:
    """``33529124`` → ``"32 MiB"`` (binary units, 3 significant digits)."""
    count = float(count)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count:.0f} B"


def format_flops(count: float) -> str:
    """``1.5e9`` → ``"1.5 GFLOP"``."""
    count = float(count)
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(count) >= size:
            return f"{count / size:.3g} {unit}"
    return f"{count:.0f} FLOP"

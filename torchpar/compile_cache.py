"""JAX's persistent compilation cache, on by default: a step XLA compiled once loads from disk next time.

XLA compiles a large training step in tens of seconds to minutes on a GPU. JAX can keep each compiled
executable on disk, keyed by the program, the compile options, the XLA flags, the devices and the jax/jaxlib
versions; another process compiling the same step then reads it back instead (on a GPU, XLA's per-fusion
autotuning results are kept there too). :func:`torchpar.init` turns the cache on, and Ray host actors get
the same settings through their environment (:func:`environment`, :mod:`torchpar.runtime.ray.host_actor`).

Which directory (first rule that applies):

| setting | cache |
|---|---|
| JAX's own ``jax_compilation_cache_dir`` (``JAX_COMPILATION_CACHE_DIR``, or ``jax.config.update``) | left exactly as configured: torchpar changes nothing |
| ``init(compile_cache=False)`` | none |
| ``init(compile_cache="/path")`` | ``/path`` |
| ``TORCHPAR_CACHE_DIR=off`` (or ``0``, or empty) | none |
| ``TORCHPAR_CACHE_DIR=/path`` | ``/path`` |
| nothing set | ``$XDG_CACHE_HOME/torchpar/xla``, by default ``~/.cache/torchpar/xla`` |

Where torchpar sets the directory it also sets JAX's thresholds for writing an entry, unless they were set
already: every executable is written, whatever its compile time (:data:`MIN_COMPILE_TIME_S`) and size. JAX's
default of 1 s would skip the steps of small models (a small MLP's step compiles in about 0.1 s on a CPU); the
few helper programs torchpar also compiles (PRNG keys, dtype conversions) add a few small files. The directory
may be deleted at any time. Like any JAX compilation cache it is trusted code: do not point it at a directory
others can write to.

:func:`hits` counts executables this process loaded from the cache (JAX's monitoring event
``/jax/compilation_cache/cache_hits``), :func:`counts` also the requests and the entries written.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

log = logging.getLogger(__name__)

ENV_VAR = "TORCHPAR_CACHE_DIR"
"""Environment variable: the cache directory, or ``off`` / ``0`` / empty for none."""
OFF_VALUES = ("off", "0", "")
MIN_COMPILE_TIME_S = 0.0
"""Executables that compiled faster than this are not written to the cache (JAX's default: 1 s)."""
JAX_VARIABLES = (
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
)
"""JAX's environment variables for its cache; a process JAX starts in reads them when it imports JAX."""

_JAX_DEFAULT_MIN_COMPILE_TIME_S = 1.0
_JAX_DEFAULT_MIN_ENTRY_SIZE = 0
_EVENTS = {
    "/jax/compilation_cache/compile_requests_use_cache": "requests",
    "/jax/compilation_cache/cache_hits": "hits",
    "/jax/compilation_cache/cache_misses": "writes",
}  # JAX records a "miss" when it writes the entry

_ours: str | None = None  # the directory torchpar gave JAX (None: JAX's setting, if any, is not ours)
_logged: str | None = None
_counts = dict.fromkeys(_EVENTS.values(), 0)
_counts_lock = threading.Lock()
_listening = False


def default_dir() -> str:
    """``$XDG_CACHE_HOME/torchpar/xla`` (``~/.cache/torchpar/xla`` when ``XDG_CACHE_HOME`` is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "torchpar", "xla")


def requested_dir() -> str | None:
    """The directory ``TORCHPAR_CACHE_DIR`` asks for (the default when unset; ``None`` for ``off``)."""
    value = os.environ.get(ENV_VAR)
    if value is None:
        return default_dir()
    if value.strip().lower() in OFF_VALUES:
        return None
    return os.path.expanduser(value.strip())


def enable(directory: str | None = None) -> str | None:
    """Turn JAX's persistent compilation cache on in ``directory`` (``None``: :func:`requested_dir`); returns the
    directory JAX caches in, or ``None`` for no cache.

    A directory set through JAX itself is kept as it is (see the module docstring). Call it before the first
    compilation you want cached; calling it again with the same directory does nothing. A directory that cannot
    be created leaves the cache off, with a warning.
    """
    import jax

    _listen()
    current = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # jax sets its flags at run time
    if current and current != _ours:
        if directory is not None and os.path.abspath(directory) != os.path.abspath(current):
            log.warning(
                "torchpar: compile cache %s ignored: JAX's jax_compilation_cache_dir is set to %s, which "
                "torchpar keeps",
                directory,
                current,
            )
        _log_once(current, "set through JAX")
        return current
    wanted = directory if directory is not None else requested_dir()
    if wanted is None:
        disable()
        return None
    wanted = os.path.abspath(os.path.expanduser(wanted))
    try:
        os.makedirs(wanted, mode=0o700, exist_ok=True)
    except OSError as error:
        log.warning(
            "torchpar: compile cache off: cannot create %s (%s); set %s to a writable directory or 'off'",
            wanted,
            error,
            ENV_VAR,
        )
        disable()
        return None
    _set_thresholds(jax.config)
    jax.config.update("jax_compilation_cache_dir", wanted)
    _set_ours(wanted)
    _log_once(wanted, f"set {ENV_VAR}=off to turn it off" if directory is None else "")
    return wanted


def disable() -> None:
    """Turn off the cache :func:`enable` turned on (one set through JAX itself stays). Executables already loaded
    stay loaded; JAX stops reading and writing entries only if it had not opened the cache yet."""
    if _ours is None:
        return
    import jax

    if jax.config.jax_compilation_cache_dir == _ours:  # type: ignore[attr-defined]  # jax sets its flags at run time
        jax.config.update("jax_compilation_cache_dir", None)
        log.info("torchpar: XLA compilation cache off (it was %s)", _ours)
    _set_ours(None)


def cache_dir() -> str | None:
    """The directory JAX's persistent compilation cache uses in this process (``None``: no cache)."""
    if "jax" not in sys.modules:
        return os.environ.get("JAX_COMPILATION_CACHE_DIR") or None
    import jax

    return jax.config.jax_compilation_cache_dir or None  # type: ignore[attr-defined]  # jax sets its flags at run time


def environment() -> dict[str, str]:
    """JAX's cache settings in force here as environment variables, for the processes this one starts (Ray host
    actors import JAX after their environment is set, so they cache in the same directory)."""
    if "jax" not in sys.modules:
        return {name: value for name, value in os.environ.items() if name in JAX_VARIABLES}
    import jax

    directory = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # jax sets its flags at run time
    if not directory:
        return {}
    return {
        "JAX_COMPILATION_CACHE_DIR": directory,
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": repr(
            jax.config.jax_persistent_cache_min_compile_time_secs  # type: ignore[attr-defined]  # a run-time flag
        ),
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": str(
            jax.config.jax_persistent_cache_min_entry_size_bytes  # type: ignore[attr-defined]  # a run-time flag
        ),
    }


def hits() -> int:
    """Executables this process has loaded from the persistent cache since :func:`enable` was first called."""
    return counts()["hits"]


def counts() -> dict[str, int]:
    """Since :func:`enable` was first called in this process: ``requests`` (compilations that looked in the
    cache), ``hits`` (loaded from it) and ``writes`` (entries written)."""
    with _counts_lock:
        return dict(_counts)


def _set_thresholds(config: Any) -> None:
    """torchpar's write thresholds in ``jax.config``, where neither the environment nor the program set them."""
    if (
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ
        and config.jax_persistent_cache_min_compile_time_secs == _JAX_DEFAULT_MIN_COMPILE_TIME_S
    ):
        config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_S)
    if (
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES" not in os.environ
        and config.jax_persistent_cache_min_entry_size_bytes == _JAX_DEFAULT_MIN_ENTRY_SIZE
    ):
        config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no size threshold


def _set_ours(directory: str | None) -> None:
    global _ours
    _ours = directory


def _log_once(directory: str, note: str) -> None:
    global _logged
    if directory != _logged:
        log.info("torchpar: XLA compilation cache at %s%s", directory, f" ({note})" if note else "")
        _logged = directory


def _listen() -> None:
    """Count JAX's cache events from now on (:func:`counts`); once per process."""
    global _listening
    with _counts_lock:
        if _listening:
            return
        _listening = True
    import jax.monitoring

    jax.monitoring.register_event_listener(_on_event)


def _on_event(event: str, **_: object) -> None:
    name = _EVENTS.get(event)
    if name is not None:
        with _counts_lock:
            _counts[name] += 1

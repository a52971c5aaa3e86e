"""The disk cache of measured profiles (``profile=True``): stage and collective timings by what determines them.

A timing is stored as one JSON file named by the SHA-256 of its key, a JSON object holding everything the
measurement depends on: the stage graph (every op, operand, shape and dtype), its layouts and logical mesh, the
devices' platform and kind (and the CPU model for CPU devices), the jax version, the numerics and the remat
option. Anything else that changes the timing (another driver, XLA flags set by hand, load on the machine) is not
in the key: delete the directory to measure again. Writes are atomic (a temporary file renamed into place), so
concurrent planners never read half an entry.

Which directory (first rule that applies): ``TORCHPAR_PROFILE_DIR`` (``off``/``0``/empty: none);
``TORCHPAR_CACHE_DIR=off``: none; otherwise ``$XDG_CACHE_HOME/torchpar/profiles`` (``~/.cache/torchpar/profiles``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from torchpar import compile_cache

if TYPE_CHECKING:
    import jax

log = logging.getLogger(__name__)

ENV_VAR = "TORCHPAR_PROFILE_DIR"
OFF_VALUES = compile_cache.OFF_VALUES
VERSION = 1
"""Bumped when the meaning of a stored timing changes; older entries are then never read."""


def profile_dir() -> str | None:
    """The cache directory by the module docstring's rules (``None``: no disk cache)."""
    value = os.environ.get(ENV_VAR)
    if value is not None:
        return None if value.strip().lower() in OFF_VALUES else os.path.expanduser(value.strip())
    general = os.environ.get(compile_cache.ENV_VAR)
    if general is not None and general.strip().lower() in OFF_VALUES:
        return None
    return os.path.join(os.path.dirname(compile_cache.default_dir()), "profiles")  # beside the XLA cache's default


def hardware_name(devices: Sequence[jax.Device]) -> str:
    """``platform:device kind`` of ``devices`` (all the same kind), with the processor model for CPU devices, whose
    JAX device kind does not tell one machine from another."""
    kinds = sorted({f"{d.platform}:{d.device_kind}" for d in devices})
    name = ",".join(kinds)
    if all(d.platform == "cpu" for d in devices):
        name += f" ({_cpu_model()}, {os.cpu_count()} cores)"
    return name


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class ProfileCache:
    """``get(key)`` / ``put(key, value)`` of JSON timings under ``directory`` (``None``: remember nothing). A value
    comes back as JSON made it (lists for tuples): each caller reads what it stores under its kind of key."""

    def __init__(self, directory: str | None):
        self.directory = directory
        self.hits = 0
        self.misses = 0

    def _path(self, key: Mapping[str, object]) -> str:
        text = json.dumps({"version": VERSION, **key}, sort_keys=True, default=str)
        return os.path.join(self.directory or "", hashlib.sha256(text.encode()).hexdigest() + ".json")

    def get(self, key: Mapping[str, object]) -> object | None:
        """The stored value of ``key``, or ``None``. A corrupt entry is logged and treated as absent."""
        if self.directory is None:
            return None
        path = self._path(key)
        try:
            with open(path) as file:
                value = json.load(file)
        except FileNotFoundError:
            self.misses += 1
            return None
        except (OSError, ValueError) as error:
            log.warning("profile cache entry %s is unreadable (%s); measuring again", path, error)
            self.misses += 1
            return None
        self.hits += 1
        return value

    def put(self, key: Mapping[str, object], value: object) -> None:
        """Store ``value`` under ``key``; a directory that cannot be written is logged, never raised."""
        if self.directory is None:
            return
        try:
            os.makedirs(self.directory, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
            with os.fdopen(handle, "w") as file:
                json.dump(value, file)
            os.replace(temporary, self._path(key))
        except OSError as error:
            log.warning(
                "could not write the profile cache in %s (%s): timings will be measured again next time",
                self.directory,
                error,
            )

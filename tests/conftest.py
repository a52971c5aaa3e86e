"""Test session set-up: 8 fake CPU devices for JAX (before anything imports it), quiet transformers, one
XLA compilation cache for the session, XLA:CPU's backend at optimization level 0 and its elemental emitters
(compiling is most of the suite's time), the nominal cost constants (not measured ones: the same plans on every machine), a
cyclic garbage collector that runs less often and skips what collection imported, and the ``ray`` mark on every test
that starts Ray processes.

Many tests compile the same small programs (the same tiny model under several options, a stage compiled
in the driver and again in a host actor); JAX's persistent compilation cache, in a directory of this
session only, compiles each once. The variables are inherited by the processes the tests start (examples,
Ray host actors), so they share it.

``make test`` runs the tests without the ``ray`` mark on two pytest-xdist workers at nice 10 and, beside them at
normal priority, the Ray tests one at a time (never two Ray tests at once: host actors are pinned to cores, and
several simulated clusters on two cores would crowd each other past their timeouts; the niced tests only take
the CPU the Ray tests leave). The embedded Ray instance of
``tests/runtime/ray_helpers.ray_cluster`` is kept between tests and stopped
at the end of the session.
"""

import atexit
import gc
import importlib.util
import inspect
import mmap
import os
import re
import shutil
import tempfile
from pathlib import Path

import pytest

_xla_cache = tempfile.mkdtemp(prefix="torchpar-tests-xla-cache-")
atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _xla_cache)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# plans priced with the nominal cost constants, not this machine's measured ones: the plans tests assert do not
# depend on the machine or its load (tests/planner/test_machine_constants.py switches measuring on)
os.environ.setdefault("TORCHPAR_COST_CONSTANTS", "nominal")
# XLA:CPU's LLVM backend at optimization level 0: the suite compiles hundreds of tiny programs and runs each a few
# times, so compilation is most of its time (a fifth less wall time). HLO passes — the partitioner, collectives,
# fusion — run as in production; the same HLO arithmetic (no fast-math), last bits aside (LLVM's instruction choice),
# within every test's tolerance.
# With it, XLA:CPU's older elemental emitters instead of its MLIR fusion emitters (where this jaxlib has the flag: an
# unknown XLA flag aborts the process): the same fusions, emitted in about two thirds of the compile time.
# TORCHPAR_TEST_XLA_OPT=default compiles as users do.


def _jaxlib_knows(flag: str) -> bool:
    """Whether this jaxlib's binaries register the XLA flag ``flag`` (found by name, without importing jax)."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or spec.origin is None:
        return False
    for path in Path(spec.origin).parent.glob("*.so"):
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as binary:
            if binary.find(flag.encode()) >= 0:
                return True
    return False


if os.environ.get("TORCHPAR_TEST_XLA_OPT", "0") != "default" and "xla_backend_optimization_level" not in \
        os.environ.get("XLA_FLAGS", ""):
    _fast_compile = ["--xla_backend_optimization_level=0"]
    if _jaxlib_knows("xla_cpu_use_fusion_emitters"):
        _fast_compile.append("--xla_cpu_use_fusion_emitters=false")
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *_fast_compile]).strip()

# The suite is compile-bound: malloc as the system sets it compiles ~10% faster than the one torchpar.init sets for
# steps (one arena; torchpar/host_heap.py), which tests/api/test_host_heap.py runs in processes of its own.
os.environ.setdefault("TORCHPAR_HOST_HEAP", "system")

import torchpar  # noqa: E402

torchpar.init(cluster="local", num_devices=8)

import transformers  # noqa: E402

transformers.logging.set_verbosity_error()


# The cyclic garbage collector at its default thresholds (700, 10, 10) runs a full collection every few seconds
# of a test, each walking every object alive — after collection, the millions of objects torch, transformers, JAX
# and OpInfo's database leave — and drops what JAX's and torch's weak-reference caches hold: a fifth of a capture
# test's CPU time. Young collections every 50,000 allocations still free the garbage a test leaves (its engines'
# cycles), and the objects alive once the tests are collected are frozen (never walked again; they live to the
# end anyway). Measured on tests/runtime/test_loss_reduction.py and tests/models/test_hf_training.py alone:
# 143 → 111 CPU-s, peak memory 1.21 → 1.37 GB; `make test-fast` 257 → 230 CPU-s. The processes the tests start keep
# Python's defaults, except the doc-block runner (tests/docs/doc_blocks.py), which sets these thresholds before a
# case imports anything; host actors settle their own (torchpar/runtime/ray/host_actor.py).
gc.set_threshold(50_000, 20, 10)


def pytest_collection_finish(session: pytest.Session) -> None:
    gc.collect()
    gc.freeze()


_RAY_WORDS = ('cluster="ray"', "ray_cluster(", "ray.init(")
_RAY_IN_ID = re.compile(r"(?<![a-z])ray")  # test_ray_faults.py, [ray], [ray_data_parallel.py]; not "array"


def _source_starts_ray(function: object) -> bool:
    try:
        source = inspect.getsource(function)
    except (AttributeError, OSError, TypeError):
        return False
    return any(word in source for word in _RAY_WORDS)


def _starts_ray(item: pytest.Item) -> bool:
    """A test starts Ray if its id says so, a host fixture it uses is a Ray set-up (``two_hosts_of_two``; not a
    local cluster of two hosts), or its own code starts Ray."""
    if _RAY_IN_ID.search(item.nodeid.lower()):
        return True
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        if "host" in name and any(_source_starts_ray(definition.func)
                                  for definition in (info.name2fixturedefs.get(name, ()) if info else ())):
            return True
    return _source_starts_ray(getattr(item, "function", None))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _starts_ray(item):
            item.add_marker(pytest.mark.ray)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the embedded Ray instance that ``tests/runtime/ray_helpers.ray_cluster`` keeps between tests."""
    torchpar.shutdown()

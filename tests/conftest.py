"""Test session set-up: 8 fake CPU devices for JAX (before anything imports it), quiet transformers, and one
XLA compilation cache for the session.

Many tests compile the same small programs (the same tiny model under several options, a stage compiled
in the driver and again in a host actor); JAX's persistent compilation cache, in a directory of this
session only, compiles each once. The variables are inherited by the processes the tests start (examples,
Ray host actors), so they share it.
"""

import atexit
import os
import shutil
import tempfile

_xla_cache = tempfile.mkdtemp(prefix="torchpar-tests-xla-cache-")
atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _xla_cache)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import torchpar  # noqa: E402

torchpar.init(cluster="local", num_devices=8)

import transformers  # noqa: E402

transformers.logging.set_verbosity_error()

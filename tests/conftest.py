"""Test session set-up: 8 fake CPU devices for JAX (before anything imports it), quiet transformers."""

import torchpar

torchpar.init(cluster="local", num_devices=8)

import transformers  # noqa: E402

transformers.logging.set_verbosity_error()

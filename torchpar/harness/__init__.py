"""Harnesses around torchpar, not part of its core: model builders with random weights (:mod:`.zoo`) and the
side-by-side loss comparison with PyTorch (:mod:`.compare`), for the tests, examples, benchmarks and
``python -m torchpar compare``. Nothing in the core imports them."""

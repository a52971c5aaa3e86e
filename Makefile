# Two commands on a fresh machine with Python ≥ 3.11:
#   make demo   — create .venv, install, train GPT-2 with PyTorch and torchpar side by side
#   make test   — create .venv, install with test extras, run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test install benchmark clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) examples/compare_loss.py --model gpt2 --steps 20 --optimizer adamw --plot compare_loss.png

# The Ray tests (one at a time) run beside the tests without Ray (two xdist workers), sharing one XLA compilation
# cache: the Ray tests leave much of a core idle (processes starting, actors waiting on each other, timeouts), which
# the other tests use; their output is printed after the others'. Exit status 5 ("nothing collected", e.g.
# PYTEST_ARGS naming one file) is not a failure.
test: install
	@cache=$$(mktemp -d); export JAX_COMPILATION_CACHE_DIR=$$cache; raylog=$$cache.ray.log; \
	$(PY) -m pytest -q -m ray $(PYTEST_ARGS) > $$raylog 2>&1 & ray=$$!; \
	trap 'kill $$ray 2>/dev/null; rm -rf $$cache $$raylog; exit 130' INT TERM; \
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not ray" $(PYTEST_ARGS); first=$$?; \
	wait $$ray; second=$$?; \
	echo "--- the Ray tests (pytest -m ray) ---"; cat $$raylog; \
	rm -rf $$cache $$raylog; \
	for status in $$first $$second; do [ $$status -eq 0 ] || [ $$status -eq 5 ] || exit $$status; done

benchmark: install
	$(PY) benchmarks/single_device.py

clean:
	rm -rf $(VENV) .pytest_cache compare_loss.png

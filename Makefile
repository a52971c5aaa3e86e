# Two commands on a fresh machine with Python ≥ 3.11:
#   make demo   — create .venv, install, train GPT-2 with PyTorch and torchpar side by side
#   make test   — create .venv, install with test extras, run the test suite
#   make test-fast — the same venv, a subset for iterating (no Ray; 2 min on a quiet 2-vCPU machine)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test test-fast lint install benchmark clean

# pip prints what it collects and downloads (no --quiet): a fresh install takes minutes and should not look hung.
$(VENV)/.installed: pyproject.toml
	@echo "torchpar: creating $(VENV) and installing torch 2.13.0 (CPU wheel), JAX (jax[cpu]), OR-Tools, Ray, transformers"
	@echo "torchpar: and the test tools: about 2.2 GB on disk, 3-5 minutes on a fresh machine (once; later runs reuse it)"
	$(PYTHON) -m venv $(VENV)
	@echo "torchpar: [1/2] torch==2.13.0"
	$(PY) -m pip install --progress-bar on torch==2.13.0
	@echo "torchpar: [2/2] torchpar and its dependencies (pyproject.toml, extras [test])"
	$(PY) -m pip install --progress-bar on -e ".[test]"
	@echo "torchpar: installed into $(VENV) ($$(du -sh $(VENV) | cut -f1))"
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) examples/compare_loss.py --model gpt2 --steps 20 --optimizer adamw --plot compare_loss.png

# The tests that start no Ray processes run on two xdist workers at a lower priority (nice 10) while, beside them, the
# Ray tests run one at a time at normal priority: the Ray tests spend much of their time waiting (host processes
# starting, timeouts they provoke), the others fill the cores meanwhile, and the Ray processes get the CPU whenever
# they want it, so their timeouts hold. (Beside them at the same priority, a Ray example's subprocess once ran past
# its 300 s guard in CI — 45 s alone.) `make lint` runs beside them too, at nice 10 (mypy is a minute on one core:
# the suite is CPU-bound, so run first it would leave the other core idle). The lint's and the Ray part's output
# follow the other part's. One XLA compilation cache is shared. Exit status 5 ("nothing collected", e.g. PYTEST_ARGS
# naming one file) is not a failure. Each part reports its ten slowest tests (--durations=10).
test: install
	@cache=$$(mktemp -d); ray_log=$$(mktemp); lint_log=$$(mktemp); export JAX_COMPILATION_CACHE_DIR=$$cache; \
	nice -n 10 $(MAKE) --no-print-directory lint > $$lint_log 2>&1 & lint=$$!; \
	$(PY) -m pytest -q -m ray --durations=10 $(PYTEST_ARGS) > $$ray_log 2>&1 & ray=$$!; \
	trap 'kill $$ray $$lint 2>/dev/null; rm -rf $$cache $$ray_log $$lint_log; exit 130' INT TERM; \
	echo "--- the tests without Ray (pytest -m 'not ray', nice 10); the Ray tests and make lint run beside them ---"; \
	nice -n 10 $(PY) -m pytest -q -n 2 --dist worksteal -m "not ray" --durations=10 $(PYTEST_ARGS); first=$$?; \
	wait $$ray; second=$$?; wait $$lint; linted=$$?; \
	echo "--- make lint (beside the tests) ---"; cat $$lint_log; \
	echo "--- the Ray tests (pytest -m ray, one at a time, beside the others) ---"; cat $$ray_log; \
	rm -rf $$cache $$ray_log $$lint_log; \
	[ $$linted -eq 0 ] || { echo "make lint failed (its output is above)"; exit $$linted; }; \
	for status in $$first $$second; do [ $$status -eq 0 ] || [ $$status -eq 5 ] || exit $$status; done

# A subset for iterating (about 2 minutes on 2 cores, no Ray): capture and autograd semantics (not PyTorch's module_db
# sweep or the attention masks), the engine, every op against PyTorch's OpInfo samples, optimizers, the planner's
# solvers, every one-stage method trained beside PyTorch, accumulation and micro-batch losses, schedules, per-device
# programs, layering. `make test` is what CI runs.
FAST_TESTS = tests/capture/test_grad_semantics.py tests/capture/test_autograd_functions.py tests/api/test_engine.py tests/jaxbackend/test_optim.py tests/jaxbackend/test_ops_opinfo.py \
	tests/jaxbackend/test_spmd.py tests/planner/test_ilp.py tests/planner/test_layers.py tests/planner/test_stages.py \
	tests/planner/test_sharded_training.py tests/planner/test_schedules.py tests/runtime/test_grad_accumulation.py \
	tests/runtime/test_loss_reduction.py tests/runtime/test_last_batch.py tests/runtime/test_grad_norm.py tests/planner/test_training_plan.py tests/test_layering.py

# Style and types as a machine checks them (configuration: pyproject.toml's [tool.ruff] and [tool.mypy]);
# `ruff format torchpar jaxbackend` fixes the layout, `ruff check --fix` what it can of the rest; mypy must report
# nothing on torchpar/ and jaxbackend/ (about a minute on 2 cores). Part of `make test`.
lint: install
	$(PY) -m ruff check torchpar jaxbackend
	$(PY) -m ruff format --check torchpar jaxbackend
	$(PY) -m mypy

test-fast: install
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not ray" --durations=10 $(FAST_TESTS) $(PYTEST_ARGS)

benchmark: install
	$(PY) benchmarks/single_device.py

clean:
	rm -rf $(VENV) .pytest_cache compare_loss.png

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

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

benchmark: install
	$(PY) benchmarks/single_device.py

clean:
	rm -rf $(VENV) .pytest_cache compare_loss.png

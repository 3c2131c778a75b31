# Every target creates .venv on first use and installs through constraints.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test bench lint clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[lightning,dev]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.installed
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_engine.py

lint: $(VENV)/.installed
	$(PY) -m ruff check src tests examples benchmarks
	$(PY) -m ruff format --check src tests examples benchmarks
	$(PY) -m mypy

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

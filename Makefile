# Thin aliases for dev.py, which needs only Python and pip (see README).
PYTHON ?= python3

.PHONY: demo test bench plots lint wheel docs clean
demo test bench plots lint wheel docs:
	$(PYTHON) dev.py $@

clean:
	rm -rf .venv .venv-demo build dist docs/_build src/*.egg-info

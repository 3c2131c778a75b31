# Thin aliases for dev.py, which needs only Python and pip (see README).
PYTHON ?= python3

.PHONY: demo test bench plots lint clean
demo test bench plots lint:
	$(PYTHON) dev.py $@

clean:
	rm -rf .venv build src/*.egg-info

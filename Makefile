# Thin aliases for dev.py, which needs only Python and pip (see README).
PYTHON ?= python3

.PHONY: demo test bench plots lint wheel clean
demo test bench plots lint wheel:
	$(PYTHON) dev.py $@

clean:
	rm -rf .venv build dist src/*.egg-info

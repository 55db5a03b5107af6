# Fresh clone: `make demo` sets up .venv and runs the examples; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test setup clean

setup: $(VENV)/.installed

# torch==2.13.0 first: it is the CPU build on these machines; an unpinned torch would pull CUDA wheels.
# The test extra brings triton and matplotlib; triton is pinned to the version README's table claims.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]' triton==3.9.0
	touch $@

demo: setup
	$(PY) examples/run_all.py

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info

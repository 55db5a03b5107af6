# Fresh clone: `make demo` sets up .venv and runs the examples; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-oldest-triton setup clean

setup: $(VENV)/.installed

# torch==2.13.0 first: it is the CPU build on these machines; an unpinned torch would pull CUDA wheels.
# The test extra brings triton and matplotlib; triton is pinned to the version README's table claims.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip 'setuptools>=77'  # tests build the wheel without build isolation
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]' triton==3.9.0
	touch $@

demo: setup
	$(PY) examples/run_all.py

# One pytest worker per core (pytest-xdist), each test file on one worker: most of the suite is
# single-threaded (Triton's interpreter), and a file's tests share fixtures and kernel caches.
test: setup
	$(PY) -m ruff check
	$(PY) -m pytest -q -n auto --dist loadfile

# The oldest Triton pyproject allows (triton>=3.6), proven on CPU: the Triton kernel tests in a venv
# that sees .venv's packages through a .pth line but has its own triton 3.6.0, and numpy < 2.4
# (Triton 3.6's interpreter turns 1-element arrays into ints, which numpy 2.4 refuses).
OLDEST_TRITON := 3.6.0
OLD := .venv-triton-oldest
test-oldest-triton: setup
	rm -rf $(OLD)
	$(PY) -m venv --without-pip $(OLD)
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" > \
		"$$($(OLD)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_venv.pth"
	$(PY) -m pip --python $(OLD)/bin/python install -q --no-deps triton==$(OLDEST_TRITON) 'numpy<2.4'
	$(OLD)/bin/python -c "import triton; assert triton.__version__ == '$(OLDEST_TRITON)', triton.__version__"
	PYTHONPATH=$(CURDIR) $(OLD)/bin/python -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning tests/backends/triton/test_triton_forward.py

clean:
	rm -rf $(VENV) $(OLD) build *.egg-info

# Fresh clone: `make demo` sets up .venv and runs the examples; `make test` sets up and runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test test-quick test-oldest setup clean

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
# single-threaded (Triton's interpreter), and a file's tests share fixtures and kernel caches. The 20
# slowest tests are listed at the end, so a test that grows shows up.
test: setup
	$(PY) -m ruff check
	$(PY) -m pytest -q -n auto --dist loadfile --durations=20

# The inner loop, under 2 minutes on 2 cores: property tests draw a fifth of their examples
# (FLEXC_QUICK=1, read by tests/strategies.py), and the slowest files are left out: those that mostly
# run Triton's interpreter, torch.compile, ptxas, a fresh virtual environment or process groups, and the
# catalogue-wide comparisons with torch and dense references; so are the tests, wherever they are, of
# the TRITON backend (the interpreter), torch.compile and every catalogue mod (QUICK_DESELECTED, by name):
# 1570 of 2561 tests run. `make test` (CI) runs everything.
QUICK_SKIPPED := tests/backends/triton tests/torch_compile tests/test_package.py tests/test_simulated_gpu.py \
	tests/test_gpu_script.py tests/test_triton_bench.py tests/test_kernel_metrics.py \
	tests/call/test_generated_backward_coverage.py tests/call/test_dropin_grad_accuracy.py \
	tests/call/test_distributed.py tests/call/test_dropout.py tests/backends/test_versioned_memo.py \
	tests/masks/test_block_mask_oracle.py tests/analysis/test_ranges_catalogue.py tests/tools/test_gallery.py
QUICK_DESELECTED := not TRITON and not compile and not every_catalogue and not rewritten_mods
test-quick: setup
	$(PY) -m ruff check
	FLEXC_QUICK=1 $(PY) -m pytest -q -n auto --dist loadfile --durations=10 $(addprefix --ignore=,$(QUICK_SKIPPED)) \
		-k "$(QUICK_DESELECTED)"

# The oldest torch and Triton pyproject allows (torch>=2.11, triton>=3.6), the stack GPU machines ship,
# proven on CPU in a venv of its own (kept while pyproject.toml and the pins are unchanged): torch 2.11.0
# from the index (its CUDA build, which runs on CPU), triton 3.6.0, numpy < 2.4 (Triton 3.6's
# interpreter turns 1-element arrays into ints, which numpy 2.4 refuses) and flexc's test extra. It runs
# the tests of what differs in torch 2.11: torch.compile, the simulated GPU, bench/gpu.py, building and
# converting BlockMasks (and plotting torch's), the drop-in checks against torch's API, and the Triton
# forward kernels. Two workers, a test file each (about 4 minutes on 2 cores).
OLDEST_TORCH := 2.11.0
OLDEST_TRITON := 3.6.0
OLDEST := .venv-oldest
OLDEST_TESTS := tests/torch_compile tests/test_simulated_gpu.py tests/test_gpu_script.py tests/masks \
	tests/tools/test_plot.py $(wildcard tests/call/test_dropin_*.py) tests/call/test_differences.py \
	tests/backends/triton/test_triton_forward.py tests/test_device.py tests/test_device_limits.py \
	tests/test_device_streams.py tests/backends/triton/test_config_defaults.py tests/backends/triton/test_triton_retry.py

$(OLDEST)/.installed-$(OLDEST_TORCH)-$(OLDEST_TRITON): pyproject.toml
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install -q --upgrade pip 'setuptools>=77'
	$(OLDEST)/bin/python -m pip install -q torch==$(OLDEST_TORCH) triton==$(OLDEST_TRITON) 'numpy<2.4' -e '.[test]'
	rm -f $(OLDEST)/.installed-*
	touch $@

test-oldest: $(OLDEST)/.installed-$(OLDEST_TORCH)-$(OLDEST_TRITON)
	$(OLDEST)/bin/python -c "import torch, triton; v = torch.__version__.split('+')[0], triton.__version__; \
		assert v == ('$(OLDEST_TORCH)', '$(OLDEST_TRITON)'), v"
	$(OLDEST)/bin/python -m pytest -q -n 2 --dist loadfile -p no:cacheprovider -W ignore::DeprecationWarning \
		$(OLDEST_TESTS)

clean:
	rm -rf $(VENV) $(OLDEST) build *.egg-info

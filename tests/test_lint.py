"""ruff's pyflakes rules (pyproject's [tool.ruff]) find nothing in flexc/, tests/, bench/ or examples/:
no undefined names, no unused imports or variables."""
import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (the test extra brings it: pip install -e '.[test]')")
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "flexc", "tests", "bench",
                             "examples"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, f"ruff check found problems:\n{result.stdout}{result.stderr}"

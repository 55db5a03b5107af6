"""Paths of the repository, for tests in any folder of tests/."""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent  # the checkout: flexc/, docs/, examples/, bench/
TESTS = ROOT / "tests"

"""The suite's two speeds: `make test` (CI) runs every test with every property's full example count
and lists its slowest tests; `make test-quick` draws fewer examples and leaves out the slowest files."""
import re

from repo import ROOT
from strategies import example_count, examples, quick_run

MAKEFILE = (ROOT / "Makefile").read_text()


def _recipe(target: str) -> str:
    return re.search(rf"^{target}:.*\n((?:\t.*\n)+)", MAKEFILE, re.M).group(1)


def test_properties_draw_their_full_count_unless_flexc_quick_is_set():
    assert not quick_run({}) and not quick_run({"FLEXC_QUICK": ""}) and not quick_run({"FLEXC_QUICK": "0"})
    assert quick_run({"FLEXC_QUICK": "1"})
    assert [example_count(n, quick=False) for n in (2, 16, 300)] == [2, 16, 300]
    assert [example_count(n, quick=True) for n in (2, 16, 300)] == [2, 3, 60]
    assert examples(40).max_examples == example_count(40)


def test_make_test_runs_everything_and_lists_the_slowest_tests():
    recipe = _recipe("test")
    assert "--durations=20" in recipe and "FLEXC_QUICK" not in recipe and "--ignore" not in recipe


def test_make_test_quick_draws_fewer_examples_and_skips_files_that_exist():
    recipe = _recipe("test-quick")
    assert "FLEXC_QUICK=1" in recipe and "$(addprefix --ignore=,$(QUICK_SKIPPED))" in recipe
    assert '-k "$(QUICK_DESELECTED)"' in recipe and re.search(r"^QUICK_DESELECTED := not \w", MAKEFILE, re.M)
    skipped = re.search(r"^QUICK_SKIPPED := ((?:.*\\\n)*.*)$", MAKEFILE, re.M).group(1).replace("\\\n", " ").split()
    assert skipped and all((ROOT / path).exists() for path in skipped), skipped
    assert "make test-quick" in (ROOT / "README.md").read_text()

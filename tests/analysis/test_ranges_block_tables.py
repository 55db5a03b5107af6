from strategies import examples
"""flexc.analysis.block_tables builds torch's ordered block tables without sorting; the reference here is
the stable descending argsort that defines the layout."""
import torch
from hypothesis import given, strategies as st

from flexc.analysis.block_tables import ordered_tables


def by_sorting(occupancy):
    dense = occupancy.to(torch.int32)
    return (dense.sum(dim=-1, dtype=torch.int32),
            torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32))


def assert_same(occupancy):
    num, indices = ordered_tables(occupancy)
    ref_num, ref_indices = by_sorting(occupancy)
    assert num.dtype == indices.dtype == torch.int32
    assert torch.equal(num, ref_num) and torch.equal(indices, ref_indices)


@examples(60)
@given(rows=st.integers(1, 40), cols=st.integers(1, 70), density=st.sampled_from([0.0, 0.03, 0.1, 0.5, 0.95, 1.0]),
       seed=st.integers(0, 1000), transpose=st.booleans())
def test_random_occupancy_gives_the_stable_argsort_order(rows, cols, density, seed, transpose):
    occupancy = torch.rand(2, rows, cols, generator=torch.Generator().manual_seed(seed)) < density
    assert_same(occupancy.transpose(-2, -1) if transpose else occupancy)


def test_structured_rows_runs_few_columns_and_mixed_rows():
    i, j = torch.arange(300).view(300, 1), torch.arange(300).view(1, 300)
    for occupancy in (i >= j, (i - j >= 0) & (i - j <= 3), (i == j) | (i - j == 2), (i == j) | (j == 0),
                      (j % 3 == 0), ((i // 37) == (j // 37)) & (i >= j)):
        assert_same(occupancy)
        assert_same(occupancy.t())
        assert_same(occupancy.to(torch.int32)[None, None])

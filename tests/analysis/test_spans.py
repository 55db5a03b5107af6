"""flexc.analysis.spans' algebra on sorted disjoint half-open spans equals set algebra on the integers they cover."""
from hypothesis import given, strategies as st

from flexc.analysis.spans import INF, complement, intersect, union
from strategies import examples

LO, HI = -40, 40  # the reference counts integers here; spans may also reach -inf/inf


@st.composite
def _spans(draw):
    cuts = sorted(set(draw(st.lists(st.integers(LO + 1, HI - 1), max_size=8))))
    ends = [-INF if draw(st.booleans()) else LO] + cuts + [INF if draw(st.booleans()) else HI]
    # alternate covered / uncovered pieces between the cuts, starting with either
    covered = draw(st.booleans())
    out = []
    for lo, hi in zip(ends, ends[1:]):
        if covered and lo < hi:
            out.append((lo, hi))
        covered = not covered
    return tuple(out)


def _points(spans) -> set:
    return {k for lo, hi in spans for k in range(LO, HI) if lo <= k < hi}


@examples(300)
@given(_spans(), _spans())
def test_intersection_complement_and_union_match_sets(x, y):
    every = set(range(LO, HI))
    both = intersect(x, y)
    assert _points(both) == _points(x) & _points(y)
    assert all(lo < hi for lo, hi in both) and all(a[1] <= b[0] for a, b in zip(both, both[1:]))
    assert _points(complement(x)) == every - _points(x)
    assert _points(union(x, y)) == _points(x) | _points(y)

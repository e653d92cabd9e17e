"""merge_spans: the union of [lo, hi) spans, sorted and disjoint."""

import pytest

from hotweights.changes.spans import merge_spans


@pytest.mark.parametrize("spans, want", [
    ([], []),
    ([(5, 9)], [(5, 9)]),
    ([(10, 20), (0, 5)], [(0, 5), (10, 20)]),  # sorted
    ([(0, 5), (5, 8)], [(0, 8)]),  # touching: joined
    ([(0, 10), (2, 4), (9, 12)], [(0, 12)]),  # inside, overlapping
    ([(3, 3), (0, 1)], [(0, 1), (3, 3)]),  # an empty span is kept
])
def test_merge_spans(spans, want):
    assert merge_spans(iter(spans)) == want  # any iterable, read once

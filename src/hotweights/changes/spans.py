"""Spans [lo, hi) of addresses or bytes, merged: the one loop `writewatch` and `checkpoint`
take their unions with."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["merge_spans"]


def merge_spans(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of `spans` as sorted, disjoint spans; spans that touch are joined."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out

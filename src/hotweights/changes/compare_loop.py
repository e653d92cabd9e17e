"""Which blocks of byte ranges differ between two buffers, in one compiled loop (numba).

`blocks.compare_bytes` narrows a patched shard's changed 64 KiB blocks to the 4 KiB pages
that differ from the file: a few hundred short ranges per tensor, where numpy's calls per
range cost most of the time (17 MB in 200 ranges: ~15 ms here, ~1.5 ms in this loop).

Imported by `blocks` only where the compiled loops may run (`compiled.numba_ready`).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(nogil=True, cache=True)
def _dirty(a: np.ndarray, b: np.ndarray, spans: np.ndarray, block: int,
           out: np.ndarray) -> None:
    for r in range(spans.shape[0]):
        at, hi = spans[r, 0], spans[r, 1]
        while at < hi:
            end = min(hi, at + block)
            x, y, acc = a[at:end], b[at:end], np.uint8(0)
            for i in range(x.size):  # from 0, no early exit: the loop vectorises
                acc |= x[i] ^ y[i]
            if acc:
                out[at // block] = True
            at = end


def dirty_blocks(a: np.ndarray, b: np.ndarray, spans: np.ndarray, block: int,
                 out: np.ndarray) -> None:
    """Set `out[j]` where the `block` bytes from `j * block` differ between the uint8
    arrays `a` and `b`, within the (k, 2) int64 `spans` [start, stop) (starts multiples of
    `block`, inside both arrays: the caller checks)."""
    _dirty(a, b, spans, block, out)

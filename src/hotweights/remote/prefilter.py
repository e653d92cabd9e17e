"""Which rows of which tensors may have changed since the last update, from per-block
fingerprints (`hotweights.changes.blocks`): blocks whose hash did not change are not compared.

Each tensor of two dims or more is cut into blocks of whole rows along dim 0 (about
`BLOCK_BYTES` each, a multiple of 8 bytes); any other tensor is one block. Hashing reads the
new weights once (xxh3 on the CPU, in one compiled loop: 0.02-0.04 s for 500 MB on one core
here; torch-mix64 on a GPU), and `delta.encode` then reads the old and new values only in the
blocks whose hash changed. A change is missed only if a changed block keeps its 64-bit hash:
odds of 2**-64 per changed block.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from hotweights.changes import blocks

__all__ = ["BLOCK_BYTES", "Prefilter", "Prints", "candidates", "fingerprints", "spared"]

BLOCK_BYTES = 2 << 10  # 1 % of rows changed at random leaves ~99 % of the rows of 2 KiB
# (a row of 1024 bf16) unread, ~92 % at 16 KiB: on a 500 MB model the encode after the
# fingerprints took 0.025 s, 0.049 s at 16 KiB (benchmarks/remote_update.py); the hashes
# cost 8 bytes per block (0.4 % of the weights), and no more time to take
DENSER = 0.5  # more blocks changed than this: the tensor is compared whole, not gathered
SPARE = 0.25  # fingerprints that spare less of the compare than this are then skipped ...
SKIP = 4  # ... for this many updates

Prints = dict[str, tuple[int, str, np.ndarray]]  # name -> (rows per block, kind, hashes)
_NONE = torch.zeros(0, dtype=torch.int64)  # no row changed (empty: never written to)


def _rows_per_block(t: torch.Tensor) -> int:
    """Whole rows per block, the block a multiple of 8 bytes; 0: the tensor is one block."""
    if t.dim() < 2 or not t.numel():
        return 0
    row_bytes = t.numel() // t.shape[0] * t.element_size()
    whole = 8 // math.gcd(row_bytes, 8)  # rows per 8-byte multiple
    return -(-max(1, BLOCK_BYTES // row_bytes) // whole) * whole


def fingerprints(tensors: Mapping[str, torch.Tensor]) -> Prints:
    """Per-block fingerprints of every tensor, on its own device (see the module doc).

    Raises:
        FingerprintError: a non-contiguous tensor (named).
    """
    out = {}
    for name, t in tensors.items():
        k = _rows_per_block(t)
        size = (k * t.numel() // t.shape[0] * t.element_size() if k
                else max(8, -(-t.nbytes // 8) * 8))
        fp = blocks.fingerprint({name: t}, block_size=size)
        out[name] = (k, fp.kind, fp.tensors[name][1])
    return out


def candidates(before: Prints | None, now: Prints,
               tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """name -> the rows (int64, ascending) of `tensors[name]` in blocks whose fingerprint
    changed from `before` to `now`; empty when none did. Left out, to be compared whole: a
    tensor `before` lacks or cut otherwise, a changed tensor that is one block, and one with
    more than `DENSER` of its blocks changed (gathering them would cost more than it saves).
    """
    out = {}
    for name, (k, kind, h) in now.items():
        old = (before or {}).get(name)
        if old is None or old[:2] != (k, kind) or old[2].shape != h.shape:
            continue
        changed = np.flatnonzero(old[2] != h)
        if not len(changed):
            out[name] = _NONE
        elif k and len(changed) <= DENSER * len(h):  # numpy: a fraction of torch's cost
            rows = (changed[:, None] * k + np.arange(k)).reshape(-1)
            n = tensors[name].shape[0]
            out[name] = torch.from_numpy(rows if rows[-1] < n else rows[rows < n])
    return out


def spared(rows: Mapping[str, torch.Tensor], tensors: Mapping[str, torch.Tensor]) -> float:
    """The fraction of the bytes of `tensors` that `rows` (from `candidates`) leaves
    uncompared."""
    left = 0
    for name, r in rows.items():
        t = tensors[name]
        left += t.nbytes - (len(r) * (t.nbytes // t.shape[0]) if len(r) else 0)
    total = sum(t.nbytes for t in tensors.values())
    return left / total if total else 1.0


class Prefilter:
    """The fingerprints of what the receivers hold, and when taking them pays: an update
    whose fingerprints spared less than `SPARE` of the compare (changes spread over most
    blocks: every tensor's low bits, say) skips them for the next `SKIP` updates, which
    compare everything; then they are taken again."""

    def __init__(self) -> None:
        self.prints: Prints | None = None  # of what the receivers hold; None: not known
        self._skip = 0

    def rows(self, new: Mapping[str, torch.Tensor], *, use: bool = True
             ) -> tuple[dict[str, torch.Tensor] | None, Prints | None]:
        """(`encode_all`'s rows for `new`, or None: compare everything; the fingerprints of
        `new`, for `prints` once the receivers hold it, or None: not taken). `use`: the
        receivers hold what `prints` describes."""
        if self._skip:
            self._skip -= 1
            return None, None
        now = fingerprints(new)
        if not use or self.prints is None:
            return None, now
        rows = candidates(self.prints, now, new)
        if spared(rows, new) < SPARE:
            self._skip = SKIP
        return rows, now

"""xxh3_64 of every block of a buffer in one compiled loop: the hashes
``xxhash.xxh3_64_intdigest`` gives each block, by the xxhash extension's own C function
called from a numba loop instead of once per block from Python (500 MB in 16 KiB blocks:
~20 ms on one core here, against ~60 ms).

Imported by `blocks` only where the compiled loops may run (`compiled.numba_ready`). Its
import fails (and `blocks` hashes block by block, the same hashes) where the extension does
not export the function or its hashes differ from xxhash's on a probe.
"""

from __future__ import annotations

import ctypes

import llvmlite.binding as llvm
import numba
import numpy as np
import xxhash
from xxhash import _xxhash

# the extension's dispatcher (AVX2 where the CPU has it), else its baseline build: the same
# hashes either way
_NAME = next((name for name in ("XXH3_64bits_dispatch", "XXH3_64bits")
              if hasattr(ctypes.CDLL(_xxhash.__file__), name)), None)
if _NAME is None:
    raise ImportError(f"{_xxhash.__file__} exports no XXH3_64bits")
llvm.load_library_permanently(_xxhash.__file__)  # the compiled loop links to it by name
_xxh3 = numba.types.ExternalFunction(_NAME, numba.types.uint64(numba.types.intp,
                                                               numba.types.uintp))


@numba.njit(nogil=True, cache=True)
def _blocks(address: int, n: int, size: int, out: np.ndarray) -> None:
    for i in range(len(out)):
        lo = i * size
        out[i] = _xxh3(address + lo, min(size, n - lo))


def hashes(a: np.ndarray, size: int) -> np.ndarray:
    """uint64 xxh3_64 of each `size` bytes of the contiguous uint8 array `a` (the last block
    may be short)."""
    out = np.empty(-(-len(a) // size), np.uint64)
    if len(out):
        _blocks(a.ctypes.data, len(a), size, out)
    return out


_probe = np.frombuffer(bytes(range(256)) * 5, np.uint8)
if [int(h) for h in hashes(_probe, 100)] != [
        xxhash.xxh3_64_intdigest(_probe[i:i + 100].tobytes()) for i in range(0, 1280, 100)]:
    raise ImportError(f"{_xxhash.__file__}'s {_NAME} hashes differ from xxhash's")

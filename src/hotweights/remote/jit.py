"""The remote path's hot loops, compiled, where numba is installed (every vLLM install has
it; the loops themselves are in `jit_loops`).

The numpy codec makes a dozen passes over a piece (gaps unpacked, widened, shifted, summed;
old values gathered; xor bits unpacked and applied): a scattered update's pieces cost a
server ~65 ns per changed element to decode that way. Here `decode` reads each section once,
in one loop, and gathers the old values in a loop of its own (~25 ns in all); `encode`
writes the five sections in one loop; `compare` finds a chunk's changed elements, their old
and new values and the changed rows in one pass, 8-byte words at a time (the trainer's
`delta.encode`; given rows, read in place rather than gathered); `scatter` writes a patch's
values, `xor_scatter` applies its xors to the old values (the apply, while generation is
paused). Same results, bit for bit (the tests run both ways); a piece the decode loop finds
wrong is handed back (None) and `codec.decode` decodes it the numpy way, which names the
field at fault: the errors stay the numpy path's, word for word.

Off (numpy only) without numba, or with ``HOTWEIGHTS_JIT=0`` (`changes.compiled`). The
loops are compiled on first use per value size (~1 s, the compare ~4 s; numba caches them
on disk where it can): `warm` compiles the receiving side's ahead, as a server joins a
trainer, and `packing.warm` the sending side's, as a trainer's first update travels.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from hotweights.changes import compiled

logger = logging.getLogger(__name__)

MASKS = (np.uint64(1) << np.arange(64, dtype=np.uint64)) - np.uint64(1)  # width -> its mask
LEAD = np.r_[0, np.uint64(1) << np.arange(64, dtype=np.uint64)].astype(np.uint64)  # an xor's
# bit length -> its leading one (the codec's tables too: `codec` imports this module)
_WHOLE = np.zeros(1, np.int64)  # one run from the first unit: a whole chunk compared
_lock = threading.Lock()
_loops = None  # the module of compiled loops once imported; False: no numba (or off)


def _get():
    global _loops
    if _loops is None:
        with _lock:
            if _loops is None:
                if not compiled.numba_ready():
                    _loops = False
                else:
                    try:
                        from hotweights.remote import jit_loops as _loops
                    except RuntimeError as e:  # numba found no place for its cache
                        logger.warning("hotweights: the compiled loops are off (%s)", e)
                        _loops = False
    return _loops


def enabled() -> bool:
    """Whether the loops compile (numba installed, not switched off)."""
    return bool(_get())


def decode(k: int, first: int, numel: int, shift: int, low: np.ndarray, high: np.ndarray,
           unary: bool, escapes: np.ndarray, xor: bool, third: np.ndarray,
           fourth: np.ndarray, old, floating: bool, utype, index=np.int64
           ) -> tuple[np.ndarray, np.ndarray] | None:
    """(indices of dtype `index`, bit patterns) of a piece of `k` > 0 elements from its
    sections (`high` unary bits if `unary`, else bytes; `high` and `third` inflated), or
    None: no numba, or the piece is wrong somewhere.

    `old`: the receiver's old bit patterns, flat (numpy of `utype`): xor values are applied
    to them here; anything else: the values come back as bare xors (``old ^ new``)."""
    built = _get()
    if not built:
        return None
    out, idx = np.empty(k, utype), np.empty(k, index)
    have_old = isinstance(old, np.ndarray)
    code = built.decode(k, first, numel, shift, _words(low),
                        _words(high) if unary else _bytes(high), unary, 8 * len(high),
                        escapes.astype(np.uint64), xor, _bytes(third), _words(fourth),
                        len(fourth), floating, MASKS, LEAD, out, idx)
    if code == 0 and xor and have_old:  # apart: a loop of only these reads keeps many in
        # flight (inside the decode loop each one waited for memory: ~3x slower)
        built.xor_gather(out, old, idx)
    return (idx, out) if code == 0 else None


def encode(idx: np.ndarray, bits: np.ndarray, old: np.ndarray | None, floating: bool,
           shift: int, bit_length16: np.ndarray
           ) -> tuple[list[np.ndarray], np.ndarray | None] | None:
    """(`codec.encode`'s five sections (not deflated), xor values: how many of each bit
    length, else None) of a piece of > 0 elements, in one pass; None without numba."""
    built = _get()
    if not built:
        return None
    xor = old is not None
    low, nlow, high, nhigh, escapes, third, fourth, nfourth, rest, hist = built.encode(
        idx.astype(np.int64, copy=False), bits, old if xor else bits[:1], xor, floating,
        shift, MASKS, bit_length16)
    return [low.view(np.uint8)[:nlow], high.view(np.uint8)[:nhigh],
            escapes.astype("<u8").view(np.uint8), third,
            fourth.view(np.uint8)[:nfourth] if xor else rest], hist if xor else None


def unary_pack(widths: np.ndarray, wmin: int) -> np.ndarray | None:
    """Each of `widths` (uint8) less `wmin` in unary, as bytes; None without numba."""
    built = _get()
    if not built:
        return None
    words, n = built.unary_pack(widths, wmin)
    return words.view(np.uint8)[:n]


def unary_widths(data: np.ndarray, k: int, wmin: int, most: int) -> np.ndarray | None:
    """`unary_pack`'s `k` widths back from its bytes, or None: no numba, or the bytes are
    wrong (another count, an excess above `most`, bits past the last one's byte)."""
    built = _get()
    if not built:
        return None
    out = np.empty(k, np.uint8)
    return out if built.unary_widths(_words(data), 8 * len(data), wmin, most, out) == 0 \
        else None


def scatter(flat: np.ndarray, idx: np.ndarray, values: np.ndarray) -> bool:
    """``flat[idx] = values`` (int32 or int64 indices, bit patterns of `flat`'s dtype) in one
    loop: ~0.7x torch's index_copy_ on one thread. False, nothing written, without numba or where
    an index is outside `flat` (torch's index_copy_ then says which)."""
    built = _get()
    return bool(built) and built.scatter(flat, idx, values)


def xor_scatter(flat: np.ndarray, idx: np.ndarray, xors: np.ndarray) -> bool:
    """``flat[idx] ^= xors`` (int32 or int64 indices, bit patterns of `flat`'s dtype) in one loop,
    reading each old value only here (a staged xor update's apply). False, nothing
    written, without numba or where an index is outside `flat`."""
    built = _get()
    return bool(built) and built.xor_scatter(flat, idx, xors)


def compare(old: np.ndarray, new: np.ndarray, element: np.dtype, per_row: int, limit: int,
            rows: np.ndarray | None = None) -> tuple | None:
    """Compare two arrays of one integer dtype, each unit `element`s packed (an 8-byte word
    of four bf16, say), in one pass: (how many elements differ, their places (int64, in
    elements), old and new bit patterns (of `element`), a flag per `per_row` units saying
    whether any of them differs (none for `per_row` 0)); None without numba, where more than
    `limit` elements differ (the loop stops there) or where most of a sample of units
    differs: numpy's vectorised compare counts those faster.

    `rows` (int64): compare only these rows of `per_row` units, as if gathered into one
    chunk (the places are in that chunk), but read where they are: no copies."""
    built = _get()
    if not built or limit <= 0:
        return None
    sample = np.zeros(0, element)
    loop = getattr(built, f"compare{old.itemsize // sample.itemsize}")
    found = loop(old, new, _WHOLE, len(new), per_row, limit, sample) if rows is None else \
        loop(old, new, rows * per_row, per_row, per_row, limit, sample)
    return found if found[0] >= 0 else None


def warm(itemsizes=(2,)) -> None:
    """Compile the loops for values of these byte sizes now (a no-op without numba)."""
    for s in itemsizes:
        utype = np.dtype(f"u{s}")
        one = np.zeros(1, np.uint8)
        for index in (np.int32, np.int64):  # `Staged` keeps int32 where they fit
            decode(1, 0, 1, 0, one[:0], one[:0], True, np.zeros(0, np.uint64), True, one,
                   one[:0], np.zeros(1, utype), True, utype, index)
            scatter(np.zeros(1, utype), np.zeros(1, index), np.zeros(1, utype))
            xor_scatter(np.zeros(1, utype), np.zeros(1, index), np.zeros(1, utype))
    unary_widths(np.ones(1, np.uint8), 1, 1, 0)


def _words(a: np.ndarray) -> np.ndarray:
    # a bit stream as uint64 words, and a zero word past its end (`bits_at` reads two)
    out = np.zeros((len(a) // 8 + 2) * 8, np.uint8)
    out[:len(a)] = a
    return out.view(np.uint64)


def _bytes(a: np.ndarray) -> np.ndarray:
    # one compiled signature: writable, contiguous uint8 (inflated sections are read-only)
    return a if a.flags.writeable and a.flags.c_contiguous else a.copy()

"""The patch codec's loops, compiled, where numba is installed (every vLLM install has it).

The numpy codec makes a dozen passes over a piece (gaps unpacked, widened, shifted, summed;
old values gathered; xor bits unpacked and applied): a scattered update's pieces cost a
server ~65 ns per changed element to decode that way. Here `decode` reads each section once,
in one loop, and gathers the old values in a loop of its own (~25 ns in all); `encode`
writes the five sections in one loop; `scatter` writes a patch's values (the apply, while
generation is paused). Same results, bit for bit (the tests run every piece both ways); a
piece the decode loop finds wrong is handed back (None) and `codec.decode` decodes it the
numpy way, which names the field at fault: the errors stay the numpy path's, word for word.

Off (numpy only) without numba, or with ``HOTWEIGHTS_JIT=0``. The loops are compiled on
first use per value size (~1 s; numba caches them on disk where it can): `warm`
compiles the receiving side's ahead, as a server joins a trainer.
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np

logger = logging.getLogger(__name__)

_ESC = 255
_MASKS = (np.uint64(1) << np.arange(64, dtype=np.uint64)) - np.uint64(1)  # width -> its mask
_LEAD = np.r_[0, np.uint64(1) << np.arange(64, dtype=np.uint64)].astype(np.uint64)
_lock = threading.Lock()
_kernel = None  # the compiled loops, once built; False: no numba (or switched off)


def _build(cache: bool):
    import numba

    u64 = np.uint64

    @numba.njit(nogil=True, cache=cache, inline="always")
    def bits_at(words, pos, w, masks):
        # the `w` (< 64) bits at bit `pos` of a little-endian stream, from the two words
        # they span (the next word's bits shifted in two steps: never by 64)
        q, r = pos >> 6, u64(pos & 63)
        return ((words[q] >> r) | ((words[q + 1] << u64(1)) << (u64(63) - r))) & masks[w]

    @numba.njit(nogil=True, cache=cache)
    def kernel(k, first, numel, shift, low, high, escapes, xor, third, fourth, nbytes4,
               floating, masks, lead, out):
        # third, fourth: sections 3 and 4 (xor: bit lengths, bits; raw: top bytes, the
        # rest). -> (0, indices) with `out` filled; (1, _) where the piece is wrong
        s = out.itemsize
        nbits = 8 * s
        idx = np.empty(k, np.int64)
        if xor:  # every width first: the bit section must hold exactly their sum
            total = 0
            for i in range(k):
                n = np.int64(third[i])
                if n > nbits:
                    return 1, idx
                total += max(n - 1, 0)
            if (total + 7) // 8 != nbytes4:
                return 1, idx
        limit = u64(numel - 1) >> u64(shift)  # the largest high part that can still fit
        e = gpos = xpos = 0
        pos = first
        sign = u64(nbits - 1)
        for i in range(k):
            if i:
                g = u64(high[i - 1])
                if g == _ESC:
                    if e >= len(escapes):
                        return 1, idx
                    g = u64(escapes[e])
                    e += 1
                if g > limit:
                    return 1, idx
                pos += np.int64((g << u64(shift)) | bits_at(low, gpos, shift, masks)) + 1
                gpos += shift
                if pos >= numel:
                    return 1, idx
            idx[i] = pos
            if xor:
                n = np.int64(third[i])
                w = max(n - 1, 0)
                v = bits_at(fourth, xpos, w, masks) | lead[n]
                xpos += w
            else:
                v = (u64(third[i]) << u64(nbits - 8)) | bits_at(
                    fourth, 8 * (s - 1) * i, 8 * (s - 1), masks)
                if floating and s > 1:  # the sign went below the exponent: back on top
                    v = (v >> u64(1)) | ((v & u64(1)) << sign)
            out[i] = v
        # (the low section's length was checked against the gaps by `check_fields`)
        return (0 if e == len(escapes) else 1), idx

    @numba.njit(nogil=True, cache=cache)
    def xor_gather(out, old, idx):
        for i in range(len(idx)):
            out[i] ^= old[idx[i]]

    @numba.njit(nogil=True, cache=cache, inline="always")
    def put(words, pos, v, w, masks):
        # the low `w` (< 64) bits of `v` at bit `pos` of a zeroed little-endian stream
        v &= masks[w]
        q, r = pos >> 6, u64(pos & 63)
        words[q] |= v << r
        words[q + 1] |= (v >> u64(1)) >> (u64(63) - r)

    @numba.njit(nogil=True, cache=cache, inline="always")
    def bit_length(x, table):
        if x >> u64(32):
            if x >> u64(48):
                return 48 + np.int64(table[x >> u64(48)])
            return 32 + np.int64(table[x >> u64(32)])
        if x >> u64(16):
            return 16 + np.int64(table[x >> u64(16)])
        return np.int64(table[x])

    @numba.njit(nogil=True, cache=cache)
    def encoder(idx, bits, old, xor, floating, shift, masks, table):
        # -> sections 0-4 of `codec.encode`, before deflate: low bits, high bytes, escapes,
        # (xor: bit lengths, bits below the leading one; raw: top bytes, the rest)
        k, s = len(idx), bits.itemsize
        nbits = 8 * s
        low = np.zeros((k * shift) // 64 + 2, np.uint64)
        high = np.empty(max(k - 1, 0), np.uint8)
        escapes = np.empty(max(k - 1, 0), np.uint64)
        third = np.empty(k, np.uint8)
        fourth = np.zeros((k * nbits) // 64 + 2, np.uint64) if xor else \
            np.zeros(0, np.uint64)
        rest = np.empty(0 if xor else k * (s - 1), np.uint8)
        e = xpos = 0
        sign = u64(nbits - 1)
        for i in range(k):
            if i:
                gap = u64(idx[i] - idx[i - 1] - 1)
                put(low, (i - 1) * shift, gap, shift, masks)
                h = gap >> u64(shift)
                if h >= _ESC:
                    escapes[e] = h
                    e += 1
                    h = u64(_ESC)
                high[i - 1] = h
            v = u64(bits[i])
            if xor:
                x = v ^ u64(old[i])
                n = bit_length(x, table)
                third[i] = n
                if n > 1:
                    put(fourth, xpos, x, n - 1, masks)
                    xpos += n - 1
            else:
                if floating and s > 1:  # the sign below the exponent: one byte for both
                    v = ((v << u64(1)) | (v >> sign)) & masks[nbits] if nbits < 64 else \
                        (v << u64(1)) | (v >> sign)
                third[i] = (v >> u64(nbits - 8)) & u64(255)
                for b in range(s - 1):
                    rest[i * (s - 1) + b] = (v >> u64(8 * b)) & u64(255)
        return (low, (max(k - 1, 0) * shift + 7) // 8, high, escapes[:e], third,
                fourth, (xpos + 7) // 8, rest)

    @numba.njit(nogil=True, cache=cache)
    def scatter(flat, idx, values):
        n = len(flat)
        for i in range(len(idx)):  # bounds first: nothing written if one is out
            if idx[i] < 0 or idx[i] >= n:
                return False
        for i in range(len(idx)):
            flat[idx[i]] = values[i]
        return True

    @numba.njit(nogil=True, cache=cache, inline="always")
    def differing(old, new, a, b, c, per_row, collect, flags, pos, olds, news):
        for i in range(a, b):
            if old[i] != new[i]:
                if per_row:
                    flags[i // per_row] = True
                if collect:
                    pos[c], olds[c], news[c] = i, old[i], new[i]
                c += 1
        return c

    @numba.njit(nogil=True, cache=cache)
    def compare(old, new, per_row, collect):
        n = len(new)
        flags = np.zeros(n // per_row if per_row else 0, np.bool_)
        m = n if collect else 0
        pos, olds, news = np.empty(m, np.int64), np.empty(m, old.dtype), np.empty(m, new.dtype)
        c = 0
        whole = n - n % 4
        for first in range(0, whole, 4):  # 4 units a step, looked into only if one differs:
            differ = 0  # ~2x a loop of one at 1 % changed
            for i in range(first, first + 4):
                differ |= old[i] ^ new[i]
            if differ:
                c = differing(old, new, first, first + 4, c, per_row, collect, flags, pos,
                              olds, news)
        c = differing(old, new, whole, n, c, per_row, collect, flags, pos, olds, news)
        k = c if collect else 0  # copies: the n-long buffers are not kept
        return c, pos[:k].copy(), olds[:k].copy(), news[:k].copy(), flags

    return kernel, xor_gather, encoder, scatter, compare


def _get():
    global _kernel
    if _kernel is None:
        with _lock:
            if _kernel is None:
                if os.environ.get("HOTWEIGHTS_JIT", "1") == "0":
                    _kernel = False
                else:
                    try:
                        _kernel = _build(cache=True)
                    except ImportError:
                        logger.info("hotweights: numba not installed: the numpy loops run")
                        _kernel = False
                    except RuntimeError as e:  # no writable place for numba's cache
                        logger.info("hotweights: compiled loops not cached (%s)", e)
                        _kernel = _build(cache=False)
    return _kernel


def enabled() -> bool:
    """Whether the loops compile (numba installed, not switched off)."""
    return bool(_get())


def decode(k: int, first: int, numel: int, shift: int, low: np.ndarray, high: np.ndarray,
           escapes: np.ndarray, xor: bool, third: np.ndarray, fourth: np.ndarray, old,
           floating: bool, utype) -> tuple[np.ndarray, np.ndarray] | None:
    """(int64 indices, bit patterns) of a piece of `k` > 0 elements from its sections
    (`high` and `third` inflated), or None: no numba, or the piece is wrong somewhere.

    `old`: the receiver's old bit patterns, flat (numpy of `utype`): xor values are applied
    to them here; anything else: the values come back as bare xors (``old ^ new``)."""
    built = _get()
    if not built:
        return None
    kernel, xor_gather = built[:2]
    out = np.empty(k, utype)
    have_old = isinstance(old, np.ndarray)
    code, idx = kernel(k, first, numel, shift, _words(low), _bytes(high),
                       escapes.astype(np.uint64), xor, _bytes(third),
                       _words(fourth), len(fourth), floating, _MASKS, _LEAD, out)
    if code == 0 and xor and have_old:  # apart: a loop of only these reads keeps many in
        # flight (inside the decode loop each one waited for memory: ~3x slower)
        xor_gather(out, old, idx)
    return (idx, out) if code == 0 else None


def encode(idx: np.ndarray, bits: np.ndarray, old: np.ndarray | None, floating: bool,
           shift: int, bit_length16: np.ndarray) -> list[np.ndarray] | None:
    """`codec.encode`'s five sections (not deflated) of a piece of > 0 elements, in one
    pass; None without numba."""
    built = _get()
    if not built:
        return None
    xor = old is not None
    low, nlow, high, escapes, third, fourth, nfourth, rest = built[2](
        idx.astype(np.int64, copy=False), bits, old if xor else bits[:1], xor, floating,
        shift, _MASKS, bit_length16)
    return [low.view(np.uint8)[:nlow], high, escapes.astype("<u8").view(np.uint8), third,
            fourth.view(np.uint8)[:nfourth] if xor else rest]


def scatter(flat: np.ndarray, idx: np.ndarray, values: np.ndarray) -> bool:
    """``flat[idx] = values`` (int64 indices, bit patterns of `flat`'s dtype) in one loop:
    ~0.7x torch's index_copy_ on one thread. False, nothing written, without numba or where
    an index is outside `flat` (torch's index_copy_ then says which)."""
    built = _get()
    return bool(built) and built[3](flat, idx, values)


def compare(old: np.ndarray, new: np.ndarray, per_row: int, collect: bool) -> tuple | None:
    """Compare two arrays of one integer dtype in one pass: (how many units differ, their
    positions (int64), old and new units if `collect` (else empty), a flag per `per_row`
    units saying whether any of them differs (none for `per_row` 0)); None without numba."""
    built = _get()
    return built[4](old, new, per_row, collect) if built else None


def warm(itemsizes=(2,)) -> None:
    """Compile the loops for values of these byte sizes now (a no-op without numba)."""
    for s in itemsizes:
        utype = np.dtype(f"u{s}")
        one = np.zeros(1, np.uint8)
        decode(1, 0, 1, 0, one[:0], one[:0], np.zeros(0, np.uint64), True, one, one[:0],
               np.zeros(1, utype), True, utype)
        scatter(np.zeros(1, utype), np.zeros(1, np.int64), np.zeros(1, utype))


def _words(a: np.ndarray) -> np.ndarray:
    # a bit stream as uint64 words, and a zero word past its end (`bits_at` reads two)
    out = np.zeros((len(a) // 8 + 2) * 8, np.uint8)
    out[:len(a)] = a
    return out.view(np.uint64)


def _bytes(a: np.ndarray) -> np.ndarray:
    # one compiled signature: writable, contiguous uint8 (inflated sections are read-only)
    return a if a.flags.writeable and a.flags.c_contiguous else a.copy()

"""The compiled loops behind `hotweights.remote.jit` (imported by it only where numba is
installed; plain module-level functions, so numba can cache them on disk)."""

import numba
import numpy as np

u64 = np.uint64

_DE_BRUIJN = 0x03F79D71B4CA8B09  # its 64 windows of 6 bits are 0..63, once each
_CTZ = np.zeros(64, np.uint8)
_CTZ[[(_DE_BRUIJN << i & (1 << 64) - 1) >> 58 for i in range(64)]] = np.arange(64)


@numba.njit(nogil=True, cache=True, inline="always")
def ctz_de_bruijn(x):
    # the trailing zeros of x > 0: its lowest one times the sequence picks its window
    return _CTZ[((x & (~x + u64(1))) * u64(_DE_BRUIJN)) >> u64(58)]


try:  # the instruction itself
    from numba.cpython.unsafe.numbers import trailing_zeros as ctz
except ImportError:  # another numba
    ctz = ctz_de_bruijn
_ESC = 255  # `codec`'s escape byte (format 2's bytes) ...
_UNARY_ESC = 16  # ... and zeros (its unary highs)


@numba.njit(nogil=True, cache=True, inline="always")
def bits_at(words, pos, w, masks):
    # the `w` (< 64) bits at bit `pos` of a little-endian stream, from the two words
    # they span (the next word's bits shifted in two steps: never by 64)
    q, r = pos >> 6, u64(pos & 63)
    return ((words[q] >> r) | ((words[q + 1] << u64(1)) << (u64(63) - r))) & masks[w]


@numba.njit(nogil=True, cache=True)
def decode(k, first, numel, shift, low, high, unary, nbits1, escapes, xor, third, fourth,
           nbytes4, floating, masks, lead, out, idx):
    # high: section 1, bytes, or with `unary` words of `nbits1` bits; third, fourth:
    # sections 3 and 4 (xor: bit lengths, bits; raw: top bytes, the rest). Fills `idx`
    # (k, int32 or int64) and `out`; -> 0, or 1 where the piece is wrong. Three short
    # loops, not one: each gap's high part first (the unary ones found a word at a time),
    # then the indices (a running sum), then the values; a third faster than one loop
    # whose every step waited for the last one's bit position
    s = out.itemsize
    nbits = 8 * s
    if xor:  # every width first: the bit section must hold exactly their sum
        total = 0
        for i in range(k):
            n = np.int64(third[i])
            if n > nbits:
                return 1
            total += max(n - 1, 0)
        if (total + 7) // 8 != nbytes4:
            return 1
    esc = _UNARY_ESC if unary else _ESC
    if unary:  # the zeros before each one; `idx[i]` holds gap i - 1's high part for now
        n = prev = 0
        for q in range((nbits1 + 63) // 64):
            w = high[q]
            while w:
                p = q * 64 + np.int64(ctz(w))
                if p - prev > _UNARY_ESC or n >= k - 1:
                    return 1
                n += 1
                idx[n] = p - prev
                prev = p + 1
                w &= w - u64(1)
        # every gap's one, the last in the section's last byte (zeros after it)
        if n != k - 1 or (k > 1 and (prev + 7) // 8 != (nbits1 + 7) // 8):
            return 1
    else:
        for i in range(1, k):
            idx[i] = high[i - 1]
    limit = u64(numel - 1) >> u64(shift)  # the largest high part that can still fit
    ushift, lmask = u64(shift), masks[shift]
    e = lpos = avail = 0
    buf = u64(0)  # the next `avail` low bits, from bit `lpos` on
    pos = first
    if k:
        idx[0] = pos
    for i in range(1, k):
        g = u64(idx[i])
        if g == esc:
            if e >= len(escapes):
                return 1
            g = u64(escapes[e])
            e += 1
        if g > limit:
            return 1
        if avail < shift:
            buf, avail = bits_at(low, lpos, 63, masks), 63
        pos += np.int64((g << ushift) | (buf & lmask)) + 1
        buf >>= ushift
        avail -= shift
        lpos += shift
        if pos >= numel:
            return 1
        idx[i] = pos
    # (the low section's length was checked against the gaps by `check_fields`)
    if e != len(escapes):
        return 1
    xpos = 0
    sign = u64(nbits - 1)
    for i in range(k):
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
    return 0


@numba.njit(nogil=True, cache=True)
def xor_gather(out, old, idx):
    for i in range(len(idx)):
        out[i] ^= old[idx[i]]


@numba.njit(nogil=True, cache=True, inline="always")
def put(words, pos, v, w, masks):
    # the low `w` (< 64) bits of `v` at bit `pos` of a zeroed little-endian stream
    v &= masks[w]
    q, r = pos >> 6, u64(pos & 63)
    words[q] |= v << r
    words[q + 1] |= (v >> u64(1)) >> (u64(63) - r)


@numba.njit(nogil=True, cache=True, inline="always")
def bit_length(x, table):
    if x >> u64(32):
        if x >> u64(48):
            return 48 + np.int64(table[x >> u64(48)])
        return 32 + np.int64(table[x >> u64(32)])
    if x >> u64(16):
        return 16 + np.int64(table[x >> u64(16)])
    return np.int64(table[x])


@numba.njit(nogil=True, cache=True)
def encode(idx, bits, old, xor, floating, shift, masks, table):
    # -> sections 0-4 of `codec.encode`, before deflate: low bits, unary highs, escapes,
    # (xor: bit lengths, bits below the leading one; raw: top bytes, the rest)
    k, s = len(idx), bits.itemsize
    nbits = 8 * s
    low = np.zeros((k * shift) // 64 + 2, np.uint64)
    high = np.zeros((k * (_UNARY_ESC + 1)) // 64 + 2, np.uint64)
    escapes = np.empty(max(k - 1, 0), np.uint64)
    third = np.empty(k, np.uint8)
    fourth = np.zeros((k * nbits) // 64 + 2, np.uint64) if xor else \
        np.zeros(0, np.uint64)
    rest = np.empty(0 if xor else k * (s - 1), np.uint8)
    hist = np.zeros(nbits + 1, np.int64)  # xor: how many values of each bit length
    e = xpos = hpos = 0
    sign = u64(nbits - 1)
    for i in range(k):
        if i:
            gap = u64(idx[i] - idx[i - 1] - 1)
            put(low, (i - 1) * shift, gap, shift, masks)
            h = gap >> u64(shift)
            if h >= _UNARY_ESC:
                escapes[e] = h
                e += 1
                h = u64(_UNARY_ESC)
            hpos += np.int64(h)  # h zeros, then a one
            high[hpos >> 6] |= u64(1) << u64(hpos & 63)
            hpos += 1
        v = u64(bits[i])
        if xor:
            x = v ^ u64(old[i])
            n = bit_length(x, table)
            third[i] = n
            hist[n] += 1
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
    return (low, (max(k - 1, 0) * shift + 7) // 8, high, (hpos + 7) // 8, escapes[:e], third,
            fourth, (xpos + 7) // 8, rest, hist)


@numba.njit(nogil=True, cache=True)
def unary_pack(widths, wmin):
    # each width's excess over `wmin` in unary (that many zeros, then a one) -> (words,
    # bytes used)
    total = 0
    for i in range(len(widths)):
        total += np.int64(widths[i]) - wmin + 1
    words = np.zeros(total // 64 + 2, np.uint64)
    pos = 0
    for i in range(len(widths)):
        pos += np.int64(widths[i]) - wmin
        words[pos >> 6] |= u64(1) << u64(pos & 63)
        pos += 1
    return words, (pos + 7) // 8


@numba.njit(nogil=True, cache=True)
def unary_widths(words, nbits, wmin, most, out):
    # `unary_pack`'s widths back into `out` (one per value) from words of `nbits` bits ->
    # 0, or 1 where the section is wrong: another count of ones, an excess above `most`,
    # or bits after the last one's byte
    k, n, prev = len(out), 0, 0
    for q in range((nbits + 63) // 64):
        w = words[q]
        while w:
            p = q * 64 + np.int64(ctz(w))
            if p - prev > most or n >= k:
                return 1
            out[n] = wmin + p - prev
            n += 1
            prev = p + 1
            w &= w - u64(1)
    if n != k or (prev + 7) // 8 != (nbits + 7) // 8:
        return 1
    return 0


@numba.njit(nogil=True, cache=True, inline="always")
def within(flat, idx):
    # every index inside `flat`: checked before a scatter writes anything
    n = len(flat)
    for i in range(len(idx)):
        if idx[i] < 0 or idx[i] >= n:
            return False
    return True


@numba.njit(nogil=True, cache=True)
def scatter(flat, idx, values):
    if not within(flat, idx):
        return False
    for i in range(len(idx)):
        flat[idx[i]] = values[i]
    return True


@numba.njit(nogil=True, cache=True)
def xor_scatter(flat, idx, xors):
    if not within(flat, idx):
        return False
    for i in range(len(idx)):
        flat[idx[i]] ^= xors[i]
    return True


_BLOCK = 1024  # steps between two checks of the limit
_STEP = 16  # units a step of the compare, looked into only if one of them differs: at 1 %
# of bf16 elements changed, half the steps are (~1.3x 4 units a step)


@numba.njit(nogil=True, cache=True, inline="always")
def flag_row(at, per_row, flags, row_end):
    # `row_end[0]`: the end of the row last flagged (places only grow: one division per
    # changed row)
    if per_row and at >= row_end[0]:
        r = at // per_row
        flags[r] = True
        row_end[0] = (r + 1) * per_row


@numba.njit(nogil=True, cache=True, inline="always")
def changed_elements(m, at, old, new, v, c, per_row, limit, flags, pos, olds, news, row_end,
                     lanes):
    # the elements of the mask `m` (bit k * lanes + j: element j of unit at + k), counted
    # on from `c`; those past `limit` counted only
    bits = 64 // lanes if lanes > 1 else 0
    while m:
        e = u64(ctz(m))
        m &= m - u64(1)
        i = at + e // u64(lanes)
        place = np.int64(i) + v
        flag_row(place, per_row, flags, row_end)
        if c < limit:
            pos[c] = place * lanes + np.int64(e % u64(lanes))
            if lanes == 1:
                olds[c], news[c] = old[i], new[i]
            else:
                shift, mask = (e % u64(lanes)) * u64(bits), ~u64(0) >> u64(64 - bits)
                olds[c], news[c] = (u64(old[i]) >> shift) & mask, (u64(new[i]) >> shift) & mask
        c += 1
    return c


@numba.njit(nogil=True, cache=True, inline="always")
def unit_mask(old, new, i, lanes):
    # bit j: element j of unit i differs
    x = old[i] ^ new[i]
    if lanes == 1:
        return u64(x != 0)
    bits, m = 64 // lanes, u64(0)
    for j in range(lanes):
        m |= u64(((u64(x) >> u64(bits * j)) & (~u64(0) >> u64(64 - bits))) != u64(0)) << u64(j)
    return m


@numba.njit(nogil=True, cache=True, inline="always")
def differing_in(old, new, a, b, v, c, per_row, limit, flags, pos, olds, news, row_end,
                 lanes):
    # units a..b (unsigned: numba then skips its checks for negative indices, ~1.5x), each
    # `lanes` elements (a literal at every call: the loops unroll); `v` added to a unit's
    # place gives its place in the compared chunk. A step of units at a time (up to 64
    # elements), looked into only if one differs: a mask of its changed elements, then
    # only those (no branch per unit or element). The limit is checked once per block of
    # steps: a check per step makes the loop ~2x slower.
    step = min(_STEP, 64 // lanes)
    first, end = u64(a), u64(b)
    whole = end - (end - first) % u64(step)
    while first < whole and c <= limit:
        block = min(whole, first + u64(_BLOCK * step))
        while first < block:
            differ = old[first] ^ new[first]
            for k in range(1, step):
                differ |= old[first + u64(k)] ^ new[first + u64(k)]
            if differ:
                m = u64(0)
                for k in range(step):
                    m |= unit_mask(old, new, first + u64(k), lanes) << u64(k * lanes)
                c = changed_elements(m, first, old, new, v, c, per_row, limit, flags, pos,
                                     olds, news, row_end, lanes)
            first += u64(step)
    while first < end and c <= limit:  # the last units, one at a time
        c = changed_elements(unit_mask(old, new, first, lanes), first, old, new, v, c,
                             per_row, limit, flags, pos, olds, news, row_end, lanes)
        first += u64(1)
    return c if c <= limit else -1


# `differing_in` per element count, each compiled on its own: inlined into the loop over
# the runs, its loop runs ~2x slower
@numba.njit(nogil=True, cache=True)
def scan1(old, new, a, b, v, c, per_row, limit, flags, pos, olds, news, row_end):
    return differing_in(old, new, a, b, v, c, per_row, limit, flags, pos, olds, news,
                        row_end, 1)


@numba.njit(nogil=True, cache=True)
def scan2(old, new, a, b, v, c, per_row, limit, flags, pos, olds, news, row_end):
    return differing_in(old, new, a, b, v, c, per_row, limit, flags, pos, olds, news,
                        row_end, 2)


@numba.njit(nogil=True, cache=True)
def scan4(old, new, a, b, v, c, per_row, limit, flags, pos, olds, news, row_end):
    return differing_in(old, new, a, b, v, c, per_row, limit, flags, pos, olds, news,
                        row_end, 4)


@numba.njit(nogil=True, cache=True)
def scan8(old, new, a, b, v, c, per_row, limit, flags, pos, olds, news, row_end):
    return differing_in(old, new, a, b, v, c, per_row, limit, flags, pos, olds, news,
                        row_end, 8)


@numba.njit(nogil=True, cache=True, inline="always")
def _sample_step(n):
    # every 61st unit, at most ~4096 of them (an odd step: no stride of a power of two)
    return max(61, n // 4096) | 1


@numba.njit(nogil=True, cache=True, inline="always")
def compare(old, new, starts, run, per_row, limit, element, lanes, scan):
    # the runs of `run` units that begin at `starts`, compared as if gathered into one chunk
    # (the places and flags are that chunk's) but read where they are; each unit holds
    # `lanes` elements of `element`'s dtype, reported one by one, by `scan` (`compare1` ..
    # `compare8` below: the literal and its loop)
    n = len(starts) * run
    sampled = hits = 0
    for j in range(0, n, _sample_step(n)):  # most units differ (a full update): numpy's
        i = starts[j // run] + j % run  # vector compare counts them faster than this loop
        sampled += 1  # finds them
        hits += old[i] != new[i]
    if 2 * hits > sampled:
        return -1, np.empty(0, np.int64), element[:0].copy(), element[:0].copy(), \
            np.empty(0, np.bool_)
    flags = np.zeros(n // per_row if per_row else 0, np.bool_)
    m = min(n * lanes, limit)  # more changed elements than that: -1, at once
    pos, olds, news = np.empty(m, np.int64), np.empty(m, element.dtype), \
        np.empty(m, element.dtype)
    c = 0
    row_end = np.zeros(1, np.int64)
    for r in range(len(starts)):
        a = starts[r]
        c = scan(old, new, a, a + run, r * run - a, c, per_row, limit, flags, pos, olds, news,
                 row_end)
        if c < 0:
            break
    k = max(c, 0)  # copies: the m-long buffers are not kept
    return c, pos[:k].copy(), olds[:k].copy(), news[:k].copy(), flags


@numba.njit(nogil=True, cache=True)
def compare1(old, new, starts, run, per_row, limit, element):
    return compare(old, new, starts, run, per_row, limit, element, 1, scan1)


@numba.njit(nogil=True, cache=True)
def compare2(old, new, starts, run, per_row, limit, element):
    return compare(old, new, starts, run, per_row, limit, element, 2, scan2)


@numba.njit(nogil=True, cache=True)
def compare4(old, new, starts, run, per_row, limit, element):
    return compare(old, new, starts, run, per_row, limit, element, 4, scan4)


@numba.njit(nogil=True, cache=True)
def compare8(old, new, starts, run, per_row, limit, element):
    return compare(old, new, starts, run, per_row, limit, element, 8, scan8)

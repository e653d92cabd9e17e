"""Compact, exact coding of one patch piece: sorted flat indices and their values, as bytes.

At 1 % of elements changed at random, a patch's flat indices are ~100 apart and bf16 values
carry ~2.5 bits of exponent entropy: sent as int32 indices and raw values, a changed element
costs 6 bytes; coded here, ~2.3 bytes (raw values) or ~1 byte (XOR with the receiver's old
values, when few bits flip). Everything is vectorised numpy (`decode` and `encode` run one
compiled loop instead where numba is installed: `hotweights.remote.jit`). The gaps are
Rice-coded (``shift`` low bits, the rest in unary: within a few % of their entropy where
changes fall at random, at no cost beyond the loop); so are the xor values' bit lengths
where that costs next to their entropy (a value that moved by a few units in its last
place: each length's excess over the piece's smallest in unary); the only other entropy
coder is zlib's Huffman stage (the standard library, so every receiver has it), run over
section 3 otherwise. No torch, no transport.

A piece is five byte sections, concatenated (their lengths in the header's ``sections``):

0. ``low``: the low ``shift`` bits of every gap (``index[i+1] - index[i] - 1``), bit-packed;
1. ``high``: the rest of every gap (``gap >> shift``) in unary, bit-packed: that many zero
   bits, then a one (16 zeros and a one: see ``escapes``); the last byte padded with zeros;
2. ``escapes``: uint64 ``gap >> shift`` of the gaps whose high part is 16 or more, in order;
3. ``values="raw"``: the top byte of every value (after rotating a float's bits left by one:
   its exponent); ``values="xor"``: the bit length of every ``new ^ old``, one byte each,
   or, where the header has ``widths: "unary"``, each one less the header's ``wmin`` in
   unary (that many zero bits, then a one), bit-packed;
4. ``values="raw"``: the other bytes of every value, little-endian; ``values="xor"``: the bits
   below the leading one of every ``new ^ old``, bit-packed.

Section 3 in bytes is zlib-deflated (raw deflate, level 1, run-length matches only) where
that is smaller; ``zipped`` lists it. Unary bit lengths are chosen where they cost at most a
quarter bit a value more than their entropy (the best zlib's Huffman stage can do): a
bf16 step of a few units in the last place, ~2.5 bits a value either way, without zlib's
~10 ns a value to deflate and ~3 to inflate (format 4). The header's ``high`` says
``"unary"``; a piece without it (format 2, still read) holds one byte per gap's high part
in section 1 (255: escaped), which ``zipped`` may list too. The first index is the
header's ``first``; the gaps make the indices strictly increasing by construction. `decode`
checks every size against the header and the element count before it reads, so a corrupt
piece raises `CodecError` naming the field, never reads or writes out of bounds.
"""

from __future__ import annotations

import math
import zlib

import numpy as np

from hotweights.errors import DeltaError, install
from hotweights.remote import jit

__all__ = ["UINT", "VALUES", "CodecError", "check_fields", "decode", "encode", "zstd_compress",
           "zstd_decompress"]

RAW, XOR = "raw", "xor"
VALUES = (RAW, XOR)
_SECTIONS = 5
_ZIPPABLE = (1, 3)  # (1: format 2's high bytes only)
_ESC = 255  # format 2's escaped high byte
UNARY = "unary"  # the header's "high": section 1 coded in unary
_UNARY_ESC = 16  # a high part this large or larger is escaped (jit_loops' too)
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_GROUPED = 56  # widths up to this many bits are read with one unaligned uint64 read each,
# and fixed ones (un)packed 8 values at a time
_MASKS = jit.MASKS  # width -> its mask
# an xor's bit length -> the bits sent below its leading one; -> that leading one, per size
_WIDTH = np.maximum(np.arange(65) - 1, 0).astype(np.uint8)
_BIT_LENGTH16 = np.frexp(np.arange(1 << 16, dtype=np.float64))[1].astype(np.uint8)
_LEAD = {s: jit.LEAD[:8 * s + 1].astype(UINT[s]) for s in UINT}


class CodecError(DeltaError):
    """A piece does not decode; `field` names the header field or section at fault."""

    def __init__(self, field: str, msg: str):
        super().__init__(f"field '{field}' {msg}")
        self.field, self.msg = field, msg


# -- bits -------------------------------------------------------------------------------------

def _pack_fixed(x: np.ndarray, width: int) -> np.ndarray:
    """The low `width` bits of every uint64 in `x`, little-endian bit order, as bytes."""
    if not width or not len(x):
        return np.zeros(0, np.uint8)
    if width % 8 == 0:  # whole bytes: the little-endian bytes of each value
        return np.ascontiguousarray(x.view(np.uint8).reshape(-1, 8)[:, :width // 8]).reshape(-1)
    if width > _GROUPED:
        return _write_bits(x, np.arange(0, len(x) * width, width, dtype=np.uint64),
                           np.full(len(x), width, np.uint64))
    # 8 values fill exactly `width` bytes, value j of each group at the same bit offset:
    # each j is one strided pass over the groups, shifted into the group's uint64 words
    n = len(x)
    groups, nwords = -(-n // 8), -(-width // 8)
    padded = np.zeros(groups * 8, np.uint64)
    np.bitwise_and(x, _MASKS[width], out=padded[:n])
    lanes = np.ascontiguousarray(padded.reshape(groups, 8).T)
    words = np.zeros((nwords, groups), np.uint64)
    for j in range(8):
        word, bit = divmod(j * width, 64)
        words[word] |= lanes[j] << np.uint64(bit)
        if bit + width > 64:  # its high bits in the next word
            words[word + 1] |= (lanes[j] >> np.uint64(1)) >> np.uint64(63 - bit)
    out = np.ascontiguousarray(words.T).view(np.uint8).reshape(groups, 8 * nwords)[:, :width]
    return out.reshape(-1)[:(n * width + 7) // 8].copy()


def _write_bits(x: np.ndarray, pos: np.ndarray, width: np.ndarray) -> np.ndarray:
    """The low `width[i]` (< 64) bits of each `x[i]` at bit `pos[i]` (increasing, back to
    back) of a little-endian bit stream, as bytes: each value split over the (at most two)
    uint64 words it spans, the parts of one word summed (their bits are disjoint)."""
    x = x & _MASKS[width]
    q, r = pos >> np.uint64(6), pos & np.uint64(63)
    words = np.zeros(int(q[-1]) + 2, np.uint64)
    first = np.flatnonzero(np.r_[True, q[1:] != q[:-1]])  # each word's first value
    at = q[first]
    words[at] = np.add.reduceat(x << r, first)
    words[at + np.uint64(1)] += np.add.reduceat((x >> np.uint64(1)) >> (np.uint64(63) - r), first)
    return words.view(np.uint8)[:(int(pos[-1] + width[-1]) + 7) // 8].copy()


def _unpack_fixed(data: np.ndarray, n: int, width: int) -> np.ndarray:
    if not width or not n:
        return np.zeros(n, np.uint64)
    if width > _GROUPED:
        return _read_bits(data, np.arange(0, n * width, width, dtype=np.uint64),
                          np.full(n, width, np.uint64))
    # `_pack_fixed`'s groups: value j of every group through one strided (unaligned) uint64
    # view of the bytes, at the same byte offset and bit shift in each group
    groups = -(-n // 8)
    padded = _padded(data, groups * width + 8)
    lanes, mask = np.empty((8, groups), np.uint64), _MASKS[width]
    for j in range(8):
        at, bit = divmod(j * width, 8)
        words = np.ndarray((groups,), "<u8", buffer=padded, offset=at, strides=(width,))
        np.right_shift(words, np.uint64(bit), out=lanes[j])
        np.bitwise_and(lanes[j], mask, out=lanes[j])
    return lanes.T.reshape(-1)[:n]


def _read_bits(data: np.ndarray, pos: np.ndarray, width: np.ndarray) -> np.ndarray:
    """The `width[i]` (< 64) bits at bit `pos[i]` of the little-endian bit stream `data`,
    each from the (at most two) uint64 words it spans: a few gathers, no bit matrix."""
    words = _padded(data, (len(data) // 8 + 2) * 8).view(np.uint64)
    q, r = pos >> np.uint64(6), pos & np.uint64(63)
    # the next word's bits go above the first's 64 - r: shifted in two steps (never by 64)
    out = (words[q] >> r) | ((words[q + np.uint64(1)] << np.uint64(1)) << (np.uint64(63) - r))
    return out & _MASKS[width]


def _padded(data: np.ndarray, nbytes: int) -> np.ndarray:
    """`data`'s bytes, then zeros up to `nbytes`: room for whole-word reads past its end."""
    out = np.zeros(nbytes, np.uint8)
    out[:len(data)] = data
    return out


def _bit_length(x: np.ndarray) -> np.ndarray:
    """Bits needed by each unsigned `x` (0 for 0), as uint8: exact for all 64 bits."""
    if x.dtype.itemsize <= 2:
        return _BIT_LENGTH16[x]
    if x.dtype.itemsize <= 4:  # exact in a float64: frexp's exponent is the bit length
        return np.frexp(x.astype(np.float64))[1].astype(np.uint8)
    hi, lo = (x >> np.uint64(32)).astype(np.float64), (x & np.uint64(0xFFFFFFFF)).astype(
        np.float64)  # each exact in a float64: frexp's exponent is the bit length
    return np.where(hi > 0, 32 + np.frexp(hi)[1], np.frexp(lo)[1]).astype(np.uint8)


def _pack_varying(x: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The low widths[i] bits of each x[i], back to back, little-endian bit order."""
    if not len(widths) or not (top := int(widths.max())):
        return np.zeros(0, np.uint8)
    x = x.astype(np.uint64, copy=False)
    if int(widths.min()) == top:  # one width: the same stream, packed 8 at a time
        return _pack_fixed(x, top)
    w = widths.astype(np.uint64)
    return _write_bits(x, np.cumsum(w) - w, w)


def _unpack_varying(data: np.ndarray, widths: np.ndarray) -> np.ndarray:
    w = widths.astype(np.uint64)
    if not len(w) or not (top := int(w.max())):
        return np.zeros(len(widths), np.uint64)
    if int(w.min()) == top:
        return _unpack_fixed(data, len(w), top)
    pos = np.cumsum(w) - w
    if top > _GROUPED:
        return _read_bits(data, pos, w)
    # each value from one unaligned uint64 read at its first byte (its bits fit: <= 56 + 7)
    words = np.ndarray((len(data) + 1,), "<u8", buffer=_padded(data, len(data) + 8),
                       strides=(1,))
    out = words[pos >> np.uint64(3)]
    out >>= pos & np.uint64(7)
    return out & _MASKS[w]


def _zip(raw: np.ndarray) -> bytes | None:
    """Raw deflate of `raw`, or None where it is not smaller. Run-length matches only: as
    fast as Huffman alone (~90 M bytes/s) and within 2 % of it on exponents, yet a constant
    stream (one XOR width, one exponent) costs next to nothing."""
    if len(raw) < 64:
        return None
    c = zlib.compressobj(1, zlib.DEFLATED, -15, 9, zlib.Z_RLE)
    z = c.compress(raw) + c.flush()
    return z if len(z) < len(raw) else None


def _unzip(data: np.ndarray, n: int, field: str) -> np.ndarray:
    d = zlib.decompressobj(-15)
    try:
        out = d.decompress(data.tobytes(), n + 1)  # at most one byte past what is expected
    except zlib.error as e:
        raise CodecError(field, f"does not inflate ({e})") from None
    if len(out) != n or not d.eof or d.unconsumed_tail or d.unused_data:
        raise CodecError(field, f"inflates to {len(out)}{'+' if not d.eof else ''} bytes, "
                         f"expected {n}")
    return np.frombuffer(out, np.uint8)


# -- values -----------------------------------------------------------------------------------

def _rotl(v: np.ndarray, bits: int) -> np.ndarray:
    return (v << v.dtype.type(1)) | (v >> v.dtype.type(bits - 1))


def _rotr(v: np.ndarray, bits: int) -> np.ndarray:
    return (v >> v.dtype.type(1)) | (v << v.dtype.type(bits - 1))


def _planes(v: np.ndarray, s: int) -> tuple[np.ndarray, np.ndarray]:
    """(top byte of each value, the other bytes of each, little-endian) of unsigned `v`."""
    b = v.view(np.uint8).reshape(-1, s)
    return np.ascontiguousarray(b[:, s - 1]), np.ascontiguousarray(b[:, :s - 1]).reshape(-1)


# -- the piece --------------------------------------------------------------------------------

def encode(indices: np.ndarray, bits: np.ndarray, *, floating: bool,
           old: np.ndarray | None = None) -> tuple[dict, np.ndarray]:
    """Code one patch piece.

    Args:
        indices: its flat element indices, strictly increasing, any integer dtype.
        bits: the new values' bit patterns, an unsigned view (uint8/16/32/64) of one per index.
        floating: the tensor is a float one (its exponent is coded apart).
        old: the receiver's old bit patterns at `indices` (same dtype as `bits`): values are
            then sent as ``new ^ old``; None: raw.
    Returns:
        (header fields: ``count``, ``first``, ``shift``, ``high``, ``values``,
        ``sections``, ``zipped``; the piece's bytes, unpadded).
    """
    k = len(indices)
    idx = indices.astype(np.int64, copy=False)
    shift = _rice_shift((int(idx[-1]) - int(idx[0]) - (k - 1)) / (k - 1)) if k > 1 else 0
    got = jit.encode(idx, bits, old, floating, shift, _BIT_LENGTH16) if k else None
    sections, lengths = got or _sections(idx, bits, old, floating, shift)
    fields, zipped = {"count": k, "first": int(idx[0]) if k else 0, "shift": shift,
                      "high": UNARY, "values": RAW if old is None else XOR}, []
    if lengths is not None and (wmin := _unary_min(lengths, k)) is not None:
        packed = jit.unary_pack(sections[3], wmin)
        sections[3] = _pack_unary(sections[3].astype(np.int64) - wmin) if packed is None \
            else packed
        fields.update(widths=UNARY, wmin=wmin)
    elif (z := _zip(sections[3])) is not None:
        sections[3] = np.frombuffer(z, np.uint8)
        zipped.append(3)
    fields.update(sections=[len(x) for x in sections], zipped=zipped)
    return fields, np.concatenate(sections) if k else np.zeros(0, np.uint8)


def _unary_min(lengths: np.ndarray, k: int) -> int | None:
    """The smallest of the xor values' bit lengths (`lengths`: how many of each), where
    those lengths in unary past it cost at most a quarter bit a value more than their
    entropy (and for a small piece 64 bits); else None: deflated (a constant stream, or one
    spread over many lengths)."""
    at = np.flatnonzero(lengths)
    if not len(at):
        return None
    counts, wmin = lengths[at], int(at[0])
    bits = int((counts * (at - wmin + 1)).sum())
    entropy = float(-(counts * np.log2(counts / k)).sum())
    return wmin if bits <= entropy + k / 4 + 64 else None


def _rice_shift(mean: float) -> int:
    """The Rice parameter for gaps of this mean: the best for geometric gaps (changes at
    random; Kiely's rule), whose unary parts then average ~1.5 bits."""
    if mean <= 0:
        return 0
    return min(62, max(0, 1 + math.floor(math.log2(-math.log(0.6180339887498949)
                                                   / math.log1p(1 / mean)))))


def _sections(idx: np.ndarray, bits: np.ndarray, old: np.ndarray | None, floating: bool,
              shift: int) -> list[np.ndarray]:
    """`encode`'s five sections, before deflate, the numpy way."""
    s = bits.dtype.itemsize
    gaps = (np.diff(idx) - 1).astype(np.uint64)
    high = gaps >> np.uint64(shift)
    escapes = high[high >= _UNARY_ESC]
    sections = [_pack_fixed(gaps, shift), _pack_unary(np.minimum(high, _UNARY_ESC)),
                escapes.astype("<u8").view(np.uint8)]
    if old is None:
        v = _rotl(bits, 8 * s) if floating and s > 1 else bits
        return [*sections, *_planes(np.ascontiguousarray(v), s)], None
    x = bits ^ old
    length = _bit_length(x)
    return [*sections, length, _pack_varying(x, _WIDTH[length])], \
        np.bincount(length, minlength=8 * s + 1)


def _pack_unary(zeros: np.ndarray) -> np.ndarray:
    """Each of `zeros` (integers >= 0) in unary: that many zero bits, then a one, bit-packed
    little-endian."""
    ones = np.cumsum(zeros.astype(np.uint64) + np.uint64(1)) - np.uint64(1)
    unary = np.zeros(int(ones[-1]) + 1 if len(ones) else 0, np.uint8)
    unary[ones] = 1
    return np.packbits(unary, bitorder="little")


def check_fields(e: dict, numel: int, itemsize: int) -> int:
    """Check a piece's header fields against its tensor's element count and element size;
    return the piece's byte length (unpadded). Raises `CodecError`."""
    k, first, shift = e.get("count"), e.get("first"), e.get("shift")
    for field, v in (("count", k), ("first", first), ("shift", shift)):
        if type(v) is not int or v < 0:
            raise CodecError(field, f"must be an int >= 0, found {v!r}")
    if k > numel or (k and first >= numel) or shift > 62:
        raise CodecError("count", f"{k} elements from {first} (shift {shift}) do not fit the "
                         f"{numel} elements")
    if e.get("values") not in VALUES:
        raise CodecError("values", f"must be one of {list(VALUES)}, found {e.get('values')!r}")
    sections, zipped = e.get("sections"), e.get("zipped")
    if not (isinstance(sections, list) and len(sections) == _SECTIONS and all(
            type(n) is int and n >= 0 for n in sections)):
        raise CodecError("sections", f"must be {_SECTIONS} ints >= 0, found {sections!r}")
    if e.get("high", UNARY) != UNARY:
        raise CodecError("high", f"must be {UNARY!r} or absent, found {e.get('high')!r}")
    gaps, xor, unary = max(k - 1, 0), e["values"] == XOR, "high" in e
    most = _unary_widths_most(e, xor, 8 * itemsize)  # None: bit lengths in bytes
    zippable = () if most is not None else (3,) if unary else _ZIPPABLE
    if not (isinstance(zipped, list) and all(z in zippable for z in zipped)
            and len(set(zipped)) == len(zipped)):
        raise CodecError("zipped", f"must list some of {list(zippable)}, found {zipped!r}")
    if unary and not -(-gaps // 8) <= sections[1] <= -(-gaps * (_UNARY_ESC + 1) // 8):
        raise CodecError("sections", f"[1] is {sections[1]} bytes: not {gaps} unary gaps")
    if most is not None and not -(-k // 8) <= sections[3] <= -(-k * (most + 1) // 8):
        raise CodecError("sections", f"[3] is {sections[3]} bytes: not {k} unary bit "
                         "lengths")
    exact = {0: (gaps * shift + 7) // 8, 1: None if unary else gaps,
             3: k if most is None else None, 4: None if xor else k * (itemsize - 1)}
    for i, want in exact.items():
        if want is not None and i not in zipped and sections[i] != want:
            raise CodecError("sections", f"[{i}] is {sections[i]} bytes, {k} elements make "
                             f"{want}")
    if sections[2] % 8 or sections[2] // 8 > gaps:
        raise CodecError("sections", f"[2] is {sections[2]} bytes: not 8 per escaped gap")
    if xor and sections[4] > (k * 8 * itemsize + 7) // 8:
        raise CodecError("sections", f"[4] is {sections[4]} bytes, more than {k} values hold")
    if any(sections[i] > k + 1024 for i in zipped):  # only kept where smaller than k bytes
        raise CodecError("sections", f"a deflated section of {sections} is too long for "
                         f"{k} elements")
    return sum(sections)


def _unary_widths_most(e: dict, xor: bool, nbits: int) -> int | None:
    """With ``widths: "unary"`` (xor values only): the largest excess over ``wmin`` a bit
    length can have; else None."""
    if "widths" not in e:
        return None
    if e["widths"] != UNARY or not xor:
        raise CodecError("widths", f"must be {UNARY!r} (xor values only) or absent, found "
                         f"{e['widths']!r}")
    wmin = e.get("wmin")
    if type(wmin) is not int or not 0 <= wmin <= nbits:
        raise CodecError("wmin", f"must be an int from 0 to {nbits}, found {wmin!r}")
    return nbits - wmin


def decode(e: dict, data: np.ndarray, *, numel: int, itemsize: int, floating: bool,
           old=None, index=np.int64) -> tuple[np.ndarray, np.ndarray]:
    """Decode a piece whose fields passed `check_fields`.

    Args:
        e: its header fields; data: its bytes (uint8, exactly `check_fields`' length).
        numel, itemsize, floating: its tensor's element count, element size, float or not.
        old: for ``values="xor"``: the receiver's current bit patterns, flat (unsigned
            numpy of `itemsize`), or a callable, int64 indices -> those at the indices; or
            None: the values come back as the xors themselves (``old ^ new``), for a
            receiver that applies them in place at its commit.
        index: the indices' dtype: int64, or int32 where `numel` fits it.
    Returns:
        (indices, strictly increasing and inside the tensor; unsigned bit patterns).
    Raises:
        CodecError: naming the field; `old` missing for xor values is the caller's to check.
    """
    k, shift, sizes = e["count"], e["shift"], e["sections"]
    ends = np.cumsum(sizes)
    part = [data[int(a):int(b)] for a, b in zip(np.concatenate([[0], ends[:-1]]), ends,
                                                strict=True)]
    utype = UINT[itemsize]
    if not k:
        return np.zeros(0, index), np.zeros(0, utype)
    gaps_n, first, xor, unary = k - 1, e["first"], e["values"] == XOR, "high" in e
    high = _unzip(part[1], gaps_n, "indices") if 1 in e["zipped"] else part[1]
    third = _unzip(part[3], k, "values") if 3 in e["zipped"] else part[3]
    if (most := _unary_widths_most(e, xor, 8 * itemsize)) is not None:  # unary lengths
        third = jit.unary_widths(third, k, e["wmin"], most)
        if third is None:
            third = (_unary(part[3], k, most, "values", "bit length") + np.uint64(e["wmin"])
                     ).astype(np.uint8)
    got = jit.decode(k, first, numel, shift, part[0], high, unary, part[2].view("<u8"), xor,
                     third, part[4], old, floating, UINT[itemsize], index)
    if got is not None:
        idx, values = got
        return idx, values if not xor or old is None or isinstance(old, np.ndarray) else \
            values ^ old(idx)
    if unary:
        wide = _unary(high, gaps_n, _UNARY_ESC, "indices", "gap")
        escaped = wide == _UNARY_ESC
    else:
        wide = high.astype(np.uint64)
        escaped = high == _ESC
    escapes = part[2].view("<u8")
    if (n_escaped := int(np.count_nonzero(escaped))) != len(escapes):
        raise CodecError("indices", f"hold {n_escaped} escaped gaps, section [2] "
                         f"{len(escapes)}")
    if len(escapes) and int(escapes.max()) >= numel:
        raise CodecError("indices", f"hold a gap past the {numel} elements")
    if len(escapes):
        wide[escaped] = escapes
    # every gap is below (max(255, numel) + 1) << shift: where k of them could pass 2**62,
    # their sum is checked in floats first, so neither the shift nor the sum can wrap
    if k * ((max(_ESC, numel) + 1) << shift) >= 2 ** 62 and \
            (float(wide.sum(dtype=np.float64)) + k) * 2.0 ** shift > 2.0 ** 62:
        raise CodecError("indices", f"run past the {numel} elements")
    gaps = _unpack_fixed(part[0], gaps_n, shift)
    gaps |= np.left_shift(wide, np.uint64(shift), out=wide)
    idx = np.empty(k, np.int64)  # first, then each gap + 1, summed up
    idx[0] = first
    np.add(gaps.view(np.int64), 1, out=idx[1:])
    np.cumsum(idx, out=idx)
    if int(idx[-1]) >= numel:
        raise CodecError("indices", f"run past the {numel} elements")
    idx = idx.astype(index, copy=False)
    if not xor:
        b = np.empty((k, itemsize), np.uint8)
        b[:, itemsize - 1] = third
        b[:, :itemsize - 1] = part[4].reshape(k, itemsize - 1)
        v = b.view(utype).reshape(-1)
        return idx, (_rotr(v, 8 * itemsize) if floating and itemsize > 1 else v)
    length = third
    if len(length) and int(length.max()) > 8 * itemsize:
        raise CodecError("values", f"hold an xor of {int(length.max())} bits, more than "
                         f"{8 * itemsize}")
    widths = _WIDTH[length]
    if (need := (int(widths.sum(dtype=np.uint64)) + 7) // 8) != sizes[4]:
        raise CodecError("values", f"need {need} bytes of xor bits, section [4] holds "
                         f"{sizes[4]}")
    values = _LEAD[itemsize][length]  # the leading one of each xor is implied
    if old is not None:
        values = values ^ (old[idx] if isinstance(old, np.ndarray) else old(idx))
    if sizes[4]:
        values ^= _unpack_varying(part[4], widths).astype(utype)
    return idx, values


def _unary(data: np.ndarray, n: int, most: int, field: str, what: str) -> np.ndarray:
    """The `n` unary numbers of a section (uint64), checked: exactly `n` ones, the last in
    the last byte, no number above `most`; `field` and `what` are named where one is wrong."""
    ones = np.flatnonzero(np.unpackbits(data, bitorder="little"))
    if len(ones) != n or (n and int(ones[-1]) // 8 != len(data) - 1):
        raise CodecError(field, f"hold {len(ones)} unary {what}s in {len(data)} bytes, "
                         f"expected {n}")
    out = np.diff(ones, prepend=-1).astype(np.uint64) - np.uint64(1)
    if n and int(out.max()) > most:
        raise CodecError(field, f"hold a unary {what} of {int(out.max())} zeros, more than "
                         f"{most}")
    return out


# -- the round compressor ---------------------------------------------------------------------

def _zstd():
    try:
        import zstandard
    except ImportError:
        raise DeltaError(f"compress='zstd' needs the zstandard package: {install('zstd')}"
                         ) from None
    return zstandard


def zstd_compress(raw: bytes | memoryview, level: int = 1) -> bytes:
    """zstd frame of `raw`, its size in its header, compressed on every core (raises
    `DeltaError` naming the extra without zstandard)."""
    return _zstd().ZstdCompressor(level=level, threads=-1, write_content_size=True).compress(
        raw)


def zstd_decompress(data: bytes, n: int) -> bytes:
    """Exactly `n` bytes from zstd frame `data`: a frame whose header does not say `n` is
    refused before anything is allocated; one that holds more or less, is cut off or is
    followed by other bytes raises `CodecError`."""
    zstandard = _zstd()
    try:
        size = zstandard.frame_content_size(data)
        if size != n:
            raise CodecError("raw_nbytes", f"is {n}, the buffer's zstd frame says {size}")
        stream = zstandard.ZstdDecompressor().decompressobj()
        out = stream.decompress(data)
    except zstandard.ZstdError as e:
        raise CodecError("buffer", f"does not decompress ({e})") from None
    if not stream.eof or stream.unused_data:
        raise CodecError("buffer", "is cut off inside its zstd frame" if not stream.eof else
                         f"holds {len(stream.unused_data)} bytes after its zstd frame")
    if len(out) != n:
        raise CodecError("raw_nbytes", f"is {n}, the buffer decompresses to {len(out)} bytes")
    return out

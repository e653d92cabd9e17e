"""Deltas packed into bounded rounds: what goes on the wire.

`pack` lays many deltas (`hotweights.remote.delta`) into a few contiguous uint8 buffers (one
per round, at most ``max_bytes`` each; a bigger delta is split: patches by index range, rows
by row range, dense by flat element range), each with a small JSON-able header. Patches go
compact by default (`hotweights.remote.codec`: Rice-coded index gaps, values with their
exponents entropy-coded: ~2.3 bytes per changed bf16 element instead of 6); ``values="xor"``
sends ``new ^ old`` instead, for receivers that hold the old values, and
``compress="zstd"`` compresses each round's buffer. The receiving side, which checks a whole
round against its targets before it writes anything, is `hotweights.remote.delta_apply`.
No transport, no vLLM.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hotweights.errors import DeltaError
from hotweights.remote import codec, delta, jit
from hotweights.remote.delta import (
    _BITS,
    _NP_BITS,
    _RANGE,
    DENSE,
    PATCH,
    ROWS,
    SAME,
    Delta,
    _np_row_index,
    _row_index,
    dtype_name,
)

__all__ = ["COMPRESS", "FORMAT", "MIN_ROUND_BYTES", "PATCHES", "VALUES", "Round", "pack", "warm"]

logger = logging.getLogger(__name__)

FORMAT = 4  # 1: patches only flat; 2: compact patches' gap highs in bytes; 3: xor bit
# lengths only in bytes (all still read)
PATCHES = ("compact", "flat")  # pack's patch layouts: codec-coded, or format 1's arrays
VALUES = codec.VALUES  # pack's patch values: "raw" (any receiver), "xor" (it holds the old)
COMPRESS = (None, "zstd")  # pack's round compressor
_BLOCK = 1 << 20  # changed elements per compact piece: a round boundary splits one
MIN_ROUND_BYTES = 64  # the smallest max_bytes: room for a few elements of any patch


def _al(n: int) -> int:
    return (n + 7) & ~7  # every section starts 8-byte aligned, so it can be viewed in place


@dataclass(frozen=True, eq=False)
class Round:
    """One packed round: a JSON-able header and one contiguous uint8 buffer.

    Attributes:
        header: ``{"format", "round", "rounds", "nbytes", "entries"}``: this round's number,
            0 or, on the last round, how many the update has, the buffer's length, and one
            entry per piece of a delta: "name", "kind", "dtype", "shape", "offset" and
            "nbytes" (its 8-byte aligned segment of the buffer) and, by kind: dense "start",
            "stop" (its flat element range); patch, flat: "count", "index_dtype" (the
            indices, then the values, each section 8-byte aligned); patch, compact: "count",
            "first", "shift", "high", "values", "sections", "zipped", and unary xor
            bit lengths' "widths", "wmin" (see `hotweights.remote.codec`);
            rows "nranges", "nrows" (the int64 pairs, then the rows). A compressed round
            also has "compress" ("zstd") and "raw_nbytes": the segments' offsets are in the
            decompressed buffer.
        buffer: uint8 tensor of ``header["nbytes"]`` bytes.
    """
    header: dict
    buffer: torch.Tensor

    def header_bytes(self) -> bytes:
        """The header as compact UTF-8 JSON, as it goes on the wire."""
        return json.dumps(self.header, separators=(",", ":")).encode()

    @property
    def wire_bytes(self) -> int:
        """Bytes on the wire: the JSON header and the buffer."""
        return len(self.header_bytes()) + self.buffer.numel()


@dataclass(frozen=True, eq=False)
class _Piece:
    delta: Delta
    fields: dict  # the header entry's kind-specific fields
    nbytes: int
    src: tuple  # dense: (start, stop); patch: (i0, i1) or (coded bytes,); rows: (ranges, rows)


class _Plan:
    """Greedy split of deltas into rounds of at most `cap` bytes (sizes only, no copies)."""

    def __init__(self, cap: int):
        self.cap, self.rounds, self.used = cap, [[]], 0

    @property
    def room(self) -> int:
        return self.cap - self.used

    def add(self, p: _Piece) -> None:
        self.rounds[-1].append(p)
        self.used += p.nbytes

    def next(self) -> None:
        if self.rounds[-1]:
            self.rounds.append([])
            self.used = 0

    def dense(self, d: Delta, start: int, stop: int) -> None:
        s = d.dtype.itemsize
        while start < stop:
            if (k := min(stop - start, self.room // s)) == 0:
                self.next()
                continue
            self.add(_Piece(d, {"start": start, "stop": start + k}, _al(k * s),
                            (start, start + k)))
            start += k

    def patch(self, d: Delta) -> None:
        i, isz, s = 0, d.indices.element_size(), d.dtype.itemsize
        while i < d.changed:
            if (k := min(d.changed - i, (self.room - 16) // (isz + s))) <= 0:
                self.next()  # 16: both sections' alignment padding
                continue
            self.add(_Piece(d, {"count": k, "index_dtype": dtype_name(d.indices.dtype)},
                            _al(k * isz) + _al(k * s), (i, i + k)))
            i += k

    def compact(self, d: Delta, xor: bool) -> None:
        """A patch coded by `codec`, in pieces of at most `_BLOCK` elements: their sizes are
        known once coded, so they are coded here; a piece that does not fit the room left is
        coded again, shorter (about once a round)."""
        s = d.dtype.itemsize
        idx = d.indices.cpu().numpy()
        bits = d.values.view(_BITS[s]).cpu().numpy().view(codec.UINT[s])
        old = None if not xor or d.old_values is None else \
            d.old_values.view(_BITS[s]).cpu().numpy().view(bits.dtype)
        i, floating = 0, d.dtype.is_floating_point
        while i < d.changed:
            n = min(d.changed - i, _BLOCK)
            while True:
                fields, data = codec.encode(idx[i:i + n], bits[i:i + n], floating=floating,
                                            old=None if old is None else old[i:i + n])
                size = _al(len(data))
                if size <= self.room:
                    self.add(_Piece(d, fields, size, (data,)))
                    i += n
                    break
                if self.rounds[-1] and (n == 1 or 4 * self.room < size):
                    self.next()  # little room left here: a fresh round
                else:
                    n = max(1, min(n - 1, int(n * self.room / size * 0.95)))

    def rows(self, d: Delta) -> None:
        row = math.prod(d.shape[1:])
        row_bytes = row * d.dtype.itemsize
        if _al(d.nbytes) <= self.room:  # all of it in this round: no split to work out
            self.add(_Piece(d, {"nranges": len(d.ranges), "nrows": d.changed // row},
                            _al(d.nbytes), (np.ascontiguousarray(d.ranges), d.changed // row)))
            return
        todo, j = d.ranges.copy(), 0
        while j < len(todo):
            lens = todo[j:, 1] - todo[j:, 0]
            cost = _RANGE * np.arange(1, len(lens) + 1) + np.cumsum(lens) * row_bytes
            whole = int(np.searchsorted(cost, self.room, side="right"))
            take = todo[j:j + whole]
            if whole < len(lens):  # the next run, in part
                part = max(0, self.room - (int(cost[whole - 1]) if whole else 0) - _RANGE
                           ) // row_bytes
                if part:
                    a = todo[j + whole, 0]
                    take = np.concatenate([take, [[a, a + part]]])
                    todo[j + whole, 0] += part
            if len(take):
                m = int((take[:, 1] - take[:, 0]).sum())
                self.add(_Piece(d, {"nranges": len(take), "nrows": m},
                                _al(_RANGE * len(take) + m * row_bytes), (take.copy(), m)))
                if (j := j + whole) < len(todo):
                    self.next()
            elif self.rounds[-1]:
                self.next()
            else:  # one row is bigger than a round: send it as dense pieces
                a = int(todo[j, 0])
                self.dense(d, a * row, (a + 1) * row)
                todo[j, 0] += 1
                j += int(todo[j, 0] == todo[j, 1])


def _write(p: _Piece, seg: torch.Tensor) -> None:
    d, u8 = p.delta, torch.uint8
    if len(p.src) == 1:  # a compact patch, coded
        data = torch.from_numpy(p.src[0])
        seg[:len(data)].copy_(data)
        seg[len(data):].zero_()
    elif d.kind == DENSE or "start" in p.fields:  # a row too big for a round comes as dense
        a, b = p.src
        k = (b - a) * d.dtype.itemsize
        seg[:k].copy_(d.tensor.detach().reshape(-1)[a:b].view(u8))
        seg[k:].zero_()
    elif d.kind == PATCH:
        (i0, i1), s = p.src, d.dtype.itemsize
        ni = (i1 - i0) * d.indices.element_size()
        seg[:ni].copy_(d.indices[i0:i1].view(u8))
        seg[ni:_al(ni)].zero_()
        seg[_al(ni):_al(ni) + (i1 - i0) * s].copy_(d.values[i0:i1].view(u8))
        seg[_al(ni) + (i1 - i0) * s:].zero_()
    else:
        (take, m), k = p.src, len(p.src[0])
        src, s = d.tensor.detach(), d.dtype.itemsize
        row = math.prod(d.shape[1:])
        nd = m * row * s
        if delta._NUMPY and src.device.type == seg.device.type == "cpu":  # ~3x less per piece
            out = seg.numpy()
            out[:_RANGE * k] = take.reshape(-1).view(np.uint8)
            np.take(src.view(_BITS[s]).numpy().reshape(-1, row), _np_row_index(take), axis=0,
                    out=out[_RANGE * k:_RANGE * k + nd].view(_NP_BITS[s]).reshape(m, row))
            out[_RANGE * k + nd:] = 0
            return
        seg[:_RANGE * k].copy_(torch.from_numpy(take).view(-1).view(u8))
        data = seg[_RANGE * k:_RANGE * k + nd].view(d.dtype).view(m, *d.shape[1:])
        rows = _row_index(torch.from_numpy(take)).to(src.device)
        if src.device == data.device:
            torch.index_select(src, 0, rows, out=data)
        else:
            data.copy_(src.index_select(0, rows))
        seg[_RANGE * k + nd:].zero_()


def warm(dtypes: Iterable[torch.dtype]) -> None:
    """Compile the sending side's loops (`jit`: the compare, the patch encode) for tensors
    of these dtypes now: a tiny update of each, encoded and packed as an update's is, so
    the compiled signatures are the same (~3 s each where numba's disk cache is cold, as in
    a fresh container, else ~0.1 s). A no-op without numba; never raises (what it could
    not compile compiles at first use, as without it)."""
    if not jit.enabled():
        return
    for dtype in dtypes:
        try:
            old = {"rows": torch.zeros(4, 8, dtype=dtype), "flat": torch.zeros(3, dtype=dtype)}
            new = {k: t.clone() for k, t in old.items()}
            for t in new.values():
                t.view(-1)[1] = 1
            for _ in pack(delta.encode_each(old, new), max_bytes=1 << 12, values=codec.XOR):
                pass
        except Exception as e:  # a dtype the encode refuses: the update names it
            logger.debug("warming the compiled loops for %s failed: %r", dtype, e)


def pack(deltas: Iterable[Delta], *, max_bytes: int, device: torch.device | str | None = None,
         staging: torch.Tensor | Sequence[torch.Tensor] | None = None,
         patches: str = "compact", values: str = "raw",
         compress: str | None = None, cut_bytes: int | None = None, cut_payload: int = 0,
         cut_wait: float = 0.0) -> Iterator[Round]:
    """Pack deltas into rounds, each one buffer of at most `max_bytes` and a small header.

    Rounds are made as the deltas are read: a round is handed out as soon as the next one
    has begun, so with `deltas` a generator (`encode_each`) the first rounds travel while
    later tensors are still being encoded. The number of rounds is known only at the end:
    every round's header says ``"rounds": 0`` but the last one's, which says how many there
    are. An update always has at least one round (an empty one when nothing changed).

    Args:
        deltas: from `encode_each` / `encode_all` (``same`` ones are skipped).
        max_bytes: the staging budget: the most buffer bytes in one round (rounded down to a
            multiple of 8, at least `MIN_ROUND_BYTES`); a bigger delta is split across rounds.
        device: where buffers are allocated; default the staging tensor's device, else the
            first delta's, else the CPU.
        staging: a 1-D uint8 tensor of at least `max_bytes` reused for every round: each
            round's buffer is then a view of it, overwritten when the next round is read; or
            several such tensors, used in turn (two: a round's buffer stays as it is until
            the round after the next is read, `Channel.send(ahead=True)`).
        patches: ``"compact"`` (default): patches coded by `hotweights.remote.codec`
            (gap-coded indices; coded here, on the CPU, as the deltas are read);
            ``"flat"``: int32/int64 indices and raw values, as a format-1 receiver reads
            them (the round is still format 3).
        values: compact patches' values: ``"raw"`` (default): the new values, which every
            receiver can decode; ``"xor"``: ``new ^ old`` bit patterns, a few bits each when
            few bits flip, decodable only by a receiver that holds the old values
            (`delta_apply.apply`'s targets, `Staged`'s `old`). Only deltas from `encode`
            carry the old values (`Delta.old_values`); the others go raw.
        compress: None (default), or ``"zstd"``: each round's whole buffer is compressed
            (level 1) where that makes it smaller; needs the ``zstd`` extra (zstandard).
        cut_bytes: also end a round (where more changes follow) once its deltas cover this
            many bytes of tensors, unchanged ones included: small updates then come in
            several rounds, which the receivers stage while the rest is encoded.
        cut_payload, cut_wait: ... but only once the round holds `cut_payload` bytes at least
            or was opened `cut_wait` seconds ago (default 0, 0: always): each round has
            fixed costs on both sides (its collectives, a hand-off to every receiver's
            thread, long where a busy engine shares its CPU), worth paying for the overlap
            only where the round carries enough, while the receivers' wait for a round
            stays bounded in time.
    Returns:
        An iterator of `Round`.
    Raises:
        DeltaError: a bad `max_bytes`, `staging`, `patches`, `values`, `compress`,
            `cut_bytes`, `cut_payload` or `cut_wait` (named), or zstd asked for without
            zstandard installed, before any round is made; while reading, what reading
            `deltas` raises.
    """
    for field, got, allowed in (("patches", patches, PATCHES), ("values", values, VALUES),
                                ("compress", compress, COMPRESS)):
        if got not in allowed:
            raise DeltaError(f"pack: field '{field}' must be one of {list(allowed)}, found "
                             f"{got!r}")
    if values == codec.XOR and patches != "compact":
        raise DeltaError("pack: field 'values' 'xor' needs patches='compact'")
    if compress is not None:
        codec.zstd_compress(b"")  # raises now, naming the extra, if zstandard is missing
    if type(max_bytes) is not int or max_bytes < MIN_ROUND_BYTES:
        raise DeltaError(f"pack: field 'max_bytes' must be an int >= {MIN_ROUND_BYTES}, found "
                         f"{max_bytes!r}")
    if cut_bytes is not None and (type(cut_bytes) is not int or cut_bytes < 1):
        raise DeltaError(f"pack: field 'cut_bytes' must be an int >= 1, found {cut_bytes!r}")
    if type(cut_payload) is not int or cut_payload < 0:
        raise DeltaError(f"pack: field 'cut_payload' must be an int >= 0, found "
                         f"{cut_payload!r}")
    if not (isinstance(cut_wait, int | float) and cut_wait >= 0):
        raise DeltaError(f"pack: field 'cut_wait' must be seconds >= 0, found {cut_wait!r}")
    cap = max_bytes // 8 * 8
    buffers = (() if staging is None else (staging,) if isinstance(staging, torch.Tensor)
               else tuple(staging))
    for b in buffers:
        if not (isinstance(b, torch.Tensor) and b.dtype == torch.uint8 and b.dim() == 1
                and b.is_contiguous() and b.numel() >= cap):
            found = f"{b.dtype} of shape {tuple(b.shape)}" if isinstance(b, torch.Tensor) \
                else type(b).__name__
            raise DeltaError(f"pack: field 'staging' must be contiguous 1-D uint8 tensors of "
                             f">= {cap} bytes, found {found}")
    if device is None and buffers:
        device = buffers[0].device  # else the first delta's (`_Writer`)
    return _rounds(deltas, _Plan(cap), patches, values, _Cut(cut_bytes, cut_payload, cut_wait),
                   _Writer(device, buffers, compress))


@dataclass
class _Cut:
    """When a round that is not full ends (`pack`'s `cut_bytes`, `cut_payload`, `cut_wait`)."""

    cover: int | None  # None: a round ends only when full
    payload: int
    wait: float
    covered: int = 0  # bytes of tensors the open round's deltas cover
    opened: float = 0.0  # when it was opened (`time.monotonic`)

    def due(self, held: int) -> bool:
        return self.cover is not None and self.covered >= self.cover and (
            held >= self.payload or time.monotonic() - self.opened >= self.wait)


def _rounds(deltas: Iterable[Delta], plan: _Plan, patches: str, values: str,
            cut: _Cut, writer: _Writer) -> Iterator[Round]:
    cut.opened = time.monotonic()
    for d in deltas:
        if d.kind != SAME and cut.due(plan.used):
            plan.next()  # only now: the last round is never an empty one
            cut.covered, cut.opened = 0, time.monotonic()
        cut.covered += math.prod(d.shape) * d.dtype.itemsize
        if d.kind == DENSE:
            plan.dense(d, 0, math.prod(d.shape))
        elif d.kind == PATCH and patches == "compact":
            plan.compact(d, xor=values == codec.XOR)
        elif d.kind == PATCH:
            plan.patch(d)
        elif d.kind == ROWS:
            plan.rows(d)
        while len(plan.rounds) > 1:  # full ones: on their way while the rest is encoded
            cut.opened = time.monotonic()  # the round after it is open
            yield writer.round(plan.rounds.pop(0), last=False)
    yield writer.round(plan.rounds[0], last=True)


class _Writer:
    """Fills each round's buffer (and header) from its planned pieces, in order."""

    def __init__(self, device, buffers: tuple[torch.Tensor, ...], compress: str | None):
        self.device, self.buffers, self.compress, self.i = device, buffers, compress, 0

    def round(self, pieces: list[_Piece], last: bool) -> Round:
        if self.device is None:  # the first delta's device, else the CPU
            d = pieces[0].delta if pieces else None
            self.device = ("cpu" if d is None else d.tensor.device if d.tensor is not None
                           else d.values.device)
        size, i = sum(p.nbytes for p in pieces), self.i
        staging = self.buffers[i % len(self.buffers)] if self.buffers else None
        buf = (staging[:size] if staging is not None
               else torch.empty(size, dtype=torch.uint8, device=self.device))
        entries, off = [], 0
        for p in pieces:
            _write(p, buf[off:off + p.nbytes])
            d = p.delta
            entries.append({"name": d.name, "kind": DENSE if "start" in p.fields else d.kind,
                            "dtype": dtype_name(d.dtype), "shape": list(d.shape),
                            "offset": off, "nbytes": p.nbytes,
                            **{k: int(v) if isinstance(v, np.integer) else v
                               for k, v in p.fields.items()}})
            off += p.nbytes
        head = {"format": FORMAT, "round": i, "rounds": i + 1 if last else 0, "nbytes": size}
        if self.compress is not None and size:
            z = codec.zstd_compress(buf.cpu().numpy().tobytes())
            if len(z) < size:
                head |= {"nbytes": len(z), "compress": self.compress, "raw_nbytes": size}
                zt = torch.frombuffer(bytearray(z), dtype=torch.uint8)
                buf = staging[:len(z)].copy_(zt) if staging is not None else zt.to(self.device)
        logger.debug("round %d%s: %d pieces, %d bytes (%d on the wire)", i + 1,
                     " (the last)" if last else "", len(pieces), size, head["nbytes"])
        self.i += 1
        return Round({**head, "entries": entries}, buf)

"""Exact weight deltas: what changed per tensor.

`encode` compares bit patterns (an integer view of the same width: -0.0 vs 0.0 and a NaN's
payload are changes, two equal NaNs are not), a bounded chunk at a time, and keeps the
encoding of the new tensor that is cheapest on the wire:

- ``same``: bit-identical, nothing sent;
- ``patch``: sorted flat element indices (int32; int64 from `INT64_INDEX_FROM` elements)
  and the new values in the tensor's dtype (and the old ones there, for `packing.pack`'s
  ``values="xor"``);
- ``rows`` (tensors of two dims or more): runs of changed rows along dim 0, as int64
  (start, stop) pairs, and those rows;
- ``dense``: the whole tensor.

Packing deltas into bounded rounds for the wire is `hotweights.remote.packing`; the
receiving side is `hotweights.remote.delta_apply`. No transport, no vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from hotweights.errors import DeltaError
from hotweights.remote import jit

__all__ = ["INT64_INDEX_FROM", "KINDS", "Delta", "dense", "dtype_name", "encode", "encode_all",
           "encode_each"]

logger = logging.getLogger(__name__)

SAME, PATCH, ROWS, DENSE = "same", "patch", "rows", "dense"
KINDS = (SAME, PATCH, ROWS, DENSE)
INT64_INDEX_FROM = 2**31  # a tensor with this many elements or more gets int64 patch indices
_CHUNK = 1 << 22  # elements compared, checked or converted per step: bounds temporaries
_RANGE = 16  # bytes of one int64 (start, stop) pair
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the wire names it: "bfloat16", "float32", ..."""
    return str(dtype).removeprefix("torch.")


def _flat(name: str, t: torch.Tensor, who: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise DeltaError(f"{name}: {who} tensor is not contiguous (shape {tuple(t.shape)}, "
                         f"stride {t.stride()}); pass a contiguous tensor")
    if t.dtype.itemsize not in _BITS or t.dtype.is_complex:
        raise DeltaError(f"{name}: field 'dtype' {dtype_name(t.dtype)} is not supported; "
                         "use a float, integer or bool tensor")
    return t.detach().reshape(-1)


def _runs(flags: np.ndarray) -> np.ndarray:
    # bool flags -> (k, 2) int64 [start, stop) of their runs of True: where a padded copy
    # changes, starts and stops alternate
    padded = np.zeros(len(flags) + 2, dtype=bool)
    padded[1:-1] = flags
    return np.flatnonzero(padded[1:] != padded[:-1]).astype(np.int64, copy=False).reshape(-1, 2)


def index_copy(t: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    """``t.index_copy_(0, idx, values)`` bit for bit, in every dtype (torch's has no CPU
    kernel for FP8 or the unsigned integers)."""
    bits = _BITS.get(t.element_size())
    if bits is not None:
        t, values = t.view(bits), values.view(bits)
    t.index_copy_(0, idx, values)


def values_at(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The values of `t` at flat (row-major) indices `idx` (int64, on `t`'s device), read
    where they lie: no copy of a `t` that is not contiguous (GPT-OSS's experts, transposed)."""
    if t.is_contiguous():
        return t.view(-1).index_select(0, idx)
    return t[torch.unravel_index(idx, t.shape)]


def _row_index(ranges: torch.Tensor) -> torch.Tensor:
    # (k, 2) int64 [start, stop) pairs -> the int64 row numbers they cover, in order.
    if ranges.device.type == "cpu":  # numpy: ~10x less per call on the few runs of a tensor
        return torch.from_numpy(_np_row_index(ranges.numpy()))
    lens = ranges[:, 1] - ranges[:, 0]
    before = torch.cumsum(lens, 0) - lens
    return (torch.repeat_interleave(ranges[:, 0] - before, lens)
            + torch.arange(int(lens.sum()), device=ranges.device))


def _np_row_index(r: np.ndarray) -> np.ndarray:
    lens = r[:, 1] - r[:, 0]
    return np.repeat(r[:, 0] - (lens.cumsum() - lens), lens) + np.arange(lens.sum())


def _chunks(n: int, row: int) -> Iterator[tuple[int, int]]:
    # Flat element ranges of at most _CHUNK elements that hold whole rows, or (a row longer
    # than a chunk) lie inside one row: each chunk's changed rows are found without a gather.
    if row > _CHUNK:
        for r0 in range(0, n, row):
            for lo in range(r0, r0 + row, _CHUNK):
                yield lo, min(lo + _CHUNK, r0 + row)
        return
    step = _CHUNK // row * row if row else _CHUNK
    for lo in range(0, n, step):
        yield lo, min(lo + step, n)


@dataclass(frozen=True, eq=False)
class Delta:
    """The exact encoding of one tensor's new value given its old one (see `encode`).

    Attributes:
        name: the tensor's name, the key of its target on the receiving side.
        kind: one of `KINDS`.
        dtype, shape: the tensor's.
        changed: elements the delta carries: for ``patch`` exactly those whose bit pattern
            changed, for ``rows`` those of the rows sent, for ``dense`` every element.
        nbytes: payload bytes before packing (0 for ``same``).
        indices, values: ``patch`` only: sorted flat indices (int32 or int64), new values.
        old_values: ``patch`` from `encode` only: the old values at `indices` (what every
            receiver holds there), read by ``packing.pack(values="xor")``.
        ranges: ``rows`` only: int64 array (k, 2) of [start, stop) runs of changed rows.
        tensor: ``rows`` and ``dense`` only: the new tensor itself, not a copy, so pack the
            delta before that tensor changes again.
    """
    name: str
    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    changed: int
    nbytes: int
    indices: torch.Tensor | None = None
    values: torch.Tensor | None = None
    ranges: np.ndarray | None = None
    tensor: torch.Tensor | None = None
    old_values: torch.Tensor | None = None


def dense(name: str, tensor: torch.Tensor) -> Delta:
    """The dense delta of a tensor: a full sync, or a receiver without the old value.

    Args:
        name: the tensor's name.
        tensor: its new value, contiguous (referenced, not copied).
    Returns:
        A ``dense`` `Delta` (``same`` for a tensor without elements).
    Raises:
        DeltaError: a non-contiguous tensor or an unsupported dtype (named).
    """
    _flat(name, tensor, "new")
    n = tensor.numel()
    return Delta(name, DENSE if n else SAME, tensor.dtype, tuple(tensor.shape), n,
                 n * tensor.dtype.itemsize, tensor=tensor if n else None)


def encode(name: str, old: torch.Tensor, new: torch.Tensor, *,
           rows: torch.Tensor | None = None) -> Delta:
    """The cheapest exact encoding of `new` given `old`, by bytes on the wire.

    The two are compared as integer bit patterns a chunk of `_CHUNK` elements at a time, so
    temporaries stay a few times a chunk whatever the tensor's size: as 8-byte words where
    the chunk allows it (a quarter of the compares for 16-bit dtypes), then element by
    element only inside the words that differ. Patch indices are kept only while they cost
    less than the dense tensor. `old` may live on another device than
    `new` (a host snapshot of GPU weights): each chunk of it is copied to `new`'s device.

    Args:
        name: the tensor's name, carried by the delta and named in errors.
        old: the value the receiver holds.
        new: the value it must end with (referenced by ``rows`` and ``dense`` deltas).
        rows: when the caller knows (`hotweights.remote.prefilter`), the only rows along dim
            0 (int64, ascending; a tensor of two dims or more, unless empty) where `new` may
            differ: only they are compared, gathered a chunk at a time.
    Returns:
        A `Delta`; of equal costs dense is preferred, then rows, then patch.
    Raises:
        DeltaError: names the tensor: dtype or shape differ, a non-contiguous tensor, a dtype
            without an integer view of its width (complex), `rows` for a tensor without rows.
    """
    _check_alike(name, new, old)
    old_flat, new_flat = _flat(name, old, "old"), _flat(name, new, "new")
    shape, numel = tuple(new.shape), new.numel()
    row = numel // shape[0] if len(shape) >= 2 and numel else 0  # elements per row, or 0
    if rows is not None and len(rows) and not row:
        raise DeltaError(f"{name}: `rows` given for a tensor without rows (shape {shape})")
    flats = (old_flat, new_flat)
    if _NUMPY and all(flat.device.type == "cpu" for flat in flats):
        # numpy from here on: its small ops cost a fraction of torch's (see `_ne`)
        bits = _BITS[new.dtype.itemsize]
        flats = tuple(flat.view(bits).numpy() for flat in flats)
        rows = None if rows is None else rows.cpu().numpy()
        if rows is not None and len(rows) and (rows.min() < 0 or rows.max() >= shape[0]):
            raise DeltaError(f"{name}: `rows` holds rows outside 0..{shape[0] - 1}")
        rows_changed = np.zeros(shape[0] if row else 0, dtype=bool)
    else:
        rows_changed = torch.zeros(shape[0] if row else 0, dtype=torch.bool, device=new.device)
    comparison = _Comparison(numel, row, new.dtype.itemsize, rows_changed)
    for where, chunks in _pieces(numel, row, rows, *flats):
        comparison.add(where, *chunks, in_place=isinstance(where, np.ndarray))
    if not comparison.changed:
        return Delta(name, SAME, new.dtype, shape, 0, 0)
    return comparison.cheapest(name, new)


def _check_alike(name: str, new: torch.Tensor, old: torch.Tensor) -> None:
    for field, theirs, ours in (("dtype", old.dtype, new.dtype),
                                ("shape", tuple(old.shape), tuple(new.shape))):
        if theirs != ours:
            raise DeltaError(f"{name}: field '{field}' differs (old {theirs}, new {ours}); "
                             "leave it out of `old` to send it dense")


class _Comparison:
    """What `encode` learns of one tensor, a chunk at a time: whether anything changed,
    which rows did, and the patch while it costs less than the dense tensor.

    The patch's pieces are (where, positions, values, lanes, olds). With lanes None,
    `positions` are the changed elements of the chunk at `where`, `values` and `olds` their
    new and old values; else they are its changed 8-byte words, `values` and `olds` their
    new and old words and `lanes` which of their elements changed: expanded
    (`_expand`) only if the patch is chosen (a changed row sent as rows skips it) or when
    those words hold half the dense size.
    """

    def __init__(self, numel: int, row: int, itemsize: int, rows_changed):
        self.numel, self.row, self.itemsize = numel, row, itemsize
        self.index_size = 8 if numel >= INT64_INDEX_FROM else 4
        self.dense_bytes = numel * itemsize
        self.rows_changed = rows_changed  # a flag per row along dim 0 (none without rows)
        self.changed = False
        self.pieces: list[tuple] | None = []  # None: the patch costs as much as dense
        self.patched = 0  # elements the pieces carry
        self.held = 0  # bytes the pieces not yet expanded hold

    def _too_dear(self, elements: int) -> bool:
        """Whether a patch of this many elements costs as much as the dense tensor."""
        return elements * (self.index_size + self.itemsize) >= self.dense_bytes

    def _affordable(self) -> int:
        """How many more changed elements the patch can take before it costs as much as
        the dense tensor (0 once it does)."""
        if self.pieces is None:
            return 0
        return max(0, -(-self.dense_bytes // (self.index_size + self.itemsize)) - self.patched)

    def add(self, where, old_chunk, new_chunk, in_place: bool = False) -> None:
        """Compare one chunk of the flat tensors (`where`: see `_pieces`). `in_place`: the
        chunks are the whole flat tensors (numpy) and `where` the rows to compare, read
        where they are by the compiled loop, else gathered here."""
        if isinstance(new_chunk, torch.Tensor):  # non_blocking only towards an accelerator,
            # whose stream orders the compare after the copy
            old_chunk = old_chunk.to(new_chunk.device,
                                     non_blocking=new_chunk.device.type != "cpu")
        # elements per compared unit: 8-byte words where they fit
        word = _word(self.row, old_chunk, new_chunk)
        old_units, new_units = (_iv(chunk, 8 if word > 1 else self.itemsize)
                                for chunk in (old_chunk, new_chunk))
        chunk_len = len(where) * self.row if in_place else len(new_chunk)
        # numpy chunks: one compiled pass where numba is installed (~0.6x numpy's passes)
        # while the patch can still afford what it finds
        per_row = (self.row // word if chunk_len >= self.row else len(old_units)) \
            if self.row else 0
        found = jit.compare(old_units, new_units, _NP_BITS[self.itemsize], per_row,
                            self._affordable(), rows=where if in_place else None) \
            if isinstance(old_units, np.ndarray) else None
        if found is None and in_place:  # gathered after all
            old_units, new_units = (units.reshape(-1, per_row).take(where, axis=0).reshape(-1)
                                    for units in (old_units, new_units))
        if found is None:
            differs = _ne(old_units, new_units)
            units_changed = _count(differs)  # much cheaper than nonzero
            if self.row:
                self._mark_rows(where, self._row_flags(differs, per_row), chunk_len)
        else:
            units_changed, positions, olds, news, flags = found
            word = 1  # the loop reports elements
            if self.row:
                self._mark_rows(where, flags, chunk_len)
        if not units_changed:
            return
        self.changed = True
        if self.pieces is None:
            return
        if self._too_dear(self.patched + units_changed):
            self.pieces = None  # even one element per changed word costs as much as dense
            return
        if found is None:
            positions = _nonzero(differs)
            olds, news = _take(old_units, positions), _take(new_units, positions)
        if word > 1 and self._too_dear(self.patched + units_changed * word) and \
                self._too_dear(self.patched + _count(_ne(_iv(olds, self.itemsize),
                                                         _iv(news, self.itemsize)))):
            self.pieces = None  # the changed elements, counted, cost as much as dense
            return
        self._add_piece(where, word, positions, olds, news)

    @staticmethod
    def _row_flags(differs, per_row: int):
        """Whether each run of `per_row` units in `differs` holds a changed one."""
        # 8 flags at a time where rows allow: a quicker reduction
        return (_iv(differs, 8).reshape(-1, per_row // 8) if per_row % 8 == 0 else
                differs.reshape(-1, per_row)).any(1)

    def _mark_rows(self, where, flags, chunk_len: int) -> None:
        row = self.row
        first = where if isinstance(where, int) else 0
        if chunk_len >= row:
            if isinstance(where, int):
                self.rows_changed[first // row:first // row + len(flags)] = flags
            else:
                self.rows_changed[where] = flags
        else:  # a chunk inside one row: one flag
            self.rows_changed[first // row] |= flags[0]

    def _add_piece(self, where, word: int, positions, olds, news) -> None:
        """Keep the changed units at `positions` of a chunk, their old and new units."""
        if word == 1:
            piece, elements = (where, positions, news, None, olds), len(positions)
        else:
            olds, news = _iv(olds, self.itemsize), _iv(news, self.itemsize)
            lanes = _ne(olds, news)
            piece, elements = (where, positions, news, lanes, olds), _count(lanes)
        self.held += len(positions) * (positions.dtype.itemsize + 16 + word)
        self.patched += elements
        if self._too_dear(self.patched):
            self.pieces = None  # patches already cost as much as the dense tensor: stop keeping
            return
        self.pieces.append(piece)
        if self.held > self.dense_bytes // 2:  # bound what the unexpanded pieces hold
            self.pieces = [_expand(piece, self.row, self.index_size) for piece in self.pieces]
            self.held = 0

    def cheapest(self, name: str, new: torch.Tensor) -> Delta:
        """The delta of the encoding that costs the fewest bytes (the first of equal costs:
        dense, rows, patch)."""
        shape, ranges = tuple(new.shape), None
        costs = [(self.dense_bytes, DENSE, self.numel)]
        if self.row:
            ranges = _runs(self.rows_changed if isinstance(self.rows_changed, np.ndarray)
                           else self.rows_changed.cpu().numpy())
            rows_sent = int((ranges[:, 1] - ranges[:, 0]).sum())
            costs.append((_RANGE * len(ranges) + rows_sent * self.row * self.itemsize, ROWS,
                          rows_sent * self.row))
        if self.pieces is not None:
            costs.append((self.patched * (self.index_size + self.itemsize), PATCH,
                          self.patched))
        cost, kind, carried = min(costs, key=lambda entry: entry[0])
        if kind == PATCH:
            _, indices, values, _, olds = zip(*(_expand(piece, self.row, self.index_size)
                                                for piece in self.pieces), strict=True)
            return Delta(name, PATCH, new.dtype, shape, self.patched, cost,
                         indices=_cat(indices), values=_cat(values).view(new.dtype),
                         old_values=_cat(olds).view(new.dtype))
        return Delta(name, kind, new.dtype, shape, carried, cost, tensor=new,
                     ranges=ranges if kind == ROWS else None)


def _expand(piece: tuple, row: int, index_size: int) -> tuple:
    """A patch piece (see `_Comparison`) as its changed elements' flat indices in the tensor
    (`index_size`-byte integers), their new and old values: (None, indices, values, None,
    olds)."""
    where, positions, values, lanes, olds = piece
    if where is None:
        return piece
    if lanes is not None:  # the changed elements of the changed words (word a power of two)
        word = len(lanes) // max(1, len(positions))
        lane_hits = _nonzero(lanes)
        values, olds = _take(values, lane_hits), _take(olds, lane_hits)
        positions = (_take(positions, lane_hits >> (word.bit_length() - 1)) * word
                     + (lane_hits & (word - 1)))
    flat = positions + where if isinstance(where, int) else \
        _take(where, positions // row) * row + positions % row
    return None, (flat.astype(_NP_BITS[index_size]) if isinstance(flat, np.ndarray)
                  else flat.to(_BITS[index_size])), values, None, olds


def _pieces(numel: int, row: int, rows: np.ndarray | torch.Tensor | None, *flats
            ) -> Iterator[tuple[int | np.ndarray | torch.Tensor, list]]:
    """(where, the chunk of each of `flats`, numpy arrays or tensors): `where` is the first
    flat element of a slice of `_chunks`, or, given `rows`, the row numbers (on the device of
    `flats[1]`, the new tensor) a chunk of whole rows was gathered from."""
    if rows is None:
        for lo, hi in _chunks(numel, row):
            yield lo, [flat[lo:hi] for flat in flats]
        return
    step = max(1, _CHUNK // row) if row else 1
    for first in range(0, len(rows), step):
        gathered = rows[first:first + step]
        if isinstance(gathered, np.ndarray):  # gathered by `_Comparison.add` if need be
            yield gathered, list(flats)
        else:
            yield gathered.to(flats[1].device), [
                flat.view(-1, row).index_select(0, gathered.to(flat.device)).view(-1)
                for flat in flats]


def _word(row: int, a, *more) -> int:
    """Elements per 8-byte word when every chunk can be compared as int64 words (their
    offsets and lengths whole words, whole rows whole words too), else 1."""
    w = 8 // a.dtype.itemsize
    ok = w > 1 and len(a) % w == 0 and (not row or len(a) < row or row % w == 0) and all(
        t.ctypes.data % 8 == 0 if isinstance(t, np.ndarray) else
        t.storage_offset() % w == 0 and t.data_ptr() % 8 == 0 for t in (a, *more))
    return w if ok else 1


# On the CPU, `encode` works on numpy views of the tensors' bits (no copies): numpy's
# compare, nonzero and count run 1.6x, 1.8x and 5x as fast as torch's on one thread
# (measured on int64 words), and its small ops cost a fraction of torch's. The compare reads
# the most: with more than 2 torch threads, torch's (parallel) compare runs instead.
_NUMPY = True  # tests turn it off to run torch's path (an accelerator's) on the CPU
_NP_BITS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def _iv(x, nbytes: int):
    """An integer view of `x` (numpy array or tensor) with `nbytes`-wide elements."""
    return x.view(_NP_BITS[nbytes]) if isinstance(x, np.ndarray) else x.view(_BITS[nbytes])


def _take(x, i):
    return x.take(i) if isinstance(x, np.ndarray) else x.index_select(0, i)


def _cat(xs) -> torch.Tensor:
    if isinstance(xs[0], np.ndarray):
        return torch.from_numpy(xs[0] if len(xs) == 1 else np.concatenate(xs))
    return xs[0] if len(xs) == 1 else torch.cat(xs)


def _ne(x, y):
    if isinstance(x, np.ndarray):
        return np.not_equal(x, y) if torch.get_num_threads() <= 2 else \
            (torch.from_numpy(x) != torch.from_numpy(y)).numpy()
    return x != y


def _nonzero(flags):
    return np.flatnonzero(flags) if isinstance(flags, np.ndarray) else flags.nonzero().view(-1)


def _count(flags) -> int:
    return int(np.count_nonzero(flags) if isinstance(flags, np.ndarray)
               else torch.count_nonzero(flags))


def encode_all(old: Mapping[str, torch.Tensor] | None, new: Mapping[str, torch.Tensor], *,
               rows: Mapping[str, torch.Tensor] | None = None) -> list[Delta]:
    """Encode every tensor of `new` against its namesake in `old` (see `encode`).

    Args:
        old: what the receiver holds; None for a full sync. A name missing from it is sent
            dense; a name only in it is left out (the receiver keeps its value).
        new: name -> the value the receiver must end with.
        rows: name -> the only rows that may differ (see `encode`); a name missing from it
            is compared whole.
    Returns:
        One `Delta` per tensor of `new`, in its order (``same`` ones included).
    Raises:
        DeltaError: as `encode`, naming the tensor.
    """
    out = list(encode_each(old, new, rows=rows))
    if logger.isEnabledFor(logging.DEBUG):
        kinds = {k: sum(d.kind == k for d in out) for k in KINDS}
        logger.debug("encoded %d tensors %s: %d payload bytes", len(out), kinds,
                     sum(d.nbytes for d in out))
    return out


def encode_each(old: Mapping[str, torch.Tensor] | None, new: Mapping[str, torch.Tensor], *,
                rows: Mapping[str, torch.Tensor] | None = None) -> Iterator[Delta]:
    """`encode_all`, one tensor at a time, as the iterator is read: `packing.pack` sends the first
    rounds while the later tensors are still being compared."""
    for k, t in new.items():
        yield encode(k, old[k], t, rows=None if rows is None else rows.get(k)) \
            if old is not None and k in old else dense(k, t)

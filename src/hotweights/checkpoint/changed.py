"""Which bytes of each shard the live tensors change: the second stage of `sync`.

Per shard, against its sidecar's fingerprints (`checkpoint.sidecar`) where they are
fresh: the tensors `changed=` rules out keep their recorded hashes and the others are
hashed per block; without `changed=`, a `WriteWatch`'s written pages stand for the
tensors whose recorded hashes are the sidecar's (only the blocks they touch are hashed)
and xxh3 hashes the rest coarse first (`blocks.refresh`). Where a sidecar cannot be
trusted, every page is compared with the file. Shards are hashed a few at once, on
threads (one per CPU, up to `HASH_THREADS`), and handed on as they are done, those found
changed in this process's latest syncs first (`_order`). `to_pages`
narrows changed blocks to the pages that differ from the file, for the shards patched
rather than rewritten.
"""

from __future__ import annotations

import collections
import itertools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

from hotweights.changes import blocks
from hotweights.changes.writewatch import WriteWatch
from hotweights.checkpoint import sidecar, threads
from hotweights.checkpoint.dtypes import TORCH
from hotweights.checkpoint.mapped import mapped
from hotweights.checkpoint.result import Progress
from hotweights.checkpoint.shards import Shard
from hotweights.checkpoint.stage import raw
from hotweights.checkpoint.writes import PAGE
from hotweights.errors import LiveTensorError

HASH_THREADS = 4  # shards hashed at once, at most (`_threads`)
Ranges = list[tuple[str, int, int]]  # (tensor, byte range [lo, hi) within it)
_KEPT = 4096  # shards whose last changes this process remembers (`_order`)
# shard path -> (the number of the last sync that found it changed, the bytes it found)
_seen: dict[str, tuple[int, int]] = {}
_syncs = itertools.count(1)  # this process's syncs that found a change, numbered


@dataclass(frozen=True)
class ShardTensors:
    """The live tensors of one shard, by disk name, in the file's shapes; some may not be
    contiguous (a transposed view) or in the file's dtype (`convert_dtype`) until `ready`."""

    shard: Shard
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:  # as the file holds them
        return sum(self.shard.tensors[n].nbytes for n in self.tensors)

    def ready(self) -> ShardTensors:
        """The tensors contiguous, in the file's dtypes: copies made now, one shard at a
        time, of those that are not (a sync holds the copies of the shards it hashes or
        stages, not the whole model's; in journal mode, those of the changed tensors until
        the journal is written)."""
        return ShardTensors(self.shard, {
            n: _cast(n, t, TORCH[self.shard.tensors[n].dtype], self.shard.path)
            for n, t in self.tensors.items()})


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype, path: str) -> torch.Tensor:
    """`t` in `dtype`, contiguous; a float cast that makes finite values infinite (out of
    the narrower dtype's range) is refused, naming the tensor."""
    out = t.to(dtype).contiguous()
    if t.dtype != dtype and (lost := int((torch.isinf(out) & torch.isfinite(t)).sum())):
        raise LiveTensorError(
            f"{name} in {path}: cast to the file's "
            f"{str(dtype).removeprefix('torch.')}, {lost} finite value(s) overflow to inf "
            f"(beyond {torch.finfo(dtype).max:.6g}); nothing was written")
    return out


@dataclass(frozen=True)
class ShardChanges:
    """What may differ between one shard and its live tensors."""

    shard: Shard
    tensors: dict[str, torch.Tensor]
    ranges: Ranges  # the bytes that may differ
    compared: bool  # `ranges` are the pages that differ from the file; else whole blocks
    fresh: blocks.Fingerprints  # of the live tensors: the sidecar to record
    hashed: tuple[str, ...]  # the tensors whose block hashes were taken now
    copied: bool = False  # some `tensors` are copies (`ShardTensors.ready`)


@dataclass(frozen=True)
class Found:
    """What `find_changes` found, over all shards."""

    shards: list[ShardChanges]
    bytes_hashed: int
    bytes_compared: int  # with the file: no usable sidecar
    bytes_trusted: int  # not hashed: `changed=` left them out, or the watch saw them unwritten

    def hashes(self) -> dict[str, np.ndarray]:
        """The block hashes taken now, by tensor: what a `WriteWatch` records."""
        return {n: c.fresh.tensors[n][1] for c in self.shards for n in c.hashed}


def find_changes(shards: list[ShardTensors], *, block_size: int,
                 trusted: frozenset[str] | None, watch: WriteWatch | None,
                 written: Mapping[str, list[tuple[int, int]]], progress: Progress,
                 then: Callable[[ShardChanges], None] = lambda changes: None) -> Found:
    """What may differ in each shard.

    Args:
        shards: the live tensors, per shard.
        block_size: bytes per fingerprinted block.
        trusted: the disk names `changed=` rules out (None: no hint; then xxh3 shards are
            hashed coarse first).
        watch: the `WriteWatch` that told `written`, or None.
        written: disk name -> the byte ranges `watch` saw written since it last recorded.
        progress: called with ("hash", bytes done, total) after each shard.
        then: called with each shard's changes as soon as they are found (`sync` stages
            that shard while the next one is hashed).
    """
    total = sum(s.nbytes for s in shards)
    done = hashed = compared = 0
    found: list[ShardChanges] = [None] * len(shards)  # type: ignore[list-item]
    workers = min(len(shards), _threads()) or 1
    pool = threads.pool(workers, thread_name_prefix="hotweights-hash")
    order, jobs = iter(_order(shards)), collections.deque()

    def submit() -> None:  # one job more than workers at a time: a job done holds the
        if (i := next(order, None)) is not None:  # copies it made until it is handed on
            jobs.append((i, pool.submit(_shard_changes, shards[i], block_size, trusted,
                                        watch, written)))
    progress("hash", 0, total)  # the bar shows from the start (a shard takes seconds)
    try:
        for _ in range(workers + 1):
            submit()
        while jobs:  # in that order: `then` stages each
            i, job = jobs.popleft()
            changes, n, from_file = job.result()
            submit()
            hashed += n
            compared += shards[i].nbytes if from_file else 0
            then(changes)  # stages it: its tensors are held till then, not after
            found[i] = replace(changes, tensors={})
            done += shards[i].nbytes
            progress("hash", done, total)
    finally:
        pool.shutdown(cancel_futures=True)
    _remember(found)
    return Found(found, hashed, compared, total - hashed)


def _order(shards: list[ShardTensors]) -> list[int]:
    """The shards' indices, those that the latest syncs in this process found changed
    first (the most recent, then the most bytes), the others in their order: a trainer
    changes the same tensors step after step, and a changed shard hashed first is staged
    while the others are hashed, not after them."""
    return sorted(range(len(shards)), key=lambda i: tuple(
        -x for x in _seen.get(shards[i].shard.path, (0, 0))))


def _remember(found: list[ShardChanges]) -> None:
    """Note which shards this sync found changed, for `_order`."""
    changed = [(c.shard.path, ranges_bytes(c.ranges)) for c in found if c.ranges]
    if changed:
        if len(_seen) + len(changed) > _KEPT:
            _seen.clear()
        n = next(_syncs)
        _seen.update((path, (n, nbytes)) for path, nbytes in changed)


def _threads() -> int:
    """Shards hashed at once: one per CPU this process may run on, up to `HASH_THREADS`
    (the hash loop reads memory at ~20 GB/s a core: a few cores fill the bus)."""
    return min(HASH_THREADS, len(os.sched_getaffinity(0)))


def _shard_changes(s: ShardTensors, block_size: int, trusted: frozenset[str] | None,
                   watch: WriteWatch | None, written: Mapping[str, list[tuple[int, int]]]
                   ) -> tuple[ShardChanges, int, bool]:
    """One shard's changes, the bytes hashed, and whether it was compared with the file
    (no usable sidecar)."""
    live, s = s.tensors, s.ready()
    kind = blocks.kind_of(s.tensors.values())
    old = sidecar.load(s.shard, block_size, kind)
    if old is not None and set(old.tensors) >= set(s.tensors):
        changes, hashed = _from_sidecar(s, old, trusted, watch, written)
        from_file = False
    else:
        changes, hashed, from_file = _from_file(s, block_size, kind), s.nbytes, True
    copied = any(t is not live[n] for n, t in s.tensors.items())
    return replace(changes, copied=copied) if copied else changes, hashed, from_file


def ranges_bytes(ranges: Ranges) -> int:
    return sum(hi - lo for _, lo, hi in ranges)


def to_pages(changes: ShardChanges) -> Ranges:
    """`changes.ranges`, the whole changed blocks narrowed to the pages that differ from
    the file (only those are read). Where the watch saw some pages of a block written,
    its other pages are compared too: a write it cannot see (DMA) is written with the
    rest, as the block's new hash in the sidecar says."""
    if changes.compared or not changes.ranges:
        return changes.ranges
    return _differing(changes.shard, changes.tensors, changes.ranges)


def _from_sidecar(s: ShardTensors, old: blocks.Fingerprints, trusted: frozenset[str] | None,
                  watch: WriteWatch | None, written: Mapping[str, list[tuple[int, int]]]
                  ) -> tuple[ShardChanges, int]:
    """The changed blocks against the sidecar's `old` fingerprints; the bytes hashed."""
    todo = {n: t for n, t in s.tensors.items() if n not in (trusted or ())}
    if trusted is None and old.kind == blocks.XXH3:
        # the watch's pages stand where the sidecar holds the hashes the watch recorded
        seen = {n: r for n, r in written.items()
                if n in todo and _same(watch.recorded(n), old.tensors[n][1])}
        new = blocks.refresh(old, todo, written=seen)
    else:  # named tensors are likely changed: straight to per-block hashes
        seen, new = {}, blocks.fingerprint(todo, block_size=old.block_size, kind=old.kind)
    diff = blocks.changed(_subset(old, todo), new)
    if len(todo) < len(s.tensors):  # the trusted tensors keep their recorded hashes
        kept = {n: new if n in todo else old for n in s.tensors}
        new = blocks.Fingerprints(old.kind, old.block_size, {
            n: fp.tensors[n] for n, fp in kept.items()}, {
            n: fp.coarse[n] for n, fp in kept.items() if n in fp.coarse})
    ranges = [(n, int(lo), int(hi)) for n, c in diff.tensors.items() for lo, hi in c.ranges]
    hashed = sum(t.nbytes for n, t in todo.items() if n not in seen) + sum(
        _block_bytes(r, old.block_size, todo[n].nbytes) for n, r in seen.items())
    return ShardChanges(s.shard, s.tensors, ranges, False, new, tuple(todo)), hashed


def _from_file(s: ShardTensors, block_size: int, kind: str) -> ShardChanges:
    """The pages that differ from the file, and the fingerprints for the sidecar (with
    coarse hashes, for `blocks.refresh` next time)."""
    fresh = blocks.fingerprint(s.tensors, block_size=block_size, kind=kind, coarse=True)
    whole = [(n, 0, t.nbytes) for n, t in s.tensors.items()]
    return ShardChanges(s.shard, s.tensors, _differing(s.shard, s.tensors, whole),
                        True, fresh, tuple(s.tensors))


def _differing(shard: Shard, tensors: Mapping[str, torch.Tensor], ranges: Ranges) -> Ranges:
    """The pieces of `ranges` whose bytes differ from the file's, cut at the file's page
    boundaries (a tensor seldom starts on one: a page of the tensor's own would straddle
    two of the file's, both then written)."""
    per: dict[str, list[tuple[int, int]]] = {}
    for name, lo, hi in ranges:
        per.setdefault(name, []).append((lo, hi))
    out = []
    with mapped(shard.path, shard.check) as view:
        for name, spans in per.items():
            info = shard.tensors[name]
            out += [(name, a, b) for a, b in _pages_differing(
                name, tensors[name], view[info.begin:info.end], -info.begin % PAGE, spans)]
    return out


def _pages_differing(name: str, t: torch.Tensor, disk: memoryview, head: int,
                     spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte ranges of `spans` of tensor `t` that differ from its bytes in the file,
    `disk`, in the file's pages: the first `head` bytes, then pages (the slices of the
    file's map go with this call)."""
    live, head = raw(t), min(head, len(disk))
    out = []
    if head and any(lo < head for lo, _ in spans) and not np.array_equal(
            live[:head].cpu().numpy(), np.frombuffer(disk[:head], np.uint8)):
        out.append((0, head))
    body = [((max(lo, head) - head) // PAGE * PAGE, hi - head) for lo, hi in spans
            if hi > head]  # in the file's pages from `head` on
    if body:
        change = blocks.compare_bytes(name, live[head:], disk[head:], block_size=PAGE,
                                      ranges=body)
        out += [(int(a) + head, int(b) + head) for a, b in change.ranges]
    return out


def _same(a: np.ndarray | None, b: np.ndarray) -> bool:
    return a is b or np.array_equal(a, b)  # the sidecar this process wrote: the same array


def _block_bytes(ranges: list[tuple[int, int]], block_size: int, nbytes: int) -> int:
    """The bytes of the blocks that `ranges` touch."""
    blocks_touched = set()
    for lo, hi in ranges:
        blocks_touched.update(range(lo // block_size, -(-hi // block_size)))
    return min(nbytes, len(blocks_touched) * block_size)


def _subset(fp: blocks.Fingerprints, names) -> blocks.Fingerprints:
    return blocks.Fingerprints(fp.kind, fp.block_size, {n: fp.tensors[n] for n in names})

"""`diagnose`: what a `sync` into a checkpoint directory would find there, read-only."""

from __future__ import annotations

import json
import os
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from hotweights.changes import blocks
from hotweights.checkpoint import clone, journal, lock, sidecar, trash
from hotweights.checkpoint.dtypes import NAMES, TORCH
from hotweights.checkpoint.first_save import check_config, short_of_space
from hotweights.checkpoint.incremental import (
    castable,
    check_mode,
    read_to_sync,
    write_mode,
)
from hotweights.checkpoint.names import storage_key, to_disk, unpack
from hotweights.checkpoint.result import check_dir_arg, mib, not_a_directory
from hotweights.checkpoint.shards import Shard
from hotweights.checkpoint.writable import shared_file, why_not_replaceable, why_not_writable
from hotweights.errors import CheckpointError

__all__ = ["Diagnosis", "Mismatch", "ShardInfo", "diagnose"]

SAMPLES = 5  # names shown of each kind


@dataclass(frozen=True)
class ShardInfo:
    name: str
    size: int
    tensors: int
    sidecar: str  # "fresh" | "missing" | "stale" | "corrupt" (`sidecar.state`)
    version: str | None = None  # the weight version a fresh sidecar records
    kind: str | None = None  # the hash of a fresh sidecar's fingerprints (`blocks.KINDS`)
    block_size: int | None = None  # and their block size
    # Why a sync of the live tensors would not use a fresh sidecar (`sidecar.load`: another
    # hash kind or block size) but compare the shard with the file; None when it would use
    # it, or no live tensors were given (a sync from CPU tensors takes xxh3_64, from CUDA
    # ones torch-mix64-v1).
    unused: str | None = None


@dataclass(frozen=True)
class Mismatch:
    name: str
    shard: str
    field: str  # "shape" | "dtype"
    file: str
    live: str

    def line(self) -> str:
        return (f"{self.name} in {self.shard}: the file holds {self.field} {self.file}, "
                f"the live tensor {self.live}")


@dataclass(frozen=True)
class Diagnosis:
    """What `diagnose` found. `problems` are what make `hotweights diagnose` exit 1."""

    model_dir: str
    error: str | None  # the checkpoint could not be read (then shards is empty)
    first_save: bool  # no safetensors yet: a sync makes a first full save
    shards: tuple[ShardInfo, ...]
    tensors: int
    model_bytes: int  # tensor bytes on disk
    journal: dict | None  # the meta of a committed journal not yet applied
    # why `recover` refuses the committed journal (damaged, or its files changed since)
    journal_refused: str | None
    leftovers: tuple[str, ...]  # an uncommitted journal, staged files, the trash
    # A sync was cut short here (a journal, committed or not, or staged files): a reader
    # must run `hotweights recover DIR` (`journal.recover`) before loading the shards.
    interrupted: bool
    writer_active: bool  # a sync holds the directory's writer lock right now (its journal
    # and staged files are then its own: not looked at)
    fs_type: str
    mount: str
    mode: str  # the mode asked for
    write_mode: str | None  # what a sync would do in `mode`; None if it cannot
    write_reason: str
    live: bool  # live tensors were given, and the fields below describe them
    matched: int = 0
    only_live: int = 0
    only_live_samples: tuple[str, ...] = ()
    only_disk: int = 0
    only_disk_samples: tuple[str, ...] = ()
    tied: int = 0
    mismatches: tuple[Mismatch, ...] = ()
    # live names could not be placed on disk, or mostly have no place there (a sync
    # refuses them: `NameMap.unplaced`)
    names_error: str | None = None
    # shards this process could not replace (or, in journal mode, write into), and why
    unchangeable: tuple[str, ...] = ()
    # why a first save of the live tensors would be refused (none, a dtype, no room), or
    # why a sync that rewrites shards whole (write mode copy) cannot rewrite the largest
    space: str | None = None
    # why no sync can write the sidecars (each then compares every shard with the file)
    sidecars: str | None = None

    @property
    def problems(self) -> list[str]:
        """One line each for what stops a sync or leaves the checkpoint unfinished."""
        out = []
        if self.error:
            out.append(f"unreadable checkpoint: {self.error}")
        if self.journal_refused:
            out.append(self.journal_refused)
        elif self.journal is not None:
            version = self.journal.get("version")
            which = "" if version is None else f" (version {version})"
            out.append(f"a committed journal{which} is not applied yet, a shard may be half "
                       f"written: run hotweights recover {shlex.quote(self.model_dir)} before "
                       "reading the shards (a sync or serve finishes it too)")
        if self.write_mode is None:
            out.append(self.write_reason)
        out += self.unchangeable
        if self.sidecars:
            out.append(self.sidecars)
        if self.space:
            out.append(self.space)
        if self.names_error:
            out.append(self.names_error)
        elif self.only_live:  # a few: a sync writes the rest, and `hotweights sync` exits 1
            out.append(f"{self.only_live} live tensor(s) have no place in the checkpoint: a "
                       f"sync does not write them (e.g. {', '.join(self.only_live_samples)})")
        out += [m.line() for m in self.mismatches]
        return out

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "problems": self.problems})


def diagnose(model_dir: str | os.PathLike,
             live: Mapping[str, torch.Tensor] | torch.nn.Module | None = None, *,
             mode: str = "auto", block_size: int = blocks.DEFAULT_BLOCK_SIZE,
             convert_dtype: bool = False, config: object = None) -> Diagnosis:
    """Look at a checkpoint directory as `sync` would, and write nothing to it.

    The one exception: finding the write mode probes for reflinks by cloning a small
    temporary file in the directory (`clone.supports_reflink`), removed again. The
    writer lock is tried and released at once to tell a running sync from leftovers.

    Args:
        model_dir: the checkpoint directory.
        live: the tensors a sync would write (HF names), or a transformers model; their
            names, shapes and dtypes are checked against the shard headers, and their
            devices against the sidecars' hash kinds. No byte of them is read.
        mode: the write mode to check ("auto", "reflink", "journal", "copy").
        block_size: the block size of the sync to check the sidecars for.
        convert_dtype: as the sync's: a live dtype other than the file's is then cast, not
            a mismatch (a dtype the file's has no torch form of still is).
        config: as the sync's: the model's config, for a state dict whose names it
            converts (e.g. fused MoE experts).

    Returns:
        A `Diagnosis`; see its `problems`.

    Raises:
        CheckpointError: `model_dir` is not a directory, `mode` is unknown, `live` is not
            names to tensors (a meta tensor named).
        FingerprintError: `block_size` not a positive multiple of 8.
    """
    check_dir_arg(model_dir, "diagnose")
    d = Path(model_dir)
    if not os.path.lexists(d):
        above = next(p for p in Path(os.path.abspath(d)).parents if os.path.lexists(p))
        if not above.is_dir():  # as the sync's mkdir would find
            raise CheckpointError(f"{d}: no such directory, and a sync cannot create it: "
                                  f"{above} is not a directory")
        raise CheckpointError(f"{d}: no such directory (a sync would create it and save the "
                              "model whole)")
    if not d.is_dir():
        raise not_a_directory(d)
    check_mode(mode)
    blocks.check_block_size(block_size, "diagnose")
    check_config(config)
    try:
        wmode, reason = write_mode(d, mode)
    except CheckpointError as e:  # mode "reflink" where there are none: a finding, but
        wmode, reason = None, str(e)  # for a first save (below)
    if not (writable := os.access(d, os.W_OK)):  # a sync stages, renames and journals in it
        wmode, reason = None, (f"{d}: not writable by this process: a sync cannot stage or "
                               "replace its shards here")
    kind, mount = clone.fs_type(d)
    active = lock.held(d)  # its journal and staged files are its own, mid-write
    pending, refused, leftovers, interrupted = (None, None, (), False) if active else \
        _journal_state(d)
    base = dict(model_dir=str(d), journal=pending, journal_refused=refused,
                leftovers=leftovers, interrupted=interrupted,
                writer_active=active, fs_type=kind, mount=mount, mode=mode,
                write_mode=wmode, write_reason=reason, live=live is not None)
    try:
        disk = read_to_sync(d)
    except CheckpointError as e:  # (a pending journal's replay may complete it)
        left = (" (as a committed journal left it: its replay, by recover or the next sync, "
                "completes it)") if pending is not None else ""
        return Diagnosis(error=f"{e}{left}", first_save=False, shards=(), tensors=0,
                         model_bytes=0, **base)
    if disk is None:
        if writable:  # in any mode
            base.update(write_mode="copy", write_reason="a first save writes whole files, "
                        "in any mode")
        return Diagnosis(error=None, first_save=True, shards=(), tensors=0, model_bytes=0,
                         space=None if live is None else _first_save(d, live, config), **base)
    shards = {}
    for shard, _ in disk.values():
        shards.setdefault(shard.path, shard)
    found, by_shard = _compare(d, live, disk, convert_dtype, config) if live is not None \
        else ({}, {})
    infos = tuple(_shard_info(shard, by_shard.get(shard.path), block_size)
                  for shard in sorted(shards.values(), key=lambda s: s.path))
    return Diagnosis(**base, error=None, first_save=False, shards=infos, tensors=len(disk),
                     model_bytes=sum(info.nbytes for _, info in disk.values()),
                     unchangeable=_unchangeable(shards, wmode),
                     sidecars=None if wmode is None else _sidecars_unwritable(sorted(shards)),
                     space=_rewrite_space(d, shards.values()) if wmode == "copy" else None,
                     **found)


def _rewrite_space(d: Path, shards: Iterable[Shard]) -> str | None:
    """Why a sync in write mode copy cannot rewrite the largest shard (it stages a changed
    shard whole beside the old one until the commit), else None."""
    largest = max(shards, key=lambda s: s.size, default=None)
    if largest is None or (free := short_of_space(d, largest.size)) is None:
        return None
    return (f"{largest.path}: not enough free space to rewrite it: a sync in write mode copy "
            f"stages a changed shard whole ({mib(largest.size)}), {mib(free)} are free; a "
            "sync that changes it fails, writing nothing")


def _first_save(d: Path, live, config: object) -> str | None:
    """Why a first save of `live` would be refused: no tensors, a dtype safetensors has no
    name for, or not enough room in `d`'s filesystem (a tied tensor written once, as the
    save writes it)."""
    tensors = unpack(live, config)[0]
    if not tensors:
        return f"{d}: live holds no tensors to save (an empty state dict?)"
    if bad := next((n for n, t in tensors.items() if t.dtype not in NAMES), None):
        return (f"{bad}: the live tensor is {str(tensors[bad].dtype).removeprefix('torch.')}, "
                "which has no safetensors dtype")
    once = {storage_key(t) or name: t for name, t in tensors.items()}
    need = sum(t.numel() * t.element_size() for t in once.values())
    if (free := short_of_space(d, need)) is not None:
        return (f"{d}: not enough free space: a first save writes {mib(need)}, {mib(free)} "
                "are free")
    return None


def _unchangeable(shards: Iterable[str], write_mode: str | None) -> tuple[str, ...]:
    """What would stop a sync from changing each shard, should it change (`writable`):
    patched in place in journal mode (but a symlink or a file with other links is
    replaced), else replaced."""
    if write_mode is None:  # the directory itself: said once, in `write_reason`
        return ()
    out = []
    for path in sorted(shards):
        in_place = write_mode == "journal" and not shared_file(path)
        why = why_not_writable(path) if in_place else why_not_replaceable(path)
        if why:
            out.append(f"{path}: a sync that changes it cannot "
                       f"{'write into' if in_place else 'replace'} it ({why})")
    return tuple(out)


def _sidecars_unwritable(shards: list[str]) -> str | None:
    """Why a sync could not write the sidecars of `shards` (their directory, or a sidecar's
    name taken by a directory), if it could not."""
    if not shards:  # no tensors: nothing to fingerprint
        return None
    where = sidecar.path_of(shards[0]).parent
    costs = "every sync compares every shard with the file, byte by byte"
    if os.path.lexists(where) and not where.is_dir():
        return f"{where}: not a directory, where the sidecars belong: {costs} (remove it)"
    if where.is_dir() and (why := why_not_replaceable(os.fspath(where / "x"))):
        return f"{where}: the sidecars cannot be written ({why}): {costs}"
    for path in map(sidecar.path_of, shards):
        if path.is_dir() and not path.is_symlink():
            return (f"{path}: a directory where a sidecar belongs: a sync compares its shard "
                    "with the file, byte by byte (remove it)")
    return None


def _shard_info(shard, live: list[torch.Tensor] | None, block_size: int) -> ShardInfo:
    """`live`: the live tensors a sync would write into this shard (None: not known)."""
    state, doc = sidecar.state(shard)
    info = ShardInfo(Path(shard.path).name, shard.size, len(shard.tensors), state)
    if state != "fresh":
        return info
    version, fp = doc.get("version"), doc.get("fingerprints")
    kind, size = (fp.get("kind"), fp.get("block_size")) if isinstance(fp, dict) else (None, None)
    unused = None
    if live:
        want = blocks.kind_of(live)
        if kind != want:
            device = "CPU" if want == blocks.XXH3 else next(
                t.device.type for t in live if t.device.type != "cpu")
            unused = f"{kind} fingerprints: a sync from {device} tensors compares this " \
                     "shard with the file"
        elif size != block_size:
            unused = f"{size}-byte blocks: a sync at {block_size} compares this shard with " \
                     "the file"
    return replace(info, version=None if version is None else str(version), kind=kind,
                   block_size=size, unused=unused)


def _journal_state(d: Path) -> tuple[dict | None, str | None, tuple[str, ...], bool]:
    """The committed journal's meta, why `recover` refuses it (if it does), the
    leftovers, and whether a sync was interrupted."""
    pending, refused = journal.inspect(d)
    leftovers = []
    if (d / (journal.JOURNAL_NAME + ".tmp")).exists():
        leftovers.append(f"{journal.JOURNAL_NAME}.tmp: an uncommitted journal")
    if os.path.lexists(d / journal.STAGE_DIR):
        leftovers.append(f"{journal.STAGE_DIR}/: files staged for a journal")
    interrupted = pending is not None or bool(refused or leftovers)  # the trash is none
    if os.path.lexists(d / trash.TRASH_DIR):
        leftovers.append(f"{trash.TRASH_DIR}/: replaced shards not freed yet (recover "
                         "or the next sync frees them)")
    return pending, refused, tuple(leftovers), interrupted


def _compare(d: Path, live, disk, convert_dtype: bool, config: object
             ) -> tuple[dict, dict[str, list[torch.Tensor]]]:
    """The `Diagnosis` fields about the live tensors, and those placed in each shard (by
    its path)."""
    tensors, model, model_type = unpack(live, config)
    try:
        names = to_disk(tensors, disk.keys(), model=model, model_type=model_type)
    except CheckpointError as e:
        return dict(names_error=str(e)), {}
    mismatches, by_shard = [], {}
    for name, t in names.tensors.items():
        shard, info = disk[name]
        by_shard.setdefault(shard.path, []).append(t)
        where = Path(shard.path).name
        if tuple(t.shape) != info.shape and info.dtype in TORCH:  # else the dtype's row
            mismatches.append(Mismatch(name, where, "shape", str(list(info.shape)),
                                       str(list(t.shape))))
        want = TORCH.get(info.dtype)
        if want != t.dtype and not (convert_dtype and want is not None and
                                    castable(want, t.dtype)):
            mismatches.append(Mismatch(name, where, "dtype", info.dtype,
                                       str(t.dtype).removeprefix("torch.")))
    return dict(matched=len(names.tensors), only_live=len(names.only_live),
                only_live_samples=names.only_live[:SAMPLES], only_disk=len(names.only_disk),
                only_disk_samples=names.only_disk[:SAMPLES], tied=len(names.tied),
                mismatches=tuple(mismatches), names_error=names.unplaced(d)), by_shard

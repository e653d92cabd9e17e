"""One commit record per directory: a crash leaves every file all old or all new, together.

One journal per directory, `DIR/.hotweights-journal`, covering every file a sync changes,
patched in place or replaced whole by a complete file staged in `DIR/.hotweights-stage/`:

    header  : magic b"HWJRNL\\r\\n", format u32, meta length u32, meta (JSON)
    file    : b"I", name length u16, 0 u64, length u64, name (UTF-8), identity (JSON):
              what the journal was written against, before each move (null: no file
              there) and before the first patch of each file
    patch   : b"R", name length u16, offset u64, length u64, name (UTF-8), payload
    move    : b"M", name length u16, inode u64, size u64, name (UTF-8): the staged file
              (that inode and size) replaces it
    commit  : b"C", record count u64, xxh3_64 of every byte before the commit record

The format is 3; a journal of format 1 or 2 (an older version's, `_FORMATS`) still
replays, without the checks it has no records for; one of another format (a later
version's) is refused, and kept with its staged files. It is written to
`DIR/.hotweights-journal.tmp`, fsync'd, renamed, and the directory fsync'd: the rename is
the commit point (staged files are written and fsync'd before, and the stage directory
too). Before it writes anything, a replay checks every file: it refuses one not yet
moved over that is not the one the journal was written against (another inode on the
same filesystem, another size or safetensors header, a file where there was none, or
none: a checkpoint copied back after a crash), and a staged file that is gone counts as
moved only if the file in its place is that staged file (else it refuses: it is lost).
`apply` replays it (renames, pwrite, fsync each file, fsync the directory) and removes it;
replaying twice is harmless; `apply(wait=False)` leaves the fsyncs and the journal's
removal to this process's finisher thread (`finisher`). A file a move replaces is kept in
`DIR/.hotweights-trash/` and freed after the commit (`trash`). `recover` finishes a
committed journal, or discards an incomplete one with whatever was staged for it. Writers
hold the directory's lock (`lock.locked`). An identity record is JSON of a `FileId`
(`fileid`): dev, ino, size, and for a safetensors file header_end and header.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import signal
import stat
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import xxhash

from hotweights.checkpoint import clone, finisher, lock, threads, trash
from hotweights.checkpoint.fileid import FileId
from hotweights.checkpoint.held import interrupts_held
from hotweights.checkpoint.lock import locked
from hotweights.checkpoint.mapped import mapped
from hotweights.checkpoint.writable import shared_file, why_not_replaceable, why_not_writable
from hotweights.checkpoint.writes import PAGE, write_all
from hotweights.errors import CheckpointError

__all__ = ["JOURNAL_NAME", "STAGE_DIR", "apply", "pending", "recover", "write_journal"]

logger = logging.getLogger(__name__)

JOURNAL_NAME = ".hotweights-journal"
_TMP_NAME = JOURNAL_NAME + ".tmp"
STAGE_DIR = ".hotweights-stage"  # complete files waiting for their move record
_written: tuple | None = None  # (path, FileId, records) of the journal this process committed
commits = 0  # the journals this process committed: whether an interrupted sync did
_MAGIC = b"HWJRNL\r\n"
# Formats read: 1 (no file records, moves without the staged file's identity), 2 (no
# record of a move's target), both replayed without those checks; 3, written (its identity
# records hash the bytes the patches replace per page piece, "old_pages"; an older
# version's hashed them per patch, "old", which is not checked).
_FORMATS = (1, 2, 3)
_FORMAT = _FORMATS[-1]
_HEAD = struct.Struct("<8sII")
_REC = struct.Struct("<cHQQ")
_COMMIT = struct.Struct("<cQQ")
_CHUNK = 8 << 20

# Test-only crash hook: tests/test_checkpoint_journal.py sets it to "<step>:<n>" to SIGKILL
# the process at a named step, so every crash point is reached deterministically.
_CRASH_AT = os.environ.get("HOTWEIGHTS_JOURNAL_CRASH_AT")


def _crash_point(step: str, n: int = 0) -> None:
    if _CRASH_AT == f"{step}:{n}":
        os.kill(os.getpid(), signal.SIGKILL)


_failed: dict[str, str] = {}  # directory -> why its commit's finisher failed (`not_durable`)


class _Corrupt(Exception):  # the journal is incomplete or damaged; the message says how
    pass


def _check_name(name: str) -> bytes:
    bad = (not name or name in (".", "..") or "/" in name or "\\" in name
           or "\0" in name or os.path.isabs(name) or name.startswith(JOURNAL_NAME)
           or name in (STAGE_DIR, trash.TRASH_DIR))
    if bad:
        raise CheckpointError(f"{name!r}: a patch target must be a plain file name in the "
                              "directory (no path separators, '..' or journal names)")
    return name.encode()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _target_size(directory: str, name: str, sizes: dict[str, int]) -> int:
    if name not in sizes:
        path = os.path.join(directory, name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: patch target does not exist") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: patch target is not a regular file")
        sizes[name] = st.st_size
    return sizes[name]


def _validate(directory: str, name: str, offset: int, data: Any,
              sizes: dict[str, int]) -> tuple[bytes, memoryview]:
    raw = name.encode() if name in sizes else _check_name(name)  # once per file
    view = memoryview(data).cast("B")
    size = _target_size(directory, name, sizes)
    if size < 0:
        raise CheckpointError(f"{os.path.join(directory, name)}: both moved and patched")
    if offset < 0 or offset + view.nbytes > size:
        raise CheckpointError(
            f"{os.path.join(directory, name)}: patch at offset {offset} of {view.nbytes} "
            f"bytes falls outside the file ({size} bytes); patches never grow a file")
    return raw, view


def _write_all(fd: int, data: bytes | memoryview, hasher: Any) -> None:
    hasher.update(data)
    write_all(fd, data)


def _check_staged(directory: str, name: str) -> tuple[bytes, FileId, dict | None]:
    """A move's name, its staged file's identity and its target's (None: a new file)."""
    raw = _check_name(name)
    path = os.path.join(directory, STAGE_DIR, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no staged file to move into place") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: the staged file is not a regular file")
    target = os.path.join(directory, name)
    try:
        was = _identity(target)
    except FileNotFoundError:
        was = None
    if why := why_not_replaceable(target):
        raise CheckpointError(f"{target}: this process cannot replace it ({why}); nothing "
                              "was written")
    return raw, FileId.of_stat(st), was


def _identity(path: str) -> dict:
    """A file's identity record: what tells it from another of the same name (device,
    inode, size; for a safetensors file its header, which no patch touches)."""
    fid = FileId.of(path, header=True)
    out = {"dev": fid.dev, "ino": fid.ino, "size": fid.size}
    if fid.header is not None:
        out["header_end"], out["header"] = fid.header_end, fid.header
    return out


def _pages(offset: int, length: int) -> Iterator[tuple[int, int]]:
    """The pieces [start, end) of a patch of `length` bytes at file offset `offset`, cut at
    the file's page boundaries: a write cut short (a kill, a full disk) or a power loss
    during the apply leaves each page of a patch whole old or whole new, not the patch."""
    at = 0
    while at < length:
        end = min(length, at + PAGE - (offset + at) % PAGE)
        yield at, end
        at = end


def _old_hashes(old: bytes, offset: int) -> list[int]:
    """The xxh3 of each page piece (`_pages`) of the bytes `old` a patch at `offset`
    replaces."""
    view = memoryview(old)
    return [xxhash.xxh3_64_intdigest(view[a:b]) for a, b in _pages(offset, len(old))]


def _check_bytes(path: str, old: list[int], patches: list[tuple[int, int, int]],
                 data: Any, journal: str) -> None:
    """Refuse to replay onto `path` unless each page piece (`_pages`) of each of its
    `patches` (offset, length, payload position in the journal's `data`) holds the bytes
    it replaces (their xxh3 in `old`, in order) or its own (applied before a crash): else
    it is another file, whatever its identity says (the device of a filesystem can change
    across a reboot, and the inode is then not compared; a copy of the same size and header
    put back)."""
    pieces = sum(1 for offset, length, _ in patches for _ in _pages(offset, length))
    if len(old) != pieces:
        raise CheckpointError(f"{journal}: a damaged journal: {pieces} patch pieces of "
                              f"{path}, {len(old)} of their old bytes' hashes; nothing was "
                              "written and the journal is kept")
    hashes = iter(old)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, length, pos in patches:
            now = memoryview(os.pread(fd, length, offset))
            for a, b in _pages(offset, length):
                if xxhash.xxh3_64_intdigest(now[a:b]) != next(hashes) and \
                        now[a:b] != data[pos + a:pos + b]:
                    raise CheckpointError(
                        f"{path}: not the file journal {journal} was committed for (its "
                        f"bytes at offset {offset + a} are neither those the journal "
                        "replaces nor its own), e.g. a copy put back after a crash; nothing "
                        "was written. Remove the journal if these files are the ones to keep")
    finally:
        os.close(fd)


def _check_identity(path: str, want: dict | None, journal: str) -> None:
    """Refuse to replay onto `path` unless it is the file `want` describes (None: no file
    was there). The inode is compared on the same filesystem only (a move to another one
    changes it)."""
    try:
        have = _identity(path)
    except FileNotFoundError:
        have = None
    if want is None or have is None:
        if want is have:
            return
        why = "there was no file then" if want is None else "it is gone"
    else:
        fields = ("size", "header") + (("ino",) if have["dev"] == want["dev"] else ())
        if not (differ := [k for k in fields if have.get(k) != want.get(k)]):
            return
        why = (f"{', '.join(differ)} differ: {want.get(differ[0])} then, "
               f"{have.get(differ[0])} now")
    raise CheckpointError(
        f"{path}: not the file journal {journal} was committed for ({why}), e.g. a copy "
        "put back after a crash; nothing was written. Remove the journal if these files "
        "are the ones to keep")


def write_journal(directory: str | os.PathLike, patches: Iterable[tuple[str, int, Any]],
                  *, moves: Sequence[str] = (), meta: dict | None = None,
                  check: Callable[[], None] | None = None) -> str:
    """Write and commit a redo journal of `patches` and `moves`; no file is touched yet.

    Args:
        directory: the directory holding every changed file.
        patches: (file name relative to `directory`, byte offset, bytes-like) triples,
            streamed once. A sequence is validated and sized before anything is written;
            an iterator is validated as it streams, and a bad patch discards the journal.
        moves: names whose new content is staged whole, written and fsync'd, in
            `directory/.hotweights-stage/`; applying renames each over its name.
        meta: JSON-able data kept in the header (e.g. the weight version), see `pending`.
        check: called once the journal is written, just before its commit; what it
            raises discards the journal (e.g. a file it was made for changed meanwhile).

    Returns:
        The journal's path; `apply(directory)` writes it into the files.

    Raises:
        CheckpointError: a bad name, a missing target, a patch outside its file, too
            little free space, an unwritable directory, or a committed journal pending.
    """
    global _written
    _written = None
    directory = os.path.abspath(directory)  # as `apply` takes it (`_records`)
    journal, tmp = os.path.join(directory, JOURNAL_NAME), os.path.join(directory, _TMP_NAME)
    if os.path.exists(journal):
        raise CheckpointError(f"{journal}: a committed journal is pending; "
                              "run hotweights.checkpoint.journal.recover first")
    head = json.dumps(meta or {}).encode()
    moved = [_check_staged(directory, name) for name in moves]
    if moves:  # the staged names are durable before the commit that moves them
        fsync_dir(os.path.join(directory, STAGE_DIR))
    sizes: dict[str, int] = {name: -1 for name in moves}  # never patched as well
    if isinstance(patches, Sequence):
        need = _HEAD.size + len(head) + _COMMIT.size
        for name, offset, data in patches:
            raw, view = _validate(directory, name, offset, data, sizes)
            need += _REC.size + len(raw) + view.nbytes
        free = shutil.disk_usage(directory).free
        if need > free:
            raise CheckpointError(f"{directory}: the journal needs {need} bytes, "
                                  f"only {free} are free; nothing was written: free "
                                  f"{need - free} bytes more")
    written, records = 0, []  # records as `_scan` reads them back, for `apply`
    readers: dict[str, int] = {}  # per patched file: an fd that reads the bytes it replaces
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError as e:
        raise CheckpointError(f"{directory}: cannot write the journal: {e.strerror}; "
                              "nothing was written") from e
    try:
        hasher = xxhash.xxh3_64()
        _write_all(fd, _HEAD.pack(_MAGIC, _FORMAT, len(head)) + head, hasher)
        pos = _HEAD.size + len(head)
        buf = bytearray()  # small records gather here: one write per _CHUNK, not two each

        def add(tag: bytes, name: str, raw: bytes, a: int, b: int, payload: bytes = b"") -> None:
            """A record into `buf`, and into `records` as `_scan` reads it back."""
            nonlocal pos
            buf.extend(_REC.pack(tag, len(raw), a, b) + raw)
            pos += _REC.size + len(raw)
            records.append((tag, name, a, b, pos))  # pos: where its payload starts
            buf.extend(payload)
            pos += len(payload)

        for name, (raw, fid, was) in zip(moves, moved, strict=True):
            payload = json.dumps(was).encode()
            add(b"I", name, raw, 0, len(payload), payload)
            add(b"M", name, raw, fid.ino, fid.size)
        header_ends: dict[str, int] = {}  # per patched file: where its header ends
        # per patched file: its identity record, written after its patches with the xxh3
        # of the bytes each page piece of each patch replaces ("old_pages", `_pages`),
        # which a replay after a crash checks
        idents: dict[str, tuple[bytes, dict]] = {}
        for name, offset, data in patches:
            raw, view = _validate(directory, name, offset, data, sizes)
            if name not in header_ends:
                if why := why_not_writable(os.path.join(directory, name)):
                    raise CheckpointError(f"{os.path.join(directory, name)}: this process "
                                          f"cannot write into it ({why}); nothing was written")
                _refuse_shared(os.path.join(directory, name))  # since it was planned
                ident = _identity(os.path.join(directory, name))
                header_ends[name] = ident.get("header_end", 0)
                ident["old_pages"] = []
                idents[name] = raw, ident
                readers[name] = os.open(os.path.join(directory, name), os.O_RDONLY)
            if offset < header_ends[name]:
                raise CheckpointError(f"{os.path.join(directory, name)}: patch at offset "
                                      f"{offset} falls in the safetensors header (it ends "
                                      f"at {header_ends[name]}); patches never change it")
            idents[name][1]["old_pages"] += _old_hashes(
                os.pread(readers[name], view.nbytes, offset), offset)
            written += _REC.size + len(raw) + view.nbytes
            add(b"R", name, raw, offset, view.nbytes)
            pos += view.nbytes  # the payload, below
            _crash_point("record", len(records) - 2 * len(moves) - 1)
            if len(buf) + view.nbytes > _CHUNK:
                _write_all(fd, buf, hasher)
                buf.clear()
            if view.nbytes > _CHUNK:  # hashed and written from one copy of each chunk:
                for at in range(0, view.nbytes, _CHUNK):  # live memory written meanwhile
                    _write_all(fd, bytes(view[at:at + _CHUNK]), hasher)  # cannot differ
            else:
                buf += view
        for name, (raw, ident) in idents.items():
            payload = json.dumps(ident).encode()
            add(b"I", name, raw, 0, len(payload), payload)
        _write_all(fd, buf, hasher)
        _write_all(fd, _COMMIT.pack(b"C", len(records), hasher.intdigest()), xxhash.xxh3_64())
        os.fsync(fd)
        if check:
            check()
        for name in idents:  # linked since its first patch was streamed
            _refuse_shared(os.path.join(directory, name))
    except BaseException as e:  # a bad patch, a full disk, ^C: nothing stays behind
        os.close(fd)
        os.unlink(tmp)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise CheckpointError(f"{directory}: out of space writing the journal after "
                                  f"{written} bytes of patches; nothing was written (the "
                                  "journal is discarded)") from e
        if isinstance(e, OSError):
            raise CheckpointError(f"{tmp}: cannot write the journal: {e.strerror}; nothing "
                                  "was written (the journal is discarded)") from e
        raise
    finally:
        for reader in readers.values():
            os.close(reader)
    os.close(fd)
    _crash_point("before-rename")
    os.replace(tmp, journal)
    global commits
    commits += 1
    _crash_point("after-rename")
    fsync_dir(directory)
    _written = (journal, FileId.of(journal), records)
    logger.info("%s: journal committed, %d records", journal, len(records))
    return journal


def _refuse_shared(path: str) -> None:
    if why := shared_file(path):
        raise CheckpointError(f"{path}: now {why} (made while this sync ran), which a patch "
                              "in place would write through; nothing was written: sync again "
                              "(it rewrites the file whole)")


def _records(path: str, mine: bool) -> list[tuple[bytes, str, int, int, int]]:
    """The journal's records: if `mine`, as this process wrote them (if it is still that
    file: no re-read), else read back and verified by `_scan`."""
    global _written
    written, _written = _written, None
    if mine and written is not None and written[:2] == (path, FileId.of(path)):
        return written[2]
    return _scan(path)[1]


def _read_exact(f: Any, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise _Corrupt(f"torn at byte {f.tell()} (wanted {n} more bytes)")
    return data


def _scan(path: str) -> tuple[dict, list[tuple[bytes, str, int, int, int]]]:
    """Verify the whole journal; its meta and (tag, name, offset, length, payload pos)."""
    records = []
    if os.path.isdir(path):
        raise CheckpointError(f"{path}: a directory where a sync's journal belongs; move it "
                              "away (no sync of this directory made it)")
    with open(path, "rb") as f:
        total = os.fstat(f.fileno()).st_size
        hasher = xxhash.xxh3_64()
        magic, fmt, meta_len = _HEAD.unpack(_read_exact(f, _HEAD.size))
        if magic != _MAGIC:
            raise _Corrupt(f"not a hotweights journal (magic {magic!r})")
        if fmt not in _FORMATS:  # a later version's: discarding it could leave torn files
            raise CheckpointError(
                f"{path}: a journal of format {fmt}; this version of hotweights knows formats "
                f"{', '.join(map(str, _FORMATS))}. Finish it with the hotweights version that "
                "wrote it (hotweights recover DIR); the journal and the staged files are kept")
        if meta_len > total:
            raise _Corrupt(f"a meta of {meta_len} bytes in a file of {total}")
        head = _read_exact(f, meta_len)
        hasher.update(_HEAD.pack(magic, fmt, meta_len) + head)
        while True:
            if f.tell() + _COMMIT.size == total:
                tag, count, digest = _COMMIT.unpack(_read_exact(f, _COMMIT.size))
                if tag != b"C" or count != len(records) or digest != hasher.intdigest():
                    raise _Corrupt("bad commit record (count or checksum mismatch)")
                break
            rec = _read_exact(f, _REC.size)
            tag, name_len, offset, length = _REC.unpack(rec)
            if tag not in (b"R", b"M", b"I")[:3 if fmt > 1 else 2] or (
                    tag == b"M" and fmt == 1 and (offset or length)):
                raise _Corrupt(f"bad record {tag!r} at byte {f.tell() - _REC.size}")
            raw = _read_exact(f, name_len)
            hasher.update(rec + raw)
            records.append((tag, raw.decode(errors="replace"), offset, length, f.tell()))
            if tag == b"M":  # no payload: a move's fields are its staged file's identity
                length = 0
            while length:
                chunk = _read_exact(f, min(length, _CHUNK))
                hasher.update(chunk)
                length -= len(chunk)
    try:
        meta = json.loads(head)
    except ValueError as e:
        raise _Corrupt(f"unreadable meta: {e}") from None
    return meta, records


def _damaged(path: str, e: _Corrupt) -> str:
    return (f"{path}: a damaged journal ({e}). It was whole when it was committed, so an "
            "apply it began may have left a shard half written; it is kept and nothing was "
            "done. Delete it, then sync the directory again from the weights it should hold "
            "(a shard that changed behind its sidecar is compared with them byte by byte), "
            "or restore the shards from a copy")


def _unreadable(path: str, e: OSError) -> str:
    return (f"{path}: cannot read this sync journal ({e.strerror or e}); the sync cut short "
            "that left it may have left shards half written: make it readable, then run "
            f"hotweights recover {os.path.dirname(path)}")


def pending(directory: str | os.PathLike) -> dict | None:
    """The meta of a committed journal in `directory`, or None if there is none.

    Raises:
        CheckpointError: the journal is damaged (an apply it began may have left a shard
            half written: `inspect` says so without raising), of a format this version does
            not know, a directory stands in its place, or it cannot be read.
    """
    finisher.finish()  # a journal this process is still removing is not pending
    path = os.path.join(os.fspath(directory), JOURNAL_NAME)
    try:
        return _scan(path)[0]
    except FileNotFoundError:
        return None
    except _Corrupt as e:
        raise CheckpointError(_damaged(path, e)) from None
    except OSError as e:  # EACCES, EIO, ELOOP: not known to be no journal
        raise CheckpointError(_unreadable(path, e)) from e


def _moved(directory: str, name: str, ino: int, size: int) -> bool:
    """Whether the staged `name` was moved over its target by an earlier, interrupted
    replay. Gone from the stage, it was only if the target is that staged file (`ino`,
    `size`; 0, 0: a format 1 journal, which did not say); else it is lost, and refused."""
    staged, target = os.path.join(directory, STAGE_DIR, name), os.path.join(directory, name)
    if os.path.exists(staged):
        return False
    try:
        have = FileId.of(target)
    except FileNotFoundError:
        raise CheckpointError(f"{target}: the journal moves {staged} into place, and "
                              "neither exists; nothing was written") from None
    if (ino or size) and (have.ino, have.size) != (ino, size):
        raise CheckpointError(
            f"{staged}: the staged file is lost (not moved: {target} is another file, "
            f"inode {have.ino}, {have.size} bytes, not inode {ino}, {size} bytes); "
            "the commit cannot be finished, nothing was written. The journal is kept")
    return True


def inspect(directory: str | os.PathLike) -> tuple[dict | None, str | None]:
    """(the meta of the committed journal of `directory`, why `recover` would refuse it),
    from one read of it: (None, None) where there is none, (None, why) where it is
    damaged; else the checks a replay makes before its first rename or write. Nothing is
    written.

    Raises:
        CheckpointError: the journal is of a format this version does not know.
    """
    finisher.finish()  # a journal this process is still removing is not pending
    directory = os.fspath(directory)
    path = os.path.join(directory, JOURNAL_NAME)
    try:
        meta, records = _scan(path)
    except FileNotFoundError:
        return None, None
    except _Corrupt as e:
        return None, _damaged(path, e)
    except OSError as e:
        return None, _unreadable(path, e)
    try:
        _checked(directory, path, records, verify=True)
    except CheckpointError as e:
        return meta, str(e)
    except OSError as e:  # e.g. a file this process may not read
        return meta, f"{e.filename or path}: cannot check it ({e.strerror or e})"
    return meta, None


def _checked(directory: str, path: str, records: list, verify: bool
             ) -> tuple[list[tuple], list[tuple], set[str]]:
    """(the moves, the patches, the moves an earlier replay did) of the journal at
    `path`, once every file it changes is checked (`verify`: and every patched range holds
    the bytes it replaces or its own); else a CheckpointError naming it."""
    sizes: dict[str, int] = {}
    moves = [r[1:4] for r in records if r[0] == b"M"]
    patches = [r[1:] for r in records if r[0] == b"R"]
    for name in {*(m[0] for m in moves), *(r[0] for r in patches)}:
        _check_name(name)
    done = {name for name, ino, size in moves if _moved(directory, name, ino, size)}
    with mapped(path) as data:  # a committed journal may still be for other files
        for _, name, _, length, pos in (r for r in records if r[0] == b"I"):
            want = json.loads(bytes(data[pos:pos + length]))
            if name not in done:  # a file moved is the staged one by now (`_moved`)
                _check_identity(os.path.join(directory, name), want, path)
            if verify and isinstance(want, dict) and "old_pages" in want:
                _check_bytes(os.path.join(directory, name), want["old_pages"],
                             [(o, n, p) for f, o, n, p in patches if f == name], data, path)
    for name, offset, length, _ in patches:
        if offset + length > _target_size(directory, name, sizes):
            raise CheckpointError(f"{os.path.join(directory, name)}: journal {path} patches "
                                  f"offset {offset} beyond the file's end; the file changed "
                                  "after the journal was committed")
    _check_changeable(directory, path, [m[0] for m in moves if m[0] not in done],
                      {r[0] for r in patches})
    return moves, patches, done


def _replay(directory: str, path: str, records: list, verify: bool
            ) -> tuple[list[int], bool, dict[str, FileId]]:
    """Move and patch the files as the journal says; (the patched files' fds, whether any
    file was moved), for `_durable`, and name -> each file as this replay left it (moved:
    as staged; patched: after its last write). `verify`: see `_checked`."""
    moves, patches, done = _checked(directory, path, records, verify)
    placed: dict[str, FileId] = {}
    for k, name in enumerate(m[0] for m in moves if m[0] not in done):  # all checked
        target, staged = os.path.join(directory, name), os.path.join(directory, STAGE_DIR, name)
        with _applying(directory, path, target, "not moved into place yet"):
            if os.path.exists(target):
                trash.keep(directory, target, name)
            placed[name] = FileId.of(staged)  # a rename keeps it (but its ctime)
            os.replace(staged, target)
        _crash_point("move", k)
    fds: dict[str, int] = {}
    try:
        with mapped(path) as data:
            for k, (name, offset, length, pos) in enumerate(patches):
                with _applying(directory, path, os.path.join(directory, name),
                               "perhaps half written"):
                    if name not in fds:
                        fds[name] = os.open(os.path.join(directory, name),  # checked:
                                            os.O_WRONLY | os.O_NOFOLLOW)  # no link
                    view = data[pos:pos + length]
                    write_all(fds[name], view, offset)
                    view.release()
                _crash_point("apply", k)
        placed |= {name: FileId.of_stat(os.fstat(fd)) for name, fd in fds.items()}
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return list(fds.values()), bool(moves), placed


@contextlib.contextmanager
def _applying(directory: str, path: str, target: str, left: str) -> Iterator[None]:
    """An OSError (a full disk: copy-on-write blocks of a shard shared with a reflinked
    copy; an I/O error) while a committed journal changes `target`, said as what it
    leaves (`left`: of this file)."""
    try:
        yield
    except OSError as e:
        raise CheckpointError(
            f"{target}: {e.strerror or e} while applying the committed journal {path}: the "
            f"files may hold part of the sync (this one {left}); the journal is kept: once "
            f"the cause is fixed, run hotweights recover {directory}") from e


def _check_changeable(directory: str, path: str, moved: list[str], patched: set[str]
                      ) -> None:
    """Refuse to replay journal `path` if a file it moves over or patches cannot be
    changed by this process (permissions, a sticky directory, an immutable file): found
    before the first rename or write, not half way through."""
    for names, why_not, verb in ((moved, why_not_replaceable, "replace"),
                                 (sorted(patched), why_not_writable, "write into")):
        for name in names:
            if why := why_not(os.path.join(directory, name)):
                raise CheckpointError(
                    f"{os.path.join(directory, name)}: this process cannot {verb} it "
                    f"({why}), so journal {path} cannot be applied; nothing was written and "
                    f"the journal is kept: once it can, run hotweights recover {directory}")
    if why := why_not_replaceable(path):  # its removal, once the files hold the commit
        raise CheckpointError(
            f"{path}: this process cannot remove it ({why}) once applied, so it is not "
            f"applied; nothing was written and the journal is kept: once it can, run "
            f"hotweights recover {directory}")
    for name in sorted(patched):
        if why := shared_file(os.path.join(directory, name)):
            raise CheckpointError(
                f"{os.path.join(directory, name)}: {why}, which journal {path}'s patches "
                "would write through; nothing was written and the journal is kept: give "
                "each other name a copy of its own (`cp OTHER OTHER.tmp && mv OTHER.tmp "
                "OTHER`; for a symlink, `mv` its target over it if nothing else needs the "
                f"old bytes), then run hotweights recover {directory}")


def _discarded(path: str, what: str, remove: Callable[[str], None]) -> bool:
    """Remove `path`, `what` a sync left uncommitted; False where this process cannot (a
    read-only directory, say), logged: the files are whole all the same (a reader may go
    on), and a sync into the directory fails on it by name."""
    try:
        remove(path)
    except OSError as e:
        logger.warning("%s: %s, which this process cannot remove (%s); the shards are as "
                       "they were: remove it once it can", path, what, e.strerror or e)
        return False
    logger.warning("%s: discarded %s", path, what)
    return True


def _fsync_all(fds: list[int]) -> None:
    """fsync the files a replay patched, then close them (whatever happens)."""
    try:
        if len(fds) > 1:  # concurrent fsyncs share the filesystem's journal commits
            with threads.pool(len(fds)) as pool:
                list(pool.map(os.fsync, fds))
        elif fds:
            os.fsync(*fds)
    finally:
        for fd in fds:
            os.close(fd)


def _remove(directory: str, path: str, moved: bool) -> None:
    """Once the files are fsync'd: make the moves durable and remove the journal; from
    then on the files alone hold the commit."""
    if moved:  # patches in place change no directory entry
        fsync_dir(directory)
    _crash_point("before-unlink")
    os.unlink(path)  # not fsync'd: a journal that reappears after a crash replays harmlessly


def _durable(directory: str, path: str, fds: list[int], moved: bool) -> None:
    _fsync_all(fds)
    _remove(directory, path, moved)


def _durable_later(directory: str, path: str, fds: list[int], moved: bool,
                   then: Callable[[dict[str, FileId]], None] | None,
                   placed: dict[str, FileId]) -> None:
    """`_durable` in this process's finisher thread, then `then`, after which the trash is
    swept, all under the writer lock the caller holds, handed over to the thread: a writer
    in another process waits for it all, never takes the journal for a crashed sync's.
    The journal is removed only if it is still this one (where no lock was handed over, a
    writer in another process may have replayed it and committed its own since)."""
    mine, key = FileId.of(path), os.path.realpath(directory)
    _failed.pop(key, None)
    kept = lock.hand_over(directory)

    def run() -> None:
        removed = False
        try:
            with lock.taken_over(directory, kept):
                _fsync_all(fds)
                if FileId.of(path) == mine:  # else another writer's journal by now
                    _remove(directory, path, moved)
                    removed = True
                    if then:
                        then(placed)
                    trash.sweep(directory, background=True)
        except Exception as e:  # noqa: BLE001
            if removed:  # the commit is durable: only what follows it failed
                logger.error("%s: the commit is durable, but recording it failed (%s): the "
                             "next sync compares the shards with the file", directory, e)
            elif isinstance(e, FileNotFoundError):  # replayed and removed by another
                logger.info("%s: removed before this process could (%s)", path, e)  # writer
            else:  # the journal stays, to be replayed
                _failed[key] = str(e)
                logger.error("%s: could not make the commit durable (%s); the journal is "
                             "kept and the next sync or recover replays it", path, e)

    finisher.start(run)


def not_durable(directory: str | os.PathLike) -> str | None:
    """Why this process's last commit in `directory` could not be made durable by its
    finisher thread (the journal kept, for `recover`), or None. Call `finisher.finish`
    first."""
    return _failed.get(os.path.realpath(directory))


def apply(directory: str | os.PathLike, *, wait: bool = True,
          then: Callable[[dict[str, FileId]], None] | None = None, mine: bool = False
          ) -> bool:
    """Replay the committed journal of `directory` into its files, then remove it.

    Args:
        directory: the checkpoint directory (the caller holds its writer lock).
        wait: fsync the files and remove the journal before returning. False: return once
            the files hold the commit (a reader sees it) and leave the fsyncs and the
            removal to a thread (`finisher.finish` waits for it); a crash before they are
            done leaves the committed journal, which `recover` replays.
        then: called once the commit is durable and the journal removed, under the
            writer lock (in the thread if not `wait`), with the name of each file the
            replay moved or patched -> that file as it left it (a file that differs by
            then was written by another program); e.g. to record what the files hold.
        mine: the journal is the one this process's last `write_journal` committed, under
            the writer lock held since: its records are taken as written, not read back.

    Returns:
        True if a journal was replayed, False if there was none.

    Raises:
        CheckpointError: the journal is damaged, stale, or of a
            format this version does not know.
    """
    directory = os.path.abspath(directory)  # the finisher thread may run after a chdir
    path = os.path.join(directory, JOURNAL_NAME)
    if not os.path.exists(path):
        return False
    try:
        records = _records(path, mine)
    except _Corrupt as e:
        raise CheckpointError(_damaged(path, e)) from None
    with interrupts_held():  # a Ctrl-C between two renames, or before the patched files'
        fds, moved, placed = _replay(directory, path, records, verify=not mine)  # fds are
        if wait:  # handed on: raised after
            _durable(directory, path, fds, moved)
        else:
            _durable_later(directory, path, fds, moved, then, placed)
    if wait:
        if then:
            then(placed)
        trash.sweep(directory, background=True)
    logger.info("%s: journal applied, %d records", path, len(records))
    return True


def recover(directory: str | os.PathLike, *, lock: bool = True) -> str:
    """Finish or discard an interrupted journal in `directory`.

    Args:
        directory: the checkpoint directory.
        lock: take the writer lock (False: the caller holds it).

    Returns:
        "replayed" (a committed journal was applied), "discarded" (an uncommitted one
        was removed, the files untouched), "kept" (one left as it was, which this process
        cannot remove, a read-only directory say: the files untouched, whole) or "none".

    Raises:
        CheckpointError: a committed journal no longer fits its files (they changed since,
            or a staged file is lost), cannot be applied by this process, is damaged, or
            is of a format this version does not know (a later version's); it is kept,
            with the staged files, for a person to look at.
    """
    if lock:
        with locked(directory):
            return recover(directory, lock=False)
    directory = os.fspath(directory)
    outcome = "none"
    tmp = os.path.join(directory, _TMP_NAME)
    if os.path.exists(tmp):
        if os.path.isdir(tmp) and not os.path.islink(tmp):
            raise CheckpointError(f"{tmp}: a directory where a sync's uncommitted journal "
                                  "belongs: move it away")
        outcome = "discarded" if _discarded(tmp, "an uncommitted journal", os.unlink) \
            else "kept"
    path = os.path.join(directory, JOURNAL_NAME)
    if os.path.exists(path):
        try:
            _, records = _scan(path)
        except _Corrupt as e:
            raise CheckpointError(_damaged(path, e)) from None
        with interrupts_held():  # as in `apply`; the fsyncs and the removal too
            _durable(directory, path, *_replay(directory, path, records, verify=True)[:2])
        logger.warning("%s: replayed an interrupted journal, %d records", path, len(records))
        outcome = "replayed"
    trash.sweep(directory, background=False)
    if probes := clone.sweep_probes(directory):
        logger.info("%s: removed the reflink probes of processes gone: %s", directory, probes)
    stage = os.path.join(directory, STAGE_DIR)
    with contextlib.suppress(OSError):  # empty: left by a sync cut short once it applied
        os.rmdir(stage)
    if os.path.lexists(stage):  # staged for a journal that never committed
        gone = _discarded(stage, "the files staged by an interrupted sync", shutil.rmtree
                          if os.path.isdir(stage) and not os.path.islink(stage) else os.unlink)
        outcome = ("discarded" if gone else "kept") if outcome in ("none", "kept") \
            else outcome
    if outcome in ("replayed", "discarded"):
        fsync_dir(directory)
    return outcome

"""Safetensors headers read and checked without touching the data: shards, index, directory.

Only the 8-byte length and the JSON header of each shard are read; every check the
safetensors loader makes on a header is made here first, so that a sync never patches a
file that a reader would refuse, and every error names the file and the tensor or field.
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from dataclasses import dataclass, replace
from pathlib import Path

from hotweights.checkpoint.dtypes import BITS
from hotweights.checkpoint.fileid import MAX_HEADER, FileId
from hotweights.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# path -> (raw header, file size, Shard) as last parsed: the same header bytes in a file of
# the same size make the same Shard (a sync reads every header every time; JSON and checks
# cost ~1 ms per 100 tensors).
_parsed: dict[str, tuple[bytes, int, Shard]] = {}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str               # as in the header: "BF16", "F32", ...
    shape: tuple[int, ...]
    begin: int               # absolute byte offsets in the file: 8 + header_len + data offset
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Shard:
    path: str
    file: FileId                     # the file as its header was read (no header digest)
    header_len: int
    tensors: dict[str, TensorInfo]   # in file order; treat as read-only
    metadata: dict[str, str]

    @property
    def size(self) -> int:
        return self.file.size

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    def check(self, now: os.stat_result | None) -> None:
        """Raise unless `now` (the file at `path` now; None: gone) is the one whose header
        was read: bytes placed by that header would land elsewhere in another."""
        if now is None or FileId.of_stat(now) != self.file:
            raise CheckpointError(
                f"{self.path}: {'removed' if now is None else 'changed'} while this sync "
                f"ran (another program writing into {os.path.dirname(self.path)}?); nothing "
                "was written: sync again once it is done")


def _no_dup_keys(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {dup!r}")
    return out


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON (the safetensors loader refuses it)")


def read_shard(path: str | os.PathLike) -> Shard:
    """Read and validate the header of one safetensors file (never its data).

    Raises:
        CheckpointError: naming the file and the tensor or field at fault.
    """
    path = str(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated: {len(head)} bytes, "
                                      "shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise CheckpointError(f"{path}: header length {n} bytes is absurd "
                                      f"(over {MAX_HEADER}): not a safetensors file")
            if 8 + n > st.st_size:
                raise CheckpointError(f"{path}: header length {n} runs past the end of "
                                      f"the file ({st.st_size} bytes): truncated or corrupt")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from e
    if (seen := _parsed.get(path)) is not None and seen[:2] == (raw, st.st_size):
        return replace(seen[2], file=FileId.of_stat(st))
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_dup_keys,
                            parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # nested past Python's stack
        raise CheckpointError(f"{path}: header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is a JSON {type(header).__name__}, "
                              "expected an object")
    metadata = header.pop("__metadata__", None)  # null: none, as the loader takes it
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")
    data_len = st.st_size - 8 - n
    tensors = [_tensor(path, name, entry, 8 + n, data_len) for name, entry in header.items()]
    # Like the loader: tensors tile the data section exactly, no overlap, hole or tail.
    pos, prev = 8 + n, None
    for t in sorted(tensors, key=lambda t: (t.begin, t.end)):
        if t.begin < pos:
            raise CheckpointError(f"{path}: tensor {t.name} [{t.begin}, {t.end}) overlaps "
                                  f"tensor {prev.name} [{prev.begin}, {prev.end})")
        if t.begin > pos:
            raise CheckpointError(f"{path}: {t.begin - pos} unclaimed bytes before tensor "
                                  f"{t.name} at file offset {pos}")
        pos, prev = t.end, t
    if pos != st.st_size:
        raise CheckpointError(f"{path}: {st.st_size - pos} trailing bytes after the last "
                              f"tensor (data section {data_len} bytes, tensors end at "
                              f"{pos - 8 - n})")
    shard = Shard(path, FileId.of_stat(st), n,
                  {t.name: t for t in tensors}, dict(metadata))
    if len(_parsed) >= 4096:  # many directories in one process: start again
        _parsed.clear()
    _parsed[path] = raw, st.st_size, shard
    return shard


def _tensor(path: str, name: str, entry: object, base: int, data_len: int) -> TensorInfo:
    where = f"{path}: tensor {name}"
    if not isinstance(entry, dict):
        raise CheckpointError(f"{where}: entry is a JSON {type(entry).__name__}, expected an "
                              "object with dtype, shape, data_offsets")
    for field in ("dtype", "shape", "data_offsets"):
        if field not in entry:
            raise CheckpointError(f"{where}: missing field {field!r}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise CheckpointError(f"{where}: dtype {dtype!r} is not a string")
    if dtype not in BITS:
        raise CheckpointError(f"{where}: unknown dtype {dtype!r}; known: "
                              f"{', '.join(BITS)}")
    if not isinstance(shape, list) or not all(
            type(d) is int and 0 <= d < 2**63 for d in shape):
        raise CheckpointError(f"{where}: shape {shape!r} is not a list of integers >= 0 "
                              "(and < 2**63)")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(
            type(o) is int and o >= 0 for o in offsets):
        raise CheckpointError(f"{where}: data_offsets {offsets!r} is not [begin, end] "
                              "integers >= 0")
    begin, end = offsets
    if begin > end:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}]: begin > end")
    if end > data_len:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] past the end of the "
                              f"data section ({data_len} bytes): truncated shard or bad "
                              "offsets")
    bits = math.prod(shape) * BITS[dtype]
    if bits % 8 or bits // 8 != end - begin:
        raise CheckpointError(f"{where}: data_offsets [{begin}, {end}] hold {end - begin} "
                              f"bytes, but {dtype} x {list(shape)} needs {bits / 8:g}")
    return TensorInfo(name, dtype, tuple(shape), base + begin, base + end)


def read_index(model_dir: str | os.PathLike) -> dict[str, str] | None:
    """Map each tensor name to its shard file name (relative to `model_dir`).

    From `model.safetensors.index.json` (its `weight_map`), else the single
    `model.safetensors`. Returns None when the directory holds no safetensors at all: the
    caller's cue for a first full save.

    Raises:
        CheckpointError: bad index (not JSON, no weight_map, a shard file that does not
            exist), both an index and a `model.safetensors` it does not name, or
            safetensors files with neither an index nor `model.safetensors`.
    """
    d = Path(model_dir)
    index = d / INDEX_NAME
    for p in (index, d / SINGLE_NAME):
        if p.exists() and not p.is_file():
            raise CheckpointError(f"{p}: not a file (a directory?): move it away")
    if index.is_file():
        try:
            doc = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise CheckpointError(f"{index}: not valid JSON: {e}") from e
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        if not wm:
            raise CheckpointError(f"{index}: its 'weight_map' names no tensor: remove the "
                                  "index (a sync then saves the model anew)")
        checked = set()  # each shard is looked for once, not once per tensor
        for name, fn in wm.items():
            if isinstance(fn, str) and fn in checked:
                continue
            if not isinstance(fn, str) or Path(fn).name != fn or fn in ("", ".", ".."):
                raise CheckpointError(f"{index}: weight_map[{name!r}] = {fn!r} is not a "
                                      "file name in the model directory")
            if not (d / fn).is_file():
                where = ("which is not a file" if (d / fn).exists() else
                         _dangling(d / fn) if (d / fn).is_symlink() else
                         f"which does not exist in {d}")
                raise CheckpointError(f"{index}: tensor {name} is in shard {fn}, {where}")
            checked.add(fn)
        if (d / SINGLE_NAME).is_file() and SINGLE_NAME not in checked:
            raise CheckpointError(
                f"{d}: both {SINGLE_NAME} and {INDEX_NAME} (of other shards): transformers "
                f"loads {SINGLE_NAME} and ignores the index, vLLM loads the index's shards; "
                "remove whichever is stale (a leftover of another save?)")
        return dict(wm)
    single = d / SINGLE_NAME
    if single.is_file():
        return {name: SINGLE_NAME for name in read_shard(single).tensors}
    if single.is_symlink():
        raise CheckpointError(f"{single}: {_dangling(single)}")
    strays = sorted(p.name for p in d.glob("*.safetensors")) if d.is_dir() else []
    if strays:
        raise CheckpointError(f"{d}: safetensors files {strays[:5]} but neither {INDEX_NAME} "
                              f"nor {SINGLE_NAME}: which ones form the model is unknown")
    return None


def _dangling(link: Path) -> str:
    """Where the symlink `link`, which leads to no file, leads: a loop, or a target gone."""
    try:
        os.stat(link)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"a symlink to {os.readlink(link)}, in a loop of symlinks"
    return (f"a symlink to {os.readlink(link)}, which does not exist (a Hugging Face cache "
            "blob removed?)")


def read_dir(model_dir: str | os.PathLike, *, strict: bool = False
             ) -> dict[str, tuple[Shard, TensorInfo]] | None:
    """Every tensor of the checkpoint in `model_dir`: name -> (its Shard, its TensorInfo).

    Reads each shard's header once. Returns None when there are no safetensors (see
    `read_index`). A tensor a shard holds but the index does not name is in it too:
    transformers and vLLM load every tensor of each shard the index lists. One that two
    shards hold is the index's (else the first shard's), unless `strict` (a sync: it would
    write one copy, and a loader may take the other, the later file's).

    Raises:
        CheckpointError: as `read_shard` and `read_index`; for a tensor the index places
            in a shard whose header does not hold it (named with the shard), and, with
            `strict`, for one that two shards hold (named with both).
    """
    wm = read_index(model_dir)
    if wm is None:
        return None
    shards = {fn: read_shard(Path(model_dir) / fn) for fn in dict.fromkeys(wm.values())}
    missing = [(n, fn) for n, fn in wm.items() if n not in shards[fn].tensors]
    if missing:
        shown = ", ".join(f"{n} (in {fn})" for n, fn in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{Path(model_dir) / INDEX_NAME}: {len(missing)} tensors "
                              f"listed but absent from their shard's header: {shown}{more}")
    out = {n: (shards[fn], shards[fn].tensors[n]) for n, fn in wm.items()}
    for fn, shard in shards.items():
        for n, info in shard.tensors.items():
            if (held := out.setdefault(n, (shard, info))[0]) is not shard and strict:
                first = Path(held.path).name + (" (the index's)" if n in wm else "")
                raise CheckpointError(
                    f"{Path(model_dir)}: tensor {n} is in {first} and in {fn}: transformers "
                    "and vLLM load both, the later file's last; remove the stale copy")
    return out

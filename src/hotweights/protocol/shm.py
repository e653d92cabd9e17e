"""Tensors shared between processes of one machine, described by a JSON manifest.

CPU: the server copies its weights once into one new file under /dev/shm and computes on
tensors mapped over it; a trainer maps the same file (MAP_SHARED) and sees the very same
bytes. CUDA: nothing moves; each tensor's allocation is exported as a CUDA IPC handle
(with the GPU's UUID, since device indices differ between processes) and the trainer
opens it. No pickle crosses the boundary: the manifest is plain JSON.

Trust: the trainer maps only a file hotweights names (`hotweights-<server_id>-<pid>` in
the shared-memory directory), a regular file of this user that no one else may write,
opened without following links and mapped by descriptor. A live server holds an
exclusive flock on its file, which is how `sweep_stale` tells a live file from a stale
one (a PID says nothing across PID namespaces that share /dev/shm, e.g. `--ipc=host`).
"""

from __future__ import annotations

import base64
import binascii
import errno
import fcntl
import itertools
import json
import logging
import mmap
import os
import re
import stat
import uuid
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hotweights.errors import ManifestError

logger = logging.getLogger(__name__)

FORMAT = 1
_ALIGN = 64  # bytes: every tensor starts on a cache line
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
              torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)
}


@dataclass(frozen=True)
class CudaIpc:
    """How another process opens one CUDA tensor: torch's `reduce_tensor` fields.

    Handles are base64 text (None where torch gives none, e.g. an empty storage).
    """

    stride: tuple[int, ...]
    storage_offset: int  # elements, from the start of the storage
    handle: str | None  # cudaIpcMemHandle of the allocation
    storage_bytes: int
    storage_offset_bytes: int  # of the storage inside the allocation
    ref_counter_handle: str | None
    ref_counter_offset: int
    event_handle: str | None
    event_sync: bool

    @classmethod
    def from_dict(cls, data: object, *, where: str) -> CudaIpc:
        """Validate and build; ManifestError names `where` (the tensor) and the field."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: field 'ipc' must be an object, found {data!r}")
        values = {}
        for name, kind in _IPC_FIELDS.items():
            if name not in data:
                raise ManifestError(f"{where}: field 'ipc.{name}' is missing")
            value = data[name]
            if kind is int:
                ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
            elif kind is bool:
                ok = isinstance(value, bool)
            elif kind is tuple:
                ok = isinstance(value, list | tuple) and all(
                    isinstance(n, int) and not isinstance(n, bool) for n in value)
                value = tuple(value) if ok else value
            else:  # base64 text or None
                ok = value is None or (isinstance(value, str) and _is_b64(value))
            if not ok:
                want = {int: "an int >= 0", bool: "a bool", tuple: "a list of ints"}.get(
                    kind, "base64 text or null")
                raise ManifestError(f"{where}: field 'ipc.{name}' must be {want}, "
                                    f"found {value!r}")
            values[name] = value
        if values["storage_bytes"] and values["handle"] is None:
            raise ManifestError(f"{where}: field 'ipc.handle' is null for "
                                f"{values['storage_bytes']} storage bytes")
        return cls(**values)


def _refuse_overlaps(source: str, tensors: list[TensorEntry]) -> None:
    """A name given twice, or two tensors of the segment over the same bytes (CUDA tensors
    have storages of their own), is a ManifestError naming both."""
    seen: set[str] = set()
    for e in tensors:
        if e.name in seen:
            raise ManifestError(f"{source}: tensor {e.name!r} is listed twice")
        seen.add(e.name)
    laid = sorted((e for e in tensors if e.ipc is None and e.nbytes), key=lambda e: e.offset)
    for a, b in itertools.pairwise(laid):
        if a.offset + a.nbytes > b.offset:
            raise ManifestError(f"{source}: tensors {a.name!r} (bytes [{a.offset}, "
                                f"{a.offset + a.nbytes})) and {b.name!r} (from byte {b.offset}) "
                                "overlap")


_IPC_FIELDS = dict(stride=tuple, storage_offset=int, handle=str, storage_bytes=int,
                   storage_offset_bytes=int, ref_counter_handle=str, ref_counter_offset=int,
                   event_handle=str, event_sync=bool)


def _is_b64(text: str) -> bool:
    try:
        base64.b64decode(text, validate=True)
    except binascii.Error:
        return False
    return True


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a manifest: where it lies in the shared file."""

    name: str
    dtype: str  # "bfloat16"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the file (CPU)
    ipc: CudaIpc | None = None  # CUDA: how to open the tensor; see _share_cuda

    @property
    def nbytes(self) -> int:
        numel = 1
        for n in self.shape:
            numel *= n
        return numel * _DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Manifest:
    """What a trainer needs to map a server's weights: JSON in, JSON out."""

    format: int
    server_id: str
    path: str  # the shared-memory file
    nbytes: int
    tensors: tuple[TensorEntry, ...]
    model: str = ""  # the model directory the server loaded
    tp_rank: int = 0
    tp_size: int = 1
    weight_version: int = 0
    gpu_uuid: str | None = None  # CUDA: the GPU that holds every tensor

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: object, *, source: str = "manifest") -> Manifest:
        """Validate and build; ManifestError names `source` and the field at fault."""
        if not isinstance(data, dict):
            raise ManifestError(f"{source}: expected a JSON object, found {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise ManifestError(
                f"{source}: field 'format' is {data.get('format')!r}, this hotweights reads "
                f"format {FORMAT}; use the same hotweights version on both sides"
            )
        fields = dict(server_id=str, path=str, nbytes=int, tensors=list | tuple)
        for key, kind in fields.items():
            if not isinstance(data.get(key), kind):
                raise ManifestError(f"{source}: field '{key}' must be a "
                                    f"{getattr(kind, '__name__', 'list')}, found {data.get(key)!r}")
        tensors = []
        for i, t in enumerate(data["tensors"]):
            where = f"{source}: tensors[{i}]"
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise ManifestError(f"{where}: expected an object with a 'name'")
            if t.get("dtype") not in _DTYPES:
                raise ManifestError(f"{where} ({t['name']}): unknown dtype {t.get('dtype')!r}; "
                                    f"known: {', '.join(_DTYPES)}")
            shape, offset = t.get("shape"), t.get("offset")
            if not isinstance(shape, list | tuple) or not all(
                    type(n) is int and 0 <= n < 2**63 for n in shape):
                raise ManifestError(f"{where} ({t['name']}): bad shape {shape!r}")
            if type(offset) is not int or not 0 <= offset < 2**63 or offset % _ALIGN:
                raise ManifestError(f"{where} ({t['name']}): bad offset {offset!r}")
            ipc = t.get("ipc")
            if ipc is not None:
                ipc = CudaIpc.from_dict(ipc, where=f"{where} ({t['name']})")
                if len(ipc.stride) != len(shape):
                    raise ManifestError(f"{where} ({t['name']}): field 'ipc.stride' "
                                        f"{list(ipc.stride)} does not match shape {shape}")
            entry = TensorEntry(t["name"], t["dtype"], tuple(shape), offset, ipc)
            if ipc is None and offset + entry.nbytes > data["nbytes"]:
                raise ManifestError(f"{where} ({t['name']}): bytes [{offset}, "
                                    f"{offset + entry.nbytes}) run past nbytes={data['nbytes']}")
            if ipc is not None and entry.nbytes and not ipc.storage_bytes:
                raise ManifestError(f"{where} ({t['name']}): field 'ipc.storage_bytes' is 0 "
                                    f"for shape {list(shape)}")
            tensors.append(entry)
        _refuse_overlaps(source, tensors)
        extra = {k: data[k] for k in ("model", "tp_rank", "tp_size", "weight_version",
                                      "gpu_uuid") if k in data}
        for key, least in dict(model=None, tp_rank=0, tp_size=1, weight_version=0).items():
            value = extra.get(key)
            if key in extra and (type(value) is not str if least is None else
                                 type(value) is not int or value < least):
                want = "a str" if least is None else f"an int >= {least}"
                raise ManifestError(f"{source}: field '{key}' must be {want}, found {value!r}")
        if "tp_rank" in extra and extra["tp_rank"] >= extra.get("tp_size", 1):
            raise ManifestError(f"{source}: field 'tp_rank' ({extra['tp_rank']}) must be below "
                                f"'tp_size' ({extra.get('tp_size', 1)})")
        if any(e.ipc for e in tensors) and not isinstance(extra.get("gpu_uuid"), str):
            raise ManifestError(f"{source}: CUDA tensors but no 'gpu_uuid'")
        return cls(FORMAT, data["server_id"], data["path"], data["nbytes"], tuple(tensors),
                   **extra)

    @classmethod
    def from_json(cls, text: str, *, source: str = "manifest") -> Manifest:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{source}: not JSON: {e}") from e
        return cls.from_dict(data, source=source)


_HELD: dict[str, int] = {}  # path -> locked descriptor of each file this process shares


def _map(fd: int, nbytes: int) -> torch.UntypedStorage:
    # By descriptor: the file that was checked is the file that is mapped. The storage
    # holds a reference to the mmap object, so the mapping lives as long as any tensor.
    mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapping, dtype=torch.uint8).untyped_storage()


def _names_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd` (no one removed or replaced it)."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _create_locked(path: Path) -> int:
    # The server holds an exclusive flock on its file for its lifetime: that is what tells
    # `sweep_stale` the file is live. A sweeper can lock and remove the file between our
    # create and our lock; then it is created again.
    for _ in range(3):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        if _names_file(fd, path):
            return fd
        os.close(fd)
    raise ManifestError(f"{path}: removed as soon as created, three times; another process "
                        f"is removing files in {path.parent}")


def _tensor(storage: torch.UntypedStorage, entry: TensorEntry) -> torch.Tensor:
    dtype = _DTYPES[entry.dtype]
    out = torch.empty(0, dtype=dtype)
    out.set_(storage, entry.offset // dtype.itemsize, entry.shape)
    return out


def share(
    tensors: Mapping[str, torch.Tensor],
    *,
    directory: str | os.PathLike = "/dev/shm",
    server_id: str | None = None,
    moved: Callable[[str, torch.Tensor], None] | None = None,
    **manifest_fields,
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Copy `tensors` into one new shared-memory file (mode 0600).

    Returns the manifest and, by name, tensors mapped over the file (the caller computes
    on these from now on). Nothing is left behind on failure. `moved`: called with each
    name and its shared tensor as soon as it is copied, when `tensors` (a dict) lets go of
    it: the caller computes on it from then on, and the old bytes are freed as the copy
    goes, not at its end (a server's host memory holds the model once, not twice). CUDA
    tensors are shared where they lie: no copy, no call.
    """
    server_id = server_id or uuid.uuid4().hex[:12]
    devices = {t.device for t in tensors.values()}
    if len(devices) == 1 and next(iter(devices)).type == "cuda":
        return _share_cuda(tensors, server_id, next(iter(devices)), **manifest_fields)
    entries, at = [], 0
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES or t.device.type != "cpu":
            raise ManifestError(f"{name}: cannot share a {t.dtype} tensor on {t.device}")
        entries.append(TensorEntry(name, dtype, tuple(t.shape), at))
        at += -(-entries[-1].nbytes // _ALIGN) * _ALIGN
    path = Path(directory) / f"hotweights-{server_id}-{os.getpid()}"
    fd = _create_locked(path)
    try:
        try:  # reserve the pages now: a full tmpfs would otherwise SIGBUS the copy
            os.posix_fallocate(fd, 0, max(at, 1))
        except OSError as e:
            raise ManifestError(f"{directory}: cannot reserve {at:,} bytes for the shared "
                                f"weights ({e.strerror}); make it larger (docker: "
                                "--shm-size)") from None
        storage = _map(fd, max(at, 1))
        shared = {}
        for entry in entries:
            shared[entry.name] = _tensor(storage, entry)
            shared[entry.name].copy_(tensors[entry.name])
            if moved is not None:
                del tensors[entry.name]
                moved(entry.name, shared[entry.name])
    except BaseException:
        path.unlink(missing_ok=True)
        os.close(fd)
        raise
    _HELD[str(path)] = fd  # the lock lives until `release`, or until this process dies
    manifest = Manifest(FORMAT, server_id, str(path), max(at, 1), tuple(entries),
                        **manifest_fields)
    logger.info("shared %d tensors (%d bytes) in %s", len(entries), at, path)
    return manifest, shared


def attach(manifest: Manifest, *,
           directory: str | os.PathLike = "/dev/shm") -> dict[str, torch.Tensor]:
    """Map a manifest's file; by name, tensors over the server's own bytes (no copy).

    Args:
        manifest: the server's manifest.
        directory: where the server's shared-memory files lie; a `path` elsewhere is
            refused.

    Raises:
        ManifestError: the file is gone, or is not one hotweights would have made for
            this server: another name or directory, a link, not a regular file, another
            user's, writable by others, or of another size.
    """
    if manifest.gpu_uuid is not None:
        return _attach_cuda(manifest)
    fd = _open_checked(manifest, Path(directory))
    try:
        storage = _map(fd, manifest.nbytes)
    finally:
        os.close(fd)  # the mapping keeps the file
    return {entry.name: _tensor(storage, entry) for entry in manifest.tensors}


def _open_checked(manifest: Manifest, directory: Path) -> int:
    path, prefix = Path(manifest.path), f"hotweights-{manifest.server_id}-"
    if (path.parent != directory or not path.name.startswith(prefix)
            or not re.fullmatch(r"[0-9]+", path.name[len(prefix):])):
        raise ManifestError(f"{manifest.path}: not a shared-weights file of server "
                            f"{manifest.server_id}; expected {directory / prefix}<pid>")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ManifestError(f"{path}: shared weights of server {manifest.server_id} are "
                            "gone (server stopped, or another machine?)") from None
    except OSError as e:
        why = "a symbolic link" if e.errno == errno.ELOOP else f"unreadable ({e.strerror})"
        raise ManifestError(f"{path}: is {why}; hotweights maps only the server's own "
                            "file") from None
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "is not a regular file"
    elif st.st_uid != os.getuid():
        problem = f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    elif st.st_mode & 0o022:
        problem = f"has mode {stat.S_IMODE(st.st_mode):o}: other users may write it"
    elif st.st_size != manifest.nbytes or manifest.nbytes < 1:
        problem = (f"has {st.st_size} bytes, the manifest says {manifest.nbytes}; it "
                   "belongs to another server")
    if problem:
        os.close(fd)
        raise ManifestError(f"{path}: {problem}")
    return fd


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def _share_cuda(tensors, server_id, device, **manifest_fields):
    # Export the existing allocations (no copy; addresses do not change, so CUDA graphs
    # captured on them stay valid). The server must keep the tensors alive.
    from torch.multiprocessing.reductions import reduce_tensor

    entries = []
    for name, t in tensors.items():
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ManifestError(f"{name}: cannot share a {t.dtype} tensor")
        try:
            fields = reduce_tensor(t.detach())[1]
        except RuntimeError as e:  # memory CUDA IPC cannot export (cuMem, host, imported)
            raise ManifestError(f"{name}: CUDA IPC cannot share this tensor's memory "
                                f"({e}); serve it from vLLM's own device memory") from e
        if len(fields) != 15:  # torch's private layout, read as torch 2.6-2.13 have it
            raise ManifestError(f"{name}: torch {torch.__version__} exports a CUDA tensor in "
                                f"{len(fields)} fields, not the 15 this hotweights reads: "
                                "its private layout changed; serve with a torch it knows")
        (_, _, stride, offset, _, _, _, handle, storage_bytes, storage_offset_bytes, _,
         ref_handle, ref_offset, event_handle, event_sync) = fields
        ipc = CudaIpc(tuple(stride), offset, _b64(handle), storage_bytes,
                      storage_offset_bytes, _b64(ref_handle), ref_offset, _b64(event_handle),
                      bool(event_sync))
        entries.append(TensorEntry(name, dtype, tuple(t.shape), 0, ipc))
    uuid_ = str(torch.cuda.get_device_properties(device).uuid)
    manifest = Manifest(FORMAT, server_id, f"cuda:{uuid_}", 0, tuple(entries),
                        gpu_uuid=uuid_, **manifest_fields)
    return manifest, dict(tensors)


def _attach_cuda(manifest: Manifest) -> dict[str, torch.Tensor]:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    uuids = [str(torch.cuda.get_device_properties(i).uuid)
             for i in range(torch.cuda.device_count())]
    if manifest.gpu_uuid not in uuids:
        raise ManifestError(f"GPU {manifest.gpu_uuid} of server {manifest.server_id} is not "
                            f"visible here (CUDA_VISIBLE_DEVICES?); visible: {uuids}")
    device = uuids.index(manifest.gpu_uuid)  # the index differs between processes
    out = {}
    for e in manifest.tensors:
        ipc, dtype = e.ipc, _DTYPES[e.dtype]
        if ipc is None:
            raise ManifestError(f"{e.name}: a CUDA manifest ({manifest.path}) with no 'ipc'")
        if not ipc.storage_bytes:
            out[e.name] = torch.empty(e.shape, dtype=dtype, device=f"cuda:{device}")
            continue
        out[e.name] = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(e.shape), ipc.stride, ipc.storage_offset,
            torch.UntypedStorage, dtype, device, _unb64(ipc.handle), ipc.storage_bytes,
            ipc.storage_offset_bytes, False, _unb64(ipc.ref_counter_handle),
            ipc.ref_counter_offset, _unb64(ipc.event_handle), ipc.event_sync)
    return out


def release(manifest: Manifest) -> None:
    """Remove the shared file and drop its lock; mappings stay valid until unmapped."""
    if manifest.gpu_uuid is None:
        Path(manifest.path).unlink(missing_ok=True)
        fd = _HELD.pop(manifest.path, None)
        if fd is not None:
            os.close(fd)


def remove_server_files(server_id: str, directory: str | os.PathLike = "/dev/shm") -> None:
    """Remove every shared-weight file of one server (all its workers)."""
    for path in Path(directory).glob(f"hotweights-{server_id}-*"):
        path.unlink(missing_ok=True)


def sweep_stale(directory: str | os.PathLike = "/dev/shm") -> list[str]:
    """Remove shared-weight files that no live server holds (killed before cleanup).

    A live server holds an exclusive flock on its file; a file that can be locked is
    stale, and is removed while locked. The PID in the name is not consulted: containers
    with their own PID namespaces may share /dev/shm (`--ipc=host`).
    """
    removed = []
    for path in Path(directory).glob("hotweights-*-*"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:  # gone, a link, or another user's
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live server holds it
                continue
            if not _names_file(fd, path):
                continue
            try:
                path.unlink()
            except OSError:  # another user's (sticky /dev/shm), or gone
                continue
        finally:
            os.close(fd)
        removed.append(str(path))
        logger.info("removed stale shared weights %s", path)
    return removed

"""Tensors shared between processes of one machine, described by a JSON manifest.

CPU: the server copies its weights once into one new file under /dev/shm and computes on
tensors mapped over it; a trainer maps the same file (MAP_SHARED) and sees the very same
bytes. CUDA: nothing moves; each tensor's allocation is exported as a CUDA IPC handle
(with the GPU's UUID, since device indices differ between processes) and the trainer
opens it. No pickle crosses the boundary: the manifest is plain JSON.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import uuid
from collections.abc import Mapping
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
class TensorEntry:
    """One tensor of a manifest: where it lies in the shared file."""

    name: str
    dtype: str  # "bfloat16"
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the file (CPU)
    ipc: dict | None = None  # CUDA IPC handle fields (CUDA); see _export_cuda

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
                    isinstance(n, int) and n >= 0 for n in shape):
                raise ManifestError(f"{where} ({t['name']}): bad shape {shape!r}")
            if not isinstance(offset, int) or offset < 0 or offset % _ALIGN:
                raise ManifestError(f"{where} ({t['name']}): bad offset {offset!r}")
            ipc = t.get("ipc")
            if ipc is not None and not (isinstance(ipc, dict) and isinstance(
                    ipc.get("handle"), str) and isinstance(ipc.get("stride"), list | tuple)):
                raise ManifestError(f"{where} ({t['name']}): bad ipc {ipc!r}")
            entry = TensorEntry(t["name"], t["dtype"], tuple(shape), offset, ipc)
            if ipc is None and offset + entry.nbytes > data["nbytes"]:
                raise ManifestError(f"{where} ({t['name']}): bytes [{offset}, "
                                    f"{offset + entry.nbytes}) run past nbytes={data['nbytes']}")
            tensors.append(entry)
        extra = {k: data[k] for k in ("model", "tp_rank", "tp_size", "weight_version",
                                      "gpu_uuid") if k in data}
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


def _map(path: str, nbytes: int) -> torch.UntypedStorage:
    return torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)


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
    **manifest_fields,
) -> tuple[Manifest, dict[str, torch.Tensor]]:
    """Copy `tensors` into one new shared-memory file (mode 0600).

    Returns the manifest and, by name, tensors mapped over the file (the caller computes
    on these from now on). Nothing is left behind on failure.
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
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:  # reserve the pages now: a full tmpfs would otherwise SIGBUS the copy
            os.posix_fallocate(fd, 0, max(at, 1))
        except OSError as e:
            raise ManifestError(f"{directory}: cannot reserve {at:,} bytes for the shared "
                                f"weights ({e.strerror}); make it larger (docker: "
                                "--shm-size)") from None
        storage = _map(str(path), max(at, 1))
        shared = {}
        for entry in entries:
            shared[entry.name] = _tensor(storage, entry)
            shared[entry.name].copy_(tensors[entry.name])
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    manifest = Manifest(FORMAT, server_id, str(path), max(at, 1), tuple(entries),
                        **manifest_fields)
    logger.info("shared %d tensors (%d bytes) in %s", len(entries), at, path)
    return manifest, shared


def attach(manifest: Manifest) -> dict[str, torch.Tensor]:
    """Map a manifest's file; by name, tensors over the server's own bytes (no copy)."""
    if manifest.gpu_uuid is not None:
        return _attach_cuda(manifest)
    try:
        size = os.stat(manifest.path).st_size
    except FileNotFoundError:
        raise ManifestError(f"{manifest.path}: shared weights of server {manifest.server_id} "
                            "are gone (server stopped, or another machine?)") from None
    if size != manifest.nbytes:
        raise ManifestError(f"{manifest.path}: {size} bytes, the manifest says "
                            f"{manifest.nbytes}; it belongs to another server")
    storage = _map(manifest.path, manifest.nbytes)
    return {entry.name: _tensor(storage, entry) for entry in manifest.tensors}


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
        (_, _, stride, offset, _, _, _, handle, storage_bytes, storage_offset_bytes, _,
         ref_handle, ref_offset, event_handle, event_sync) = reduce_tensor(t.detach())[1]
        ipc = dict(stride=list(stride), storage_offset=offset, handle=_b64(handle),
                   storage_bytes=storage_bytes, storage_offset_bytes=storage_offset_bytes,
                   ref_counter_handle=_b64(ref_handle), ref_counter_offset=ref_offset,
                   event_handle=_b64(event_handle), event_sync=event_sync)
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
        if not ipc["storage_bytes"]:
            out[e.name] = torch.empty(e.shape, dtype=dtype, device=f"cuda:{device}")
            continue
        out[e.name] = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(e.shape), tuple(ipc["stride"]), ipc["storage_offset"],
            torch.UntypedStorage, dtype, device, _unb64(ipc["handle"]),
            ipc["storage_bytes"], ipc["storage_offset_bytes"], False,
            _unb64(ipc["ref_counter_handle"]), ipc["ref_counter_offset"],
            _unb64(ipc["event_handle"]), ipc["event_sync"])
    return out


def release(manifest: Manifest) -> None:
    """Remove the shared file; mappings that exist stay valid until unmapped."""
    if manifest.gpu_uuid is None:
        Path(manifest.path).unlink(missing_ok=True)


def remove_server_files(server_id: str, directory: str | os.PathLike = "/dev/shm") -> None:
    """Remove every shared-weight file of one server (all its workers)."""
    for path in Path(directory).glob(f"hotweights-{server_id}-*"):
        path.unlink(missing_ok=True)


def sweep_stale(directory: str | os.PathLike = "/dev/shm") -> list[str]:
    """Remove shared-weight files whose server process is gone (killed before cleanup)."""
    removed = []
    for path in Path(directory).glob("hotweights-*-*"):
        pid = path.name.rsplit("-", 1)[1]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        try:
            path.unlink(missing_ok=True)
        except PermissionError:  # another user's server
            continue
        removed.append(str(path))
        logger.info("removed stale shared weights %s", path)
    return removed

"""Tensors in shared memory (CPU): one file under /dev/shm, described by a JSON manifest.

The server copies its weights once into a new file and computes on tensors mapped over
it; a trainer on the same machine maps the same file (MAP_SHARED) and sees the very same
bytes. No pickle crosses the boundary: the manifest is plain JSON.
"""

from __future__ import annotations

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
    offset: int  # bytes from the start of the file

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
            entry = TensorEntry(t["name"], t["dtype"], tuple(shape), offset)
            if offset + entry.nbytes > data["nbytes"]:
                raise ManifestError(f"{where} ({t['name']}): bytes [{offset}, "
                                    f"{offset + entry.nbytes}) run past nbytes={data['nbytes']}")
            tensors.append(entry)
        extra = {k: data[k] for k in ("model", "tp_rank", "tp_size", "weight_version")
                 if k in data}
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
        os.ftruncate(fd, max(at, 1))
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


def release(manifest: Manifest) -> None:
    """Remove the shared file; mappings that exist stay valid until unmapped."""
    Path(manifest.path).unlink(missing_ok=True)


def sweep_stale(directory: str | os.PathLike = "/dev/shm") -> list[str]:
    """Remove shared-weight files whose server process is gone (killed before cleanup)."""
    removed = []
    for path in Path(directory).glob("hotweights-*-*"):
        pid = path.name.rsplit("-", 1)[1]
        if not pid.isdigit() or Path(f"/proc/{pid}").exists():
            continue
        path.unlink(missing_ok=True)
        removed.append(str(path))
        logger.info("removed stale shared weights %s", path)
    return removed

"""`SyncResult`: what a sync or a first save did; `Progress`: what it tells as it goes;
`mib`: a size as its errors say it; `not_a_directory`: the error for a directory that is
none."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from hotweights.errors import CheckpointError

Progress = Callable[[str, int, int], None]  # (phase "hash" | "write", bytes done, total)


@dataclass(frozen=True)
class SyncResult:
    """What a sync did. `to_json()` for the CLI."""

    mode: str  # the mode asked for
    version: str | None
    tensors_synced: int
    tensors_changed: int
    shards_changed: tuple[str, ...]
    bytes_hashed: int  # live bytes fingerprinted
    bytes_compared: int  # live bytes compared with the file (no usable sidecar)
    bytes_written: int  # into the shards (a journal holds its patches once more)
    missing_on_disk: tuple[str, ...]  # live tensors the checkpoint does not hold
    missing_live: tuple[str, ...]  # checkpoint tensors with no live source
    seconds: float
    writes: dict[str, str] = field(default_factory=dict)  # changed shard -> how written
    tied: tuple[str, ...] = ()  # live aliases of a tensor stored once, under another name
    first_save: bool = False
    reason: str = ""  # why this write mode
    write_mode: str = ""  # the mode `mode` came to here: "reflink", "journal" or "copy" (a
    # first save: "copy"); a shard mostly changed is rewritten whole in any (`writes`)
    bytes_trusted: int = 0  # live bytes not hashed: `changed=` left them out, or a
    # `WriteWatch` saw them unwritten
    dirty: str | None = None  # `Bridge.checkpoint`: why the version the server served is
    # dirty (an update that raised after writing some weights), else None

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def check_dir_arg(model_dir: object, what: str) -> None:
    """Refuse a `model_dir` argument that is no path, or empty (an unset "$DIR" would
    mean the current directory)."""
    if not isinstance(model_dir, str | os.PathLike) or not isinstance(
            path := os.fspath(model_dir), str):
        raise CheckpointError(f"{what}: model_dir must be a path (str or os.PathLike), "
                              f"found {model_dir!r}")
    if not path.strip():
        raise CheckpointError(f"{what}: model_dir is empty (an unset variable?); give the "
                              "checkpoint directory")


def not_a_directory(path: str | os.PathLike) -> CheckpointError:
    """The error for a checkpoint directory that is none: missing, or something else."""
    return CheckpointError(f"{path}: " + ("not a directory" if os.path.lexists(path) else
                                          "no such directory"))


def mib(n: int, up: bool = False) -> str:
    """`n` bytes in MiB, to a tenth (`up`: rounded up, e.g. what to free)."""
    tenths = -(-n * 10 // (1 << 20)) if up else round(n * 10 / (1 << 20))
    return f"{tenths / 10:,.1f} MiB"

"""A first full save into a directory with no safetensors, as `save_pretrained` shards it.

The shards (`model.safetensors`, or `model-0000i-of-0000n.safetensors` and the index), the
config and the sidecars are staged in `DIR/.hotweights-stage/` and moved into place by one
journal, the config first and the index last: a crash leaves no partial checkpoint
behind. A tensor tied to another (the same storage: `lm_head.weight` and the embedding) is
written once, under the first of its names. Names are those `save_pretrained` writes:
transformers' conversions (fused MoE experts split one tensor per expert) are reverted by
`checkpoint.names.reverted`.
The sidecars hash the bytes written, chunk by chunk as they are written (`_write_shard`).
"""

from __future__ import annotations

import copy
import json
import operator
import os
import shutil
import struct
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
from huggingface_hub import split_torch_state_dict_into_shards

from hotweights.changes import blocks
from hotweights.checkpoint import journal, sidecar, stage
from hotweights.checkpoint.dtypes import NAMES
from hotweights.checkpoint.fileid import FileId
from hotweights.checkpoint.names import reverted, storage_key
from hotweights.checkpoint.result import SyncResult, mib
from hotweights.checkpoint.shards import INDEX_NAME, read_shard
from hotweights.checkpoint.writes import syncfs
from hotweights.errors import CheckpointError, LiveTensorError

_CHUNK = 64 << 20  # bytes per copy, write and hash call
_NONE = np.zeros(0, np.uint64)


def save(model_dir: Path, live: Mapping[str, torch.Tensor], *, mode: str,
         version: str | None, config: object, block_size: int, max_shard_size: int | str,
         progress: Callable[[str, int, int], None],
         after_read: Callable[[], None] | None, started: float,
         model: torch.nn.Module | None = None, model_type: str | None = None) -> SyncResult:
    """Write `live` as a new checkpoint in `model_dir` (see `checkpoint.sync`)."""
    untied: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[object, str] = {}
    for name, t in live.items():
        key = storage_key(t) or name
        if key in seen:
            tied[name] = seen[key]
        else:
            seen[key] = name
            untied[name] = t.detach()
    # ties dropped first, then transformers' conversions reverted, as save_pretrained does
    storages = Counter(p for t in untied.values() if (p := t.untyped_storage().data_ptr()))
    if any(n > 1 for n in storages.values()):  # views of one storage under many names (a
        # bridge's, of vLLM's tensors): not one tied tensor, which save_pretrained's split
        # keeps in one shard (here, the whole model); sized apart, and converted to views
        # where they can be (copies are made shard by shard, as each is written)
        tensors = reverted(untied, model_type=model_type, model=model, views=True)
        sizing = {n: t.to("meta") for n, t in tensors.items()}
    else:  # as save_pretrained shards them
        tensors = sizing = {n: t.contiguous() for n, t in  # (sized as written)
                            reverted(untied, model_type=model_type, model=model).items()}
    split = split_torch_state_dict_into_shards(sizing, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        if bad := next((n for n in names if tensors[n].dtype not in NAMES), None):
            raise LiveTensorError(f"{bad} in {filename}: the live tensor is "
                                  f"{str(tensors[bad].dtype).removeprefix('torch.')}, which "
                                  "has no safetensors dtype; nothing was written")
    config_text = _config_text(config, model)
    total, done = sum(t.numel() * t.element_size() for t in tensors.values()), 0
    if (free := short_of_space(model_dir, total)) is not None:  # before hours of writing
        raise CheckpointError(
            f"{model_dir}: not enough free space: a first save writes {mib(total)} "
            f"({total} bytes) of tensors, {mib(free)} are free: free "
            f"{mib(total - free, up=True)} more; nothing was written")
    fingerprints = {}

    def wrote(n: int) -> None:
        nonlocal done
        done += n
        progress("write", done, total)
    with stage.staging(model_dir, "write the first save") as area:
        area.mkdir()
        progress("write", 0, total)
        for filename, names in split.filename_to_tensors.items():
            with stage.naming(os.fspath(area / filename)):  # a failed write names its file
                fingerprints[filename] = _write_shard(
                    area / filename, {n: tensors[n].contiguous() for n in names}, block_size,
                    wrote)
        # config.json first, the index last: a sync cut short between moves leaves no
        # new weights beside an older config.json
        moves = [*split.filename_to_tensors]
        if config_text is not None:
            _text(area / "config.json", config_text)
            moves.insert(0, "config.json")
        if split.is_sharded:
            _text(area / INDEX_NAME, json.dumps(
                {"metadata": {"total_size": total}, "weight_map": split.tensor_to_filename},
                indent=2, sort_keys=True))
            moves.append(INDEX_NAME)
        journal.write_journal(model_dir, [], moves=moves, meta={"version": version})
    # the sidecars once the shards are durable, under the lock (a writer after this one
    # may replace a shard as soon as it is free); also when after_read raised
    stage.commit(model_dir, after_read, then=lambda placed: _sidecars(
        model_dir, fingerprints, version, placed))
    return SyncResult(
        mode=mode, version=version, tensors_synced=len(tensors), tensors_changed=len(tensors),
        shards_changed=tuple(split.filename_to_tensors), bytes_hashed=total,
        bytes_compared=0, bytes_written=total, missing_on_disk=(), missing_live=(),
        seconds=time.perf_counter() - started,
        writes=dict.fromkeys(split.filename_to_tensors, "whole"), tied=tuple(sorted(tied)),
        first_save=True, reason="no safetensors in the directory", write_mode="copy")


def short_of_space(model_dir: Path, need: int) -> int | None:
    """The bytes free in `model_dir`'s filesystem where fewer than `need`, else None."""
    if need > shutil.disk_usage(model_dir).free:
        syncfs(model_dir)  # (the blocks of files just deleted may not be free yet)
        if need > (free := shutil.disk_usage(model_dir).free):
            return free
    return None


def _sidecars(model_dir: Path, fingerprints: Mapping[str, blocks.Fingerprints],
              version: str | None, placed: dict[str, FileId]) -> None:
    """Each shard's sidecar, from the bytes written, for the shards in place (none where
    the commit failed, or another program wrote into one since)."""
    for filename, fp in fingerprints.items():
        if not (model_dir / filename).exists():
            continue
        with sidecar.best_effort(model_dir / filename):
            shard = read_shard(model_dir / filename)
            if sidecar.as_placed(shard.path, placed.get(filename)) == shard.file:
                sidecar.write(shard, fp, version)


def check_options(max_shard_size: object, config: object) -> int | str:
    """`max_shard_size` (a numpy int as an int), once it and `config` are what a first
    save takes; else a CheckpointError naming the one at fault. (`sync` asks before it
    makes or locks anything.)"""
    if isinstance(max_shard_size, str):
        try:  # huggingface_hub's own parse of "5GB"
            split_torch_state_dict_into_shards({}, max_shard_size=max_shard_size)
        except ValueError as e:
            raise CheckpointError(f"sync: field 'max_shard_size' {max_shard_size!r}: {e}"
                                  ) from None
    else:
        try:
            size = -1 if isinstance(max_shard_size, bool) else operator.index(max_shard_size)
        except TypeError:
            size = -1
        if size <= 0:
            raise CheckpointError(f"sync: field 'max_shard_size' must be bytes (an int > 0) "
                                  f"or a size such as '5GB', as for save_pretrained, found "
                                  f"{max_shard_size!r}")
        max_shard_size = size
    check_config(config)
    return max_shard_size


def check_config(config: object) -> None:
    """Refuse a `config` a sync cannot take (a CheckpointError naming it)."""
    if isinstance(config, dict):  # (a transformers config is written at a first save only:
        _config_text(config, None)  # not serialized here, at every sync that passes it)
    elif config is not None and not hasattr(config, "to_json_string"):
        raise _bad_config(config, "no to_json_string")
    model_type = (config.get("model_type") if isinstance(config, dict)
                  else getattr(config, "model_type", None))
    if model_type is not None and not isinstance(model_type, str):  # it picks conversions
        raise CheckpointError(f"sync: field 'config.model_type' must be a str (e.g. "
                              f"'llama'), found {model_type!r}")


def _config_text(config: object, model: torch.nn.Module | None) -> str | None:
    """config.json's text: of `config` (a dict or a `PretrainedConfig`), else of the
    model's own config naming its class, as save_pretrained writes it (None: neither)."""
    if config is None and getattr(model, "config", None) is not None:
        config = copy.deepcopy(model.config)  # (on a copy)
        as_saved(config, model)
    if config is None:
        return None
    if not isinstance(config, dict) and "transformers_weights" in config:
        config = copy.deepcopy(config)  # where from_pretrained read the weights: not these
        delattr(config, "transformers_weights")  # (save_pretrained drops it too)
    try:
        return (json.dumps(config, indent=2) if isinstance(config, dict)
                else config.to_json_string())
    except (AttributeError, TypeError, ValueError) as e:  # not a config, or not JSON
        raise _bad_config(config, str(e)) from None


def as_saved(config: object, model: torch.nn.Module) -> None:
    """Make `config` name `model`'s class (an FSDP wrapper's prefix left out) and dtype,
    as save_pretrained writes it."""
    config.architectures = [type(model).__name__.removeprefix("FSDP")]
    if isinstance(dtype := getattr(model, "dtype", None), torch.dtype):
        config.dtype = str(dtype).removeprefix("torch.")  # e.g. "bfloat16"


def _bad_config(config: object, why: str) -> CheckpointError:
    return CheckpointError(f"sync: field 'config' must be a dict or a transformers "
                           f"PretrainedConfig that JSON can hold, found "
                           f"{type(config).__name__} ({why})")


def _write_shard(path: Path, tensors: Mapping[str, torch.Tensor], block_size: int,
                 wrote: Callable[[int], None] = lambda n: None) -> blocks.Fingerprints:
    """Write `tensors` (contiguous) as the safetensors file `path`, fsync'd, and return the
    fingerprints of the bytes written (`wrote(n)` after each chunk of n bytes): each chunk
    of a tensor is copied once, and the file and the hashes both take that copy. A live
    tensor changed meanwhile (training in another thread) may leave the file behind it,
    never a sidecar that disagrees with the file (a later sync would take the file for the
    live bytes and skip the change)."""
    kind = blocks.kind_of(tensors.values())
    # widest items first, as safetensors orders them: each tensor aligned to its item size
    names = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header, pos = {"__metadata__": {"format": "pt"}}, 0
    for n in names:
        t = tensors[n]
        header[n] = {"dtype": NAMES[t.dtype], "shape": list(t.shape),
                     "data_offsets": [pos, pos + t.nbytes]}
        pos += t.nbytes
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)  # padded as safetensors pads: the data 8-byte aligned
    # whole coarse blocks per chunk: the chunks' hashes, end to end, are the tensor's
    step = max(1, _CHUNK // (block_size * blocks.COARSE)) * block_size * blocks.COARSE
    buf = torch.empty(min(step, pos), dtype=torch.uint8)  # the copy of a CPU chunk
    per, coarse = {}, {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for n in names:
            u8 = tensors[n].reshape(-1).view(torch.uint8)
            parts = []
            for lo in range(0, u8.numel(), step):
                chunk = u8[lo:lo + step]
                snap = (buf[:chunk.numel()].copy_(chunk) if chunk.device.type == "cpu"
                        else chunk.clone())  # on its device: hashed there
                parts.append(blocks.fingerprint({n: snap}, block_size=block_size, kind=kind,
                                                coarse=True))
                f.write(memoryview(snap.cpu().numpy()))
                wrote(chunk.numel())
            per[n] = (u8.numel(), np.concatenate([_NONE, *(p.tensors[n][1] for p in parts)]))
            if kind == blocks.XXH3:
                coarse[n] = np.concatenate([_NONE, *(p.coarse[n] for p in parts)])
        f.flush()
        os.fsync(f.fileno())
    return blocks.Fingerprints(kind, block_size, per, coarse)


def _text(path: Path, text: str) -> None:
    path.write_text(text)
    _fsync(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

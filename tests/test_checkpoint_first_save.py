"""checkpoint.first_save: its sidecars describe the bytes it wrote, whatever the live
tensors do meanwhile."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hotweights.changes import blocks
from hotweights.checkpoint import sidecar, sync
from hotweights.checkpoint.shards import read_shard


def _live() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(64, 256, generator=g) for i in range(4)}


@pytest.mark.parametrize("when", ["while it writes", "after_read"])
def test_the_sidecars_hash_the_bytes_written_not_the_live_tensors_after(tmp_path, when,
                                                                           monkeypatch):
    live = _live()

    def train() -> None:  # another thread's optimizer step
        for t in live.values():
            t.add_(1.0)

    if when == "while it writes":  # once the first bytes are written and hashed
        fingerprint, calls = blocks.fingerprint, []

        def step_once(*args, **kwargs):
            if not calls:
                train()
            calls.append(1)
            return fingerprint(*args, **kwargs)
        monkeypatch.setattr(blocks, "fingerprint", step_once)
    first = sync(tmp_path, live, max_shard_size=100_000,
                 after_read=train if when == "after_read" else None)
    monkeypatch.undo()
    assert first.first_save and len(first.shards_changed) > 1
    for shard in first.shards_changed:  # each sidecar holds the hashes of its file's bytes
        path = tmp_path / shard
        recorded = sidecar.load(read_shard(path), blocks.DEFAULT_BLOCK_SIZE, blocks.XXH3)
        on_disk = blocks.fingerprint({n: t.reshape(-1).view(torch.uint8)
                                      for n, t in load_file(path).items()})
        assert recorded is not None and recorded.tensors.keys() == on_disk.tensors.keys()
        for n, (nbytes, hashes) in on_disk.tensors.items():
            assert recorded.tensors[n][0] == nbytes, n
            assert np.array_equal(recorded.tensors[n][1], hashes), n
    stale = [n for n, t in load_file(tmp_path / first.shards_changed[0]).items()
             if not torch.equal(t, live[n])]
    assert stale  # the step came after these bytes were written
    again = sync(tmp_path, live)
    assert again.tensors_changed >= len(stale)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    for n, t in live.items():
        assert torch.equal(load_file(tmp_path / index["weight_map"][n])[n], t), n

"""CUDA change detection and checkpoints: fingerprints computed on the device (only the
hashes cross to the host), and a sync of CUDA tensors (journal and whole-shard writes)."""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hotweights.changes import blocks
from hotweights.changes.blocks import TORCH, XXH3, changed, compare_bytes, fingerprint
from hotweights.checkpoint import finisher, sync
from hotweights.errors import FingerprintError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BS = 64  # small blocks keep every case tiny


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def test_cuda_fingerprints_match_the_cpu_torch_path():
    # The torch hash is device-independent (wrap-around sums): CUDA and CPU must agree.
    g = torch.Generator().manual_seed(2)
    cpu = {"a": torch.randn(100_003, generator=g).to(torch.bfloat16),
           "b": torch.randint(0, 9, (4097,), generator=g, dtype=torch.int32),
           "e": torch.zeros(0), "v": torch.randn(1001, generator=g).to(torch.bfloat16)[1:]}
    cuda = {n: t.cuda() for n, t in cpu.items()}
    for bs in (BS, blocks.DEFAULT_BLOCK_SIZE):
        on_gpu, on_cpu = fingerprint(cuda, block_size=bs), fingerprint(cpu, block_size=bs,
                                                                       kind=TORCH)
        assert on_gpu.kind == TORCH
        for n in cpu:
            assert np.array_equal(on_gpu.tensors[n][1], on_cpu.tensors[n][1]), (n, bs)
    new = {n: t.clone() for n, t in cuda.items()}
    _u8(new["a"])[70_000] ^= 1
    c = changed(fingerprint(cuda, block_size=BS), fingerprint(new, block_size=BS))
    assert c.tensors["a"].ranges.tolist() == [[69_952, 70_016]] and c.bytes_changed == BS
    assert compare_bytes("a", new["a"], _u8(cpu["a"]).numpy(), block_size=BS
                         ).ranges.tolist() == [[69_952, 70_016]]
    with pytest.raises(FingerprintError, match="a: xxh3_64 needs a CPU tensor"):
        fingerprint(cuda, kind=XXH3)


@pytest.mark.parametrize("mode", ["journal", "copy"])
def test_a_sync_of_cuda_tensors_writes_what_changed(tmp_path, mode):
    g = torch.Generator().manual_seed(3)
    live = {"model.embed_tokens.weight": torch.randn(512, 64, generator=g),
            "model.norm.weight": torch.randn(64, generator=g),
            "lm_head.weight": torch.randn(512, 64, generator=g)}
    live = {n: t.to(torch.bfloat16).cuda() for n, t in live.items()}
    first = sync(tmp_path, live, max_shard_size="100KB")
    assert first.first_save and len(list(tmp_path.glob("*.safetensors"))) > 1
    assert sync(tmp_path, live).bytes_compared == 0  # the sidecars hold torch fingerprints
    live["lm_head.weight"][7] += 1.0
    result = sync(tmp_path, live, mode=mode)
    finisher.finish()
    assert result.tensors_changed == 1 and result.bytes_compared == 0
    if mode == "journal":
        assert 0 < result.bytes_written <= blocks.DEFAULT_BLOCK_SIZE
    disk = {}
    for shard in tmp_path.glob("*.safetensors"):
        disk.update(load_file(shard))
    for n, t in live.items():
        assert torch.equal(disk[n].view(torch.int16), t.cpu().view(torch.int16)), n


def test_a_sync_waits_for_a_write_queued_on_a_side_stream(tmp_path):
    """An optimizer step still running on another stream when `sync` starts is what the
    checkpoint holds, not the bytes before it (the hashes run on the default stream)."""
    live = {"lm_head.weight": torch.zeros(512, 64, dtype=torch.bfloat16, device="cuda")}
    sync(tmp_path, live)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning before the write
        live["lm_head.weight"].add_(1)
    result = sync(tmp_path, live)
    finisher.finish()
    assert result.tensors_changed == 1
    disk = load_file(tmp_path / "model.safetensors")
    assert torch.equal(disk["lm_head.weight"], torch.ones(512, 64, dtype=torch.bfloat16))


def test_a_patched_shards_pages_from_cuda_tensors_equal_the_cpu_ones(tmp_path, monkeypatch):
    """`stage._write_pages` (a reflinked shard's changed pages): pages gathered on the
    device are the bytes the CPU path builds (tensors not on page boundaries, a tensor
    inside one page, batches of 1 page and of many)."""
    import os

    from hotweights.checkpoint import stage

    g = torch.Generator().manual_seed(4)
    old = torch.randint(0, 256, (5 * 4096 + 100,), generator=g, dtype=torch.uint8).numpy()
    spans = [(10, 9000), (9000, 9010), (9010, 5 * 4096 + 100)]
    cpu = [(a, b, torch.randint(0, 256, (b - a,), generator=g, dtype=torch.uint8))
           for a, b in spans]
    offsets = np.arange(0, 5 * 4096 + 100, 4096, dtype=np.int64)
    for batch in (4096, 1 << 20):
        monkeypatch.setattr(stage, "_DIRECT_BUFFER", batch)
        out = {}
        for device, live in (("cpu", cpu), ("cuda", [(a, b, t.cuda()) for a, b, t in cpu])):
            path = tmp_path / f"{device}-{batch}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT)
            try:
                stage._write_pages(fd, offsets, old, live)
            finally:
                os.close(fd)
            out[device] = path.read_bytes()
        assert len(out["cpu"]) == old.size and out["cuda"] == out["cpu"]

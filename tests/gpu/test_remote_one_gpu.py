"""The CUDA parts of the remote path that one GPU can run (the NCCL channel needs two:
`test_remote_nccl.py`): deltas encoded from the trainer's CUDA tensors, sent over a Gloo
channel, staged in pinned host memory by a stand-in worker whose weights are on the same GPU,
applied in place there; a TP worker's shard (strided runs of a tensor, slabs on the GPU)
written from pinned staging; and round digests of CUDA tensors equal to the CPU ones.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from test_remote_nccl import _sum

from hotweights.remote import delta, packing, signing
from hotweights.remote.channel import Channel
from hotweights.remote.shards import Shard
from hotweights.remote.staging import Staged
from hotweights.server.launch import free_port
from hotweights.testing import tiny

DEVICE = "cuda:0"  # a module constant so the same code can be tried on "cpu" without a GPU

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TOKEN = "a-shared-secret-token"
SHAPES = {"hidden": 256, "inter": 688, "kv": 64, "vocab": 512, "layers": 2, "scale": 0.02}

RECEIVER = textwrap.dedent('''
    import hashlib, json, sys, torch
    from hotweights.testing import tiny
    from hotweights.remote.channel import Channel
    from hotweights.remote import shards
    from hotweights.remote.staging import Staged
    port, token, device = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    shapes = json.loads(sys.argv[4])
    w = {k: v.to(device) for k, v in tiny.llama_tensors(**shapes).items()}
    specs = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in w.items()}
    addrs = {k: v.data_ptr() for k, v in w.items()}
    ch = Channel(master_addr="127.0.0.1", master_port=port, rank=1, world_size=2, token=token,
                 timeout=30.0, backend="gloo")
    held, keep = [], Staged._keep  # what staging holds: each piece's host copy
    Staged._keep = lambda self, v: held.append(keep(self, v)) or held[-1]
    for _ in range(2):
        held.clear()
        staged = Staged(specs, shards={k: shards.whole(v) for k, v in w.items()},
                        pin=device.startswith("cuda"))
        ch.receive(staged)
        pinned = bool(held) and all(v.is_pinned() for v in held) if staged.pin else None
        assert staged.apply_in_place()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        h = hashlib.sha256()
        for k in sorted(w):
            h.update(w[k].view(torch.int16).cpu().numpy().tobytes())
        print(json.dumps({"sum": h.hexdigest(), "bytes": ch.bytes_received, "pinned": pinned,
                          "moved": [k for k, v in w.items() if v.data_ptr() != addrs[k]],
                          "peak": staged.peak}), flush=True)
    ch.close()
''')


def test_cuda_deltas_staged_pinned_and_applied_in_place_on_the_gpu():
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), TOKEN, DEVICE,
                             json.dumps(SHAPES)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    old = {k: v.to(DEVICE) for k, v in tiny.llama_tensors(**SHAPES).items()}
    g = torch.Generator(device=DEVICE).manual_seed(0)
    rows = {k: v.clone() for k, v in old.items()}
    for t in rows.values():
        if t.dim() == 2:
            t[torch.randint(0, t.shape[0], (max(1, t.shape[0] // 100),), device=DEVICE,
                            generator=g)] += 0.5
    scattered = {k: v.clone() for k, v in rows.items()}
    for t in scattered.values():
        flat = t.view(-1)
        flat[torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), device=DEVICE,
                           generator=g)] += 0.5
    try:
        with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=2,
                     token=TOKEN, timeout=30.0, backend="gloo") as ch:
            sent = [ch.send(packing.pack(delta.encode_all(a, b), max_bytes=1 << 20))
                    for a, b in ((old, rows), (rows, scattered))]
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert proc.returncode == 0 and len(lines) == 2, err[-3000:]
    assert [x["sum"] for x in lines] == [_sum(rows), _sum(scattered)]
    assert all(x["moved"] == [] for x in lines)  # in place: the server's addresses stand
    if DEVICE.startswith("cuda"):
        assert all(x["pinned"] for x in lines)
    total = sum(t.numel() * t.element_size() for t in old.values())
    assert sent[0] < 0.03 * total and sent[1] < 0.08 * total, (sent, total)
    assert all(0 < x["peak"] < 0.5 * total for x in lines), (lines, total)  # not a model copy


def test_round_digests_of_cuda_tensors_equal_the_cpu_ones():
    key = signing.channel_key(TOKEN, "a-nonce")
    parts = (torch.arange(8, dtype=torch.int64), torch.arange(100, dtype=torch.uint8),
             torch.randn(1000).to(torch.bfloat16).view(torch.uint8))
    on_gpu = tuple(t.to(DEVICE) for t in parts)
    assert signing.round_digest(key, 3, on_gpu) == signing.round_digest(key, 3, parts)
    assert signing.round_digest(key, 4, on_gpu) != signing.round_digest(key, 3, parts)


@pytest.mark.parametrize("dim,runs", [(0, ((2, 3), (8, 4))), (1, ((0, 2), (5, 3)))])
def test_a_shard_on_the_gpu_is_written_from_pinned_staging(dim, runs):
    g = torch.Generator().manual_seed(dim)
    old = torch.randn(12, 9, generator=g).to(torch.bfloat16)
    new = old.clone()
    new[3] += 1  # a whole row
    new.view(-1)[torch.randint(0, new.numel(), (10,), generator=g)] += 0.5  # scattered
    for want in (new, torch.randn(12, 9, generator=g).to(torch.bfloat16)):  # rows/patch; dense
        slabs = tuple(old.narrow(dim, a, n).to(DEVICE) for a, n in runs)
        addrs = [s.data_ptr() for s in slabs]
        spec = {"t": torch.empty(old.shape, dtype=old.dtype, device="meta")}
        staged = Staged(spec, shards={"t": Shard(tuple(old.shape), dim, runs,
                                                  tuple((s,) for s in slabs))},
                        pin=DEVICE.startswith("cuda"))
        for r in packing.pack(delta.encode_all({"t": old}, {"t": want}), max_bytes=64):
            staged(r)
        assert staged.apply_in_place() == {"t"}
        for (a, n), s, addr in zip(runs, slabs, addrs, strict=True):
            assert s.data_ptr() == addr
            assert torch.equal(s.cpu().view(torch.int16), want.narrow(dim, a, n).view(torch.int16))

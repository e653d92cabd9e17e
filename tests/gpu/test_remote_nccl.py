"""NCCL path of `remote.channel`: CUDA delta rounds from a trainer to a plain PyTorch process
standing in for a remote server's worker (no vLLM on the GPU box), staged and applied in
place on its GPU. NCCL needs one GPU per rank: the test needs two devices.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hotweights.remote import delta, packing
from hotweights.remote.channel import Channel
from hotweights.server.launch import free_port
from hotweights.testing import tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason="NCCL needs one GPU per rank: the sender and a receiver"),
]

TOKEN = "a-shared-secret-token"

RECEIVER = textwrap.dedent('''
    import hashlib, json, sys, torch
    from hotweights.testing import tiny
    from hotweights.remote.channel import Channel
    from hotweights.remote import shards
    from hotweights.remote.staging import Staged
    torch.cuda.set_device(1)
    w = {k: v.cuda() for k, v in tiny.llama_tensors(hidden=256, inter=688, kv=64, vocab=512,
                                                      layers=2, scale=0.02).items()}
    specs = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in w.items()}
    ch = Channel(master_addr="127.0.0.1", master_port=int(sys.argv[1]), rank=1, world_size=2,
                 token=sys.argv[2], timeout=30.0, backend="nccl", device="cuda:1")
    for _ in range(2):
        staged = Staged(specs, shards={k: shards.whole(v) for k, v in w.items()}, pin=True)
        ch.receive(staged)  # held in pinned host memory
        assert staged.apply_in_place()  # every staged tensor, in place on the GPU
        h = hashlib.sha256()
        for k in sorted(w):
            h.update(w[k].view(torch.int16).cpu().numpy().tobytes())
        print(json.dumps({"sum": h.hexdigest(), "bytes": ch.bytes_received}), flush=True)
    ch.close()
''')


def _sum(w: dict) -> str:
    import hashlib
    h = hashlib.sha256()
    for k in sorted(w):
        h.update(w[k].view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()


def test_nccl_rounds_arrive_bit_identical_and_apply_in_place_on_the_gpu():
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), TOKEN],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    torch.cuda.set_device(0)
    old = {k: v.cuda() for k, v in tiny.llama_tensors(hidden=256, inter=688, kv=64, vocab=512,
                                                        layers=2, scale=0.02).items()}
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = {k: v.clone() for k, v in old.items()}
    for t in rows.values():
        if t.dim() == 2:
            t[torch.randint(0, t.shape[0], (max(1, t.shape[0] // 100),), device="cuda",
                            generator=g)] += 0.5
    scattered = {k: v.clone() for k, v in rows.items()}
    for t in scattered.values():
        flat = t.view(-1)
        flat[torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), device="cuda",
                           generator=g)] += 0.5
    with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=2, token=TOKEN,
                 timeout=30.0, backend="nccl", device="cuda:0") as ch:
        sent = [ch.send(packing.pack(delta.encode_all(a, b), max_bytes=1 << 20))
                for a, b in ((old, rows), (rows, scattered))]
    out, err = proc.communicate(timeout=120)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert proc.returncode == 0 and len(lines) == 2, err[-3000:]
    assert [x["sum"] for x in lines] == [_sum(rows), _sum(scattered)]
    total = sum(t.numel() * t.element_size() for t in old.values())
    assert sent[0] < 0.03 * total and sent[1] < 0.08 * total, (sent, total)

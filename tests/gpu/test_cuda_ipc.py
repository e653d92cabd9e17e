"""CUDA path: a plain PyTorch process stands in for the vLLM server (no vLLM on the GPU box).

The "server" holds vLLM-style merged tensors (qkv_proj, gate_up_proj, padded vocab) on
the GPU and exports them with `shm.share` (CUDA IPC handles + GPU UUID, no copy). The test
process (the trainer) attaches, builds the HF model of views on the GPU, trains in place,
and the server sees the change in its own tensors.
"""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from hotweights import build_hf_model, plan, verify_shared
from hotweights.protocol import shm
from hotweights.testing import tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SERVER = textwrap.dedent('''
    import json, sys, torch
    from transformers import AutoModelForCausalLM
    from hotweights import plan
    from hotweights.protocol import shm
    model_dir = sys.argv[1]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).state_dict()
    # vLLM's merged tensors, assembled from the HF ones (tp=1, vocab padded to 64)
    shapes = json.loads(sys.stdin.readline())
    layout = plan(model_dir, {n: tuple(s) for n, s in shapes.items()})
    merged = {n: torch.zeros(s, dtype=torch.bfloat16, device="cuda") for n, s in shapes.items()}
    for vname, pieces in layout.pieces.items():
        for p in pieces:
            merged[vname].narrow(p.dim, p.rows[0], p.rows[1] - p.rows[0]).copy_(hf[p.hf_name])
    manifest, _ = shm.share(merged, model=model_dir)
    print(manifest.to_json(), flush=True)
    for line in sys.stdin:  # "sum NAME" -> the server's own view of its tensor
        print(json.dumps(merged[line.split()[1]].float().sum().item()), flush=True)
''')


def _vllm_shapes(model_dir) -> dict[str, tuple[int, ...]]:
    return tiny.vllm_llama_shapes(tiny.make_config("llama", 300))


def test_trainer_trains_a_cuda_server_tensors_in_place(tmp_path):
    model_dir = tiny.build("llama", tmp_path / "llama")
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(model_dir)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        server.stdin.write(json.dumps(_vllm_shapes(model_dir)) + "\n")
        server.stdin.flush()
        manifest = shm.Manifest.from_json(server.stdout.readline(), source="server")
        assert manifest.gpu_uuid == str(torch.cuda.get_device_properties(0).uuid)
        assert all(isinstance(e.ipc, shm.CudaIpc) for e in manifest.tensors)
        tensors = shm.attach(manifest)
        layout = plan(model_dir, tensors)
        model, report = build_hf_model(model_dir, tensors, layout=layout,
                                       trainable=r"layers\.0\.")
        assert verify_shared(model, tensors, layout) == layout.num_mapped
        assert report.bytes_copied == 0 and next(model.parameters()).is_cuda

        name = "model.layers.0.self_attn.qkv_proj.weight"
        server.stdin.write(f"sum {name}\n")
        server.stdin.flush()
        before = json.loads(server.stdout.readline())
        ids = torch.tensor([[1, 5, 9, 20, 33]], device="cuda")
        model(ids, labels=ids).loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(0.01 * p.grad.sign())
        torch.cuda.synchronize()
        server.stdin.write(f"sum {name}\n")
        server.stdin.flush()
        after = json.loads(server.stdout.readline())
        assert after != before
        assert after == pytest.approx(tensors[name].float().sum().item(), rel=1e-3)
    finally:
        server.stdin.close()
        server.wait(timeout=60)


def test_unknown_gpu_is_named():
    manifest = shm.Manifest.from_dict(dict(
        format=shm.FORMAT, server_id="s", path="cuda:x", nbytes=0, gpu_uuid="GPU-nope",
        tensors=[dict(name="w", dtype="float32", shape=[1], offset=0, ipc=dict(
            stride=[1], storage_offset=0, handle="", storage_bytes=4, storage_offset_bytes=0,
            ref_counter_handle="", ref_counter_offset=0, event_handle=None,
            event_sync=False))]))
    with pytest.raises(shm.ManifestError, match=r"GPU GPU-nope of server s is not visible"):
        shm.attach(manifest)

"""Benchmark: an update of every weight of an ~8 B Llama, seen by the server through CUDA IPC
views, against the two-copy alternatives (a copy through IPC, an NCCL broadcast).

A stand-in server (this script in a child process, plain PyTorch: there is no vLLM on the
GPU machine) holds vLLM-style merged bf16 tensors (qkv_proj, gate_up_proj, vocab padded
to 64) of a Llama-3-8B-shaped model on the GPU and exports them with `shm.share` (CUDA IPC
handles, no copy). This process, the trainer, attaches and builds the HF model of views.
The "update" is an optimizer-step stand-in: `p.add_(1e-3)` on every HF parameter.

- update_ms: the update written in place through the views, then
  `torch.cuda.synchronize()`: the server's tensors hold it.
- ipc_copy_ms: the trainer keeps its own copy (an HF model of views on its own merged
  tensors, same layout): the update applied to it, then every merged tensor copied into the
  server's through the IPC mapping (`copy_`), then synchronize.
- nccl_bcast_ms: the update applied to the trainer's own copy, then every merged tensor
  broadcast over NCCL (torch.distributed, 2 ranks) to a receiving process on the second
  GPU, which holds a third copy; ends when the receiver has them all. NCCL refuses two ranks
  on one GPU: with one GPU it is null and named in `skipped`.
- speedup_vs_copy: ipc_copy_ms / update_ms; params_b: the server's parameters, billions.
- digest_gbps: what signing a remote update costs on a GPU: GB/s of `remote.signing`'s
  round digest over a CUDA round of the remote channel's default size (host copies + HMAC;
  each side of a channel hashes every round once).

Every figure is the best of --repeat rounds after a warm-up round. Once per method, outside
the timing, a further round is checked on the receiving side: the server's (or receiver's)
own bit-exact checksum of a tensor changed and equals the trainer's. Both baselines are
lower bounds for vLLM's engines: they copy merged tensors as they lie, without
`load_weights`' repacking of HF tensors.

GPU memory: the server's tensors (16 GB at the default size) plus, for the baselines, the
trainer's own copy (16 GB more), freed afterwards; the NCCL receiver holds its copy on the
second GPU. A part that cannot run here is named in `skipped` with the reason (a line on
stderr) and its figure is null; the others still run. Without a CUDA device nothing is
measured: every figure but params_b is null, `"skipped": {"cuda": "no CUDA device"}`, exit
0. The exit status is 1 only when the in-place update itself failed (or the stand-in server
did not start). See docs/gpu.md.

Run:  PYTHONPATH=src python3 benchmarks/gpu_update.py [--layers 32] [--repeat 5]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

from _survive import Skips, died_of, reason

# Llama-3-8B's shapes; --layers scales the depth (every size is derived from this config).
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 vocab_size=128256, tie_word_embeddings=False, rms_norm_eps=1e-5,
                 rope_theta=500000.0, max_position_embeddings=8192)
KEYS = ("params_b", "update_ms", "ipc_copy_ms", "nccl_bcast_ms", "speedup_vs_copy",
        "digest_gbps")
DELTA = 1e-3  # the update: moves every bf16 weight below ~0.25 (they are ~ N(0, 0.02))
TIMEOUT_S = 120  # torch.distributed: a rendezvous or collective this long has hung


def llama_config(layers: int | None = None, **dims):
    """The transformers LlamaConfig of the stand-in: LLAMA3_8B, `layers` deep, `dims` over."""
    from transformers import LlamaConfig

    kwargs = dict(LLAMA3_8B, **dims)
    if layers is not None:
        kwargs["num_hidden_layers"] = layers
    return LlamaConfig(**kwargs)


def vllm_shapes(config) -> dict[str, tuple[int, ...]]:
    """vLLM's parameters of the stand-in at tp=1 (`tiny.vllm_llama_shapes`)."""
    from hotweights.testing.tiny import vllm_llama_shapes

    return vllm_llama_shapes(config)


def numel(shapes: dict[str, tuple[int, ...]]) -> int:
    return sum(math.prod(shape) for shape in shapes.values())


def checksum(t) -> int:
    """Bit-exact: the sum of the tensor's 16-bit words (bf16 bytes, not values)."""
    import torch

    return int(t.detach().reshape(-1).view(torch.int16).to(torch.int64).sum())


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _allocate(shapes: dict, device: str, *, seed: int | None) -> dict:
    import torch

    out = {n: torch.empty(s, dtype=torch.bfloat16, device=device) for n, s in shapes.items()}
    if seed is not None:
        g = torch.Generator(device=device).manual_seed(seed)
        for t in out.values():
            t.normal_(0.0, 0.02, generator=g)
    return out


def _read_json(proc: subprocess.Popen, who: str):
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the {who} exited ({died_of(proc.wait())}) before answering; "
                           "its stderr is above")
    return json.loads(line)


def _ask(proc: subprocess.Popen, who: str, message: dict):
    proc.stdin.write(json.dumps(message) + "\n")
    proc.stdin.flush()
    return _read_json(proc, who)


@contextlib.contextmanager
def child(mode: str, first: dict, who: str) -> Iterator[subprocess.Popen]:
    """This script in `mode` (--serve, --receive), given `first` as its first stdin line;
    always stopped: stdin closed (it exits at EOF), killed if it does not."""
    proc = subprocess.Popen([sys.executable, __file__, mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        proc.stdin.write(json.dumps(first) + "\n")
        proc.stdin.flush()
        yield proc
    finally:
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            print(f"the {who} did not exit; killing it", file=sys.stderr)
            proc.kill()
            proc.wait()


def serve_child() -> int:
    """Child mode: the stand-in server. Stdin: {"shapes", "device", "seed"}, then requests
    {"sum": NAME} answered with its own checksum of that tensor; stdout: the manifest
    first. Exits at EOF."""
    import torch

    from hotweights.protocol import shm

    spec = json.loads(sys.stdin.readline())
    device = spec["device"]
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    merged = _allocate(spec["shapes"], device, seed=spec["seed"])
    manifest, merged = shm.share(merged, model="gpu_update stand-in")
    try:
        print(manifest.to_json(), flush=True)
        for line in sys.stdin:
            _sync(device)
            print(json.dumps(checksum(merged[json.loads(line)["sum"]])), flush=True)
    finally:
        shm.release(manifest)
    return 0


def receive_child() -> int:
    """Child mode: the NCCL (gloo on CPU) receiver, rank 1. Stdin: {"shapes", "device",
    "port", "backend", "rounds", "check"}; stdout: its checksums of `check` after the last
    round."""
    import torch
    import torch.distributed as dist

    spec = json.loads(sys.stdin.readline())
    device = spec["device"]
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    merged = _allocate(spec["shapes"], device, seed=None)
    done = torch.zeros(1, device=device)
    dist.init_process_group(spec["backend"], init_method=f"tcp://127.0.0.1:{spec['port']}",
                            rank=1, world_size=2, timeout=timedelta(seconds=TIMEOUT_S))
    try:
        for _ in range(spec["rounds"]):
            for t in merged.values():
                dist.broadcast(t, src=0)
            dist.all_reduce(done)  # the sender's end of a round: all of it has arrived
        _sync(device)
        print(json.dumps({n: checksum(merged[n]) for n in spec["check"]}), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def best_ms(repeat: int, step: Callable[[], None], device: str) -> float:
    """The fastest of `repeat` timed calls of `step` (+ synchronize), after a warm-up."""
    times = []
    for i in range(1 + repeat):  # round 0 warms up: kernels, NCCL's communicator
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        if i:
            times.append(1e3 * (time.perf_counter() - start))
    return min(times)


def update(model) -> None:
    """The optimizer-step stand-in: every HF parameter moves by DELTA, in place."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.add_(DELTA)


def verified(server: subprocess.Popen, name: str, step: Callable[[], None], device: str,
             expected) -> None:
    """One more `step`, untimed: the server's own checksum of `name` must have changed and
    equal `expected`'s (the tensor the trainer wrote)."""
    before = _ask(server, "server", {"sum": name})
    step()
    _sync(device)
    after, want = _ask(server, "server", {"sum": name}), checksum(expected)
    if after == before or after != want:
        raise RuntimeError(f"{name}: the server's checksum is {after} (before the update "
                           f"{before}), the trainer's {want}: the update is not visible")


def in_place_ms(model, tensors: dict, server, name: str, repeat: int, device: str) -> float:
    ms = best_ms(repeat, lambda: update(model), device)
    verified(server, name, lambda: update(model), device, tensors[name])
    return ms


def trainer_copy(config, layout, tensors: dict):
    """The trainer's own copy of the server's tensors, and its HF model of views on it."""
    from hotweights import build_hf_model

    own = {n: t.clone() for n, t in tensors.items()}
    model, _ = build_hf_model(config, own, layout=layout, trainable=False)
    return own, model


def ipc_copy_ms(own: dict, own_model, tensors: dict, server, name: str, repeat: int,
                device: str) -> float:
    def step() -> None:
        update(own_model)
        for n, t in own.items():
            tensors[n].copy_(t)

    ms = best_ms(repeat, step, device)
    verified(server, name, step, device, own[name])
    return ms


def nccl_bcast_ms(own: dict, own_model, name: str, repeat: int, device: str) -> float:
    """Rank 0 broadcasts its updated copy to a receiver on the next GPU (NCCL; gloo where
    no CUDA)."""
    import torch
    import torch.distributed as dist

    from hotweights.server.launch import free_port

    cuda = device.startswith("cuda")
    port = free_port()
    spec = dict(shapes={n: list(t.shape) for n, t in own.items()}, port=port, rounds=1 + repeat,
                device=f"cuda:{torch.device(device).index + 1}" if cuda else "cpu",
                backend="nccl" if cuda else "gloo", check=[name])
    with child("--receive", spec, "receiver") as receiver:
        dist.init_process_group(spec["backend"], init_method=f"tcp://127.0.0.1:{port}",
                                rank=0, world_size=2, timeout=timedelta(seconds=TIMEOUT_S))
        try:
            done = torch.zeros(1, device=device)

            def step() -> None:
                update(own_model)
                for t in own.values():
                    dist.broadcast(t, src=0)
                dist.all_reduce(done)  # ends when the receiver has every tensor

            ms = best_ms(repeat, step, device)
        finally:
            dist.destroy_process_group()
        got, want = _read_json(receiver, "receiver")[name], checksum(own[name])
    if got != want:
        raise RuntimeError(f"{name}: the receiver's checksum is {got}, the trainer's {want}")
    return ms


def digest_gbps(repeat: int, device: str) -> float:
    """GB/s of the round digest over a round of the remote channel's default size on
    `device`, best of `repeat` after a warm-up."""
    import torch

    from hotweights.remote import signing
    from hotweights.remote.group import ROUND_BYTES

    buf = torch.randint(0, 256, (ROUND_BYTES,), dtype=torch.uint8, device=device)
    key = signing.channel_key("benchmark", "nonce")
    ms = best_ms(repeat, lambda: signing.round_digest(key, 0, (buf,)), device)
    return ROUND_BYTES / ms / 1e6


def measure(config, *, repeat: int, device: str, skips: Skips) -> dict:
    """The figures (ms) of the three methods on `device`; None where a part failed (named
    in `skips`)."""
    import torch

    from hotweights import build_hf_model, plan
    from hotweights.protocol import shm

    shapes = vllm_shapes(config)
    gb = 2 * numel(shapes) / 1e9
    name = next(n for n in shapes if n.endswith("qkv_proj.weight"))
    out = dict.fromkeys(("update_ms", "ipc_copy_ms", "nccl_bcast_ms"))
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(device)
        print(f"device: {torch.cuda.get_device_name(device)}, {torch.cuda.device_count()} "
              "visible", flush=True)
    start = time.perf_counter()
    try:
        with child("--serve", dict(shapes=shapes, device=device, seed=0), "server") as server:
            manifest = shm.Manifest.from_dict(_read_json(server, "server"), source="server")
            tensors = shm.attach(manifest)
            layout = plan(config, tensors)
            model, report = build_hf_model(config, tensors, layout=layout, trainable=False)
            if report.bytes_copied:
                raise RuntimeError(f"the view model copied {report.bytes_copied} bytes")
            print(f"server: {numel(shapes) / 1e9:.2f} B parameters ({gb:.1f} GB bf16, "
                  f"{len(shapes)} tensors) on {device}; trainer attached, "
                  f"{layout.num_mapped} HF parameters are views ({time.perf_counter() - start:.1f}"
                  " s)", flush=True)

            out["update_ms"] = skips.attempt("update", in_place_ms, model, tensors, server,
                                             name, repeat, device)
            if out["update_ms"] is not None:
                print(f"in place through the views: {out['update_ms']:.1f} ms "
                      f"({2e3 * gb / out['update_ms']:.0f} GB/s read+written), the server "
                      "sees it", flush=True)
            del model

            copy = skips.attempt("ipc_copy", trainer_copy, config, layout, tensors)
            if copy is None:
                skips.add("nccl_bcast", "needs the trainer's own copy (see ipc_copy)")
            else:
                own, own_model = copy
                out["ipc_copy_ms"] = skips.attempt("ipc_copy", ipc_copy_ms, own, own_model,
                                                   tensors, server, name, repeat, device)
                if out["ipc_copy_ms"] is not None:
                    print(f"own copy, updated, copied through IPC: {out['ipc_copy_ms']:.1f} "
                          "ms", flush=True)
                if cuda and torch.cuda.device_count() < 2:
                    skips.add("nccl_bcast", "NCCL needs one GPU per rank (it refuses two "
                              f"ranks on one device); {torch.cuda.device_count()} visible")
                else:
                    out["nccl_bcast_ms"] = skips.attempt("nccl_bcast", nccl_bcast_ms, own,
                                                         own_model, name, repeat, device)
                if out["nccl_bcast_ms"] is not None:
                    print(f"own copy, updated, broadcast to a receiver: "
                          f"{out['nccl_bcast_ms']:.1f} ms", flush=True)
                del own, own_model, copy
            # drop every IPC mapping before the server exits
            del tensors
            gc.collect()
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001 - named and reported; the JSON still comes
        skips.add("server", reason(e))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Progress is printed; the last stdout line is JSON.")
    parser.add_argument("--layers", type=int, default=LLAMA3_8B["num_hidden_layers"],
                        help="decoder layers of the Llama-3-8B-shaped stand-in; fewer for a "
                        "smaller GPU or a quick run (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="timed rounds per method, after a warm-up; the best is "
                        "reported (default: %(default)s)")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # child
    parser.add_argument("--receive", action="store_true", help=argparse.SUPPRESS)  # modes
    args = parser.parse_args(argv)
    if args.serve:
        return serve_child()
    if args.receive:
        return receive_child()
    if args.layers < 1 or args.repeat < 1:
        parser.error("--layers and --repeat need at least 1")

    config = llama_config(args.layers)
    skips = Skips()
    out = dict.fromkeys(KEYS)
    out["params_b"] = round(numel(vllm_shapes(config)) / 1e9, 3)
    import torch

    if not torch.cuda.is_available():
        print(f"no CUDA device: nothing measured ({out['params_b']} B parameters would "
              "have been)")
        skips.add("cuda", "no CUDA device")
    else:
        ms = measure(config, repeat=args.repeat, device="cuda:0", skips=skips)
        out |= {k: None if v is None else round(v, 2) for k, v in ms.items()}
        out["digest_gbps"] = skips.attempt("digest", digest_gbps, args.repeat, "cuda:0")
        if out["digest_gbps"] is not None:
            out["digest_gbps"] = round(out["digest_gbps"], 2)
            print(f"round digest (signing) of a CUDA round: {out['digest_gbps']} GB/s",
                  flush=True)
    if out["update_ms"] and out["ipc_copy_ms"]:
        out["speedup_vs_copy"] = round(out["ipc_copy_ms"] / out["update_ms"], 2)
    print(json.dumps(out | {"skipped": skips.reasons}))
    return 1 if {"server", "update"} & set(skips.reasons) else 0


if __name__ == "__main__":
    sys.exit(main())

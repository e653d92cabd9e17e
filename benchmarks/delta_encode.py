"""Benchmark: `delta` encode, pack and apply on a Llama-like bf16 state dict (~200 MB), CPU.

Four updates of the same weights, each encoded against the old weights, packed into rounds
through one reused staging buffer and applied to a receiver's copy (checked bit-exact):

- rows: 1 % of each matrix's rows (at least one), scattered, every element of them changed;
- scattered: 1 % of each tensor's elements at random (RL-like), the lowest bit flipped;
- step: as scattered, each moved by one or two units in its last place (an optimizer step
  rounded to bf16: the xors' bit lengths spread, coded in unary, `codec`);
- full: every element changed (dense).

Each update is packed three ways, side by side: ``raw`` (the default: compact patches, raw
values), ``xor`` (``values="xor"``) and ``xor+zstd`` (also ``compress="zstd"``, needs the
zstd extra; skipped without it). Each phase's time is the best of --repeat runs (the CI
machine is shared and noisy): encode (compare, shared by the three), pack (compact coding
and compression included) and apply (decompress, decode, check, write). Bytes are on the
wire (headers + buffers) against the weights' bytes. The last line is one JSON object:
{"model_bytes", "max_bytes", then per update U in rows, scattered, step, full, and option
O in raw, xor, xor+zstd: "U_O_bytes", "U_O_ratio", "U_O_rounds", "U_encode_s",
"U_O_pack_s", "U_O_apply_s", "U_O_gbps" (weight bytes / (encode + pack + apply)), and the
cost of the keyed digest a channel puts on every round (`remote.signing`, on the full
update's raw rounds, one side): "digest_gbps" (bytes hashed per second) and
"digest_pct_of_full" (its time over the full update's encode + pack + apply; sender and
receiver each pay it)}.

Run:  .venv/bin/python benchmarks/delta_encode.py [--layers 3] [--max-mb 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time

import torch

from hotweights.remote import delta, delta_apply, signing
from hotweights.remote.packing import pack
from hotweights.testing import tiny

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(_BITS[t.dtype.itemsize])


def changed(old: dict, how: str, g: torch.Generator) -> dict:
    """A copy of `old` with the lowest bit of the chosen elements flipped."""
    new = {}
    for n, t in old.items():
        u = t.clone()
        if how == "full":
            bits(u).bitwise_xor_(1)
        elif how in ("scattered", "step"):
            idx = torch.randint(0, t.numel(), (t.numel() // 100,), generator=g)
            if how == "step":
                bits(u)[idx] += torch.randint(1, 3, idx.shape, generator=g).to(bits(u).dtype)
            else:
                bits(u)[idx] ^= 1
        elif t.dim() >= 2:
            pick = torch.randint(0, t.shape[0], (max(1, t.shape[0] // 100),), generator=g)
            bits(u).view(t.shape[0], -1)[pick] ^= 1
        new[n] = u
    return new


OPTIONS = {"raw": {}, "xor": {"values": "xor"}, "xor+zstd": {"values": "xor", "compress": "zstd"}}


def run(old: dict, new: dict, receiver: dict, max_bytes: int, options: dict) -> dict:
    """Encode, pack and apply one update; returns its figures."""
    t0 = time.perf_counter()
    deltas = delta.encode_all(old, new)
    t1 = time.perf_counter()
    staging = torch.empty(max_bytes, dtype=torch.uint8)
    pack_s = apply_s = digest_s = 0.0
    key = signing.channel_key("benchmark-token", "nonce")
    nbytes = rounds = 0
    t = time.perf_counter()
    it = pack(deltas, max_bytes=max_bytes, staging=staging, **options)
    pack_s += time.perf_counter() - t  # compact patches are coded here
    while True:
        t = time.perf_counter()
        r = next(it, None)
        pack_s += time.perf_counter() - t
        if r is None:
            break
        t = time.perf_counter()
        head = torch.frombuffer(bytearray(r.header_bytes()), dtype=torch.uint8)
        meta = torch.tensor([head.numel(), r.buffer.numel(), r.header["round"],
                             r.header["rounds"]])
        signing.round_digest(key, 0, (meta, head, r.buffer))
        digest_s += time.perf_counter() - t
        t = time.perf_counter()
        delta_apply.apply(r, receiver)
        apply_s += time.perf_counter() - t
        nbytes, rounds = nbytes + r.wire_bytes, rounds + 1
    if not all(torch.equal(bits(receiver[n]), bits(new[n])) for n in new):
        raise SystemExit("error: the receiver does not hold the new weights")
    kinds = {k: sum(d.kind == k for d in deltas) for k in delta.KINDS}
    return {"bytes": nbytes, "rounds": rounds, "encode_s": t1 - t0, "pack_s": pack_s,
            "apply_s": apply_s, "digest_s": digest_s, "kinds": kinds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--kv", type=int, default=256, help="rows of k_proj and v_proj")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--max-mb", type=int, default=64, help="staging budget per round, MiB")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    old = tiny.llama_tensors(hidden=args.hidden, inter=args.inter, kv=args.kv,
                             vocab=args.vocab, layers=args.layers)
    model_bytes, max_bytes = sum(t.nbytes for t in old.values()), args.max_mb << 20
    receiver = {n: t.clone() for n, t in old.items()}
    out, g = {"model_bytes": model_bytes, "max_bytes": max_bytes}, torch.Generator()
    g.manual_seed(1)
    options = dict(OPTIONS)
    if importlib.util.find_spec("zstandard") is None:
        print("note: zstandard is not installed (the zstd extra): xor+zstd skipped")
        del options["xor+zstd"]
    for how in ("rows", "scattered", "step", "full"):
        new = changed(old, how, g)
        encode_s = []
        for label, opts in options.items():
            runs = []
            for _ in range(args.repeat):
                for n, t in receiver.items():
                    t.copy_(old[n])
                runs.append(run(old, new, receiver, max_bytes, opts))
            f = {**runs[0], **{k: min(r[k] for r in runs)
                               for k in ("encode_s", "pack_s", "apply_s", "digest_s")}}
            encode_s.append(f["encode_s"])
            total = f["encode_s"] + f["pack_s"] + f["apply_s"]
            print(f"{how:9s} {label:8s} {f['bytes'] / model_bytes:7.2%} of "
                  f"{model_bytes / 1e6:.0f} MB in {f['rounds']} rounds; encode "
                  f"{f['encode_s']:.3f} s, pack {f['pack_s']:.3f} s, apply {f['apply_s']:.3f} s;"
                  f" kinds {f['kinds']}", flush=True)
            u = f"{how}_{label}"
            out.update({f"{u}_bytes": f["bytes"], f"{u}_ratio": round(f["bytes"] / model_bytes,
                                                                      5),
                        f"{u}_rounds": f["rounds"], f"{u}_pack_s": round(f["pack_s"], 4),
                        f"{u}_apply_s": round(f["apply_s"], 4),
                        f"{u}_gbps": round(model_bytes / total / 1e9, 3)})
            if u == "full_raw":
                print(f"digest   {f['bytes'] / f['digest_s'] / 1e9:.2f} GB/s (HMAC-SHA256), "
                      f"{f['digest_s']:.3f} s: {f['digest_s'] / total:.1%} of the full "
                      "update's encode + pack + apply, on each side", flush=True)
                out.update({"digest_gbps": round(f["bytes"] / f["digest_s"] / 1e9, 3),
                            "digest_pct_of_full": round(100 * f["digest_s"] / total, 2)})
        out[f"{how}_encode_s"] = round(min(encode_s), 4)
        del new
    print(json.dumps(out))


if __name__ == "__main__":
    main()

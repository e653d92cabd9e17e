"""Benchmark: `blocks.fingerprint` against the raw xxh3 rate of the same bytes, in one run.

One buffer of random bytes (256 MB by default) is hashed:

- raw: `xxhash.xxh3_64_intdigest` over the whole buffer in one call (the machine's
  single-core xxh3 rate, the ceiling), and one call per block at 4 KiB, 64 KiB and 1 MiB;
- blocks: `blocks.fingerprint` of the same bytes seen as 8 bf16 tensors (views, no copy)
  at the default block size, with the xxh3 kind and with the torch kind on the CPU
  (the torch kind is meant for CUDA; on the CPU it is informational);
- compare: `blocks.compare_bytes` of each tensor against a copy of its bytes (the
  no-sidecar fallback).

Every figure is the best of --repeat runs. The last line is one JSON object:
{"bytes", "block_size", "xxh3_gbps", "xxh3_block_gbps": {size: gbps}, "fingerprint_gbps",
"fingerprint_vs_xxh3", "torch_cpu_gbps", "compare_gbps"}.

Run:  .venv/bin/python benchmarks/blocks.py [--mb 256] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import xxhash

from hotweights.changes import blocks


def best(fn, repeat: int) -> float:
    """Best wall time of `repeat` calls of `fn`, in seconds."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="buffer size in MB (10**6 bytes)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n = args.mb * 10**6 // 16 * 16  # whole bf16 values in 8 tensors
    buf = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    mv, bs = memoryview(buf), blocks.DEFAULT_BLOCK_SIZE
    gbps = lambda s: n / s / 1e9  # noqa: E731

    xxh3 = gbps(best(lambda: xxhash.xxh3_64_intdigest(mv), args.repeat))
    per_block = {}
    for size in (4 << 10, 64 << 10, 1 << 20):
        h = xxhash.xxh3_64_intdigest
        per_block[f"{size >> 10}KiB"] = gbps(best(
            lambda size=size, h=h: [h(mv[o:o + size]) for o in range(0, n, size)], args.repeat))

    flat = torch.from_numpy(buf).view(torch.bfloat16)  # shares buf's memory
    tensors = {f"t{i}": t for i, t in enumerate(flat.chunk(8))}
    fp = gbps(best(lambda: blocks.fingerprint(tensors, kind=blocks.XXH3), args.repeat))
    torch_cpu = gbps(best(lambda: blocks.fingerprint(tensors, kind=blocks.TORCH), 1))
    disk = buf.copy()  # stands for the file's bytes
    offsets = np.cumsum([0] + [t.numel() * 2 for t in tensors.values()])
    compare = gbps(best(lambda: [blocks.compare_bytes(name, t, disk[offsets[i]:offsets[i + 1]])
                                 for i, (name, t) in enumerate(tensors.items())], args.repeat))

    print(f"bytes: {n:,}  block size: {bs >> 10} KiB  threads: {torch.get_num_threads()}")
    print(f"xxh3, one call over the buffer     {xxh3:6.2f} GB/s")
    for size, rate in per_block.items():
        print(f"xxh3, one call per {size:>7} block  {rate:6.2f} GB/s  ({rate / xxh3:.0%})")
    print(f"blocks.fingerprint (xxh3_64)       {fp:6.2f} GB/s  ({fp / xxh3:.0%} of raw xxh3)")
    print(f"blocks.fingerprint (torch, CPU)    {torch_cpu:6.2f} GB/s  (meant for CUDA)")
    print(f"blocks.compare_bytes               {compare:6.2f} GB/s")
    print(json.dumps({"bytes": n, "block_size": bs, "xxh3_gbps": round(xxh3, 3),
                      "xxh3_block_gbps": {k: round(v, 3) for k, v in per_block.items()},
                      "fingerprint_gbps": round(fp, 3), "fingerprint_vs_xxh3": round(fp / xxh3, 3),
                      "torch_cpu_gbps": round(torch_cpu, 3), "compare_gbps": round(compare, 3)}))


if __name__ == "__main__":
    main()

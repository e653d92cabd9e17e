"""Benchmark: where a trainer keeps the old values that remote deltas are computed against.

`RemoteGroup` must know what the servers hold to send only what changed. Three options,
measured side by side in one run on the same model and the same changes (no servers needed:
what goes on the wire is what `packing.pack` would put there, its headers included):

- **snapshot** (the default, `RemoteGroup.reference`): a host copy of what the servers
  hold. Exact element deltas. Extra memory: one copy of the weights, in this process.
- **checkpoint**: the last synced checkpoint on disk, read through a memory map. The same
  exact deltas, but only while the checkpoint holds exactly the servers' version (a
  checkpoint some steps behind gives wrong deltas: an element that changed and changed
  back is missing), so it must be synced at every update: its time is counted. Extra
  memory: none of this process's own (the page cache, shared and reclaimable).
- **fingerprints**: per-block hashes of what the servers hold (`hotweights.changes.blocks`);
  every changed block is sent whole. Extra memory: 8 bytes per block.

Scenarios, each on the same bf16 model (built with `tiny.build` as in
`remote_update.py`), a fresh change per run, the lowest bit flipped: (rows) every element
of 1 % of the rows of every 2-D tensor; (scattered) 1 % of the elements of every tensor, at
random (an RL step in bf16). Seconds are the trainer's work before sending (encode against
the reference, plus the checkpoint sync or the fingerprinting), best of --repeat.

The last line is JSON: per option and scenario the bytes sent (% of the model), the
trainer's seconds and its extra memory (% of the model).

Run:  .venv/bin/python benchmarks/remote_reference.py [--size-mb 500] [--repeat 3]
      [--model-dir /tmp/hotweights-bench-remote/llama-500mb] [--block-kb 4 64]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from hotweights.changes import blocks
from hotweights.checkpoint import sync
from hotweights.checkpoint.source import open_dir
from hotweights.remote import delta, packing
from hotweights.testing import tiny
from remote_update import HEAD_DIM, HEADS, HIDDEN, INTER, KV_HEADS, change, layers_for, load_weights

ROUND = 64 << 20


def wire(deltas: list) -> int:
    """Bytes `packing.pack` puts on the wire (headers and buffers)."""
    return sum(r.wire_bytes for r in packing.pack(deltas, max_bytes=ROUND))


def block_wire(weights: dict, changes: blocks.Changes) -> int:
    """Bytes on the wire for every changed block sent whole: each byte range a dense element
    range, framed as `packing.pack` frames one (a header entry per piece, with "start" and
    "stop", and each round's header), buffers included."""
    deltas, where = [], []  # where: each range's tensor shape and first element
    for name, c in changes.tensors.items():
        t = weights[name]
        s = t.element_size()
        for a, b in c.ranges.tolist():
            deltas.append(delta.dense(name, t.view(-1)[a // s:b // s]))
            where.append((list(t.shape), a // s))
    total, k = 0, -1
    for r in packing.pack(deltas, max_bytes=ROUND):
        for e in r.header["entries"]:  # the slice's entry as the whole tensor's would read
            k += e["start"] == 0  # a range's first piece (later ones go on where it ended)
            shape, at = where[k]
            e.update(shape=shape, start=e["start"] + at, stop=e["stop"] + at)
        total += r.wire_bytes
    return total


def diff(old: blocks.Fingerprints, weights: dict) -> blocks.Changes:
    return blocks.changed(old, blocks.fingerprint(weights, block_size=old.block_size))


def best(fn, repeat: int):
    times, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=500, help="model size, MB (10**6 bytes)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per measure (best)")
    ap.add_argument("--model-dir", default=None, help="where the model is built (default: "
                    "/tmp/hotweights-bench-remote/llama-<size>mb)")
    ap.add_argument("--block-kb", type=int, nargs="+", default=[4, 64],
                    help="fingerprint block sizes, KiB")
    args = ap.parse_args()
    model_dir = Path(args.model_dir or f"/tmp/hotweights-bench-remote/llama-{args.size_mb:g}mb")
    tiny.build("llama", model_dir, hidden_size=HIDDEN, intermediate_size=INTER,
               num_hidden_layers=layers_for(args.size_mb), num_attention_heads=HEADS,
               num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM)
    weights = load_weights(model_dir)
    model_bytes = sum(t.nbytes for t in weights.values())
    print(f"model: {model_bytes:,} bytes, {len(weights)} tensors ({model_dir}); "
          f"torch threads {torch.get_num_threads()}; repeat {args.repeat}")
    work = Path(tempfile.mkdtemp(prefix="hotweights-bench-ref-"))
    ckpt = work / "ckpt"
    shutil.copytree(model_dir, ckpt)  # the checkpoint that follows the servers' version
    g = torch.Generator().manual_seed(0)
    out: dict = {"model_bytes": model_bytes}
    try:
        for how in ("rows", "scattered"):
            snapshot = {k: t.clone() for k, t in weights.items()}  # what the servers hold
            sync(ckpt, snapshot, version="0")
            change(weights, how, g)
            row = out.setdefault(how, {})

            s, deltas = best(partial(delta.encode_all, snapshot, weights), args.repeat)
            row["snapshot"] = dict(bytes=wire(deltas), s=s, memory=model_bytes)

            s, deltas = best(partial(delta.encode_all, open_dir(ckpt), weights), args.repeat)
            # syncing the new version into the checkpoint, for the next update's reference
            # (once: a second sync would find nothing to write)
            synced = sync(ckpt, weights, version="1")
            row["checkpoint"] = dict(bytes=wire(deltas), s=s + synced.seconds, memory=0,
                                     sync_s=synced.seconds, sync_written=synced.bytes_written)

            for kb in args.block_kb:
                bs = kb << 10
                old = blocks.fingerprint(snapshot, block_size=bs)
                s, changes = best(partial(diff, old, weights), args.repeat)
                row[f"fingerprints_{kb}k"] = dict(
                    bytes=block_wire(weights, changes), s=s,
                    memory=sum(8 * len(h) for _, h in old.tensors.values()))

            print(f"({how})")
            for name, r in row.items():
                extra = (f"  (sync {r['sync_s']:.3f} s, {r['sync_written']:,} B written)"
                         if "sync_s" in r else "")
                print(f"  {name:16} sent {r['bytes'] / model_bytes:7.2%}  trainer "
                      f"{r['s']:6.3f} s  extra memory {r['memory'] / model_bytes:7.2%}{extra}")
            del snapshot
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({how: {name: {"sent_pct": round(100 * r["bytes"] / model_bytes, 3),
                                   "trainer_s": round(r["s"], 3),
                                   "memory_pct": round(100 * r["memory"] / model_bytes, 3)}
                            for name, r in row.items()}
                      for how, row in out.items() if how != "model_bytes"}))


if __name__ == "__main__":
    main()

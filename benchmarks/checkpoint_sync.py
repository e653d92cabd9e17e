"""Benchmark: `checkpoint.sync` against the seed algorithm and a full safetensors rewrite.

A Llama-shaped bf16 state dict (~--size-gb GB, random values; dims derived from the size)
is saved as 4 safetensors shards with a `model.safetensors.index.json`. Each method has
its own copy of that directory:

- hotweights: `sync(dir, live, mode=--mode)`, timed in its steady state (a warm-up sync of
  the unchanged model writes the sidecars first, timed apart, not in any scenario), on
  live tensors that the scenario changes in place (only the differing elements written,
  untimed, as a trainer's step). The process's write watch (on by default) tells which
  pages were written; only those are hashed. Where this machine cannot watch writes, it
  hashes every byte (the reason is printed);
- hashed: the same without the watch (`watch=False`), on a fresh state dict: every byte
  hashed and compared with the sidecars;
- named: that, told which tensors the scenario may have changed (`changed=`, as a trainer
  passes the parameters its optimizer steps): only those are hashed;
- seed: the seed algorithm, reimplemented: per tensor a host copy (`.cpu().clone()`), a
  Python loop comparing the file's bytes with it per 4 KB block (bytes slices), differing
  blocks written in place through an mmap of the shard, `flush` (msync) per shard;
- full: `safetensors.torch.save_file` of every shard's tensors to a temp file, fsync,
  rename over the shard, fsync of the directory (what a user does with save_pretrained).

Scenarios, each from the same old content: (a) 1 % of rows changed in a few tensors,
(b) two whole decoder layers changed, (c) 1 % of elements changed at random in every
tensor (an RL step in bf16), (d) nothing changed. Before every timed run each directory
holds the old content (hotweights and seed put it back with their own method, untimed),
`os.sync()` has flushed every dirty page and the shards have been read (page cache warm for
every method); every method pays its own fsync. Also timed: a full in-place write of every
tensor right after a watch's scan against the same write to unwatched ones (the faults
the watch costs a trainer's step). hotweights frees a replaced shard's blocks
in a background thread after its commit (the timer stops when `sync` returns); the full
rewrite frees them inside its rename. Each timing is the median of --repeat
runs; after the first run of each method the directory's tensors are checked (safetensors
load, all tensors) to equal the live ones, so a wrong fast path cannot look good.

changed bytes: the bytes of the blocks that differ at hotweights' block size
(`blocks.DEFAULT_BLOCK_SIZE`, per tensor as `sync` cuts them), and the exact changed
element bytes. hash: single-core `xxhash.xxh3_64` over the model's tensors (one call per
contiguous tensor), the ceiling for change detection.

The last line is one JSON object: {"model_bytes", "changed_bytes", "written_bytes",
"speedup_vs_seed", "speedup_vs_full" (these five for scenario (a)),
"scattered_speedup_vs_full" (c), "nochange_gbps" (d), "hash_gbps", "nochange_vs_hash",
"hashed_speedup_vs_seed", "hashed_speedup_vs_full" (a, `watch=False`), "hashed_nochange_vs_hash"
(d, `watch=False`), "named_speedup_vs_seed", "named_speedup_vs_full" (a, `changed=`),
"watch_write_cost" (watched over unwatched seconds of a full write)}; a speedup is the
baseline's seconds over hotweights' seconds.

Run:  .venv/bin/python benchmarks/checkpoint_sync.py [--size-gb 1.0] [--mode auto]
      [--repeat 3] [--workdir /tmp]
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import shutil
import statistics
import struct
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from hotweights.changes import blocks, writewatch
from hotweights.changes.writewatch import WriteWatch
from hotweights.checkpoint import journal, sync

SHARDS = 4
SEED_BLOCK = 4096
VOCAB = 32000
SCENARIOS = {"a": "1% of rows in a few tensors", "b": "two whole layers",
             "c": "1% of elements, every tensor", "d": "nothing changed"}
METHODS = ("hotweights", "hashed", "named", "seed", "full")
OURS = ("hotweights", "hashed", "named")


# --- the model ------------------------------------------------------------------------

def llama_shapes(size_gb: float) -> dict[str, tuple[int, ...]]:
    """HF Llama names and shapes totalling ~size_gb GB of bf16 (GQA 4:1, untied head)."""
    h = max(128, round(1024 * math.sqrt(size_gb) / 128) * 128)
    inter, kv = max(128, round(2.75 * h / 128) * 128), h // 4
    per_layer = 2 * (2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h)
    layers = max(2, round((size_gb * 1e9 - 2 * (2 * VOCAB * h + h)) / per_layer))
    shapes = {"model.embed_tokens.weight": (VOCAB, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (h, h),
                   p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h),
                   p + "self_attn.o_proj.weight": (h, h),
                   p + "post_attention_layernorm.weight": (h,),
                   p + "mlp.gate_proj.weight": (inter, h),
                   p + "mlp.up_proj.weight": (inter, h),
                   p + "mlp.down_proj.weight": (h, inter)}
    return shapes | {"model.norm.weight": (h,), "lm_head.weight": (VOCAB, h)}


def make_model(shapes: dict[str, tuple[int, ...]], gen: torch.Generator) -> dict:
    return {n: (torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16)
            for n, s in shapes.items()}


def save_sharded(state: dict[str, torch.Tensor], d: Path) -> None:
    """4 shards in name order, cut at equal byte counts, plus the index, like save_pretrained."""
    d.mkdir(parents=True)
    total = sum(t.nbytes for t in state.values())
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(SHARDS)]
    at = 0
    for n, t in state.items():
        parts[min(SHARDS - 1, at * SHARDS // total)][n] = t
        at += t.nbytes
    weight_map = {}
    for i, part in enumerate(parts):
        fn = f"model-{i + 1:05d}-of-{SHARDS:05d}.safetensors"
        save_file(part, d / fn, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, fn)
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))


def shard_files(d: Path) -> dict[str, list[str]]:
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    out: dict[str, list[str]] = {}
    for name, fn in wm.items():
        out.setdefault(fn, []).append(name)
    return out


# --- the scenarios --------------------------------------------------------------------

def mutate(old: dict, scenario: str, gen: torch.Generator) -> tuple[dict, list[str]]:
    """A new live state dict (`old` cloned, then changed as the scenario says) and the
    names of the tensors it changed (what a trainer's optimizer steps)."""
    live = {n: t.clone() for n, t in old.items()}
    layers = sorted({int(n.split(".")[2]) for n in live if n.startswith("model.layers.")})
    names = []
    if scenario == "a":  # rare-token embedding rows, the head, two projections
        mid = layers[len(layers) // 2]
        names = ["model.embed_tokens.weight", "lm_head.weight",
                 f"model.layers.{mid}.self_attn.q_proj.weight",
                 f"model.layers.{mid}.mlp.down_proj.weight"]
        for n in names:
            t = live[n]
            rows = torch.randperm(t.shape[0], generator=gen)[:max(1, t.shape[0] // 100)]
            t[rows] = (torch.randn(len(rows), t.shape[1], generator=gen) * 0.02).to(t.dtype)
    elif scenario == "b":  # the last two layers (a trainable subset)
        names = [n for n in live if any(n.startswith(f"model.layers.{i}.") for i in layers[-2:])]
        for n in names:
            live[n] += (torch.randn(live[n].shape, generator=gen) * 0.01).to(live[n].dtype)
    elif scenario == "c":  # scattered, like an RL step: flip the sign of 1 % of values
        names = list(live)
        for t in live.values():
            flat = t.view(-1)
            idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 100),), generator=gen)
            flat[idx] = -flat[idx]  # -0.0 differs from 0.0 in its bytes too
    return live, names


def write_in_place(dst: dict, src: dict, names: list[str]) -> None:
    """Make `dst[n]` hold `src[n]`'s bytes, writing only the bytes that differ (a step
    writes its own elements; a copy of the whole tensor would write every page)."""
    for n in names:
        a, b = dst[n].view(-1).view(torch.uint8), src[n].view(-1).view(torch.uint8)
        idx = (a != b).nonzero().squeeze(1)
        a[idx] = b[idx]


def write_cost(live: dict, repeat: int) -> tuple[float, float]:
    """Seconds of one in-place write of every tensor (`mul_(1)`): watched copies right
    after a scan (every page protected again), and unwatched copies."""
    watched, plain = ({n: t.clone() for n, t in live.items()} for _ in range(2))
    out = []
    with WriteWatch() as watch:  # its own: the default one stops watching tensors written
        for d in (watched, plain):  # all over (a scan that records no hashes keeps them)
            secs = []
            for _ in range(repeat):
                watch.written(watched)  # protects the pages written since
                watch.record({})
                t0 = time.perf_counter()
                for t in d.values():
                    t.mul_(1)
                secs.append(time.perf_counter() - t0)
            out.append(statistics.median(secs))
    return out[0], out[1]


def changed_bytes(old: dict, new: dict, block_size: int) -> tuple[int, int]:
    """(bytes in blocks that differ, per tensor as sync cuts them; changed element bytes)."""
    in_blocks = elements = 0
    per_block = block_size // 2
    for n, a in old.items():
        neq = (a.view(-1).view(torch.int16) != new[n].view(-1).view(torch.int16)).numpy()
        elements += int(neq.sum()) * 2
        k = len(neq)
        pad = np.zeros(-k % per_block, dtype=bool)
        dirty = np.concatenate([neq, pad]).reshape(-1, per_block).any(axis=1)
        sizes = np.full(len(dirty), block_size)
        if len(sizes):
            sizes[-1] = k * 2 - (len(sizes) - 1) * block_size
        in_blocks += int(sizes[dirty].sum())
    return in_blocks, elements


# --- the methods ----------------------------------------------------------------------

def seed_sync(d: Path, live: dict) -> int:
    """The seed algorithm: host copy, per-4 KB Python compare, in-place mmap write."""
    written = 0
    for fn, names in shard_files(d).items():
        with open(d / fn, "r+b") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header, base = json.loads(f.read(n)), 8 + n
            with mmap.mmap(f.fileno(), 0) as m:
                for name in names:
                    begin, end = header[name]["data_offsets"]
                    new = live[name].detach().cpu().clone().contiguous().view(-1) \
                        .view(torch.uint8).numpy().tobytes()
                    for o in range(0, end - begin, SEED_BLOCK):
                        chunk = new[o:o + SEED_BLOCK]
                        at = base + begin + o
                        if m[at:at + len(chunk)] != chunk:
                            m[at:at + len(chunk)] = chunk
                            written += len(chunk)
                m.flush()
    return written


def full_rewrite(d: Path, live: dict) -> int:
    """save_file of every shard to a temp, fsync, rename over the shard, fsync the dir."""
    written = 0
    for fn, names in shard_files(d).items():
        tmp = d / (fn + ".tmp")
        save_file({n: live[n].detach().cpu().contiguous() for n in names}, tmp,
                  metadata={"format": "pt"})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        written += tmp.stat().st_size
        os.replace(tmp, d / fn)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return written


def verify(d: Path, live: dict, what: str) -> None:
    for fn, names in shard_files(d).items():
        with safe_open(d / fn, framework="pt") as f:
            for n in names:
                if not torch.equal(f.get_tensor(n).view(torch.int16), live[n].view(torch.int16)):
                    raise SystemExit(f"FAILED: {what}: {n} in {fn} differs from the live tensor")


def settle(d: Path) -> None:
    """No sync's background work left (hotweights' finisher thread of any directory),
    no dirty pages anywhere, and the shards in the page cache (equal for every method)."""
    journal.finish()  # replaced shards freed too (hotweights does it behind its commit)
    os.sync()
    for p in d.glob("*.safetensors"):
        with open(p, "rb") as f:
            while f.read(64 << 20):
                pass


# --- the run --------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="model size, GB (10**9 bytes)")
    ap.add_argument("--mode", default="auto", help="sync mode for hotweights")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per method (median)")
    ap.add_argument("--workdir", default=None, help="where the directories go (default: /tmp)")
    args = ap.parse_args()
    bs, started = blocks.DEFAULT_BLOCK_SIZE, time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    shapes = llama_shapes(args.size_gb)
    old = make_model(shapes, gen)
    model_bytes = sum(t.nbytes for t in old.values())
    h, layers = shapes["model.embed_tokens.weight"][1], (len(shapes) - 3) // 9
    print(f"model: {model_bytes:,} bytes bf16, {len(old)} tensors (hidden {h}, intermediate "
          f"{shapes['model.layers.0.mlp.up_proj.weight'][0]}, {layers} layers, vocab {VOCAB}),"
          f" {SHARDS} shards  mode: {args.mode}  block: {bs >> 10} KiB  repeat: {args.repeat}"
          f"  threads: {torch.get_num_threads()}")

    root = Path(tempfile.mkdtemp(prefix="hw-bench-sync-", dir=args.workdir))
    try:
        base = root / "base"
        save_sharded(old, base)
        dirs = {m: root / m for m in METHODS}
        for m in METHODS:
            shutil.copytree(base, dirs[m])
        watch, trained = writewatch.default(), {n: t.clone() for n, t in old.items()}
        for m in OURS:
            settle(dirs[m])
            warm = sync(dirs[m], trained if m == "hotweights" else old, mode=args.mode,
                        version="v0", watch=m == "hotweights")
        print(f"write watch: {(watch.why or 'on') if watch else 'off (' + writewatch.ENV + ')'}")
        print(f"warm-up sync (no sidecars yet; writes them; not in any scenario): "
              f"{warm.seconds:.2f} s, compared {warm.bytes_compared:,} B, written "
              f"{warm.bytes_written:,} B")

        hash_s = []
        views = [memoryview(t.view(-1).view(torch.uint8).numpy()) for t in old.values()]
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            for v in views:
                xxhash.xxh3_64_intdigest(v)
            hash_s.append(time.perf_counter() - t0)
        hash_gbps = model_bytes / statistics.median(hash_s) / 1e9

        rows = {}
        for sc in SCENARIOS:
            live, names = mutate(old, sc, gen)
            cb, ce = changed_bytes(old, live, bs)
            secs: dict[str, list[float]] = {m: [] for m in METHODS}
            written: dict[str, int] = {}
            results = {}
            for rep in range(args.repeat):
                for m in METHODS:
                    if m == "hotweights":  # the step, in place (untimed)
                        write_in_place(trained, live, names)
                    settle(dirs[m])
                    t0 = time.perf_counter()
                    if m in OURS:
                        hint = names if m == "named" else None
                        res = sync(dirs[m], trained if m == "hotweights" else live,
                                   mode=args.mode, version=f"{sc}{rep}", changed=hint,
                                   watch=m == "hotweights")
                        results[m] = res
                        written[m] = res.bytes_written
                    elif m == "seed":
                        written[m] = seed_sync(dirs[m], live)
                    else:
                        written[m] = full_rewrite(dirs[m], live)
                    secs[m].append(time.perf_counter() - t0)
                    if rep == 0:
                        verify(dirs[m], live, f"scenario ({sc}), {m}")
                        if m == "hotweights":
                            verify(dirs[m], trained, f"scenario ({sc}), {m} (its tensors)")
                    if m == "hotweights" and sc != "d":  # back to the old content, untimed
                        write_in_place(trained, old, names)
                        sync(dirs[m], trained, mode=args.mode, version="v0")
                    elif m in OURS and sc != "d":
                        sync(dirs[m], old, mode=args.mode, version="v0", watch=False)
                    elif m == "seed" and sc != "d":
                        seed_sync(dirs[m], old)
                    if rep == 0 and m != "full" and sc != "d":
                        verify(dirs[m], old, f"scenario ({sc}), {m}, restored")
            result = results["hotweights"]
            assert not result.missing_on_disk and not result.missing_live
            med = {m: statistics.median(s) for m, s in secs.items()}
            rows[sc] = dict(changed=cb, elements=ce, seconds=med, written=written,
                            results=results)
            del live

        wrote_watched, wrote_plain = write_cost(old, args.repeat)

        # the table
        print(f"\npage cache warm for every method (os.sync() then the shards read before "
              f"each run); fsync in every method; median of {args.repeat}")
        print(f"{'scenario':34} {'method':10} {'seconds':>8} {'written B':>15} "
              f"{'GB/s':>6} {'speedup':>8}")
        for sc, r in rows.items():
            print(f"({sc}) {SCENARIOS[sc]:29} changed blocks {r['changed']:,} B, "
                  f"changed elements {r['elements']:,} B")
            for m in METHODS:
                s = r["seconds"][m]
                sp = "" if m in OURS else f"{s / r['seconds']['hotweights']:7.2f}x"
                print(f"{'':34} {m:10} {s:8.3f} {r['written'][m]:15,} "
                      f"{model_bytes / s / 1e9:6.2f} {sp:>8}")
            for m, res in r["results"].items():
                print(f"{'':34} {m}: {res.tensors_changed} tensors changed, shards "
                      f"{len(res.shards_changed)}, hashed {res.bytes_hashed:,} B, compared "
                      f"{res.bytes_compared:,} B, mode {res.mode}")

        a, c, d = rows["a"], rows["c"], rows["d"]
        out = {
            "model_bytes": model_bytes, "changed_bytes": a["changed"],
            "written_bytes": a["written"]["hotweights"],
            "speedup_vs_seed": a["seconds"]["seed"] / a["seconds"]["hotweights"],
            "speedup_vs_full": a["seconds"]["full"] / a["seconds"]["hotweights"],
            "scattered_speedup_vs_full": c["seconds"]["full"] / c["seconds"]["hotweights"],
            "nochange_gbps": model_bytes / d["seconds"]["hotweights"] / 1e9,
            "hash_gbps": hash_gbps}
        out["nochange_vs_hash"] = out["nochange_gbps"] / hash_gbps
        for m in ("hashed", "named"):
            out[f"{m}_speedup_vs_seed"] = a["seconds"]["seed"] / a["seconds"][m]
            out[f"{m}_speedup_vs_full"] = a["seconds"]["full"] / a["seconds"][m]
        out["hashed_nochange_vs_hash"] = model_bytes / d["seconds"]["hashed"] / 1e9 / hash_gbps
        out["watch_write_cost"] = wrote_watched / wrote_plain

        def target(ok: bool) -> str:
            return "met" if ok else "MISSED"
        print(f"\nxxh3_64, single core, over the model's tensors: {hash_gbps:.2f} GB/s")
        print("targets:")
        print(f"  (a) vs seed   {out['speedup_vs_seed']:8.2f}x  >= 15x   "
              f"{target(out['speedup_vs_seed'] >= 15)}")
        print(f"  (a) vs full   {out['speedup_vs_full']:8.2f}x  >= 10x   "
              f"{target(out['speedup_vs_full'] >= 10)}")
        for m, how in (("hashed", "watch=False"), ("named", "changed=")):
            print(f"  (a) {m} ({how}), vs seed {out[f'{m}_speedup_vs_seed']:.2f}x "
                  f"({target(out[f'{m}_speedup_vs_seed'] >= 15)}), vs full "
                  f"{out[f'{m}_speedup_vs_full']:.2f}x "
                  f"({target(out[f'{m}_speedup_vs_full'] >= 10)})")
        print(f"  (c) vs full   {out['scattered_speedup_vs_full']:8.2f}x  >= 1x    "
              f"{target(out['scattered_speedup_vs_full'] >= 1)}")
        print(f"  (d) vs xxh3   {out['nochange_vs_hash']:8.2%}  >= 50%   "
              f"{target(out['nochange_vs_hash'] >= 0.5)}  ({out['nochange_gbps']:.2f} GB/s; "
              f"hashed {out['hashed_nochange_vs_hash']:.2%}, "
              f"{target(out['hashed_nochange_vs_hash'] >= 0.5)})")
        for sc in ("a", "b"):
            r = rows[sc]
            ratio = r["written"]["hotweights"] / r["changed"]
            print(f"  ({sc}) written / changed blocks {ratio:6.3f}  <= 1.1   "
                  f"{target(ratio <= 1.1)}  (journal not counted)")
        print(f"a full in-place write of the model (mul_(1)): {wrote_watched:.3f} s watched, "
              f"{wrote_plain:.3f} s not ({out['watch_write_cost']:.2f}x: one fault per page "
              "written after a sync)")
        print(f"total {time.perf_counter() - started:.0f} s")
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                          for k, v in out.items()}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()

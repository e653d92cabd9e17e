"""Which byte ranges of which live tensors changed: per-block fingerprints and their diff.

Each fixed-size block of a tensor's bytes (the last may be partial) gets a 64-bit hash
where the tensor lives: ``xxh3_64`` (CPU: `xxhash` over a uint8 view, no copy) or
``torch-mix64-v1`` (CUDA or any device: torch ops mix each int64 word with a constant of
its position and sum with wrap-around; only the hashes cross to the host). Two kinds are
never compared. A non-contiguous tensor is refused by name, never silently copied.

xxh3 fingerprints may also hold coarse hashes, one per `COARSE` blocks: `refresh` hashes a
tensor at that grain (large calls, near xxh3's one-call rate) and per block only where a
coarse hash differs, reusing the recorded block hashes elsewhere.
"""

from __future__ import annotations

import base64
import binascii
import functools
import importlib
import logging
import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from hotweights.changes import compiled
from hotweights.errors import FingerprintError

__all__ = ["COARSE", "DEFAULT_BLOCK_SIZE", "FORMAT", "KINDS", "Changes", "Fingerprints",
           "TensorChange", "changed", "check_block_size", "compare_bytes", "fingerprint",
           "kind_of", "refresh"]

logger = logging.getLogger(__name__)

FORMAT = 1
XXH3, TORCH = "xxh3_64", "torch-mix64-v1"
KINDS = (XXH3, TORCH)
# xxh3_64, one call per block over a 256 MB buffer, 2-core CI machine (best of 5, two noisy
# runs, GB/s): 4 KiB 6.3-9.4, 64 KiB 11.3-14.4, 256 KiB 15.8, 1 MiB 12.9-16.8, whole buffer
# in one call 14.4-14.9. 64 KiB keeps ~90 % of the large-block rate at 1/16 of 1 MiB's grain.
DEFAULT_BLOCK_SIZE = 64 << 10
# Blocks per coarse hash. Per 64 KiB block, a call from Python costs ~0.8 us over the hashing
# itself (1 GB: ~52 ms against ~38 ms in one call per tensor); per 1 MiB, ~40 ms. (The
# compiled loop, `xxh3_loop`, where it builds, has no such cost.)
COARSE = 16
_CHUNK = 64 << 20  # bytes per torch/numpy step: bounds temporaries whatever the tensor size
_MIX_A, _MIX_B = 0xFF51AFD7ED558CCD - (1 << 64), 0xC4CEB9FE1A85EC53 - (1 << 64)  # as int64


@functools.lru_cache(maxsize=8)
def _position_multipliers(words: int, device: torch.device) -> torch.Tensor:
    # splitmix64 of the position, made odd: integer arithmetic, stable across numpy versions.
    z = np.arange(words, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return torch.from_numpy(((z ^ (z >> np.uint64(31))) | np.uint64(1)).view(np.int64)).to(device)


def _mix_sum(w: torch.Tensor, mult: torch.Tensor) -> torch.Tensor:
    # Each word's term is a nonlinear bijection of it (in a plain sum of w*m two bf16 sign
    # flips cancel: 2**63 + 2**63 == 0), so changes in two words cancel with ~2**-64 odds.
    x = w * mult
    x ^= (x >> 33) & ((1 << 31) - 1)  # & makes the arithmetic shift a logical one
    x *= _MIX_A
    x ^= (x >> 29) & ((1 << 35) - 1)
    x *= _MIX_B
    x ^= (x >> 32) & ((1 << 32) - 1)
    return x.sum(dim=1)


def _torch_blocks(u8: torch.Tensor, block_size: int) -> torch.Tensor:
    words, n = block_size // 8, u8.numel()
    mult, full, out = _position_multipliers(words, u8.device), n // block_size, []
    for b0 in range(0, full, max(1, _CHUNK // block_size)):
        b1 = min(full, b0 + max(1, _CHUNK // block_size))
        chunk = u8[b0 * block_size:b1 * block_size]
        if chunk.storage_offset() % 8:
            chunk = chunk.clone()  # a misaligned view cannot be read as int64 in place
        out.append(_mix_sum(chunk.view(torch.int64).view(b1 - b0, words), mult))
    if n % block_size:  # the partial last block, zero-padded (nbytes is recorded apart)
        tail = torch.nn.functional.pad(u8[full * block_size:], (0, block_size - n % block_size))
        out.append(_mix_sum(tail.view(torch.int64).view(1, words), mult))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64, device=u8.device)


def _bytes_of(name: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise FingerprintError(f"non contiguous tensor: `{name}` (shape {tuple(t.shape)}, "
                               f"stride {t.stride()}); fingerprint a contiguous tensor")
    return t.detach().reshape(-1).view(torch.uint8)


def check_block_size(block_size: object, where: str) -> int:
    """`block_size` as an int, once it is a positive multiple of 8 (numpy ints too); else a
    FingerprintError naming it and `where` it was given."""
    try:
        size = operator.index(block_size) if not isinstance(block_size, bool) else -1
    except TypeError:
        size = -1
    if size <= 0 or size % 8:
        raise FingerprintError(f"{where}: field 'block_size' must be a positive multiple of "
                               f"8, found {block_size!r}")
    return size


@dataclass(frozen=True, eq=False)
class Fingerprints:
    """Per-block fingerprints of a set of named tensors.

    Attributes:
        kind: the hash, one of `KINDS` (``xxh3_64`` or ``torch-mix64-v1``).
        block_size: bytes per block, a positive multiple of 8.
        tensors: name -> (nbytes, uint64 array of ceil(nbytes / block_size) fingerprints).
        coarse: name -> uint64 array of one xxh3 per `COARSE` blocks, for some of `tensors`
            (xxh3 only), of the same bytes as their block hashes.
    """
    kind: str
    block_size: int
    tensors: Mapping[str, tuple[int, np.ndarray]]
    coarse: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise FingerprintError(f"fingerprints: field 'kind' must be one of {list(KINDS)}, "
                                   f"found {self.kind!r}")
        bs = check_block_size(self.block_size, "fingerprints")
        object.__setattr__(self, "block_size", bs)  # a numpy int as an int (JSON)
        for name, (nbytes, h) in self.tensors.items():
            if type(nbytes) is not int or nbytes < 0:
                raise FingerprintError(f"fingerprints: field 'tensors.{name}.nbytes' must be "
                                       f"an int >= 0, found {nbytes!r}")
            want = -(-nbytes // bs)
            if not (isinstance(h, np.ndarray) and h.dtype == np.uint64 and h.shape == (want,)):
                raise FingerprintError(f"fingerprints: field 'tensors.{name}.hashes' must be "
                                       f"{want} uint64 values ({nbytes} bytes in {bs}-byte "
                                       f"blocks), found {getattr(h, 'shape', type(h))}")
        if self.coarse and self.kind != XXH3:
            raise FingerprintError(f"fingerprints: coarse hashes are {XXH3} only, found kind "
                                   f"{self.kind!r}")
        for name, h in self.coarse.items():
            if name not in self.tensors:
                raise FingerprintError(f"fingerprints: field 'tensors.{name}.coarse' has no "
                                       "block hashes beside it")
            want = -(-self.tensors[name][0] // (bs * COARSE))
            if not (isinstance(h, np.ndarray) and h.dtype == np.uint64 and h.shape == (want,)):
                raise FingerprintError(f"fingerprints: field 'tensors.{name}.coarse' must be "
                                       f"{want} uint64 values, found "
                                       f"{getattr(h, 'shape', type(h))}")

    def to_dict(self) -> dict:
        """JSON-able form; each tensor's hashes as base64 of little-endian uint64."""
        tensors = {n: {"nbytes": nb, "hashes": _b64(h)} for n, (nb, h) in self.tensors.items()}
        for n, h in self.coarse.items():
            tensors[n]["coarse"] = _b64(h)
        return {"format": FORMAT, "kind": self.kind, "block_size": self.block_size,
                "coarse_blocks": COARSE, "tensors": tensors}

    @classmethod
    def from_dict(cls, d: object, *, source: str = "fingerprints") -> Fingerprints:
        """Rebuild from `to_dict`'s output.

        Args:
            d: the decoded JSON object.
            source: what `d` came from (a sidecar's path), named in errors.
        Returns:
            The validated `Fingerprints`.
        Raises:
            FingerprintError: naming `source` and the field at fault.
        """
        def bad(msg: str) -> FingerprintError:
            return FingerprintError(f"{source}: {msg}")
        if not isinstance(d, dict):
            raise bad(f"expected a JSON object, found {type(d).__name__}")
        if d.get("format") != FORMAT:  # a missing field reads "found None"
            raise bad(f"field 'format' must be {FORMAT}, found {d.get('format')!r}")
        if not isinstance(d.get("tensors"), dict):
            raise bad(f"field 'tensors' must be an object, found {d.get('tensors')!r}")
        def hashes(name: str, key: str, text: object) -> np.ndarray:
            if not isinstance(text, str):
                raise bad(f"field 'tensors.{name}.{key}' must be a base64 string")
            try:
                raw = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError) as e:
                raise bad(f"field 'tensors.{name}.{key}' is not base64: {e}") from None
            if len(raw) % 8:
                raise bad(f"field 'tensors.{name}.{key}' holds {len(raw)} bytes, not a "
                          "multiple of 8")
            return np.frombuffer(raw, "<u8").astype(np.uint64)

        tensors, coarse = {}, {}
        for name, entry in d["tensors"].items():
            if not isinstance(entry, dict):
                raise bad(f"field 'tensors.{name}' must be an object with 'nbytes' and a "
                          "base64 string 'hashes'")
            tensors[name] = (entry.get("nbytes"), hashes(name, "hashes", entry.get("hashes")))
            if "coarse" in entry and d.get("coarse_blocks") == COARSE:  # else: not used
                coarse[name] = hashes(name, "coarse", entry["coarse"])
        try:
            return cls(d.get("kind"), d.get("block_size"), tensors, coarse)
        except FingerprintError as e:
            raise bad(str(e).removeprefix("fingerprints: ")) from None


def kind_of(tensors: Iterable[torch.Tensor]) -> str:
    """The hash `fingerprint` takes by default: xxh3 when every tensor is on the CPU, else
    the torch hash."""
    return XXH3 if all(t.device.type == "cpu" for t in tensors) else TORCH


def _b64(h: np.ndarray) -> str:
    return base64.b64encode(h.astype("<u8").tobytes()).decode("ascii")


def _xxh3(mv: memoryview, size: int) -> np.ndarray:
    """xxh3_64 of each `size` bytes of `mv` (the last may be short): in one compiled loop
    where it builds (`xxh3_loop`), else one C call each from here."""
    if loop := _xxh3_loop():
        return loop.hashes(np.frombuffer(mv, np.uint8), size)
    return np.fromiter(map(xxhash.xxh3_64_intdigest, map(mv.__getitem__, map(  # no frame
        slice, range(0, len(mv), size), range(size, len(mv) + size, size)))),
        np.uint64, count=-(-len(mv) // size))


@functools.cache
def _compiled(module: str, without: str):
    """The compiled loops' module `hotweights.changes.<module>`, or None: they are off, or
    it does not build (`without` says what runs instead: the same results)."""
    if not compiled.numba_ready():
        return None
    try:
        return importlib.import_module(f"hotweights.changes.{module}")
    except Exception as e:  # noqa: BLE001 - any reason: the Python path gives the same
        logger.info("hotweights: %s (%s)", without, e)
        return None


_xxh3_loop = functools.partial(_compiled, "xxh3_loop", "xxh3 blocks hashed one call each")
_compare_loop = functools.partial(_compiled, "compare_loop", "blocks compared with numpy")


def _host_views(tensors: Mapping[str, torch.Tensor]) -> dict[str, memoryview]:
    flat = {name: _bytes_of(name, t) for name, t in tensors.items()}
    if off := next((n for n, u8 in flat.items() if u8.device.type != "cpu"), None):
        raise FingerprintError(f"{off}: xxh3_64 needs a CPU tensor, found "
                               f"{flat[off].device}; use kind={TORCH!r}")
    return {n: memoryview(u8.numpy()) for n, u8 in flat.items()}


def fingerprint(tensors: Mapping[str, torch.Tensor], *,
                block_size: int = DEFAULT_BLOCK_SIZE, kind: str | None = None,
                coarse: bool = False) -> Fingerprints:
    """Fingerprint every block of every tensor, on the tensor's own device.

    Args:
        tensors: name -> contiguous tensor, any dtype and device.
        block_size: bytes per block (a positive multiple of 8).
        kind: ``"xxh3_64"`` (CPU tensors only), ``"torch-mix64-v1"`` (any device), or None:
            xxh3 when every tensor is on the CPU, else the torch hash for all of them.
        coarse: with xxh3, the coarse hashes too (another pass: for `refresh` later).
    Returns:
        The `Fingerprints`; off the CPU only they cross to the host, in one copy.
    Raises:
        FingerprintError: a non-contiguous tensor or xxh3 off the CPU (named), a bad block
            size or kind.
    """
    kind = kind_of(tensors.values()) if kind is None else kind
    empty = Fingerprints(kind, block_size, {})  # checks kind and block size before any work
    if kind == XXH3:
        views = _host_views(tensors)
        return Fingerprints(kind, block_size, {
            n: (len(mv), _xxh3(mv, block_size)) for n, mv in views.items()},
            {n: _xxh3(mv, block_size * COARSE) for n, mv in views.items()} if coarse else {})
    flat = {name: _bytes_of(name, t) for name, t in tensors.items()}
    if not flat:
        return empty
    per = [_torch_blocks(u8, block_size) for u8 in flat.values()]
    both = torch.cat([h.to(per[0].device) for h in per]).cpu()  # one copy, not one per tensor
    parts = np.split(both.numpy().view(np.uint64), np.cumsum([h.numel() for h in per])[:-1])
    return Fingerprints(kind, block_size, {n: (u8.numel(), h) for (n, u8), h in zip(
        flat.items(), parts, strict=True)})


def refresh(old: Fingerprints, tensors: Mapping[str, torch.Tensor], *,
            written: Mapping[str, Iterable[tuple[int, int]]] | None = None) -> Fingerprints:
    """xxh3 fingerprints of `tensors`, reusing `old`'s block hashes where the bytes are
    unchanged, with coarse hashes where they will likely pay next time.

    A tensor `old` holds coarse hashes for (at its size) is hashed per `COARSE` blocks
    first; only the regions whose coarse hash differs are hashed per block, the other block
    hashes are `old`'s (they describe the same bytes as its coarse hashes). Its new coarse
    hashes are kept unless most regions differed: a tensor that changes all over (every
    step of full training) is then hashed per block alone, one pass. A tensor without
    coarse hashes is hashed per block; found unchanged, it gets coarse hashes again.

    Args:
        old: the recorded xxh3 fingerprints (e.g. a sidecar's), at the block size wanted.
        tensors: name -> contiguous CPU tensor.
        written: name -> the byte ranges [start, stop) of that tensor that may differ from
            `old` (a `WriteWatch` knows them): only the blocks they touch are hashed; its
            coarse hashes are kept if there are none, else dropped.
    Returns:
        The block hashes `fingerprint(tensors, kind="xxh3_64")` gives, and coarse hashes
        for some of the tensors (those of `fingerprint(..., coarse=True)`).
    Raises:
        FingerprintError: `old` not xxh3, a non-contiguous or non-CPU tensor (named).
    """
    if old.kind != XXH3:
        raise FingerprintError(f"refresh takes {XXH3} fingerprints, found {old.kind!r}")
    bs, big, per, coarse = old.block_size, old.block_size * COARSE, {}, {}
    for n, mv in _host_views(tensors).items():
        same_size = old.tensors.get(n, (-1,))[0] == len(mv)
        if same_size and written is not None and n in written:
            h, ranges = old.tensors[n][1].copy(), list(written[n])
            for lo, hi in ranges:
                b0, b1 = lo // bs, -(-hi // bs)
                h[b0:b1] = _xxh3(mv[b0 * bs:b1 * bs], bs)
            per[n] = (len(mv), h)
            if not ranges and n in old.coarse:
                coarse[n] = old.coarse[n]
            continue
        if same_size and n in old.coarse:
            now = _xxh3(mv, big)
            dirty = np.flatnonzero(old.coarse[n] != now)
            if 2 * len(dirty) <= len(now):  # mostly unchanged: per block where it differs
                h = old.tensors[n][1].copy()
                for i in dirty.tolist():
                    h[i * COARSE:(i + 1) * COARSE] = _xxh3(mv[i * big:(i + 1) * big], bs)
                per[n], coarse[n] = (len(mv), h), now
                continue
        per[n] = (len(mv), h := _xxh3(mv, bs))
        if same_size and n not in old.coarse and np.array_equal(old.tensors[n][1], h):
            coarse[n] = _xxh3(mv, big)  # found unchanged: coarse first from next time
    return Fingerprints(XXH3, bs, per, coarse)


@dataclass(frozen=True, eq=False)
class TensorChange:
    """The changed blocks of one tensor.

    Attributes:
        name, nbytes, blocks: the tensor, its size in bytes and in blocks.
        ranges: int64 (k, 2) byte ranges [start, stop) (adjacent blocks merged; <= nbytes).
        blocks_changed, bytes_changed: how many blocks changed, and the bytes they cover.
        density: blocks_changed / blocks (0.0 for a 0-byte tensor).
    """
    name: str
    nbytes: int
    blocks: int
    ranges: np.ndarray
    blocks_changed: int
    bytes_changed: int
    density: float


def _change(name: str, nbytes: int, block_size: int, diff: np.ndarray) -> TensorChange:
    if not diff.any():  # most tensors, most steps: skip the run finding
        return TensorChange(name, nbytes, len(diff), np.zeros((0, 2), np.int64), 0, 0, 0.0)
    edges = np.diff(np.concatenate(([0], diff.astype(np.int8), [0])))
    starts, stops = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    ranges = np.stack([starts * block_size, np.minimum(stops * block_size, nbytes)], axis=1)
    k, n = int(diff.sum()), len(diff)
    return TensorChange(name, nbytes, n, ranges.astype(np.int64), k,
                        int((ranges[:, 1] - ranges[:, 0]).sum()), k / n if n else 0.0)


@dataclass(frozen=True, eq=False)
class Changes:
    """What differs between two `Fingerprints` (see `changed`).

    Attributes:
        tensors: name -> `TensorChange`, for every tensor in both sets with the same size.
        added, removed: names only in the new set, only in the old set.
        resized: names in both whose byte size differs (their blocks are not compared).
        bytes_changed, density: over all of `tensors`, bytes in changed blocks and
            changed blocks / compared blocks.
    """
    tensors: Mapping[str, TensorChange]
    added: tuple[str, ...]
    removed: tuple[str, ...]
    resized: tuple[str, ...]
    bytes_changed: int
    density: float


def changed(old: Fingerprints, new: Fingerprints) -> Changes:
    """Which byte ranges of which tensors differ between two fingerprint sets.

    Args:
        old: fingerprints of the recorded state (a sidecar, version V).
        new: fingerprints of the live tensors.
    Returns:
        The `Changes`: per-tensor ranges and density, names added, removed or resized.
    Raises:
        FingerprintError: the two sets differ in kind or block size.
    """
    for key in ("kind", "block_size"):
        if (a := getattr(old, key)) != (b := getattr(new, key)):
            raise FingerprintError(f"cannot compare fingerprints: field '{key}' differs "
                                   f"(old {a!r}, new {b!r}); fingerprint again with the old one")
    per, resized = {}, []
    for name, (nbytes, h) in new.tensors.items():
        if name in old.tensors and old.tensors[name][0] != nbytes:
            resized.append(name)
        elif name in old.tensors:
            per[name] = _change(name, nbytes, new.block_size, old.tensors[name][1] != h)
    blocks = sum(c.blocks for c in per.values())
    return Changes(per, tuple(n for n in new.tensors if n not in old.tensors),
                   tuple(n for n in old.tensors if n not in new.tensors), tuple(resized),
                   sum(c.bytes_changed for c in per.values()),
                   sum(c.blocks_changed for c in per.values()) / blocks if blocks else 0.0)


def compare_bytes(name: str, live: torch.Tensor, disk: object, *,
                  block_size: int = DEFAULT_BLOCK_SIZE,
                  ranges: Iterable[tuple[int, int]] | None = None) -> TensorChange:
    """Compare a live tensor with its bytes from a file, per block (no sidecar): in one
    compiled loop over the ranges for a CPU tensor (`compare_loop`), else vectorised.

    Args:
        name: the tensor, named in the result and in errors.
        live: the contiguous live tensor (off the CPU: copied to the host in chunks).
        disk: its bytes on disk, any buffer (a memoryview of an mmap, bytes, numpy array).
        block_size: bytes per block (a positive multiple of 8).
        ranges: only these byte ranges [start, stop) are compared (each start a multiple of
            `block_size`; e.g. the ranges `changed` found); the blocks outside read as
            unchanged. None: the whole tensor.
    Returns:
        A `TensorChange` with the ranges `changed` would give for these bytes.
    Raises:
        FingerprintError: non-contiguous tensor, bad block size or range, or sizes that
            differ.
    """
    check_block_size(block_size, "compare_bytes")
    u8, on_disk = _bytes_of(name, live), np.frombuffer(disk, dtype=np.uint8)
    if on_disk.size != (n := u8.numel()):
        raise FingerprintError(f"{name}: live tensor has {n} bytes, the file {on_disk.size}")
    step, dirty = max(1, _CHUNK // block_size) * block_size, np.zeros(-(-n // block_size), bool)
    host = u8.numpy() if u8.device.type == "cpu" else None  # one view, not one per range
    spans = np.array([(0, n)] if ranges is None else list(ranges), np.int64).reshape(-1, 2)
    starts, stops = spans[:, 0], spans[:, 1]
    if len(bad := np.flatnonzero((starts % block_size != 0) | (starts < 0) | (starts > stops)
                                 | (stops > n))):
        raise FingerprintError(f"{name}: range [{starts[bad[0]]}, {stops[bad[0]]}) is not "
                               f"block-aligned within its {n} bytes (block size {block_size})")
    if host is not None and (loop := _compare_loop()):
        loop.dirty_blocks(host, on_disk, spans, block_size, dirty)
        return _change(name, n, block_size, dirty)
    words = block_size // 8
    for lo, hi in spans.tolist():
        for at in range(lo, hi, step):
            end = min(hi, at + step)
            a = host[at:end] if host is not None else u8[at:end].cpu().numpy()
            b, first, full = on_disk[at:end], at // block_size, (end - at) // block_size
            if full:  # whole blocks as uint64 words (unaligned views are fine)
                w = full * block_size
                dirty[first:first + full] = (a[:w].view(np.uint64) != b[:w].view(np.uint64)
                                             ).reshape(full, words).any(axis=1)
            if end - at > full * block_size:  # the tensor's partial last block
                dirty[first + full] = a[full * block_size:].tobytes() != \
                    b[full * block_size:].tobytes()
    return _change(name, n, block_size, dirty)

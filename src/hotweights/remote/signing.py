"""Keyed digests that prove a channel's rounds and store messages come from one of its members.

The key is derived from the channel's token and its rendezvous nonce (fresh per channel), so
it differs on every channel and the token itself never keys anything sent. A round's digest
covers its meta, header and buffer and is bound to the update it belongs to (the channel's
count of updates, the same on every rank), so a round cannot be altered, reordered, or
replayed from another update or channel. Store messages (a failure, a refusal, an abort's
reason) are signed with the same key and bound to their store key.

HMAC-SHA256 rather than keyed BLAKE2b: on 64 MiB with hashlib, on the x86 CPUs we measured
(SHA-NI), HMAC-SHA256 hashed 1.43 GB/s and keyed BLAKE2b 0.81 GB/s. A round's parts are
hashed in chunks of `CHUNK` bytes by a few threads (hashlib releases the GIL), the HMAC taken
over their lengths and the chunks' SHA-256s: one thread hashed 0.67 GiB/s on the H200
machine's CPU (docs/gpu.md), which would have held a 16 GB full sync for 24 s.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from concurrent.futures import ThreadPoolExecutor

import torch

__all__ = ["DIGEST_BYTES", "channel_key", "opened", "round_digest", "round_hashes", "sign"]

DIGEST_BYTES = 32  # a round digest: 4 int64s of the meta
CHUNK = 4 << 20  # bytes hashed by one thread at a time

_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the pid that made it, the pool)


def channel_key(token: str, nonce: str) -> bytes:
    """The channel's key: an HMAC of its nonce with the token (never the token itself)."""
    return hmac.new(token.encode(), f"hotweights/channel-key:{nonce}".encode(),
                    hashlib.sha256).digest()


def round_digest(key: bytes, update: int, parts: tuple[torch.Tensor, ...] = (), *,
                 hashes: list[bytes] | None = None) -> bytes:
    """The digest of one round of update number `update`: its meta fields, header and buffer
    (`parts`), or what `round_hashes` made of them (`hashes`)."""
    h = hmac.new(key, f"round:{update}:".encode(), hashlib.sha256)
    for d in round_hashes(parts) if hashes is None else hashes:
        h.update(d)
    return h.digest()


def round_hashes(parts: tuple[torch.Tensor, ...]) -> list[bytes]:
    """What a round's digest is taken over: each part's length and its chunks' SHA-256s, the
    same under every key (a relay verifies a round and signs it again from one hashing).

    Each part's chunks are hashed in parallel; a CUDA tensor's chunk by chunk from host
    copies (each copy overlapping the hashing of the chunks before it).
    """
    out = []
    for t in parts:
        flat = t.detach().contiguous().view(torch.uint8).reshape(-1)
        n = flat.numel()
        out.append(n.to_bytes(8, "little"))
        chunks = [flat[i:i + CHUNK] for i in range(0, n, CHUNK)]
        out.extend(_threads().map(_sha256, chunks) if len(chunks) > 1 else map(_sha256, chunks))
    return out


def _sha256(chunk: torch.Tensor) -> bytes:
    if chunk.device.type != "cpu":
        chunk = chunk.cpu()
    return hashlib.sha256(memoryview(chunk.numpy())).digest()


def _threads() -> ThreadPoolExecutor:
    """The digest threads, one per CPU this process may run on (at most 8); made again in a
    forked child (a fork keeps none of them)."""
    global _pool
    if _pool is None or _pool[0] != os.getpid():
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            os.cpu_count() or 1
        _pool = (os.getpid(), ThreadPoolExecutor(min(8, cpus),
                                                  thread_name_prefix="hotweights-digest"))
    return _pool[1]


def _mac(key: bytes, where: str, msg: str) -> str:
    return hmac.new(key, f"{where}:{msg}".encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, where: str, msg: str) -> str:
    """`msg` with its MAC, to be written under the store key `where`."""
    return f"{_mac(key, where, msg)}:{msg}"


def opened(key: bytes, where: str, signed: bytes | str) -> str | None:
    """The message `sign` wrote under `where`; None if it was not signed with `key` (forged,
    or moved from another store key)."""
    text = signed.decode(errors="replace") if isinstance(signed, bytes) else signed
    mac, _, msg = text.partition(":")
    return msg if hmac.compare_digest(mac.encode(), _mac(key, where, msg).encode()) else None


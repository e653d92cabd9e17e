"""The private process group under a `Channel`, stateless: built from its own `TCPStore` and
backend object (the way vLLM's ``stateless_init_torch_distributed_process_group`` does it,
without importing vLLM), so it lives beside any default group of the process (vLLM's own)
and never touches global state."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import PrefixStore, TCPStore

from hotweights.errors import RemoteError

BACKENDS = ("gloo", "nccl")


def listening_store(addr: str, port: int, td: timedelta, where: str) -> TCPStore:
    """Rank 0's store, listening on `addr` only (TCPStore alone binds every interface): on
    a socket bound here, whose descriptor the store takes over."""
    try:
        sock = socket.create_server((addr, port), backlog=128, family=(
            socket.AF_INET6 if ":" in addr else socket.AF_INET))
    except OSError as e:
        raise RemoteError(f"{where}: cannot listen on {addr}:{port} ({e}); is the port in "
                          f"use, and is {addr} an address of this host?") from e
    try:
        store = TCPStore(addr, port, None, True, timeout=td, wait_for_workers=False,
                         master_listen_fd=sock.fileno())
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store closes it
    return store


def build(store: PrefixStore, *, rank: int, world_size: int, backend: str, timeout: float,
          where: str, peer_hint: Callable[[], str]):
    """The `backend` group of `world_size` ranks on `store`, as `rank`.

    Raises:
        RemoteError: rank 0 finds its address written by someone else, or Gloo's connect
            does not finish within `timeout` and a margin (`peer_hint` says who is late).
    """
    # Rank 0's Gloo address (key "0/0") is its own to write: one already there is
    # someone else's, who would meet the receivers in its place (their digests refuse
    # its rounds) and leave rank 0 waiting for them past the timeout.
    if rank == 0 and backend == "gloo" and store.check(["0/0"]):
        raise RemoteError(f"{where}: the store was written by someone else: the process "
                          "group's address of rank 0 was there before it (someone on the "
                          "network reached the store's port); nothing sent")
    td = timedelta(seconds=timeout)
    if backend != "gloo":  # NCCL connects at the first collective, on its thread
        return _group(store, rank, world_size, backend, td)
    # Gloo's connect does not always keep to its timeout (peers that met someone else
    # instead): wait for it on a thread, up to the timeout and a margin, then give up.
    done: dict = {}

    def connect() -> None:
        try:
            done["pg"] = _group(store, rank, world_size, backend, td)
        except BaseException as e:  # noqa: BLE001 - raised again below
            done["error"] = e
    th = threading.Thread(target=connect, daemon=True, name=f"hotweights-group-{rank}")
    th.start()
    th.join(timeout + 5.0)
    if th.is_alive():
        raise RemoteError(f"{where}: building the process group did not finish within "
                          f"{timeout + 5.0} s: {peer_hint()}; or someone else wrote the "
                          "store's process-group keys")
    if "error" in done:
        raise done["error"]
    return done["pg"]


def _group(store: PrefixStore, rank: int, world_size: int, backend: str, td: timedelta):
    if backend == "gloo":
        from torch.distributed.distributed_c10d import ProcessGroupGloo
        pg = ProcessGroupGloo(store, rank, world_size, timeout=td)
    else:
        from torch.distributed.distributed_c10d import ProcessGroupNCCL
        opts = ProcessGroupNCCL.Options()
        opts._timeout = td
        pg = ProcessGroupNCCL(store, rank, world_size, opts)
    pg._set_sequence_number_for_group()
    return pg

"""remote.channel under attack: a host that reaches the store's port but lacks the token.

Each attack ends in a `RemoteError` on the trainer within the timeout (never a hang), and no
receiver stages a byte the trainer did not send. Receivers are processes on loopback; the
attacker is the test itself, with its own connection to the store.
"""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
from torch.distributed import PrefixStore, TCPStore

from hotweights.errors import RemoteError
from hotweights.remote import delta, packing, signing
from hotweights.remote.channel import _FIRST, _META, Channel
from hotweights.remote.hosts import free_port
from hotweights.remote.rendezvous import NS

TOKEN = "a-shared-secret-token"
TIMEOUT = 6.0

# A receiver: ready, then waits for the test's word on stdin before it joins; prints one JSON
# line: the updates it applied and the rounds it staged, and its error if any.
RECEIVER = r"""
import json, os, signal, sys
from hotweights.errors import HotweightsError
from hotweights.remote.channel import Channel
port, rank, world, updates, mode, budget = (int(sys.argv[1]), int(sys.argv[2]),
                                            int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
                                            int(sys.argv[6]))
print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()
staged, applied = [], 0
try:
    with Channel(master_addr="127.0.0.1", master_port=port, rank=rank, world_size=world,
                 token=sys.argv[7], timeout=float(sys.argv[8]), max_round_bytes=budget) as ch:
        for u in range(updates):
            def stage(r, last=u == updates - 1):
                if mode == "kill" and last and r.header["round"] == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                staged.append(r.header["round"])
            ch.receive(stage)
            applied += 1
    print(json.dumps({"applied": applied, "staged": len(staged)}), flush=True)
except HotweightsError as e:
    print(json.dumps({"error": str(e), "applied": applied, "staged": len(staged)}), flush=True)
    sys.exit(3)
"""


def _receivers(port: int, world: int, updates: int = 1, *, budget: int = 1 << 30,
               **modes: str) -> list[subprocess.Popen]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    procs = [subprocess.Popen(
        [sys.executable, "-c", RECEIVER, str(port), str(r), str(world), str(updates),
         modes.get(f"r{r}", "ok"), str(budget), TOKEN, str(TIMEOUT)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=env) for r in range(1, world)]
    for p in procs:
        assert json.loads(p.stdout.readline()) == {"ready": True}, p.stderr.read()
    return procs


def _go(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()


def _outcome(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=60)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert lines or p.returncode < 0, f"receiver printed nothing (rc {p.returncode}): {err}"
    return lines[-1] if lines else {"killed": p.returncode}


def _rounds(update: int = 0) -> list[packing.Round]:
    old = torch.zeros(4096, dtype=torch.float32)
    return list(packing.pack(delta.encode_all({"w": old}, {"w": old + 1 + update}),
                           max_bytes=4096))


class _Trainer(threading.Thread):
    """The sender: joins the channel and sends `updates` updates; keeps its error and when
    it ended."""

    def __init__(self, port: int, world: int, updates: int = 1):
        super().__init__(daemon=True)
        self.port, self.world, self.updates = port, world, updates
        self.error: BaseException | None = None
        self.elapsed = None

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            with Channel(master_addr="127.0.0.1", master_port=self.port, rank=0,
                         world_size=self.world, token=TOKEN, timeout=TIMEOUT) as ch:
                for u in range(self.updates):
                    ch.send(_rounds(u))
        except BaseException as e:  # noqa: BLE001 - the test asserts on it
            self.error = e
        self.elapsed = time.monotonic() - t0

    def outcome(self) -> BaseException | None:
        self.join(TIMEOUT + 15)
        assert not self.is_alive(), "the trainer hangs"
        return self.error


def _store(port: int) -> TCPStore:
    """The attacker's connection to the store: it needs only the port."""
    return TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=TIMEOUT))


def _wait_key(store: TCPStore, key: str) -> bytes:
    store.wait([key], timedelta(seconds=TIMEOUT))
    return store.get(key)


def _before_the_receivers_go() -> tuple[list, _Trainer, TCPStore]:
    """Two receivers and a trainer of a channel whose nonce is in its store, the receivers
    held back: (receivers, trainer, an attacker's connection to the store)."""
    port = free_port("127.0.0.1")
    procs = _receivers(port, 3)
    trainer = _Trainer(port, 3)
    trainer.start()
    s = _store(port)
    _wait_key(s, f"{NS}/nonce")
    return procs, trainer, s


def test_a_rank_claimed_first_by_a_stranger_fails_the_channel_by_name():
    procs, trainer, s = _before_the_receivers_go()
    s.compare_set(f"{NS}/claim/1", "", "attacker")
    s.set(f"{NS}/proof/1", "0" * 64)  # it cannot compute the real one
    _go(procs)
    err = trainer.outcome()
    assert isinstance(err, RemoteError)
    assert "receiver rank(s) [1] did not prove the channel's token" in str(err)
    one, two = (_outcome(p) for p in procs)
    assert "rank 1 is already taken by another receiver" in one["error"]
    assert "the sender refused the channel: token of rank(s) [1]" in two["error"]
    assert one["staged"] == two["staged"] == 0


def test_a_nonce_overwritten_in_the_store_is_named_and_nothing_is_sent():
    procs, trainer, s = _before_the_receivers_go()
    s.set(f"{NS}/nonce", "f" * 32)  # a nonce whose proofs the attacker hopes to steer
    _go(procs)
    err = trainer.outcome()
    assert isinstance(err, RemoteError)
    assert "the store was written by someone else: the channel's nonce is 'fff" in str(err)
    for p in procs:
        out = _outcome(p)
        assert "the sender refused the channel: the store was written by someone else" in \
            out["error"] and out["staged"] == 0


def test_a_forged_failure_message_is_ignored_and_the_real_one_is_named():
    port = free_port("127.0.0.1")
    procs = _receivers(port, 3, updates=2, r2="kill")
    trainer = _Trainer(port, 3, updates=2)
    trainer.start()
    _go(procs)
    s = _store(port)
    nonce = _wait_key(s, f"{NS}/nonce").decode()
    _wait_key(s, f"{NS}/verdict")
    forged = "rank 1 (receiver) stopped (forged by the attacker)"
    s.set(f"{NS}/{nonce}/failed", forged)  # written before any failure: the first wins
    err = trainer.outcome()
    assert isinstance(err, RemoteError) and trainer.elapsed < TIMEOUT + 10
    assert "rank 2 (receiver) stopped" in str(err) and "forged" not in str(err)
    one, two = (_outcome(p) for p in procs)
    assert two == {"killed": -9}
    # the first update went through despite the message; the second applied nowhere
    assert one["applied"] == 1 and "forged" not in one["error"]


def test_process_group_keys_rewritten_by_a_stranger_deliver_nothing(monkeypatch):
    port = free_port("127.0.0.1")
    procs = _receivers(port, 3)
    held, group = threading.Event(), Channel._group

    def late_group(self, store):  # the attacker wins the race for the group's keys
        if self.rank == 0 and self.name == "channel":
            held.wait(TIMEOUT + 5)
        return group(self, store)
    monkeypatch.setattr(Channel, "_group", late_group)
    trainer = _Trainer(port, 3)
    trainer.start()
    s = _store(port)
    _go(procs)
    nonce = _wait_key(s, f"{NS}/nonce").decode()
    _wait_key(s, f"{NS}/verdict")
    try:
        _impersonate(s, nonce)
    finally:
        held.set()
    err = trainer.outcome()
    assert isinstance(err, RemoteError)
    assert "the store was written by someone else: the process group's address of rank 0" \
        in str(err)
    for p in procs:
        out = _outcome(p)
        assert "round 1 is not from the trainer (altered on the way?)" in out["error"]
        assert out["staged"] == out["applied"] == 0


def _impersonate(s: TCPStore, nonce: str) -> None:
    """Join the channel's group as its rank 0 (Gloo's addresses are the keys
    ``<nonce>/pg/0/<rank>``) and send a round of the attacker's own."""
    from torch.distributed.distributed_c10d import ProcessGroupGloo
    pg = ProcessGroupGloo(PrefixStore(f"{NS}/{nonce}/pg", s), 0, 3,
                          timeout=timedelta(seconds=TIMEOUT))
    head = json.dumps({"format": 2, "round": 0, "rounds": 1, "nbytes": 64,
                       "entries": []}).encode()
    first = torch.zeros(_FIRST, dtype=torch.uint8)  # the meta, then the header
    first[:32] = torch.tensor([len(head), 64, 0, 1]).view(torch.uint8)  # and zeros for the
    first[_META * 8:_META * 8 + len(head)] = torch.frombuffer(bytearray(head),  # digest it
                                                               dtype=torch.uint8)  # cannot make
    opts = torch.distributed.BroadcastOptions()
    for t in (first, torch.full((64,), 7, dtype=torch.uint8)):
        pg.broadcast([t], opts).wait()
    pg.allreduce([torch.zeros(1, dtype=torch.int64)]).wait()
    pg.shutdown()


def test_a_round_over_the_budget_agreed_at_join_is_refused_before_allocation():
    port = free_port("127.0.0.1")
    procs = _receivers(port, 2, budget=1024)
    _go(procs)
    with pytest.raises(RemoteError, match=r"round 1 failed: rank 1 refused round 1: the "
                       r"sender's round of 4096 buffer bytes .* over the budget agreed at "
                       r"join \(1024 buffer bytes"):
        with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=2,
                     token=TOKEN, timeout=TIMEOUT) as ch:
            ch.send(_rounds())
    (out,) = (_outcome(p) for p in procs)
    assert "over the budget agreed at join" in out["error"] and out["staged"] == 0


@pytest.mark.skipif(sys.platform != "linux", reason="127.0.0.2 is local on Linux only")
def test_the_store_listens_on_the_channels_address_only():
    port = free_port("127.0.0.1")
    th = threading.Thread(target=lambda: pytest.raises(RemoteError, Channel, rank=0,
                                                       master_addr="127.0.0.1",
                                                       master_port=port, world_size=2,
                                                       token=TOKEN, timeout=2.0), daemon=True)
    th.start()
    for _ in range(100):  # until the store is up
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            break
        except ConnectionRefusedError:
            time.sleep(0.02)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=2).close()
    th.join(10)


def test_round_digests_are_bound_to_the_update_and_messages_to_their_key():
    key = signing.channel_key(TOKEN, "n1")
    parts = (torch.arange(4), torch.zeros(8, dtype=torch.uint8))
    assert key != signing.channel_key(TOKEN, "n2") and TOKEN.encode() not in key
    assert signing.round_digest(key, 0, parts) != signing.round_digest(key, 1, parts)
    msg = signing.sign(key, "ns/failed", "rank 2 stopped")
    assert signing.opened(key, "ns/failed", msg) == "rank 2 stopped"
    assert signing.opened(key, "ns/aborted", msg) is None  # moved to another key
    assert signing.opened(key, "ns/failed", "0" * 64 + ":rank 1 stopped") is None
    assert signing.opened(key, "ns/failed", b"\xff\xfe:x") is None


def test_a_round_digest_covers_every_chunk_and_the_part_boundaries():
    key = signing.channel_key(TOKEN, "n1")
    buf = torch.randint(0, 256, (3 * signing.CHUNK + 5,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(0))
    head = torch.arange(10, dtype=torch.uint8)
    digest = signing.round_digest(key, 0, (head, buf))
    assert signing.round_digest(key, 0, (head.clone(), buf.clone())) == digest
    for i in (0, signing.CHUNK, 2 * signing.CHUNK + 1, buf.numel() - 1):  # any chunk, any byte
        bad = buf.clone()
        bad[i] ^= 1
        assert signing.round_digest(key, 0, (head, bad)) != digest, i
    # a byte moved from the header to the buffer: same bytes in all, other parts
    assert signing.round_digest(key, 0, (head[:-1], torch.cat([head[-1:], buf]))) != digest


def test_round_digests_in_a_forked_child_use_threads_of_its_own():
    key = signing.channel_key(TOKEN, "n1")
    buf = torch.ones(3 * signing.CHUNK, dtype=torch.uint8)
    want = signing.round_digest(key, 0, (buf,))  # the parent's threads exist now
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a fork keeps none of the parent's threads
        os.write(write, signing.round_digest(key, 0, (buf,)))
        os._exit(0)
    os.close(write)
    got = os.read(read, 64)
    os.waitpid(pid, 0)
    assert got == want


TOKEN = "a-shared-secret-token"


def test_a_round_digest_binds_each_parts_length_even_at_a_chunk_boundary():
    # without each part's length, a whole chunk moved between parts (or an empty part added)
    # hashes the same chunks in the same order
    key = signing.channel_key(TOKEN, "n1")
    a = torch.zeros(signing.CHUNK, dtype=torch.uint8)
    b = torch.ones(16, dtype=torch.uint8)
    whole = torch.cat([a, b])
    assert signing.round_digest(key, 0, (a, b)) != signing.round_digest(key, 0, (whole,))
    empty = torch.empty(0, dtype=torch.uint8)
    assert signing.round_digest(key, 0, (b, empty)) != signing.round_digest(key, 0, (empty, b))
    assert signing.round_digest(key, 0, (b, empty)) != signing.round_digest(key, 0, (b,))


def test_a_round_digest_covers_the_last_byte_of_every_chunk_and_a_one_byte_tail():
    key = signing.channel_key(TOKEN, "n1")
    for n in (1, 2 * signing.CHUNK + 1):
        buf = torch.zeros(n, dtype=torch.uint8)
        digest = signing.round_digest(key, 0, (buf,))
        idx = [n - 1] + [k * signing.CHUNK - 1 for k in range(1, n // signing.CHUNK + 1)]
        for i in idx:
            bad = buf.clone()
            bad[i] = 1
            assert signing.round_digest(key, 0, (bad,)) != digest, (n, i)


def test_a_message_whose_mac_differs_in_its_last_digit_only_is_not_opened():
    key = signing.channel_key(TOKEN, "n1")
    msg = signing.sign(key, "ns/failed", "ValueError: rank 2 stopped")
    assert signing.opened(key, "ns/failed", msg) == "ValueError: rank 2 stopped"
    mac, rest = msg[:64], msg[64:]
    for i in (0, 31, 63):
        forged = mac[:i] + ("0" if mac[i] != "0" else "1") + mac[i + 1:] + rest
        assert signing.opened(key, "ns/failed", forged) is None, i
    assert signing.opened(key, "ns/failed", mac[:63] + rest) is None  # a shortened MAC
    assert signing.opened(signing.channel_key(TOKEN, "n2"), "ns/failed", msg) is None


def _rendezvous_store():
    return TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=3))


def test_a_receiver_of_another_world_size_is_named_before_it_proves_anything():
    from hotweights.remote.rendezvous import prove

    s = _rendezvous_store()
    s.set(f"{NS}/world", "3")
    s.set(f"{NS}/nonce", "n")
    with pytest.raises(RemoteError, match=r"^r1: field 'world_size' is 2, the sender's is 3$"):
        prove(s, rank=1, world_size=2, token=TOKEN, timeout=1.0, where="r1")
    assert not s.check([f"{NS}/proof/1"])


def test_a_receiver_refuses_a_verdict_that_does_not_prove_the_token():
    from hotweights.remote.rendezvous import prove

    s = _rendezvous_store()
    s.set(f"{NS}/world", "2")
    s.set(f"{NS}/nonce", "n")
    s.set(f"{NS}/verdict", "ok:" + "0" * 64)  # a stranger's
    with pytest.raises(RemoteError, match=r"^r1: the sender did not prove the channel's "
                                          "token"):
        prove(s, rank=1, world_size=2, token=TOKEN, timeout=1.0, where="r1")


def _prove_on_a_thread(s, rank, world_size, token):
    """A receiver proving on a connection of its own; its error lands in the list returned."""
    from hotweights.remote.rendezvous import prove

    errors, own = [], TCPStore("127.0.0.1", s.port, None, False, timeout=timedelta(seconds=3))

    def receive():
        try:
            prove(own, rank=rank, world_size=world_size, token=token, timeout=1.0,
                  where=f"r{rank}")
        except RemoteError as e:
            errors.append(e)
    t = threading.Thread(target=receive, daemon=True)
    t.start()
    return t, errors


def test_the_sender_names_the_receiver_rank_that_did_not_join():
    from hotweights.remote.rendezvous import prove

    s = _rendezvous_store()
    t, errors = _prove_on_a_thread(s, 1, 3, TOKEN)
    deadline = time.monotonic() + 60  # rank 1 under way (a loaded machine starts it late)
    while not s.check([f"{NS}/claim/1"]):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # a bound rank 1 meets on a loaded machine too: its proof is a few store calls away
    with pytest.raises(RemoteError, match=r"^s: receiver rank\(s\) \[2\] did not join within "
                                          r"2\.0 s$"):
        prove(s, rank=0, world_size=3, token=TOKEN, timeout=2.0, where="s")
    t.join(60)
    assert "the sender refused the channel: missing [2]" in str(errors[0])

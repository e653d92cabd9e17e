"""remote.channel: delta rounds broadcast over a stateless Gloo group to receiver processes."""

import itertools
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from hotweights.errors import RemoteError
from hotweights.remote import delta, signing
from hotweights.remote.announce import Announcements
from hotweights.remote.channel import _FIELDS, _FIRST, _INLINE, Channel
from hotweights.remote.hosts import free_port
from hotweights.remote.packing import pack
from hotweights.testing import tiny

TOKEN = "a-shared-secret-token"
TIMEOUT = 6.0
MAX_BYTES = 16 << 10

# The receiver runs in a plain process: builds the same old weights, checks and applies every
# round, prints one JSON line per update (or per error) with a checksum of its weights.
RECEIVER = r"""
import hashlib, json, os, signal, sys, threading, time, torch
from hotweights.remote import delta_apply, signing
from hotweights.errors import HotweightsError
from hotweights.remote.channel import _FIRST, _INLINE, Channel
sys.path.insert(0, sys.argv[1])
from test_remote_channel import TOKEN, checksum, weights
port, rank, world, token, updates, mode = (int(sys.argv[2]), int(sys.argv[3]),
                                           int(sys.argv[4]), sys.argv[5], int(sys.argv[6]),
                                           sys.argv[7])
relay = json.loads(sys.argv[9])  # {"port", "rank", "world"} of a relay channel, or null
w = weights()
hashed, _sha256 = [0], signing._sha256  # the bytes this process hashed for round digests


def counted(chunk):
    hashed[0] += chunk.numel()
    return _sha256(chunk)


signing._sha256 = counted


class LateAck:  # a process group whose allreduce fails once it has ended
    def __init__(self, pg):
        self.pg = pg

    def __getattr__(self, name):
        return getattr(self.pg, name)

    def allreduce(self, tensors):
        work = self.pg.allreduce(tensors)

        class Work:
            def wait(self):
                work.wait()
                raise RuntimeError("Connection closed by peer (the test)")
        return Work()


print(json.dumps({"ready": True}), flush=True)
sys.stdin.readline()  # "go": the sender is about to listen (a store client waits `timeout`)
try:
    rl = relay and Channel(master_addr="127.0.0.1", master_port=relay["port"], name="relay",
                           rank=relay["rank"], world_size=relay["world"], token=TOKEN,
                           timeout=float(sys.argv[8]))
    ch = rl if relay and relay["rank"] else Channel(
        master_addr="127.0.0.1", master_port=port, rank=rank, world_size=world, token=token,
        timeout=float(sys.argv[8]))
    for u in range(updates):
        staged = []

        def stage(r, last=u == updates - 1):
            i = r.header["round"]
            if mode == "kill" and last and i == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "stall" and last and i == 2:
                time.sleep(120)
            if mode == "refuse" and u == 0 and i == 2:
                raise HotweightsError("round 3 refused by the test")
            delta_apply.check(r.header, w)
            staged.append(delta_apply.Round(r.header, r.buffer.clone()))
        if mode == "late_ack" and u == updates - 1:  # its acknowledgement ends, then fails
            # here, as when another receiver dies while this one is still exchanging with it
            ch._pg = LateAck(ch._pg)
        announced = {"update": f"u{u}", "wait": 4 * float(sys.argv[8])}
        if mode == "armed":  # no time bound; update 1 is dropped by this side after 1 s
            announced["wait"] = float("inf")
            if u == 1:
                threading.Timer(1.0, ch.interrupt, ("u1",)).start()
        try:
            ch.receive(stage, relay=rl if rl is not ch else None,
                       **(announced if mode in ("announced", "armed") else {}))
        except HotweightsError as e:  # a refusal: nothing applied, the channel goes on
            if not any(x in str(e) for x in ("refused", "cancelled", "aborted",
                                                "stopped waiting")):
                raise
            print(json.dumps({"update": u, "refused": str(e), "sum": checksum(w),
                              "at": time.time()}), flush=True)
            continue
        for r in staged:
            delta_apply.apply(r, w)
        print(json.dumps({"update": u, "sum": checksum(w), "bytes": ch.bytes_received,
                          "relayed": rl.bytes_sent if rl and rl is not ch else 0,
                          "broken": ch.broken, "hashed": hashed[0], "at": time.time()}),
              flush=True)
    ch.close()
    if rl:
        rl.close()
except HotweightsError as e:
    print(json.dumps({"error": str(e), "sum": checksum(w), "at": time.time()}), flush=True)
    for c in {globals().get("ch"), globals().get("rl")} - {None}:
        c.close()  # a broken Gloo group left to the interpreter's exit may abort it
    sys.exit(3)
"""


def weights(hidden: int = 128, inter: int = 344, vocab: int = 512, layers: int = 2,
            kv: int = 64) -> dict[str, torch.Tensor]:
    """A small Llama-like bf16 state dict, the same in every process (seeded)."""
    return tiny.llama_tensors(hidden=hidden, inter=inter, kv=kv, vocab=vocab, layers=layers,
                              scale=0.02)


def checksum(w: dict[str, torch.Tensor]) -> str:
    import hashlib
    h = hashlib.sha256()
    for k in sorted(w):
        h.update(k.encode())
        h.update(w[k].view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def _rows(w, g):
    out = {}
    for k, t in w.items():
        t = t.clone()
        if t.dim() == 2:
            rows = torch.randperm(t.shape[0], generator=g)[:max(1, t.shape[0] // 100)]
            t[rows] += 0.5
        out[k] = t
    return out


def _scattered(w, g):
    out = {}
    for k, t in w.items():
        t = t.clone()
        flat = t.view(-1)
        idx = torch.randperm(flat.numel(), generator=g)[:max(1, flat.numel() // 100)]
        flat[idx] += 0.5
        out[k] = t
    return out


def _full(w, g):
    return {k: t + 0.25 for k, t in w.items()}


def _spawn(port: int, rank: int, world: int, updates: int, *, token: str = TOKEN,
           mode: str = "ok", relay: dict | None = None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    args = [sys.executable, "-c", RECEIVER, os.path.dirname(__file__), str(port), str(rank),
            str(world), token, str(updates), mode, str(TIMEOUT), json.dumps(relay)]
    return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _receivers(port: int, world: int, updates: int, **modes) -> list[subprocess.Popen]:
    """Receivers 1 .. world - 1, started and ready (imports done) before the sender connects;
    modes: ``r2={"token": ...}`` or ``r2={"mode": "kill"}`` for rank 2."""
    procs = [_spawn(port, r, world, updates, **modes.get(f"r{r}", {})) for r in range(1, world)]
    _ready(*procs)
    return procs


def _ready(*procs: subprocess.Popen) -> None:
    """Wait until every process is ready (its imports done), then let them all connect: the
    caller's sender must listen at once, within their timeout (on a loaded machine, a
    receiver started first would otherwise wait for the others' imports on its clock)."""
    for p in procs:
        assert json.loads(p.stdout.readline()) == {"ready": True}, p.stderr.read()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()


def _lines(p: subprocess.Popen) -> list[dict]:
    out, err = p.communicate(timeout=60)
    p.err = err  # for the callers' messages
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert lines or p.returncode < 0, f"receiver printed nothing (rc {p.returncode}): {err}"
    return lines


def _nbytes(w) -> int:
    return sum(t.numel() * t.element_size() for t in w.values())


def test_updates_arrive_bit_identical_and_only_what_changed_goes_on_the_wire():
    port, old = free_port("127.0.0.1"), weights()
    procs = _receivers(port, 3, 3)
    g = torch.Generator().manual_seed(1)
    sums, ratios = [], []
    with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=3,
                 token=TOKEN, timeout=TIMEOUT) as ch:
        for change, kib in ((_rows, 2), (_scattered, 8), (_full, 64)):  # several rounds each
            new = change(old, g)
            rounds = list(pack(delta.encode_all(old, new), max_bytes=kib << 10))
            before = ch.bytes_sent
            assert ch.send(rounds) == ch.bytes_sent - before
            assert len(rounds) >= 2
            # less each round's fixed first message (its meta and header, 4 KiB: with these
            # 2 KiB rounds, most of a rows update's bytes)
            ratios.append((ch.bytes_sent - before - len(rounds) * _FIRST) / _nbytes(old))
            sums.append(checksum(new))
            old = new
    # closed: its heartbeat thread is gone (a daemon thread in a store call at the
    # interpreter's exit aborts it)
    assert not [t for t in threading.enumerate() if t.name.startswith("hotweights-heartbeat")]
    for p in procs:
        got = _lines(p)
        assert p.returncode == 0, got
        assert [x["sum"] for x in got] == sums
        assert got[-1]["bytes"] == ch.bytes_sent
    rows, scattered, full = ratios
    assert rows <= 0.03 and scattered <= 0.08 and 1.0 <= full <= 1.05, ratios
    print("wire bytes / weight bytes:", ratios)


def test_reading_ahead_sends_every_round_intact_and_an_encode_failing_aborts_it():
    """`send(ahead=True)`: the next round is packed (into the other of two staging buffers)
    while this one is broadcast; the receivers get the same update, and an encode failing
    part way aborts it after the rounds before it went. Then a round whose header is longer
    than a round's first message (its rest goes in a broadcast of its own) arrives whole."""
    port, old = free_port("127.0.0.1"), weights()
    procs = _receivers(port, 3, 3)
    new = _scattered(old, torch.Generator().manual_seed(3))
    staging = [torch.empty(MAX_BYTES // 16, dtype=torch.uint8) for _ in range(2)]
    third = _scattered(new, torch.Generator().manual_seed(4))
    (whole,) = pack(delta.encode_all(new, third), max_bytes=1 << 20)
    assert len(whole.header_bytes()) > _INLINE  # its header's rest: a broadcast of its own

    def rounds(a, b):
        return pack(delta.encode_all(a, b), max_bytes=MAX_BYTES // 16, staging=staging)

    def failing(rounds):
        for i, r in enumerate(rounds):
            if i == 2:
                raise ValueError("the encode failed in the test")
            yield r
    assert len(list(rounds(old, new))) >= 4
    with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=3,
                 token=TOKEN, timeout=TIMEOUT) as ch:
        ch.send(rounds(old, new), ahead=True)
        before, update = ch.bytes_sent, ch._updates
        with pytest.raises(ValueError, match="the encode failed"):
            ch.send(failing(rounds(new, old)), ahead=True)
        assert ch._updates == update + 1  # the next update signs anew: the aborted one's
        # rounds (recorded on the way) cannot be replayed into it; the receivers agree
        went = [r.buffer.numel() for r in itertools.islice(rounds(new, old), 2)]
        assert ch.bytes_sent - before > sum(went) > 0  # the rounds that went count
        ch.send([whole], ahead=True)
    for p in procs:
        done, aborted, last = _lines(p)
        assert p.returncode == 0 and done["sum"] == checksum(new), done
        assert "aborted the update at round 3" in aborted["refused"]
        assert aborted["sum"] == checksum(new)
        assert last["sum"] == checksum(third)


def test_a_wrong_token_fails_every_side_by_name_and_nothing_is_applied():
    port, old = free_port("127.0.0.1"), weights()
    good, bad = _receivers(port, 3, 1, r2={"token": "not-the-token"})
    with pytest.raises(RemoteError, match=r"rank 0: receiver rank\(s\) \[2\] did not prove the "
                       r"channel's token"):
        Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=3, token=TOKEN,
                timeout=TIMEOUT)
    for p in (good, bad):
        (line,) = _lines(p)
        assert p.returncode == 3
        assert "the sender refused the channel: token of rank(s) [2]" in line["error"]
        assert line["sum"] == checksum(old)  # nothing applied


def test_a_receiver_killed_mid_send_is_named_by_the_sender_within_the_timeout():
    port, old = free_port("127.0.0.1"), weights()
    survivor, victim = _receivers(port, 3, 1, r2={"mode": "kill"})
    new = _full(old, None)
    with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=3,
                 token=TOKEN, timeout=TIMEOUT) as ch:
        t = time.monotonic()
        with pytest.raises(RemoteError, match=r"rank 2 \(receiver\) stopped") as e:
            ch.send(pack(delta.encode_all(old, new), max_bytes=MAX_BYTES))
        assert time.monotonic() - t < 2 * TIMEOUT
        print(f"{time.monotonic() - t:.1f} s:", e.value)
        with pytest.raises(RemoteError, match="the channel is broken"):
            ch.send(pack(delta.encode_all(old, new), max_bytes=MAX_BYTES))
    assert victim.wait(timeout=30) == -9
    (line,) = _lines(survivor)
    assert survivor.returncode == 3 and "rank 2 (receiver) stopped" in line["error"], line


def test_a_stalled_receiver_is_named_by_the_sender_within_the_timeout():
    port, old = free_port("127.0.0.1"), weights()
    survivor, stalled = _receivers(port, 3, 1, r2={"mode": "stall"})
    new = _full(old, None)
    try:
        with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=3,
                     token=TOKEN, timeout=TIMEOUT) as ch:
            t = time.monotonic()
            with pytest.raises(RemoteError, match=r"rank 2 \(receiver\) stalled behind") as e:
                ch.send(pack(delta.encode_all(old, new), max_bytes=MAX_BYTES))
            assert time.monotonic() - t < 2 * TIMEOUT, e.value
            print(f"{time.monotonic() - t:.1f} s:", e.value)
        (line,) = _lines(survivor)
        assert survivor.returncode == 3 and "rank 2 (receiver) stalled" in line["error"], line
    finally:
        stalled.kill()
        stalled.wait()


def test_a_stranger_on_the_port_does_not_disturb_the_update():
    port, old = free_port("127.0.0.1"), weights()
    procs = _receivers(port, 3, 1)
    new = _scattered(old, torch.Generator().manual_seed(2))

    def junk():
        for _ in range(50):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                    s.sendall(b"\x00\xffGET / HTTP/1.1\r\n\r\n" * 8)
                return
            except OSError:
                time.sleep(0.05)
    import threading
    th = threading.Thread(target=junk)
    th.start()
    with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=3,
                 token=TOKEN, timeout=TIMEOUT) as ch:
        ch.send(pack(delta.encode_all(old, new), max_bytes=MAX_BYTES))
    th.join()
    for p in procs:
        (line,) = _lines(p)
        assert p.returncode == 0 and line["sum"] == checksum(new)


def test_a_refusal_by_one_receiver_is_applied_by_none_and_the_channel_goes_on():
    port, old = free_port("127.0.0.1"), weights()
    procs = _receivers(port, 3, 2, r2={"mode": "refuse"})
    g = torch.Generator().manual_seed(3)
    first, second = _full(old, g), _scattered(old, g)
    with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=3,
                 token=TOKEN, timeout=TIMEOUT) as ch:
        with pytest.raises(RemoteError, match=r"refused the update, so no receiver applies "
                           r"it: rank 2: HotweightsError: round 3 refused by the test"):
            ch.send(pack(delta.encode_all(old, first), max_bytes=MAX_BYTES))
        ch.send(pack(delta.encode_all(old, second), max_bytes=MAX_BYTES))
    (told, _), (own, _) = lines = [_lines(p) for p in procs]
    for p, (refused, done) in zip(procs, lines, strict=True):
        assert p.returncode == 0 and refused["sum"] == checksum(old), (refused, p.err[-3000:])
        assert done["sum"] == checksum(second), done
    assert "rank 2: HotweightsError: round 3" in told["refused"]
    assert own["refused"] == "round 3 refused by the test"


@pytest.mark.parametrize("refused", [False, True])
def test_a_receiver_whose_acknowledgement_fails_after_the_senders_ended_takes_its_verdict(
        refused):
    # The sender's allreduce can end while a receiver still exchanges with another that
    # then dies: that receiver's fails, though every rank had staged (or refused) it all.
    # It takes the sender's sum from the store: the update stands (or is refused) there as
    # everywhere else, and the broken channel refuses the next update before its ready key.
    port, old = free_port("127.0.0.1"), weights()
    procs = _receivers(port, 3, 1, r1={"mode": "late_ack"},
                       r2={"mode": "refuse" if refused else "ok"})
    new = _full(old, torch.Generator().manual_seed(8))
    with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=3,
                 token=TOKEN, timeout=TIMEOUT) as ch:
        t0 = time.time()  # the receivers' clock (their lines say when)
        if refused:
            with pytest.raises(RemoteError, match="rank 2: HotweightsError: round 3 refused"):
                ch.send(pack(delta.encode_all(old, new), max_bytes=MAX_BYTES))
        else:
            ch.send(pack(delta.encode_all(old, new), max_bytes=MAX_BYTES))
        (late,), (other,) = [_lines(p) for p in procs]
        # taken from the store, not a timeout (nor the time the processes took to exit)
        assert max(late["at"], other["at"]) - t0 < TIMEOUT
        assert not ch.broken
    assert all(p.returncode == 0 for p in procs), (late, other)
    if refused:
        assert "rank 2: HotweightsError: round 3 refused" in late["refused"]
        assert late["sum"] == other["sum"] == checksum(old)
    else:
        assert late["sum"] == other["sum"] == checksum(new)
        assert late["broken"] and not other["broken"]


def test_a_broken_channel_refuses_a_receive_before_the_sender_waits_for_it():
    port = free_port("127.0.0.1")
    with ThreadPoolExecutor(1) as pool:
        receiver = pool.submit(Channel, master_addr="127.0.0.1", master_port=port, rank=1,
                               world_size=2, token=TOKEN, timeout=TIMEOUT)
        with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=2,
                     token=TOKEN, timeout=TIMEOUT) as ch, receiver.result() as rx:
            rx._broken = "acknowledgement of 1 rounds failed after the sender's had ended"
            with pytest.raises(RemoteError, match=r"rank 1: the channel is broken \(ack"):
                rx.receive(lambda r: None, update="u1")
            assert not ch._store.check([ch.announced.key("ready", "u1", 1)])


def test_announced_updates_wait_past_the_timeout_and_a_cancelled_one_changes_nothing():
    port, old = free_port("127.0.0.1"), weights()
    procs = _receivers(port, 3, 3, r1={"mode": "announced"}, r2={"mode": "announced"})
    g = torch.Generator().manual_seed(4)
    first, third = _rows(old, g), _scattered(old, g)
    with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=3,
                 token=TOKEN, timeout=TIMEOUT) as ch:
        time.sleep(TIMEOUT * 1.3)  # the sender works out its update for longer than the timeout
        ch.start("u0")
        ch.send(pack(delta.encode_all(old, first), max_bytes=MAX_BYTES))
        ch.cancel("u1")
        ch.cancel("u1")  # twice is harmless
        ch.start("u2")
        ch.cancel("u2")  # too late: started
        ch.send(pack(delta.encode_all(first, third), max_bytes=MAX_BYTES))
        for p in procs:
            assert [x.get("sum") for x in _lines(p)] == [checksum(first), checksum(first),
                                                         checksum(third)]
        with pytest.raises(RuntimeError, match="stop waiting"):  # the receivers are gone
            ch.start("u3", check=lambda: (_ for _ in ()).throw(RuntimeError("stop waiting")))
        t = time.monotonic()
        with pytest.raises(RemoteError, match=r"rank 1 \(receiver\), rank 2 \(receiver\) did "
                           r"not start receiving the update within"):
            ch.start("u4")
        assert TIMEOUT <= time.monotonic() - t < 2 * TIMEOUT


def test_an_update_awaited_without_bound_arrives_late_or_is_dropped_by_its_receiver():
    port, old = free_port("127.0.0.1"), weights()
    procs = _receivers(port, 2, 3, r1={"mode": "armed"})
    g = torch.Generator().manual_seed(5)
    first, third = _rows(old, g), _scattered(old, g)
    with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=2,
                 token=TOKEN, timeout=TIMEOUT) as ch:
        time.sleep(TIMEOUT * 1.3)  # past the timeout and any lease: still waited for
        ch.start("u0")
        ch.send(pack(delta.encode_all(old, first), max_bytes=MAX_BYTES))
        # u1 never comes: the receiver drops it after 1 s; u2 goes once it has said so (a
        # fixed wait let a loaded receiver still be waiting for u1 when u2 was announced)
        early = [json.loads(procs[0].stdout.readline() or "{}") for _ in range(2)]
        assert "refused" in early[1], early
        ch.start("u2")
        ch.send(pack(delta.encode_all(first, third), max_bytes=MAX_BYTES))
        lines = early + _lines(procs[0])
    assert [x.get("sum") for x in lines] == [checksum(first), checksum(first), checksum(third)]
    assert "stopped waiting for update u1 (dropped by this side)" in lines[1]["refused"]


@pytest.mark.parametrize("race", ["interrupt", "go"])
def test_a_wake_deleted_as_stale_does_not_hide_the_interrupt_or_word_written_meanwhile(race):
    # The receiver drops a stale wake key (an old one); the interrupt's wake, or the sender's,
    # landing just before that delete must still end the wait at once, not at its end.
    store = TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10))

    class Racing:  # the store, where the other side acts right before the first delete
        def __getattr__(self, name):
            return getattr(store, name)

        def delete_key(self, key):
            if race == "interrupt":
                rx.interrupt("u")
            else:
                store.set(rx.key("word", "u"), "go")
                store.set(key, "go")
            rx.store = store
            return store.delete_key(key)
    rx = Announcements(Racing(), "t", rank=1, world_size=2, addr="127.0.0.1", port=store.port,
                       timeout=5.0, where="test")
    store.set(rx.key("wake", "u", 1), "stale")
    t0 = time.monotonic()
    if race == "interrupt":
        with pytest.raises(RemoteError, match="stopped waiting for update u"):
            rx.await_word("u", 30.0)
    else:
        rx.await_word("u", 30.0)
    assert time.monotonic() - t0 < 5


def test_an_interrupt_whose_wake_cannot_reach_the_store_ends_the_wait_within_a_slice(
        monkeypatch):
    # the trainer's host gone without a word: the interrupt cannot connect; the worker's
    # main thread waits for the dropped receive, so it must end soon, not at the wait's end
    from hotweights.remote import announce
    store = TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10))
    rx = Announcements(store, "t", rank=1, world_size=2, addr="127.0.0.1", port=store.port,
                       timeout=5.0, where="test")
    ended = []

    def wait():
        with pytest.raises(RemoteError, match="stopped waiting for update u"):
            rx.await_word("u", math.inf)
        ended.append(time.monotonic())
    waiting = threading.Thread(target=wait, daemon=True)
    waiting.start()
    time.sleep(0.2)

    def unreachable(*args, **kwargs):
        raise OSError("no route to host (the test)")
    monkeypatch.setattr(announce.socket, "create_connection", unreachable)
    t0 = time.monotonic()
    rx.interrupt("u")
    waiting.join(15)
    assert ended and ended[0] - t0 < 2 * announce._WAIT_SLICE_S + 1


def test_receivers_waiting_for_an_announced_update_learn_the_sender_is_gone():
    port = free_port("127.0.0.1")
    procs = _receivers(port, 3, 1, r1={"mode": "announced"}, r2={"mode": "announced"})
    ch = Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=3, token=TOKEN,
                 timeout=TIMEOUT)
    ready = [ch.announced.key("ready", "u0", r) for r in (1, 2)]
    deadline = time.monotonic() + 60  # both wait for the update (not a fixed sleep: a
    while not ch._store.check(ready) and time.monotonic() < deadline:  # loaded machine)
        time.sleep(0.01)
    t = time.time()  # the receivers' clock (their lines say when)
    ch.close()
    for p in procs:
        (line,) = _lines(p)
        assert p.returncode == 3 and "rank 0) at 127.0.0.1" in line["error"], line
        assert "is gone" in line["error"] and line["sum"] == checksum(weights())
        assert line["at"] - t < TIMEOUT  # not the announced wait's 4 * TIMEOUT


@pytest.mark.parametrize("kw, match", [
    ({"world_size": 1}, "field 'world_size' must be an int >= 2"),
    ({"rank": 3}, r"field 'rank' must be an int in \[0, 3\)"),
    ({"token": "short"}, "field 'token' must be a string of 8"),
    ({"backend": "mpi"}, "field 'backend' must be one of"),
])
def test_bad_arguments_are_named(kw, match):
    args = {"master_addr": "127.0.0.1", "master_port": 1, "rank": 0, "world_size": 3,
            "token": TOKEN, "timeout": 1.0} | kw
    with pytest.raises(RemoteError, match=match):
        Channel(**args)


# -- a relay: one rank per server on the sender's channel, the server's workers behind it --

def _server(port: int, rank: int, world: int, updates: int, *, followers: int = 2,
            **modes) -> list[subprocess.Popen]:
    """A server on rank `rank` of the channel: its leader, which relays each round to
    `followers` more processes (relay ranks 1..); modes: ``f2={"mode": "kill"}`` for relay
    rank 2, ``lead={...}`` for the leader. Wait for them with `_ready`."""
    relay = free_port("127.0.0.1")
    return [_spawn(port, rank, world, updates, **modes.get(f"f{r}" if r else "lead", {}),
                   relay={"port": relay, "rank": r, "world": followers + 1})
            for r in range(followers + 1)]


def test_a_relay_hands_each_round_to_the_servers_workers_and_the_sender_sends_it_once():
    port, old = free_port("127.0.0.1"), weights()
    plain = _spawn(port, 2, 3, 2)  # a one-worker server
    server = _server(port, 1, 3, 2)
    _ready(plain, *server)
    g = torch.Generator().manual_seed(5)
    sums = []
    with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=3,
                 token=TOKEN, timeout=TIMEOUT) as ch:
        for change in (_rows, _full):
            new = change(old, g)
            ch.send(pack(delta.encode_all(old, new), max_bytes=MAX_BYTES))
            sums.append(checksum(new))
            old = new
    lines = [_lines(p) for p in [*server, plain]]
    for p, got in zip([*server, plain], lines, strict=True):
        assert p.returncode == 0 and [x["sum"] for x in got] == sums, got
        assert got[-1]["bytes"] == ch.bytes_sent  # the leader's from the sender, the rest relayed
    assert lines[0][-1]["relayed"] == ch.bytes_sent  # forwarded byte for byte
    # each round hashed once everywhere: the leader signs it for its relay from the hashes
    # it verified it with
    assert len({got[-1]["hashed"] for got in lines}) == 1 and lines[0][-1]["hashed"] > 0


def test_a_followers_refusal_is_its_servers_and_no_one_applies_the_update():
    port, old = free_port("127.0.0.1"), weights()
    plain = _spawn(port, 2, 3, 2)
    server = _server(port, 1, 3, 2, f2={"mode": "refuse"})
    _ready(plain, *server)
    g = torch.Generator().manual_seed(6)
    first, second = _full(old, g), _scattered(old, g)
    with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=3,
                 token=TOKEN, timeout=TIMEOUT) as ch:
        with pytest.raises(RemoteError, match=r"so no receiver applies it: rank 1: RemoteError: "
                           r"relay 127\.0\.0\.1:\d+ rank 0: receiver\(s\) refused the update, "
                           r"so no receiver applies it: rank 2: HotweightsError: round 3 "
                           r"refused by the test"):
            ch.send(pack(delta.encode_all(old, first), max_bytes=MAX_BYTES))
        ch.send(pack(delta.encode_all(old, second), max_bytes=MAX_BYTES))
    lines = [_lines(p) for p in [*server, plain]]
    for p, (refused, done) in zip([*server, plain], lines, strict=True):
        assert p.returncode == 0 and refused["sum"] == checksum(old), (refused, p.err[-3000:])
        assert done["sum"] == checksum(second), done
        assert "round 3 refused by the test" in refused["refused"]


def test_the_senders_cancel_and_abort_reach_the_followers():
    port, old = free_port("127.0.0.1"), weights()
    announced = {"mode": "announced"}
    server = _server(port, 1, 2, 3, lead=announced, f1=announced, f2=announced)
    _ready(*server)
    new = _rows(old, torch.Generator().manual_seed(7))

    def failing(rounds):
        for i, r in enumerate(rounds):
            if i == 2:
                raise ValueError("the encode failed in the test")
            yield r
    with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=2,
                 token=TOKEN, timeout=TIMEOUT) as ch:
        ch.start("u0")
        ch.send(pack(delta.encode_all(old, new), max_bytes=MAX_BYTES // 8))
        ch.cancel("u1")
        ch.start("u2")
        with pytest.raises(ValueError, match="the encode failed"):
            ch.send(failing(pack(delta.encode_all(new, old), max_bytes=MAX_BYTES // 8)))
    for p in server:
        done, cancelled, aborted = _lines(p)
        assert p.returncode == 0 and done["sum"] == checksum(new), done
        assert "the sender cancelled the update" in cancelled["refused"]
        assert "aborted the update at round 3" in aborted["refused"]
        assert "ValueError: the encode failed in the test" in aborted["refused"]
        assert cancelled["sum"] == aborted["sum"] == checksum(new)


def test_a_follower_killed_mid_update_is_named_by_the_sender_within_the_timeout():
    port, old = free_port("127.0.0.1"), weights()
    lead, survivor, victim = server = _server(port, 1, 2, 1, f2={"mode": "kill"})
    _ready(*server)
    with Channel(master_addr="127.0.0.1", master_port=port, rank=0, world_size=2,
                 token=TOKEN, timeout=TIMEOUT) as ch:
        t = time.monotonic()
        with pytest.raises(RemoteError, match=r"rank 1: RemoteError: relay 127\.0\.0\.1:\d+ "
                           r"rank 0: round \d+ failed: rank 2 \(receiver\) stopped"):
            ch.send(pack(delta.encode_all(old, _full(old, None)), max_bytes=MAX_BYTES))
        assert time.monotonic() - t < 2 * TIMEOUT
        assert not ch.broken  # the server refused: the sender's channel goes on
    assert victim.wait(timeout=30) == -9
    for p in (lead, survivor):
        (line,) = _lines(p)
        assert p.returncode == 3 and "rank 2 (receiver) stopped" in line["error"], line
        assert line["sum"] == checksum(old)


@pytest.mark.parametrize("end", ["interrupt", "timeout", "cancel"])
def test_a_receiver_that_stops_waiting_withdraws_its_ready_key(end):
    # A wait that ends without the update (dropped by this side, timed out, cancelled)
    # takes back its `ready` key: were the id reused, `start` must wait for this rank's
    # next receive, not pass at once and leave a failed one to the collective's timeout.
    store = TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10))
    rx = Announcements(store, "t", rank=1, world_size=2, addr="127.0.0.1", port=store.port,
                       timeout=5.0, where="test")
    if end == "interrupt":
        rx._interrupted.add("u")
    elif end == "cancel":
        store.set(rx.key("word", "u"), "cancel")
    with pytest.raises(RemoteError, match={"interrupt": "stopped waiting for update u",
                                           "timeout": "did not start the update within",
                                           "cancel": "cancelled the update"}[end]):
        rx.await_word("u", 0.2)
    assert not store.check([rx.key("ready", "u", 1)])


TOKEN = "a-shared-secret-token"


def _receiver(update: int, nonce: str = "n1") -> Channel:
    """A channel's receiving side as far as round verification goes (no store, no group)."""
    ch = Channel.__new__(Channel)
    ch._mac, ch._updates = signing.channel_key(TOKEN, nonce), update
    ch.name, ch.addr, ch.port, ch.rank = "channel", "127.0.0.1", 1, 1
    return ch


def _signed(update: int, head: bytes = b'{"round": 0}', buf: bytes = b"\x07" * 64,
            nonce: str = "n1"):
    head_t = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    buf_t = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    fields = torch.tensor([len(head), len(buf), 0, 1], dtype=torch.int64)
    sender = _receiver(update, nonce)
    meta = torch.cat([fields, sender._digest(signing.round_hashes((fields, head_t, buf_t)))])
    return meta, head_t, buf_t


def test_a_round_verifies_only_under_its_update_and_its_channel():
    meta, head, buf = _signed(3)
    _receiver(3)._verify(meta, head, buf, "round 1")  # as sent
    for ch in (_receiver(2), _receiver(4), _receiver(3, "n2")):  # replayed, or another channel
        with pytest.raises(RemoteError, match="round 1 is not from the trainer"):
            ch._verify(meta, head, buf, "round 1")


@pytest.mark.parametrize("word", range(_FIELDS + signing.DIGEST_BYTES // 8))
def test_every_word_of_the_meta_and_digest_is_checked(word):
    meta, head, buf = _signed(0)
    bad = meta.clone()
    bad[word] ^= 1
    with pytest.raises(RemoteError, match="is not from the trainer"):
        _receiver(0)._verify(bad, head, buf, "round 1")


def _announcing(world_size=2, timeout=5.0):
    store = TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10))
    return store, Announcements(store, "t", rank=0, world_size=world_size, addr="127.0.0.1",
                                port=store.port, timeout=timeout, where="test")


def test_the_sender_deletes_the_keys_of_the_update_before_last_only():
    store, tx = _announcing()
    for u in ("u1", "u2"):
        store.set(tx.key("ready", u, 1), "1")
        tx.word(u, b"go")
    assert store.check([tx.key("word", "u1"), tx.key("ready", "u1", 1)])  # maybe still read
    tx.word("u3", b"go")
    assert not store.check([tx.key("word", "u1")])
    assert not store.check([tx.key("ready", "u1", 1)])
    assert not store.check([tx.key("wake", "u1", 1)])
    assert store.check([tx.key("word", "u2"), tx.key("ready", "u2", 1)])


def test_the_sender_names_only_the_receivers_not_ready_in_time():
    store, tx = _announcing(world_size=3, timeout=0.2)
    store.set(tx.key("ready", "u", 1), "1")
    with pytest.raises(RemoteError, match=r"^test: rank 2 \(receiver\) did not start "
                                          r"receiving the update within 0\.2 s$"):
        tx.await_ready("u")


def _peers(rank=0, world_size=3):
    from hotweights.remote.peers import Peers

    store = TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=10))
    return store, Peers(store, "t", signing.channel_key(TOKEN, "n"), rank=rank,
                        world_size=world_size, addr="127.0.0.1", port=store.port,
                        timeout=0.8, where="test")


def test_receivers_level_with_each_other_are_not_behind():
    store, peers = _peers()
    try:
        store.set("t/progress/1", "3")
        store.set("t/progress/2", "3")
        assert peers._behind() == []
        store.set("t/progress/1", "4")
        assert peers._behind() == [2]
    finally:
        peers.close()


def test_the_first_failure_told_is_the_one_every_rank_reads():
    store, peers = _peers()
    try:
        peers.tell("rank 2 (receiver) stopped")
        peers.tell("rank 1 (receiver) stalled behind the others")  # a later finding
        assert peers.opened("t/failed") == "rank 2 (receiver) stopped"
    finally:
        peers.close()


def test_the_peers_that_stopped_are_named_by_rank_and_role():
    import re

    store, peers = _peers()  # the sender's view: neither receiver's heartbeat ever came
    try:
        e = peers.blame("round 3", RuntimeError("timed out"))
    finally:
        peers.close()
    assert re.fullmatch(r"test: round 3 failed: rank 1 \(receiver\), rank 2 \(receiver\) "
                        r"stopped \(no heartbeat for 0\.\d s\); reported by rank 0 \(timed out\)",
                        str(e))
    assert peers.opened("t/failed") == str(e).removeprefix("test: round 3 failed: ")

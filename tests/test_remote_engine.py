"""vllm_plugin.remote_engine: a server's receive of an update, armed, relayed, dropped."""

import json
import math
import threading
import time
import types

import pytest
import torch

from hotweights.errors import ConfigError, RemoteError
from hotweights.remote import shards
from hotweights.remote.delta import encode_all
from hotweights.remote.packing import pack
from hotweights.remote.staging import Staged
from test_delta import _state
from test_remote_staging import _specs


def test_a_dropped_receive_that_does_not_end_is_left_behind_with_its_own_staging(
        monkeypatch):
    # an armed wait, or a broadcast, whose trainer's host vanished without a reset: its
    # store round trip waits for TCP to give up (~15 min), and the worker's main thread,
    # which drops it (a lease's expiry, a new trainer's join), must not wait that long
    from hotweights.vllm_plugin import remote_engine
    old, _ = _state()
    release, got = threading.Event(), []

    class Stuck:  # the trainer's channel, its host gone
        broken, bytes_received = False, 0

        def interrupt(self, update):
            got.append(("interrupt", update))  # cannot reach the store either

        def give_up(self, why):
            self.broken = True

        def receive(self, staged, **kwargs):
            release.wait(30)
            got.append(staged)

        def close(self):  # not under the receive: that would wait for its collective
            got.append("closed")
    monkeypatch.setattr(remote_engine, "_DROP_WAIT_S", 0.2)
    engine = _engine(Stuck(), old)
    engine.start_receiving({"update": "u", "wait": math.inf})
    receiving, first = engine._receiving, engine.staged
    engine.discard()  # within the bound, not at the receive's end
    assert got == [("interrupt", "u")] and engine._receiving is None
    assert engine.broken and engine.channel is None  # the next update: on a new channel
    assert engine.staged is not first  # what it may still stage is not applied
    engine.shutdown()  # a new trainer's join: the channel is the receive's to close
    release.set()
    receiving.join(60)
    assert got[-2:] == [first, "closed"]


def test_a_dropped_receive_that_still_receives_rounds_is_waited_for(monkeypatch):
    # one whose lease ran out mid-stream: leaving it would break the channel for every
    # server on it, while it ends by itself
    from hotweights.vllm_plugin import remote_engine
    old, _ = _state()

    class Slow:  # a healthy channel, a round every 0.1 s
        broken, bytes_received = False, 0

        def receive(self, staged, **kwargs):
            for _ in range(30):
                time.sleep(0.1)
                self.bytes_received += 1

        def close(self):
            pass
    monkeypatch.setattr(remote_engine, "_DROP_WAIT_S", 1.0)
    engine = _engine(Slow(), old)
    engine.start_receiving({"update": None, "wait": None})
    engine.discard()  # 3 s: beyond the bound, making progress
    assert not engine.broken and engine.channel is not None


def _engine(channel, old, relay=None):
    """A remote engine of one worker, `channel` its trainer's (the parts a receive reads)."""
    from hotweights.vllm_plugin import remote_engine
    engine = object.__new__(remote_engine.HotweightsEngine)
    engine.staged, engine.channel, engine.relay = Staged(_specs(old)), channel, relay
    engine.device, engine._receiving, engine._gave_up = torch.device("cpu"), None, False
    engine.last_staged = {}
    return engine


class _Channel:
    """A channel whose receive stages `rounds`, then (`hold`) waits for an interrupt, then
    stages `later` and raises `fail`."""

    def __init__(self, rounds=(), hold=False, fail=None, later=()):
        self.rounds, self.hold, self.fail, self.later = list(rounds), hold, fail, list(later)
        self.broken, self.bytes_received, self.calls = False, 0, []
        self._interrupted, self.started = threading.Event(), threading.Event()

    def receive(self, staged, **kwargs):
        self.calls.append(("receive", kwargs))
        self.started.set()
        for r in self.rounds:
            staged(r)
            self.bytes_received += r.buffer.nbytes
        if self.hold:
            self._interrupted.wait(5)
        for r in self.later:
            staged(r)
        if self.fail is not None:
            raise self.fail

    def interrupt(self, update):
        self.calls.append(("interrupt", update))
        self._interrupted.set()

    def give_up(self, why):
        self.broken = True

    def close(self):
        self.calls.append("closed")


def _armed(engine, channel, update="next"):
    """`engine` waiting for `update` on `channel` (its receive begun: no interrupt before)."""
    engine.arm(update)
    assert channel.started.wait(60)
    return engine


def _rounds(old, new):
    return pack(encode_all(old, new), max_bytes=200)


def test_a_receive_stages_the_update_and_says_how_much():
    old, new = _state()
    channel = _Channel(_rounds(old, new))
    engine = _engine(channel, old)
    engine.start_receiving({"update": "u", "wait": 5.0})
    engine.received()
    assert channel.calls == [("receive", {"update": "u", "wait": 5.0, "relay": None})]
    staged = engine.staged
    assert staged.rounds > 1 and staged.nbytes != staged.peak
    assert engine.received_bytes() == {"trainer": channel.bytes_received, "relay": 0,
                                       "staged": staged.nbytes,
                                       "peak_staging": staged.peak}


def test_the_leader_relays_what_it_receives_and_a_follower_receives_from_the_relay():
    old, _ = _state()
    trainer, relay = _Channel(), _Channel()
    relay.bytes_received = 7
    _engine(trainer, old, relay).update_weights({})  # the leader: both channels
    assert trainer.calls == [("receive", {"update": None, "wait": None, "relay": relay})]
    follower = _engine(None, old, relay)
    follower.update_weights({"update": "u"})
    assert relay.calls[-1] == ("receive", {"update": "u", "wait": None, "relay": None})
    assert follower.received_bytes()["trainer"] == 0
    assert follower.received_bytes()["relay"] == 7


def test_a_failed_receive_leaves_nothing_staged_and_raises_where_it_is_waited_for():
    old, new = _state()
    engine = _engine(_Channel(_rounds(old, new), fail=RemoteError("trainer gone")), old)
    engine.start_receiving({})
    with pytest.raises(RemoteError, match="trainer gone"):
        engine.received()
    assert engine.staged.nbytes == 0 and list(engine.staged.patches()) == []
    assert engine.staged.apply_in_place() == set()


def test_a_server_that_has_not_joined_refuses_an_update_and_a_follower_takes_one():
    old, _ = _state()
    for call in ("start_weight_update", "start_receiving", "update_weights"):
        with pytest.raises(ConfigError, match="has not joined a trainer's channel"):
            getattr(_engine(None, old), call)(*([] if call == "start_weight_update" else [{}]))
    _engine(None, old, _Channel()).start_weight_update()  # a follower: the relay only


def test_an_armed_update_waits_without_a_bound_and_is_interrupted_by_a_discard():
    old, _ = _state()
    relay = _Channel(hold=True)  # a follower's
    engine = _armed(_engine(None, old, relay), relay)
    engine.discard()
    assert relay.calls == [("receive", {"update": "next", "wait": math.inf, "relay": None}),
                           ("interrupt", "next")]
    assert engine._receiving is None and not engine.broken


def test_a_receive_of_an_update_not_announced_is_not_interrupted():
    old, _ = _state()
    channel = _Channel(hold=True)
    engine = _engine(channel, old)
    engine.start_receiving({"update": None, "wait": 0.5})
    threading.Timer(0.3, channel._interrupted.set).start()  # it ends by itself
    engine.discard()
    assert [c for c in channel.calls if c[0] == "interrupt"] == []


def test_a_receive_of_another_update_drops_the_armed_one_first():
    old, _ = _state()
    channel = _Channel(hold=True)
    engine = _armed(_engine(channel, old), channel)
    engine.start_receiving({"update": "other", "wait": 1.0})
    engine.received()
    assert [c[0] if c[0] == "receive" else c for c in channel.calls] == [
        "receive", ("interrupt", "next"), "receive"]
    assert channel.calls[-1][1]["update"] == "other"


def test_a_receive_that_drops_a_stuck_one_is_refused_as_its_channel_is_given_up(
        monkeypatch):
    from hotweights.vllm_plugin import remote_engine

    class Deaf(_Channel):  # its host gone: an interrupt does not reach it
        def interrupt(self, update):
            self.calls.append(("interrupt", update))
    monkeypatch.setattr(remote_engine, "_DROP_WAIT_S", 0.2)
    old, _ = _state()
    channel = Deaf(hold=True)
    engine = _armed(_engine(channel, old), channel)
    with pytest.raises(RemoteError, match="gave its channel up .* the trainer opens a new"):
        engine.start_receiving({"update": "other", "wait": 1.0})
    assert [c[0] for c in channel.calls] == ["receive", "interrupt"]
    assert engine._receiving is None and engine.broken
    channel._interrupted.set()


def test_no_update_is_armed_on_a_broken_channel():
    old, _ = _state()
    channel = _Channel()
    channel.broken = True
    with pytest.raises(RemoteError, match="the channel is broken"):
        _engine(channel, old).arm("next")
    assert channel.calls == []


def test_shutdown_drops_the_receive_before_it_closes_the_channels():
    old, _ = _state()
    trainer, relay = _Channel(hold=True), _Channel()
    engine = _armed(_engine(trainer, old, relay), trainer)
    engine.shutdown()
    assert trainer.calls[1:] == [("interrupt", "next"), "closed"] and relay.calls == ["closed"]
    assert engine.channel is None and engine.relay is None
    with pytest.raises(ConfigError):
        engine.start_weight_update()


def test_a_discard_drops_what_was_staged():
    old, new = _state()
    engine = _engine(_Channel(_rounds(old, new)), old)
    engine.update_weights({})
    engine.discard()
    assert engine.staged.nbytes == 0 and list(engine.staged.patches()) == []


def test_a_dropped_receive_left_behind_does_not_report_its_staging(monkeypatch):
    from hotweights.vllm_plugin import remote_engine
    old, new = _state()
    channel = _Channel(hold=True, later=_rounds(old, new))  # its trainer's host gone:
    monkeypatch.setattr(channel, "interrupt", lambda update: None)  # no interrupt arrives
    monkeypatch.setattr(remote_engine, "_DROP_WAIT_S", 0.2)
    engine = _engine(channel, old)
    engine.start_receiving({"update": "u", "wait": math.inf})
    receiving = engine._receiving
    engine.discard()  # left behind
    assert engine.broken and engine.channel is None and channel.broken  # given up
    channel._interrupted.set()  # it stages the update after all, into its own staging
    receiving.join(60)
    assert engine.last_staged == {} and engine.staged.nbytes == 0
    assert channel.calls[-1] == "closed"


def test_a_dropped_receive_that_stops_receiving_midway_is_left_behind(monkeypatch):
    # a few rounds, then its trainer's host vanishes: the bound runs from its last round
    from hotweights.vllm_plugin import remote_engine
    old, _ = _state()

    class Stalls(_Channel):
        def receive(self, staged, **kwargs):
            for _ in range(4):
                time.sleep(0.1)
                self.bytes_received += 1
            self._interrupted.wait(30)
    channel = Stalls()
    monkeypatch.setattr(channel, "interrupt", lambda update: None)  # cannot reach it
    monkeypatch.setattr(remote_engine, "_DROP_WAIT_S", 0.25)
    engine = _engine(channel, old)
    engine.start_receiving({"update": "u", "wait": math.inf})
    start = time.monotonic()
    engine.discard()
    assert engine.broken and time.monotonic() - start < 10  # not the receive's 30 s
    channel._interrupted.set()


def test_a_receive_left_behind_closes_its_channels_once():
    from hotweights.vllm_plugin.remote_engine import RemoteUpdate, _Receiving
    old, _ = _state()
    channel = _Channel()
    receiving = _Receiving(_engine(channel, old), RemoteUpdate())
    receiving.closes = [channel]
    receiving.close_channels()  # (the engine's, as it ended meanwhile)
    receiving.close_channels()  # (its own, at its end)
    assert channel.calls == ["closed"]


def _joining(monkeypatch, *, dp_index=0, rank=0, world_size=2, refused=None):
    """An engine of worker `rank` of a server of `world_size` workers (its DP rank
    `dp_index`), and the channels it opens (one at `refused` fails to)."""
    from hotweights.vllm_plugin import remote_engine
    opened = []

    class Opened(_Channel):
        def __init__(self, **kwargs):
            if kwargs["master_addr"] == refused:
                raise RemoteError(f"{refused}: connection refused")
            super().__init__()
            opened.append(kwargs)
    monkeypatch.setattr(remote_engine, "Channel", Opened)
    old, _ = _state()
    engine = _engine(None, old)
    engine.parallel_config = types.SimpleNamespace(
        data_parallel_index=dp_index, world_size=world_size, rank=rank,
        world_size_across_dp=2 * world_size)
    return engine, opened


def _init(**kw):
    from hotweights.vllm_plugin.remote_engine import RemoteInit
    return RemoteInit(**{"master_addr": "trainer", "master_port": 29500, "rank_offset": 3,
                         "world_size": 5, "token": "t", "max_round_bytes": 1 << 20, **kw})


def test_the_leader_joins_the_trainer_s_channel_and_the_server_s_relay(monkeypatch):
    engine, opened = _joining(monkeypatch)
    before = engine.channel = _Channel()
    engine._gave_up = True  # the channel before was given up
    engine.init_transfer_engine(_init(relay_port=4000, relay_token="r"))
    common = {"timeout": 60.0, "backend": "gloo", "device": "cpu", "max_round_bytes": 1 << 20}
    assert opened == [
        {"master_addr": "127.0.0.1", "master_port": 4000, "rank": 0, "world_size": 4,
         "token": "r", "name": "relay", **common},
        {"master_addr": "trainer", "master_port": 29500, "rank": 3, "world_size": 5,
         "token": "t", **common}]
    assert before.calls == ["closed"] and not engine.broken


def test_a_leader_that_cannot_join_the_trainer_s_channel_leaves_its_relay(monkeypatch):
    # else it would take its own relay for the trainer's, as a follower does
    engine, opened = _joining(monkeypatch, refused="trainer")
    closed = []
    monkeypatch.setattr(_Channel, "close", lambda self: closed.append(self))
    with pytest.raises(RemoteError, match="trainer: connection refused"):
        engine.init_transfer_engine(_init(relay_port=4000, relay_token="r"))
    assert [o.get("name") for o in opened] == ["relay"] and len(closed) == 1
    assert engine.relay is None and engine.channel is None
    with pytest.raises(ConfigError, match="has not joined a trainer's channel"):
        engine.start_receiving({})


@pytest.mark.parametrize("dp_index, rank", [(0, 1), (1, 0)])
def test_a_worker_other_than_the_server_s_first_joins_the_relay_only(monkeypatch, dp_index,
                                                                      rank):
    engine, opened = _joining(monkeypatch, dp_index=dp_index, rank=rank)
    engine.init_transfer_engine(_init(relay_port=4000, relay_token="r"))
    assert [(o.get("name"), o["rank"]) for o in opened] == [("relay", dp_index * 2 + rank)]
    assert engine.channel is None and engine.relay is not None


def test_a_server_of_one_worker_opens_no_relay(monkeypatch):
    engine, opened = _joining(monkeypatch, world_size=1)
    engine.init_transfer_engine(_init())
    assert [o["master_addr"] for o in opened] == ["trainer"] and engine.relay is None


def _checkpoint(tmp_path, tensors: dict) -> None:
    """A safetensors file of `tensors`' headers (name -> (dtype, shape)), data zero."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * {"F32": 4, "BF16": 2, "I64": 8, "F8_E4M3": 1}[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (tmp_path / "model.safetensors").write_bytes(
        len(raw).to_bytes(8, "little") + raw + b"\0" * offset)


def _spec_engine(tmp_path, held=None):
    from hotweights.vllm_plugin import remote_engine
    engine = object.__new__(remote_engine.HotweightsEngine)
    engine._spec_map, engine.model_dir, engine._shards = None, tmp_path, held or {}
    engine.model_config = types.SimpleNamespace(dtype=torch.bfloat16)
    return engine


def test_updates_come_in_the_served_dtype_fp8_and_integers_as_stored(tmp_path):
    _checkpoint(tmp_path, {"w": ("F32", [2, 3]), "ids": ("I64", [4]),
                           "q": ("F8_E4M3", [4]), "A_log": ("BF16", [2])})
    a_log = torch.zeros(2)  # a slab vLLM keeps in float32
    engine = _spec_engine(tmp_path, {"A_log": shards.whole(a_log)})
    assert engine.served_dtypes() == {"w": "bfloat16", "ids": "int64",
                                      "q": "float8_e4m3fn", "A_log": "float32"}
    assert tuple(engine._specs()["w"].shape) == (2, 3)
    (tmp_path / "model.safetensors").unlink()  # read once
    assert engine.served_dtypes()["A_log"] == "float32"


def test_a_model_directory_without_safetensors_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no safetensors in"):
        _spec_engine(tmp_path)._specs()


def test_a_model_not_downloaded_here_is_refused_by_name(tmp_path):
    from hotweights.vllm_plugin.remote_engine import _local_dir
    config = types.SimpleNamespace(model=str(tmp_path / "nowhere"), revision="v1")
    with pytest.raises(ConfigError, match=r"no local copy of .*nowhere \(revision v1\)"):
        _local_dir(config, str(tmp_path))
    config.model = str(tmp_path)
    assert _local_dir(config, None) == tmp_path


def test_xor_values_decode_against_the_live_weights_a_worker_holds_whole():
    old, _ = _state()
    live = {k: v.clone() for k, v in old.items()}
    engine = _engine(None, old)
    engine._shards = {k: shards.whole(v) for k, v in live.items() if k != "d"}
    assert engine._old()["a"] is live["a"]
    assert not engine.decodes_xor()  # "d" goes through the loader: no old value
    engine._shards["d"] = shards.whole(live["d"])
    assert engine.decodes_xor()
    engine.staged = None
    assert not engine.decodes_xor()  # not joined yet


def test_a_finish_without_a_staging_applies_nothing_and_one_with_clears_it(monkeypatch):
    from hotweights.vllm_plugin import remote_engine
    old, new = _state()
    engine = _engine(_Channel(_rounds(old, new)), old)
    engine.model = None
    loaded = []
    monkeypatch.setattr(remote_engine, "load_checkpoint_weight_patches",
                        lambda model, chunk, **kw: loaded.extend(p.name for p in chunk))
    engine.update_weights({})
    engine.finish_weight_update()
    assert sorted(loaded) == ["a", "b", "c"] and engine.staged.nbytes == 0
    engine.finish_weight_update()  # nothing staged: nothing loaded again
    assert sorted(loaded) == ["a", "b", "c"]
    engine.staged = None
    engine.finish_weight_update()


def test_a_chunk_goes_once_it_reaches_the_bound(monkeypatch):
    from hotweights.vllm_plugin import remote_engine
    old, new = _state()
    engine = _engine(_Channel(_rounds(old, new)), old)
    engine.model, calls = None, []
    measure = Staged(_specs(old))
    for r in _rounds(old, new):
        measure(r)
    first = next(measure.patches())  # "a", sparse as the next one ("b")
    monkeypatch.setattr(remote_engine, "PATCH_CHUNK", first.values.numel())
    monkeypatch.setattr(remote_engine, "load_checkpoint_weight_patches",
                        lambda model, chunk, **kw: calls.append([p.name for p in chunk]))
    engine.update_weights({})
    engine.finish_weight_update()
    assert calls == [["a"], ["b"], ["c"]]

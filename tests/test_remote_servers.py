"""`hotweights serve --remote` + `RemoteGroup`: two real vLLM CPU servers updated over Gloo."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from hotweights import Bridge, HotweightsError, RemoteError, RemoteGroup
from hotweights.errors import FingerprintError, ServerError
from hotweights.remote.channel import _FIRST, Channel
from hotweights.server import launch
from test_server import (
    LOAD_TOL,
    PROMPT,
    TOKEN,
    Server,
    _greedy,
    _http,
    _sign_step,
    assert_served_as_claimed,
    assert_streams_ended_well,
    streaming,
)

pytestmark = pytest.mark.vllm


def _core(i: int) -> str:
    """The core remote server `i` is bound to: each its own where there are enough. vLLM
    binds every server's worker to the same core by default, and one spinning in vLLM's
    busy loop (a server polled every few ms, say) can starve another bound there of that
    core for seconds on end, though both are runnable: an update that then times out."""
    cores = sorted(os.sched_getaffinity(0))
    return str(cores[i % len(cores)])


def _restarted(victim: Server, tmp: Path) -> Server:
    """Remote server 1, killed, started again on its port and its core."""
    return Server(victim.model_dir, tmp, "--remote", port=victim.port, cores=_core(1))


@pytest.fixture(scope="module")
def remotes(tiny_model, tmp_path_factory):
    model_dir = tiny_model("llama")
    # Both start at once, from this thread: a server stops when the thread that spawned it
    # ends (PR_SET_PDEATHSIG follows the thread).
    started = [Server(model_dir, tmp_path_factory.mktemp(f"remote{i}"), "--remote", wait=False,
                      cores=_core(i)) for i in range(2)]
    started.append(Server(model_dir, tmp_path_factory.mktemp("local"), wait=False))
    try:
        for s in started:
            s.wait()
    except BaseException:
        for s in started:
            s.stop()
        raise
    yield started  # two remote servers, then a local one (last)
    for s in started:
        s.stop()


@pytest.fixture
def trainer(remotes):
    model = AutoModelForCausalLM.from_pretrained(remotes[0].model_dir, dtype=torch.bfloat16)
    # the checkpoint the servers started from: a restarted one is synced from it
    with RemoteGroup([s.url for s in remotes[:2]], token=TOKEN, timeout=10.0,
                     checkpoint=remotes[0].model_dir) as group:
        group.update(model)  # every server starts from the trainer's weights
        yield model, group


def _status(server) -> dict:
    return _http(server.url, "/hotweights/status")[2]


def _checksum(server) -> list[str]:
    return _http(server.url, "/hotweights/checksum")[2]["checksum"]


def _kill(server) -> None:
    """SIGKILL the server's whole tree: its runner and vLLM (which runs in its own session)."""
    for pid in subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True,
                              text=True).stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(int(pid)), signal.SIGKILL)
    os.killpg(server.proc.pid, signal.SIGKILL)


def _kill_during_the_send(victim, monkeypatch) -> None:
    """Kill `victim` during the next update's send, once: from the trainer's own thread, as
    it reads the 4th round (reading ahead, two rounds are on the wire by then), whatever
    the machine's pace."""
    from hotweights.remote import packing
    pack, killed = packing.pack, []

    def packed(*args, **kwargs):
        for i, r in enumerate(pack(*args, **kwargs)):
            if i == 3 and not killed:
                killed.append(victim)
                _kill(victim)
            yield r
    monkeypatch.setattr(packing, "pack", packed)


def _step_and_update(model, group) -> dict:
    """A sign-SGD step of the trainer's model on PROMPT, then the group's update (a delta)."""
    ids = torch.tensor([PROMPT])
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()
    _sign_step(model, 0.005)
    out = group.update(model)
    assert not out["full"] and out["version"] == group.n
    return out


def _nbytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.timeout(480)  # the module's three server starts count toward it
def test_fresh_servers_are_synced_from_the_checkpoint_they_loaded(remotes, tmp_path):
    # First in the module: no update has been applied to either server yet.
    urls = [s.url for s in remotes[:2]]
    assert all(_status(s)["checkpoint"] for s in remotes[:2])
    model = AutoModelForCausalLM.from_pretrained(remotes[0].model_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[:2].add_(0.01)  # 2 rows differ
    with RemoteGroup(urls, token=TOKEN, timeout=10.0, checkpoint=remotes[0].model_dir) as group:
        out = group.update(model)
        assert not out["full"] and out["from_checkpoint"] == urls
        # 2 rows to each server: a round, its first message (meta, header) 4 KiB
        assert out["bytes_sent"] < 0.01 * _nbytes(model) + 2 * _FIRST
        assert {_status(s)["checkpoint"] for s in remotes[:2]} == {None}  # no longer fresh
    served = [_greedy(s, PROMPT, 8) for s in remotes[:2]]
    assert served[0] == served[1] and _checksum(remotes[0]) == _checksum(remotes[1])
    # Another checkpoint than the one loaded: never trusted, a full sync.
    other = tmp_path / "other"
    shutil.copytree(remotes[0].model_dir, other)
    (shard,) = other.glob("*.safetensors")
    tensors = load_file(shard)
    tensors["model.norm.weight"] += 1
    save_file(tensors, shard, metadata={"format": "pt"})
    with RemoteGroup(urls, token=TOKEN, timeout=10.0, checkpoint=other) as group:
        assert group.update(model)["full"]


def test_k_updates_are_served_identically_with_one_version_number(remotes, trainer):
    model, group = trainer
    for _ in range(3):
        out = _step_and_update(model, group)
        assert [v.split("@")[0] for v in out["servers"].values()] == [str(group.n)] * 2
        # the workers wait for the next update already: its receive needs no engine request
        assert all(_status(s)["armed"] for s in remotes[:2])
    served = [_greedy(s, PROMPT, 8) for s in remotes[:2]]
    assert served[0] == served[1]  # bit-identical weights, same kernels
    assert _checksum(remotes[0]) == _checksum(remotes[1])
    assert {_status(s)["n"] for s in remotes[:2]} == {group.n}
    _assert_serves(model, served[0])


def test_a_receive_sent_late_still_reaches_its_server_before_the_commit(remotes, trainer,
                                                                       monkeypatch):
    """Armed workers (waiting since the last commit) stage an update before their server
    has its receive request, which a loaded machine may send late: the commit goes once
    every receive has answered, not before (else: "no receive of the update before its
    commit", and nothing applied)."""
    model, group = trainer
    post = RemoteGroup._post

    def late(self, url, status, route, **body):
        if route == "/hotweights/remote/receive":
            time.sleep(1.0)  # the tiny model's update is sent and staged meanwhile
        return post(self, url, status, route, **body)
    monkeypatch.setattr(RemoteGroup, "_post", late)
    assert all(_status(s)["armed"] for s in remotes[:2])
    out = _step_and_update(model, group)
    assert [v.split("@")[0] for v in out["servers"].values()] == [str(group.n)] * 2


def _assert_serves(model, served: tuple[list[int], list[float]]) -> None:
    """The served greedy tokens' logprobs are the trainer's model's."""
    tokens, logprobs = served
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0, len(PROMPT) - 1:-1]
    ours = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert (ours - torch.tensor(logprobs)).abs().max() < LOAD_TOL


def test_the_servers_serve_their_old_version_until_the_commit(remotes, trainer, monkeypatch):
    # generation goes on while the update is encoded, sent and staged; the commit pauses
    # only to apply it; the lease is renewed during an encode, or fingerprints, longer
    # than the lease
    model, group = trainer
    before = [_checksum(s) for s in remotes[:2]]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    pending = group.prepare(model, mode="keep")
    for s in remotes[:2]:
        st = _status(s)
        assert st["state"] == "staging" and not st["paused"] and st["n"] == group.n
        code, headers, _ = _http(s.url, "/v1/completions", token=None, body=dict(
            model=s.model_dir, prompt=PROMPT, max_tokens=4, temperature=0.0))
        assert code == 200 and headers["x-hotweights-version"] == st["version"]
    assert [_checksum(s) for s in remotes[:2]] == before  # nothing applied yet
    out = group.commit(pending)
    assert set(out["paused_ms"]) == {s.url for s in remotes[:2]}
    assert all(0 < ms < 10_000 for ms in out["paused_ms"].values()), out
    assert [round(_status(s)["last_paused_s"] * 1e3, 3) for s in remotes[:2]] == \
        list(out["paused_ms"].values())
    assert _checksum(remotes[0]) == _checksum(remotes[1]) != before[0]
    from hotweights.remote import delta
    encode_each = delta.encode_each

    def slow_encode(*args, **kwargs):
        time.sleep(4.5)
        yield from encode_each(*args, **kwargs)
    monkeypatch.setattr(delta, "encode_each", slow_encode)
    with torch.no_grad():
        model.model.norm.weight[0] += 1
    out = group.update(model, lease_s=3.0)  # renewed every 1 s
    assert {_status(s)["n"] for s in remotes[:2]} == {out["version"]}
    assert not any(_status(s)["dirty"] for s in remotes[:2])
    monkeypatch.undo()
    rows = group._prefilter.rows

    def slow_fingerprints(*args, **kwargs):  # taken while the begins travel
        time.sleep(4.5)
        return rows(*args, **kwargs)
    monkeypatch.setattr(group._prefilter, "rows", slow_fingerprints)
    with torch.no_grad():
        model.model.norm.weight[0] += 1
    out = group.update(model, lease_s=3.0)
    assert {_status(s)["n"] for s in remotes[:2]} == {out["version"]}
    assert not any(_status(s)["dirty"] for s in remotes[:2])


def test_require_all_a_lease_lost_during_the_send_aborts_it_everywhere(remotes, trainer,
                                                                       monkeypatch):
    # a server refuses a renewal mid-send (its lease expired while its answers were lost):
    # its commit would fail after the others committed; the send fails, nothing applied
    model, group = trainer
    monkeypatch.setattr(group, "require", "all")
    post, rows = group._post, group._prefilter.rows

    def refused(url, status, route, **body):
        out = post(url, status, route, **body)
        if url == remotes[1].url and route == "/hotweights/renew":  # (its lease kept here:
            # the receive goes on, only the trainer's word on the lease is lost)
            raise ServerError(f"{url}: POST {route}: HTTP 409: no lease held", 409)
        return out

    def slow_fingerprints(*args, **kwargs):  # renewals go out meanwhile, until one is
        deadline = time.monotonic() + 30  # refused (polled, not a fixed sleep: loaded CI)
        while not group._lease_lost:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        return rows(*args, **kwargs)
    monkeypatch.setattr(group, "_post", refused)
    monkeypatch.setattr(group._prefilter, "rows", slow_fingerprints)
    before = [(_status(s)["n"], _checksum(s)) for s in remotes[:2]]
    with torch.no_grad():
        model.model.norm.weight[0] += 1
    with pytest.raises(RemoteError, match=rf"lease of this update was lost during its send "
                                          rf"on .*{remotes[1].url}.*aborted everywhere"):
        group.update(model, lease_s=1.5)
    assert [(_status(s)["n"], _checksum(s)) for s in remotes[:2]] == before
    monkeypatch.undo()
    group.update(model)  # the next update takes it
    assert _checksum(remotes[0]) == _checksum(remotes[1]) != before[0][1]


def test_the_servers_start_the_commits_pause_as_a_small_last_round_goes_out(
        remotes, trainer, monkeypatch):
    # the engine step in flight ends while the last round travels, not in the commit; a
    # large last round (its staging would keep the servers paused) gets no such hint
    from hotweights.remote import group as group_module
    model, group = trainer
    posted, post = [], group._post

    def recorded(url, status, route, **body):
        posted.append((url, route, body.get("pause", False)))
        return post(url, status, route, **body)
    monkeypatch.setattr(group, "_post", recorded)
    for ahead in (True, False):
        monkeypatch.setattr(group_module, "_AHEAD_BYTES", (4 << 20) if ahead else 0)
        posted.clear()
        with torch.no_grad():
            model.model.norm.weight[0] += 1
        out = group.update(model, mode="keep")
        for s in remotes[:2]:
            routes = [(route, pause) for url, route, pause in posted if url == s.url]
            assert (("/hotweights/renew", True) in routes) is ahead, routes
            if ahead:  # the hint before the commit
                assert routes.index(("/hotweights/renew", True)) < \
                    routes.index(("/hotweights/commit", False)), routes
            st = _status(s)
            assert st["n"] == out["version"] and not st["paused"] and not st["dirty"]
            assert 0 < out["paused_ms"][s.url] < 10_000
        assert _checksum(remotes[0]) == _checksum(remotes[1])
    posted.clear()  # a bare prepare: its commit may come late, the servers serve till then
    with torch.no_grad():
        model.model.norm.weight[0] += 1
    pending = group.prepare(model, mode="keep")
    assert not any(pause for _, _, pause in posted), posted
    group.commit(pending)
    _assert_serves(model, _greedy(remotes[0], PROMPT, 8))


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_updates_under_load_keep_every_response_on_the_version_it_names(remotes, trainer,
                                                                        mode):
    # clients stream from a remote server while it is updated: each response was computed
    # with the weights of the version its header names (the commit's pause, begun early by
    # the last round's hint while requests are in flight, drains or aborts them first)
    model, group = trainer
    server, norm = remotes[0], model.model.norm.weight
    base = norm.detach().clone()
    snapshots = {group.n: base}
    with streaming(server, 4) as clients:
        for k in range(6):
            time.sleep(0.05)
            with torch.no_grad():  # neighbouring versions differ 4x in their logits' scale
                norm.copy_(base * (2.0 if k % 2 == 0 else 0.5))
            snapshots[group.update(model, mode=mode)["version"]] = norm.detach().clone()
    assert_streams_ended_well(clients, mode)
    assert_served_as_claimed(model, norm, clients, snapshots)
    with torch.no_grad():
        norm.copy_(snapshots[group.n])


def test_only_what_changed_goes_on_the_wire(remotes, trainer):
    model, group = trainer
    total, g = _nbytes(model), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p[torch.randperm(p.shape[0], generator=g)[:max(1, p.shape[0] // 100)]] += 0.01
    out = group.update(model)
    rows = out["bytes"][remotes[0].url] / total  # what each server received
    assert set(out["bytes"].values()) == {rows * total}
    assert out["bytes_sent"] == 2 * rows * total  # Gloo's binomial tree: 2 copies leave
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            flat[torch.randperm(flat.numel(), generator=g)[:max(1, flat.numel() // 100)]] += 0.01
    # tp=1 servers decode values xor-coded against their live weights
    assert group.links and all(link.xor for link in group.links)
    scattered = group.update(model)["bytes"][remotes[0].url] / total
    assert rows <= 0.03 and scattered <= 0.03, (rows, scattered)
    assert _checksum(remotes[0]) == _checksum(remotes[1])
    group.compress = "zstd"
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            flat[torch.randperm(flat.numel(), generator=g)[:max(1, flat.numel() // 100)]] += 0.01
    compressed = group.update(model)["bytes"][remotes[0].url] / total
    group.compress = None
    assert compressed <= scattered * 1.1, (compressed, scattered)
    assert _checksum(remotes[0]) == _checksum(remotes[1])
    _assert_serves(model, _greedy(remotes[0], PROMPT, 8))  # xor decoded to the new values


def test_a_float32_trainer_updates_servers_that_serve_its_weights_in_bf16(remotes):
    # vLLM's dtype="auto" serves a float32 checkpoint in bf16: the group sends each value
    # rounded to the nearest bf16, as vLLM's loader would load it (it was refused: "dtype
    # float32, the target's bfloat16"), and takes the next delta against what they hold
    model = AutoModelForCausalLM.from_pretrained(remotes[0].model_dir, dtype=torch.float32)
    assert _status(remotes[0])["dtypes"] == {"default": "bfloat16", "others": {}}
    with RemoteGroup([s.url for s in remotes[:2]], token=TOKEN, timeout=10.0) as group:
        assert group.update(model)["full"]
        _step_and_update(model, group)
        with torch.no_grad():  # below bf16's resolution: the servers hold the same
            model.model.norm.weight.mul_(1 + 1e-6)
        assert group.update(model)["bytes_sent"] < 64 * 1024
    assert _checksum(remotes[0]) == _checksum(remotes[1])
    _assert_serves(model.to(torch.bfloat16), _greedy(remotes[0], PROMPT, 8))


def test_a_trainer_with_frozen_layers_keeps_a_copy_of_the_trainable_ones_only(remotes):
    model = AutoModelForCausalLM.from_pretrained(remotes[0].model_dir, dtype=torch.bfloat16)
    model.requires_grad_(False)
    layer = model.model.layers[-1]
    layer.requires_grad_(True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with RemoteGroup([s.url for s in remotes[:2]], token=TOKEN, timeout=10.0) as group:
        group.update(model)
        assert group.reference.tensors.keys() == trainable
        copied = sum(t.nbytes for t in group.reference.tensors.values())
        assert copied < _nbytes(model) / 2
        with torch.no_grad():
            layer.mlp.up_proj.weight[::7] += 0.05
        out = group.update(model)
        assert not out["full"] and out["bytes_sent"] < copied
        assert _checksum(remotes[0]) == _checksum(remotes[1])
        _assert_serves(model, _greedy(remotes[0], PROMPT, 8))


def test_the_checkpoint_serves_as_the_reference_when_synced_every_update(remotes, trainer,
                                                                         tmp_path):
    model, _ = trainer
    ckpt = shutil.copytree(remotes[0].model_dir, tmp_path / "ckpt")
    with RemoteGroup([s.url for s in remotes[:2]], token=TOKEN, timeout=10.0,
                     checkpoint=ckpt, reference="checkpoint") as group:
        assert group.update(model)["full"]  # the servers were updated: not the checkpoint
        assert group.reference.tensors is None and group.checkpoint.synced_at == group.n
        for _ in range(2):
            with torch.no_grad():
                model.model.layers[0].mlp.up_proj.weight[::5] += 0.05
            out = group.update(model)
            assert not out["full"] and out["bytes_sent"] < _nbytes(model) / 10
        assert _checksum(remotes[0]) == _checksum(remotes[1])
        _assert_serves(model, _greedy(remotes[0], PROMPT, 8))
        on_disk = load_file(ckpt / "model.safetensors")
        assert len(on_disk.keys() & model.state_dict().keys()) == len(on_disk)
        assert all(torch.equal(on_disk[k], p) for k, p in model.state_dict().items()
                   if k in on_disk)
        with pytest.raises(RemoteError, match="reference='checkpoint': `model.norm.weight` "
                           r"is torch.float32 \(\d+,\), the checkpoint .* holds "
                           r"torch.bfloat16"):
            group.checkpoint.check_dtypes({"model.norm.weight": torch.zeros(
                model.config.hidden_size)})
    with pytest.raises(RemoteError, match="field 'reference'"):
        RemoteGroup(remotes[0].url, token=TOKEN, reference="checkpoint")


@pytest.mark.parametrize("bad, match", [
    ("unknown", "update not applied anywhere: .* unknown tensor `model.no_such.weight`"),
    # the trainer's own encoder sees this one, before anything is sent
    ("shape", "model.norm.weight: field 'shape' differs"),
    # the trainer refuses it (the servers keep xor-coded values as xors until the commit)
    ("nan", "^`model.norm.weight`: the patch values hold NaN or Inf; refused$"),
    # the fingerprints fail while the begins travel: the servers are let go
    ("fingerprints", r"^the fingerprints failed$"),
])
def test_bad_input_is_refused_by_name_and_nothing_is_applied(remotes, trainer, bad, match,
                                                            monkeypatch):
    model, group = trainer
    weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    if bad == "unknown":
        weights["model.no_such.weight"] = torch.zeros(4, dtype=torch.bfloat16)
    elif bad == "shape":
        weights["model.norm.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    elif bad == "nan":
        weights["model.norm.weight"][0] = float("nan")
    elif bad == "fingerprints":
        def fail(*args, **kwargs):
            raise FingerprintError("the fingerprints failed")
        monkeypatch.setattr(group._prefilter, "rows", fail)
    weights["model.layers.0.mlp.up_proj.weight"] += 1  # a change that must not land either
    before = [(_status(s)["version"], _checksum(s)) for s in remotes[:2]]
    with pytest.raises(HotweightsError, match=match):
        group.update(weights)
    assert [(_status(s)["version"], _checksum(s)) for s in remotes[:2]] == before
    assert all(_status(s)["state"] == "idle" for s in remotes[:2])
    monkeypatch.undo()
    group.update(model)  # and the next good update goes through


def test_a_refused_update_s_receive_that_travels_late_drops_no_later_update(
        remotes, trainer, monkeypatch):
    """A receive request of a refused update that reaches its server late (a loaded
    machine) lands before the trainer's abort; under the next update's lease it would
    start a receive of the refused update there, dropping the next one's (round 1
    stalled behind that server, or its commit refused). It carries the number of its own
    update, bound when it was queued: the server refuses it."""
    from hotweights.remote import delta
    model, group = trainer
    refused = group._seq + 1  # the number of the refused update's requests
    held, landed, queued = threading.Event(), threading.Event(), threading.Event()
    post, encode_each, late = group._post, delta.encode_each, []

    def late_post(url, status, route, **body):
        if route != "/hotweights/remote/receive" or url != remotes[0].url or \
                body.get("seq") != refused:
            return post(url, status, route, **body)
        late.append(body["update"])
        queued.set()
        held.wait(60)  # until the next update has started on the channel
        try:
            return post(url, status, route, **body)
        except HotweightsError as e:
            late.append(str(e))  # it carries its own update's number (queued then)
            raise
        finally:
            landed.set()

    def start_then_wait(self, *args, **kwargs):
        start(self, *args, **kwargs)
        if not held.is_set():
            held.set()
            landed.wait(60)  # the late request lands meanwhile

    def encode_once_queued(*args, **kwargs):  # the bad input fails the encode at once:
        queued.wait(60)  # not before the receive request is on its way (else it is
        yield from encode_each(*args, **kwargs)  # cancelled unsent and none travels late)
    start = Channel.start
    monkeypatch.setattr(group, "_post", late_post)
    monkeypatch.setattr(delta, "encode_each", encode_once_queued)
    monkeypatch.setattr(Channel, "start", start_then_wait)
    weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    weights["model.norm.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(HotweightsError, match="field 'shape' differs"):
        group.update(weights)
    with torch.no_grad():
        model.model.norm.weight.add_(1)
    out = group.update(model)
    assert "a request that arrived late, refused" in late[1] and not out["dropped"]
    assert {s.url: _status(s)["version"] for s in remotes[:2]} == out["servers"]


def test_the_servers_wait_for_an_encode_longer_than_the_timeout(remotes, trainer,
                                                                monkeypatch):
    # the workers wait for the update on the channel while the trainer encodes: up to the
    # lease, not the collective timeout; an encode that fails lets them go at once
    model, _ = trainer
    from hotweights.remote import delta
    encode_each = delta.encode_each
    slow = {"s": 11.0, "fail": False}

    def slow_encode(*args, **kwargs):
        time.sleep(slow["s"])
        if slow["fail"]:
            raise RuntimeError("the encode failed")
        yield from encode_each(*args, **kwargs)
    with RemoteGroup([s.url for s in remotes[:2]], token=TOKEN, timeout=10.0) as group:
        group.update(model)  # a full sync: no encode
        monkeypatch.setattr(delta, "encode_each", slow_encode)
        with torch.no_grad():
            model.model.norm.weight[0] += 1
        n = group.update(model)["version"]
        first, second = (_checksum(s) for s in remotes[:2])
        assert first == second
        assert {_status(s)["n"] for s in remotes[:2]} == {n}
        slow.update(s=1.0, fail=True)
        with torch.no_grad():
            model.model.norm.weight[0] += 1
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="the encode failed"):
            group.update(model)
        assert time.monotonic() - t < slow["s"] + 8  # not the lease's 60 s (loaded CI: margin)
        assert all(_status(s)["state"] == "idle" and _status(s)["n"] == n for s in remotes[:2])
        slow.update(s=0.0, fail=False)
        assert group.update(model)["version"] == n + 1


def test_a_wrong_token_changes_nothing(remotes, trainer):
    before = [_checksum(s) for s in remotes[:2]]
    with pytest.raises(Exception, match="401"):
        RemoteGroup([s.url for s in remotes[:2]], token="wrong-token").update(trainer[0])
    assert [_checksum(s) for s in remotes[:2]] == before


def test_a_bridge_and_two_remotes_update_as_one_transaction(remotes, monkeypatch):
    *far, local = remotes
    bridge = Bridge.connect(local.url, token=TOKEN)
    model = bridge.model(trainable=True)
    group = bridge.add_remote([s.url for s in far], token=TOKEN, timeout=10.0)
    ids = torch.tensor([PROMPT])
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        with bridge.update():
            _sign_step(model, 0.005)
    versions = {_status(s)["n"] for s in remotes}
    assert versions == {group.n} and bridge.version == f"{group.n}@{_status(local)['server_id']}"
    # one copy here, two copies there: the same bytes, the same tokens, the same version N
    assert _checksum(local) == _checksum(far[0]) == _checksum(far[1])
    served = [_greedy(s, PROMPT, 8) for s in remotes]
    assert served[0] == served[1] == served[2]
    # By default this server commits first: a remote that refuses leaves it at the new
    # version and the remotes at the old one, named; the next update catches them up.
    n, old = group.n, [_checksum(s) for s in far]
    norm = model.model.norm.weight
    with pytest.raises(RemoteError, match=rf"{local.url} serves version {n + 1}; the remote "
                       r"servers did not take it .*: `model.norm.weight`: the patch values hold "
                       "NaN or Inf"):
        with bridge.update():
            with torch.no_grad():
                saved = norm[0].item()
                norm[0] = float("nan")
    assert _status(local)["n"] == n + 1 and not _status(local)["dirty"]
    assert [_checksum(s) for s in far] == old and {_status(s)["n"] for s in far} == {n}
    with bridge.update():
        with torch.no_grad():
            norm[0] = saved
    assert {_status(s)["n"] for s in remotes} == {n + 2}
    assert _checksum(local) == _checksum(far[0]) == _checksum(far[1])
    # require="all": a remote refuses: the local step is undone, every server stays where
    # it was.
    group.require = "all"
    before = [(_status(s)["version"], _checksum(s)) for s in remotes]
    with pytest.raises(HotweightsError, match="`model.norm.weight`: the patch values hold NaN"):
        with bridge.update():
            with torch.no_grad():
                model.model.norm.weight[0] = float("nan")
                model.model.layers[0].mlp.up_proj.weight.add_(1)
    assert [(_status(s)["version"], _checksum(s)) for s in remotes] == before
    assert not _status(local)["dirty"]
    # This server commits but its answer is lost, after the remotes staged: they commit too
    # (the weights here are the new ones), and the error is raised.
    post = bridge._post

    def answer_lost(route, **kw):
        out = post(route, **kw)
        if route == "/hotweights/commit":
            raise ServerError("the commit's answer was lost")
        return out
    monkeypatch.setattr(bridge, "_post", answer_lost)
    with pytest.raises(ServerError, match="answer was lost"):
        with bridge.update():
            _sign_step(model, 0.005)
    monkeypatch.undo()
    assert _checksum(local) == _checksum(far[0]) == _checksum(far[1])
    assert {_status(s)["n"] for s in remotes} == {group.n}
    group.close()
    # No remote answers at all: this server still commits (never left paused), the error
    # names the remote.
    nobody = f"http://127.0.0.1:{launch.free_port()}"
    bridge.add_remote([nobody], token=TOKEN, timeout=2.0)
    n = _status(local)["n"]
    with pytest.raises(RemoteError, match=rf"{local.url} serves version {n + 1}; .*no answer "
                       rf"from {nobody}"):
        with bridge.update():
            _sign_step(model, 0.005)
    status = _status(local)
    assert status["state"] == "idle" and status["n"] == n + 1 and not status["dirty"]


@pytest.mark.timeout(480)  # starts a server of its own (~75 s, ~150 s loaded)
def test_a_server_killed_during_the_send_is_named_and_the_other_stays_old(
        remotes, trainer, tiny_model, tmp_path, monkeypatch):
    model, group = trainer
    group.require = "all"
    victim, survivor = remotes[1], remotes[0]
    group.max_round_bytes = 4096  # many rounds: the kill lands during the send
    before = (_status(survivor)["version"], _checksum(survivor))
    _kill_during_the_send(victim, monkeypatch)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    t0 = time.monotonic()
    with pytest.raises(RemoteError) as e:
        group.update(model)
    assert time.monotonic() - t0 < 30  # the timeout is 10 s
    assert victim.url in str(e.value) and "update not applied anywhere" in str(e.value)
    assert (_status(survivor)["version"], _checksum(survivor)) == before
    victim.proc.wait()
    # The restarted server rejoins: synced from the checkpoint it loaded, both serve one
    # version again.
    remotes[1] = _restarted(victim, tmp_path)
    group.max_round_bytes = 64 << 20
    out = group.update(model)
    assert out["from_checkpoint"] == [victim.url] and len(out["servers"]) == 2
    assert _checksum(remotes[0]) == _checksum(remotes[1])
    print(json.dumps(out))


@pytest.mark.timeout(480)  # starts a server of its own (~75 s, ~150 s loaded)
def test_a_server_that_dies_during_the_send_or_is_down_is_dropped_the_other_commits(
        remotes, trainer, tmp_path, monkeypatch):
    model, group = trainer
    victim, survivor = remotes[1], remotes[0]
    group.max_round_bytes = 4096  # many rounds: the kill lands during the send
    _kill_during_the_send(victim, monkeypatch)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    out = group.update(model)  # the send breaks; made again to the survivor
    assert out["servers"].keys() == {survivor.url} and victim.url in out["dropped"]
    # what left for the broken send counts too (the survivor's channel: one copy)
    assert out["bytes_sent"] > out["bytes"][survivor.url]
    assert _status(survivor)["n"] == out["version"] and not _status(survivor)["dirty"]
    _assert_serves(model, _greedy(survivor, PROMPT, 8))
    victim.proc.wait()
    with torch.no_grad():
        model.model.norm.weight[0] += 1
    out = group.update(model)  # down at the start: dropped at once
    assert out["servers"].keys() == {survivor.url} and "cannot reach" in out["dropped"][
        victim.url]
    remotes[1] = _restarted(victim, tmp_path)
    group.max_round_bytes = 64 << 20
    group.checkpoint = None  # nothing to sync it from: the whole model, to it alone
    with torch.no_grad():
        model.model.norm.weight[1] += 1
    out = group.update(model)
    assert out["full"] == [victim.url] and not out["dropped"]
    assert out["bytes"][victim.url] > _nbytes(model) > 100 * out["bytes"][survivor.url]
    assert _checksum(remotes[0]) == _checksum(remotes[1])
    assert {_status(s)["n"] for s in remotes[:2]} == {group.n}


@pytest.mark.timeout(480)  # starts a server of its own (~75 s, ~150 s loaded)
def test_a_server_killed_between_send_and_commit_is_named_and_the_other_serves_new(
        remotes, trainer, tmp_path):
    model, group = trainer
    victim, survivor = remotes[1], remotes[0]
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(0.01)
    pending = group.prepare(model)  # both staged the update
    # (at once: the survivor's acknowledgement may not have ended yet; its receive then
    # takes the trainer's verdict, Channel._ack)
    _kill(victim)
    victim.proc.wait()
    out = group.commit(pending)  # require="any": named, the survivor goes on
    assert out["servers"].keys() == {survivor.url} and victim.url in out["dropped"]
    assert _status(survivor)["n"] == group.n and _status(survivor)["state"] == "idle"
    remotes[1] = _restarted(victim, tmp_path)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[:2] += 0.01
    out = group.update(model)  # the restarted one: what differs from the checkpoint; the
    # survivor: only what changed since the last update
    assert out["from_checkpoint"] == [victim.url] and not out["full"]
    assert out["bytes"][survivor.url] < _nbytes(model) / 100 < out["bytes"][victim.url]
    assert out["bytes_sent"] == sum(out["bytes"].values())
    assert _checksum(remotes[0]) == _checksum(remotes[1])
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[2:4] += 0.01
    out = group.update(model)  # both up to date again: one encode, one channel
    assert not out["from_checkpoint"] and len(set(out["bytes"].values())) == 1
    assert len(group.links) == 1 and _checksum(remotes[0]) == _checksum(remotes[1])
    assert {_status(s)["n"] for s in remotes[:2]} == {group.n}


def _assert_serves_as_trained(server, model) -> None:
    """The server's greedy continuation has the trained model's logprobs, not those of the
    checkpoint it loaded (the updates moved them: ~5 here)."""
    tokens, logprobs = _greedy(server, PROMPT, 8)
    ids = torch.tensor([PROMPT + tokens])
    before = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.bfloat16)
    with torch.no_grad():
        ours, old = (torch.log_softmax(m(ids).logits[0, len(PROMPT) - 1:-1].float(), -1)
                     .gather(1, torch.tensor(tokens)[:, None]) for m in (model, before))
    assert (ours[:, 0] - torch.tensor(logprobs)).abs().max() < LOAD_TOL
    assert (ours - old).abs().max() > 5 * LOAD_TOL


@pytest.mark.timeout(480)  # starts a server of its own (~75 s, ~150 s loaded)
def test_fused_experts_reach_a_remote_server_through_its_loader(tiny_model, tmp_path):
    # transformers 5 fuses the experts ([E, 2I, H] gate_up_proj); the checkpoint, which the
    # server checks updates against, holds one tensor per expert. The group sends each
    # expert's gate, up and down under the checkpoint's names, as views of the fused
    # tensors; the server applies them through vLLM's loader into its FusedMoE w13 / w2.
    server = Server(tiny_model("qwen3_moe"), tmp_path, "--remote", cores=_core(0))
    try:
        model = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.bfloat16)
        with RemoteGroup([server.url], token=TOKEN, timeout=10.0) as group:
            assert group.update(model)["full"]
            for _ in range(2):
                _step_and_update(model, group)
        _assert_serves_as_trained(server, model)
    finally:
        server.stop()


@pytest.mark.timeout(480)  # starts a server of its own (~75 s, ~150 s loaded)
def test_a_tensor_vllm_keeps_in_float32_takes_bf16_and_float32_updates(tiny_model, tmp_path):
    # vLLM keeps Qwen3-Next's GDN A_log in float32 whatever it serves. A bf16 trainer's
    # values are widened into it (they were written bit for bit into the float32 slab); a
    # view model's are its float32 (they were refused: the servers expected bf16).
    model_dir = tiny_model("qwen3_next")
    (tmp_path / "far").mkdir()
    (tmp_path / "local").mkdir()
    far = Server(model_dir, tmp_path / "far", "--remote", wait=False, cores=_core(0))
    local = Server(model_dir, tmp_path / "local", wait=False, cores=_core(1))
    try:
        far.wait()
        local.wait()
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        a_log = [p for n, p in model.named_parameters() if n.endswith("A_log")]
        assert a_log and all(p.numel() > 2 for p in a_log)
        held = _status(far)["dtypes"]  # a float32 trainer's A_log is sent as it is
        assert held["default"] == "bfloat16" and held["others"] == {
            n: "float32" for n, _ in model.named_parameters() if n.endswith("A_log")}
        with RemoteGroup([far.url], token=TOKEN, timeout=10.0) as group:
            assert group.update(model)["full"]
            _step_and_update(model, group)  # every head's: sent dense
            with torch.no_grad():  # one head's: sent as a patch
                for p in a_log:
                    p[1] = 2.0
            out = group.update(model)
            assert not out["full"] and out["bytes_sent"] < 64 * 1024
        _assert_serves_as_trained(far, model)
        bridge = Bridge.connect(local.url, token=TOKEN)
        views = bridge.model(trainable=True)
        assert {p.dtype for n, p in views.named_parameters() if n.endswith("A_log")} == {
            torch.float32}
        group = bridge.add_remote([far.url], token=TOKEN, timeout=10.0)
        for value in (1.5, 1.25):  # a full sync, then a patch
            with bridge.update(), torch.no_grad():
                for n, p in views.named_parameters():
                    if n.endswith("A_log"):
                        p[0] = value
        assert _checksum(far) == _checksum(local)  # the same bytes, float32 A_log too
    finally:
        far.stop()
        local.stop()


@pytest.mark.timeout(480)  # starts a server of its own (~75 s, ~150 s loaded)
@pytest.mark.parametrize("arch", ["llama", "gpt_oss", "phi3"])
def test_a_tensor_parallel_server_is_updated_shard_by_shard(tiny_model, tmp_path, monkeypatch,
                                                            arch):
    # TP=2: each worker holds slices of the merged tensors; it stages only its shard of each
    # HF tensor and writes it straight into its slabs of them (GPT-OSS: its runs of expert
    # columns and rows, seen transposed; the down bias on the first worker only; Phi-3: its
    # qkv_proj and gate_up_proj, packed in the checkpoint too, cut as vLLM's loader cuts
    # them, each worker's q/k/v and gate/up runs decoded against their slabs). The server
    # takes one rank of the trainer's channel: its first worker receives each byte once and
    # hands it on to the other over the server's relay.
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("a TP=2 vLLM CPU server needs 2 cores, one per worker")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{cores[0]}|{cores[1]}")  # one NUMA node
    server = Server(tiny_model(arch), tmp_path, "--remote", "--tensor-parallel-size", "2")
    try:
        model = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(3)
        with RemoteGroup([server.url], token=TOKEN, timeout=10.0) as group:
            out = group.update(model)
            assert out["full"]
            # each worker decodes xor-coded values against its own shard (`Shard.gather`)
            assert group.links and all(link.xor for link in group.links)
            sent, total = out["bytes_sent"], _nbytes(model)
            got = _http(server.url, "/hotweights/remote/received")[2]
            staged, peak = got["staged_bytes"], got["peak_staging_bytes"]
            # each worker: about half (its shard + the replicated norms), + one round at peak
            assert all(0.4 * total < n < 0.6 * total for n in staged), (staged, total)
            assert total <= sum(staged) < 1.05 * total
            assert all(n < p <= n + sent for n, p in zip(staged, peak, strict=True))
            assert {k: _status(server)[k] for k in ("workers", "channel_ranks")} == {
                "workers": 2, "channel_ranks": 1}
            for step in range(3):
                if step == 2:  # and rows, as an embedding update sends them
                    with torch.no_grad():
                        rows = torch.randperm(model.model.embed_tokens.weight.shape[0],
                                              generator=g)[:4]
                        model.model.embed_tokens.weight[rows] += 0.05
                sent += _step_and_update(model, group)["bytes_sent"]
        got = _http(server.url, "/hotweights/remote/received")[2]
        assert {k: got[k] for k in ("trainer_bytes", "relay_bytes")} == {
            "trainer_bytes": [sent, 0], "relay_bytes": [0, sent]}  # since the server joined
        assert len(_checksum(server)) == 2
        _assert_serves_as_trained(server, model)
    finally:
        server.stop()

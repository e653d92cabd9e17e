"""`RemoteGroup`'s own decisions, without servers: when the checkpoint the servers loaded may
serve as the old values, the update refused when it changed under the encode, and what a
server that fails a renewal, a send or a join, or a step that cannot be undone, leaves."""

import os
import re
import socket
import threading
import types

import pytest
import torch
from safetensors.torch import save_file

from hotweights import RemoteError, RemoteGroup
from hotweights.checkpoint.digest import digest
from hotweights.errors import ServerError
from hotweights.protocol import tokens
from hotweights.remote import delta, packing
from hotweights.remote.group import _Plan, channel_device
from hotweights.remote.links import Links
from hotweights.remote.rendezvous import PROTOCOL
from hotweights.testing import tiny


@pytest.fixture
def checkpoint(tmp_path):
    g = torch.Generator().manual_seed(0)
    weights = {"a.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
               "b.weight": torch.randn(32, generator=g).to(torch.bfloat16)}
    save_file(weights, tmp_path / "model.safetensors")
    return tmp_path, weights


def test_the_checkpoint_serves_as_old_values_only_when_it_is_what_the_servers_hold(checkpoint):
    ckpt, weights = checkpoint
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, checkpoint=ckpt)
    new = {k: t.clone() for k, t in weights.items()}
    held = [{"checkpoint": digest(ckpt)}]
    assert group._checkpoint_for(held, new).keys() == new.keys()
    assert group._checkpoint_for([{"checkpoint": "another"}], new) is None
    assert group._checkpoint_for([{"checkpoint": None}], new) is None
    assert group._checkpoint_for(held, dict(new, extra=torch.zeros(2))) is None
    assert group._checkpoint_for(held, dict(new, **{"b.weight": torch.zeros(32)})) is None
    assert RemoteGroup(["http://127.0.0.1:1"], token="t" * 32)._checkpoint_for(held, new) \
        is None


def test_a_float32_checkpoint_serves_bf16_servers_as_they_rounded_it(tmp_path):
    # vLLM serves a float32 checkpoint in bf16: a restarted server holds each value rounded
    g = torch.Generator().manual_seed(0)
    weights = {"a.weight": torch.randn(64, 32, generator=g), "b.weight": torch.randn(32)}
    save_file(weights, tmp_path / "model.safetensors")
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, checkpoint=tmp_path)
    new = {"a.weight": weights["a.weight"].to(torch.bfloat16), "b.weight": weights["b.weight"]}
    new["a.weight"][3] += 1
    held = [{"checkpoint": digest(tmp_path)}]
    old = group._checkpoint_for(held, new)
    assert old is group._checkpoint_for(held, new)  # one channel for every such server
    assert torch.equal(old["a.weight"], weights["a.weight"].to(torch.bfloat16))
    assert old["b.weight"].dtype == torch.float32  # the servers keep it so
    deltas = list(group._encode(_Plan(["u"], old, False), new, set(), None))
    assert [(d.kind, d.dtype) for d in deltas] == [("rows", torch.bfloat16),
                                                  ("same", torch.float32)]
    wider = dict(new, **{"b.weight": torch.zeros(32, dtype=torch.float64)})
    assert group._checkpoint_for(held, wider) is None  # no server rounds a checkpoint up


def test_reference_checkpoint_refuses_servers_that_round_the_trainer_s_floats(checkpoint,
                                                                              monkeypatch):
    ckpt, weights = checkpoint
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, checkpoint=ckpt,
                        reference="checkpoint")
    status = {group.urls[0]: {"server_id": "s", "n": 0, "dtypes": {"default": "bfloat16"}}}
    monkeypatch.setattr(group, "_status", lambda urls, dropped: (status, dropped))
    monkeypatch.setattr(packing, "warm", lambda dtypes: None)
    with pytest.raises(RemoteError, match=r"reference='checkpoint': the servers hold "
                       r"`a.weight` \(and 1 more\) in torch.bfloat16, narrower than the "
                       r"trainer's torch.float32, .* use reference='copy'"):
        group.prepare({k: t.float() for k, t in weights.items()})


def test_an_encode_that_sees_the_checkpoint_written_is_refused(checkpoint, monkeypatch):
    ckpt, weights = checkpoint
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, checkpoint=ckpt)
    new = {k: t.clone() for k, t in weights.items()}
    new["a.weight"][3] += 1
    plan = _Plan(["u"], group._checkpoint_for([{"checkpoint": digest(ckpt)}], new), False)
    deltas = list(group._encode(plan, new, set(), None))
    assert [d.kind for d in deltas] == ["rows", "same"]
    encode_each = delta.encode_each

    def written_meanwhile(*args, **kwargs):  # journal mode writes in place, under the map
        yield from encode_each(*args, **kwargs)
        shard = ckpt / "model.safetensors"
        st = shard.stat()
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    monkeypatch.setattr(delta, "encode_each", written_meanwhile)
    with pytest.raises(RemoteError, match=rf"^{ckpt} was written during the update; the "
                                          "update was given up on every server: update "
                                          "again$"):
        list(group._encode(plan, new, set(), None))


@pytest.mark.parametrize("bad", [0, 63, 4096.0, "64"])
def test_a_bad_round_budget_is_named(bad):
    with pytest.raises(RemoteError, match=r"field 'max_round_bytes' must be an int >= 64, "
                                          rf"found {bad!r}"):
        RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, max_round_bytes=bad)


def _update(group, weights, new, **kw):
    """What `prepare` encodes and `commit` remembers, without servers: the deltas."""
    plan = _Plan(["u"], group.reference.tensors, group.reference.tensors is not None)
    kept, frozen_prints = group.reference.kept(new, group.reference.frozen(weights, new),
                                                  plan.held)
    rows, prints = group._prefilter.rows(new, use=plan.held)
    deltas = list(group._encode(plan, new, kept, rows))
    group.reference.remember(new, deltas if plan.held else None, frozen_prints)
    group._prefilter.prints = prints
    group._held = {"u": ("s", group.n)}  # as a commit leaves it
    return {d.name: d.kind for d in deltas}


def test_only_the_trainable_tensors_are_copied_the_rest_fingerprinted(checkpoint, caplog):
    _, weights = checkpoint
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, trainable=["a.*"])
    new = {k: t.clone() for k, t in weights.items()}
    assert _update(group, new, new) == {"a.weight": "dense", "b.weight": "dense"}  # full
    assert group.reference.tensors.keys() == {"a.weight"} and \
        group.reference.frozen_prints.keys() == {
        "b.weight"}
    new["a.weight"][3, 4] += 1
    assert _update(group, new, new) == {"a.weight": "patch"}  # b: its fingerprint, unread
    assert torch.equal(group.reference.tensors["a.weight"], new["a.weight"])
    new["b.weight"][0] += 1  # "cannot change", did: sent whole, copied from now on
    assert _update(group, new, new) == {"a.weight": "same", "b.weight": "dense"}
    assert "b.weight" in caplog.text and "sent whole, and copied from now on" in caplog.text
    assert group.reference.tensors.keys() == {"a.weight", "b.weight"} and \
        not group.reference.frozen_prints
    new["b.weight"][1] += 1
    assert _update(group, new, new)["b.weight"] == "patch"
    assert torch.equal(group.reference.tensors["b.weight"], new["b.weight"])


def test_a_step_that_changed_a_tensor_that_cannot_change_is_not_taken_as_undone(checkpoint,
                                                                                caplog):
    # the group keeps no old values of a frozen tensor: a step that wrote one cannot be
    # undone, so the local server's abort must say its weights are dirty
    _, weights = checkpoint
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, trainable=["a.*"])
    new = {k: t.clone() for k, t in weights.items()}
    _update(group, new, new)
    new["a.weight"][3, 4] += 1
    assert group.restore(new) and torch.equal(new["a.weight"], weights["a.weight"])
    new["a.weight"][3, 4] += 1
    new["b.weight"][0] += 1
    assert not group.restore(new)
    assert "b.weight" in caplog.text and "cannot be written back" in caplog.text
    caplog.clear()
    assert not group.restore({"a.fused": new["a.weight"],  # not the checkpoint's names
                              "b.weight": weights["b.weight"]})
    assert "the step cannot be undone: 1 (of 1) is no tensor of the model under its " \
        "checkpoint name, nor a view of one (e.g. a.weight" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint16, torch.bfloat16])
def test_the_reference_takes_a_patch_in_every_dtype(dtype):
    # torch's index_copy_ has no CPU kernel for FP8 or uint16: the commit raised after every
    # server had committed, and each later patch update sent the whole model again
    from hotweights.remote.reference import Reference

    old = (torch.arange(64) % 50).to(dtype).reshape(8, 8)
    new = old.clone()
    new.view(-1).view(torch.uint8 if dtype.itemsize == 1 else torch.int16)[[3, 40]] ^= 1
    ref = Reference()
    ref.remember({"w": old}, None, {})
    d = delta.encode("w", old, new)
    assert d.kind == delta.PATCH
    ref.remember({"w": new}, [d], {})
    assert torch.equal(ref.tensors["w"].view(-1).view(torch.uint8),
                       new.view(-1).view(torch.uint8))


def test_the_deltas_kept_for_the_commit_let_go_of_the_old_values_the_send_read():
    from hotweights.remote.group import _Encoded

    old = torch.zeros(64, dtype=torch.bfloat16)
    new = old.clone()
    new[[3, 40]] = 1
    kept = _Encoded()
    (sent,) = kept.read(iter([delta.encode("w", old, new)]))
    assert sent.kind == delta.PATCH and sent.old_values is not None  # the send's xor reads
    assert kept[0].old_values is None and torch.equal(kept[0].values, sent.values)


def test_a_full_resync_writes_into_the_reference_it_holds_not_a_second_copy():
    from hotweights.remote.reference import Reference

    ref, new = Reference(), {"w": torch.randn(8, 8), "b": torch.randn(8)}
    ref.remember(new, None, {})
    held = {k: t.data_ptr() for k, t in ref.tensors.items()}
    newer = {"w": torch.randn(8, 8), "b": torch.randn(4)}  # "b" another shape: a new copy
    ref.remember(newer, None, {})  # no server held the reference: copied whole again
    assert ref.tensors["w"].data_ptr() == held["w"]
    assert all(torch.equal(ref.tensors[k], t) for k, t in newer.items())


def test_frozen_fused_experts_are_named_without_copying_them(monkeypatch):
    from transformers import AutoModelForCausalLM

    from hotweights.checkpoint.names import reverted
    model = AutoModelForCausalLM.from_config(tiny.make_config("qwen3_moe", 256))
    for n, p in model.named_parameters():
        p.requires_grad_("experts" not in n)
    new = reverted(model.state_dict(), model=model)  # the checkpoint's names
    copies = []

    def counting(real):
        def counted(t, *args, **kwargs):
            out = real(t, *args, **kwargs)
            if out.device.type != "meta" and out.data_ptr() != t.data_ptr():
                copies.append(tuple(out.shape))
            return out
        return counted
    monkeypatch.setattr(torch.Tensor, "contiguous", counting(torch.Tensor.contiguous))
    frozen = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32).reference.frozen(model, new)
    monkeypatch.undo()
    assert frozen == {k for k in new if ".experts." in k} and frozen
    assert not copies  # (each prepare asks: the experts' copies, on the trainer's device)


def test_trainable_defaults_to_the_parameters_that_require_grad():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    new = {k: p.detach() for k, p in model.named_parameters()}
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32)
    assert group.reference.frozen(model, new) == {"0.weight", "0.bias"}
    assert group.reference.frozen(new, new) == set()  # a mapping: every tensor may change
    with pytest.raises(RemoteError, match=r"field 'trainable': \['2\.\*'\] match\(es\) no "
                       "tensor"):
        RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, trainable=["0.*", "2.*"]
                    ).reference.frozen(model, new)


def test_servers_hold_the_delta_the_checkpoint_or_nothing_each_sent_its_own(checkpoint):
    # up to date: the delta; restarted from the checkpoint given: what differs from it;
    # restarted from another: the whole model. Never one encode for all (a full sync for
    # everyone, or what differs from either)
    ckpt, weights = checkpoint
    urls = [f"http://127.0.0.{i}:1" for i in (1, 2, 3)]
    group = RemoteGroup(urls, token="t" * 32, checkpoint=ckpt)
    group.reference.tensors, group.n = {k: t + 1 for k, t in weights.items()}, 3
    group._held = {urls[0]: ("a", 3), urls[1]: ("b", 3)}
    status = {urls[0]: {"server_id": "a", "n": 3, "checkpoint": None},
              urls[1]: {"server_id": "b2", "n": 0, "checkpoint": digest(ckpt)},  # restarted
              urls[2]: {"server_id": "c", "n": 0, "checkpoint": "another"}}
    new = {k: t.clone() for k, t in weights.items()}
    held, loaded, whole = group._plans(status, new)
    assert (held.urls, held.held, held.reference is group.reference.tensors) == (
        [urls[0]], True, True)
    assert (loaded.urls, loaded.held, loaded.reference.keys()) == ([urls[1]], False,
                                                                   weights.keys())
    assert (whole.urls, whole.reference) == ([urls[2]], None)


def test_a_server_restarted_from_the_synced_checkpoint_shares_the_delta(checkpoint):
    # reference="checkpoint": the synced checkpoint is what every server holds, the
    # restarted one too (its digest says so): one encode, one channel
    ckpt, weights = checkpoint
    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1"]
    group = RemoteGroup(urls, token="t" * 32, checkpoint=ckpt, reference="checkpoint")
    group.n = 3
    group.checkpoint.sync(weights, 3)
    group._held = {urls[0]: ("a", 3)}
    status = {urls[0]: {"server_id": "a", "n": 3, "checkpoint": None},
              urls[1]: {"server_id": "b", "n": 0, "checkpoint": digest(ckpt)}}
    (plan,) = group._plans(status, {k: t.clone() for k, t in weights.items()})
    assert plan.urls == urls and plan.held and plan.reference is group.checkpoint.tensors()


def _prepared(group, status, new, monkeypatch):
    """`prepare`'s bookkeeping without servers: each plan encoded, nothing sent."""
    monkeypatch.setattr(group.links, "connect", lambda status, backend, device: None)
    def send(status, plans, encode, cut, mode, lease_s, meanwhile, pause_ahead):
        meanwhile()
        return [(list(encode(plan)), 0, 0) for plan, _ in plans]
    monkeypatch.setattr(group, "_send", send)
    return group._prepare(new, new, status, "wait", None, 0.0, {}, False, {})


def test_a_checkpoint_in_a_wider_float_is_refused_at_the_first_update(tmp_path,
                                                                      monkeypatch):
    """reference="checkpoint" on a float32 checkpoint that bf16 servers loaded: their
    deltas could be taken against its rounded values, but its sync after the commit would
    be refused (and the next update be a full one): refused before anything is sent."""
    weights = {"a.weight": torch.randn(64, 32), "b.weight": torch.randn(32)}
    save_file(weights, tmp_path / "model.safetensors")
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, checkpoint=tmp_path,
                        reference="checkpoint")
    new = {k: t.to(torch.bfloat16) for k, t in weights.items()}
    status = {u: {"server_id": "s", "n": 0, "checkpoint": digest(tmp_path)}
              for u in group.urls}
    with pytest.raises(RemoteError, match=r"reference='checkpoint': `a.weight` is "
                       r"torch.bfloat16 \(64, 32\), the checkpoint .* holds torch.float32"):
        _prepared(group, status, new, monkeypatch)


def test_servers_all_synced_from_the_checkpoint_leave_the_reference_whole(checkpoint,
                                                                         monkeypatch):
    # the deltas were taken against the checkpoint, not against `reference`: patching the
    # reference with them would leave it wrong wherever it differed from the checkpoint
    ckpt, weights = checkpoint
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, checkpoint=ckpt)
    group.reference.tensors = {k: t + 1 for k, t in weights.items()}  # a server held it
    new = {k: t.clone() for k, t in weights.items()}
    new["a.weight"][0] += 1
    status = {u: {"server_id": "s", "n": 4, "checkpoint": digest(ckpt)} for u in group.urls}
    pending = _prepared(group, status, new, monkeypatch)
    assert pending.deltas is None and pending.from_checkpoint == tuple(group.urls)
    monkeypatch.setattr(group, "_each", lambda fn, **kw: {
        u: {"version": f"5@{u}"} for u in group.urls})
    group.commit(pending)
    assert all(torch.equal(group.reference.tensors[k], t) for k, t in new.items())
    # beside a server that holds `reference`: its deltas patch the reference, not the
    # restarted one's (taken against the checkpoint)
    group.urls.append("http://127.0.0.2:1")
    status = {group.urls[0]: {"server_id": "s", "n": 5, "checkpoint": None},
              group.urls[1]: {"server_id": "t", "n": 0, "checkpoint": digest(ckpt)}}
    new["b.weight"][3] += 1
    pending = _prepared(group, status, new, monkeypatch)
    assert pending.from_checkpoint == (group.urls[1],) and not pending.full
    assert {d.name: d.kind for d in pending.deltas} == {"a.weight": "same", "b.weight": "patch"}
    group.commit(pending)
    assert all(torch.equal(group.reference.tensors[k], t) for k, t in new.items())


def test_servers_of_another_channel_protocol_are_named_before_any_join(monkeypatch):
    from hotweights.remote import group as group_module
    from hotweights.remote.rendezvous import PROTOCOL

    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1", "http://127.0.0.3:1"]
    answers = {urls[0]: PROTOCOL, urls[1]: PROTOCOL - 1, urls[2]: None}  # None: too old
    monkeypatch.setattr(group_module, "request", lambda u, *a, **k: {
        "remote": True, "n": 0, "server_id": "s",
        **({} if answers[u] is None else {"protocol": answers[u]})})
    group = RemoteGroup(urls, token="t" * 32)
    monkeypatch.setattr(group.links, "connect", lambda *a: pytest.fail("joined"))
    with pytest.raises(RemoteError, match=re.escape(
            f"channel protocol {{'{urls[1]}': {PROTOCOL - 1}, '{urls[2]}': '< 3'}} on those "
            f"servers, {PROTOCOL} on this trainer: run the same hotweights version")):
        group.update({"w": torch.zeros(4)})


def test_an_update_waits_for_the_device_work_queued_on_the_weights_first(monkeypatch):
    from hotweights.remote import group as group_module

    class Settled(Exception):
        pass

    def settle(tensors):  # torch.accelerator.synchronize per device: a GPU's side streams
        assert list(tensors) == ["w"]
        raise Settled
    monkeypatch.setattr(group_module, "settle", settle)
    monkeypatch.setattr(group_module, "request", lambda *a, **k: pytest.fail("read first"))
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32)
    with pytest.raises(Settled):
        group.prepare({"w": torch.zeros(4)})


def test_a_fixed_master_port_takes_the_next_free_ports_for_more_channels():
    import socket

    from hotweights.remote.hosts import free_port

    base = free_port("127.0.0.1")
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, master_port=base)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", base))  # someone else's
        assert group.links.port() > base and free_port("127.0.0.1", group.links.port())


def test_a_channel_port_on_an_ipv6_address_or_none_of_this_host_s():
    import socket

    from hotweights.remote.hosts import free_port

    if socket.has_ipv6 and free_port("::1"):  # a host with IPv6 on its loopback
        assert RemoteGroup(["http://[::1]:1"], token="t" * 32,
                           master_addr="::1").links.port() > 0
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, master_addr="192.0.2.1")
    with pytest.raises(RemoteError, match=r"no free port on 192\.0\.2\.1 for a channel: is "
                                          r"it an address of this host"):
        group.links.port()  # not port 0 handed to the servers


def test_the_default_master_addr_is_this_hosts_address_on_the_route_to_the_servers():
    from hotweights.remote.hosts import route_address

    assert RemoteGroup(["http://127.0.0.1:1"], token="t" * 32).master_addr == "127.0.0.1"
    assert route_address("http://127.0.0.1:8000") == "127.0.0.1"  # the kernel's source
    try:  # another host: the address this one sends to it from (no packet sent)
        far = route_address("http://10.255.255.1:8000")
    except RemoteError:  # a machine without a route off itself
        far = None
    if far is not None:
        assert far != "127.0.1.1"
        assert RemoteGroup(["http://10.255.255.1:8000"], token="t" * 32).master_addr == far
        assert RemoteGroup(["http://127.0.0.1:1", "http://10.255.255.1:8000"],  # local first
                           token="t" * 32).master_addr == far
    with pytest.raises(RemoteError, match=r"http://no-such-host\.invalid:8000: no route to "
                       r"its host from here .*pass RemoteGroup\(master_addr=\)"):
        route_address("http://no-such-host.invalid:8000")


def test_a_receiver_that_does_not_join_names_the_interface_variables():
    from hotweights.remote.channel import Channel
    from hotweights.server.launch import free_port

    with pytest.raises(RemoteError, match=r"did not join within 1\.0 s; can every server "
                       r"reach 127\.0\.0\.1 .*GLOO_SOCKET_IFNAME \(CPU\) or NCCL_SOCKET_IFNAME"):
        Channel(master_addr="127.0.0.1", master_port=free_port(), rank=0, world_size=2,
                token="t" * 16, timeout=1.0)


def test_the_channel_backend_follows_the_servers_devices():
    from hotweights.remote.hosts import channel_backend

    assert channel_backend({"http://a": {"device": "cpu"}, "http://b": {}}) == "gloo"
    with pytest.raises(RemoteError, match=r"different kinds of device .*'http://b': 'cuda'.*"
                       "one RemoteGroup per kind"):
        channel_backend({"http://a": {"device": "cpu"}, "http://b": {"device": "cuda"}})
    with pytest.raises(RemoteError, match=r"^http://a: workers on 'xpu' devices"):
        channel_backend({"http://a": {"device": "xpu"}})
    if torch.cuda.is_available():
        assert channel_backend({"http://a": {"device": "cuda"}}) == "nccl"
    else:
        with pytest.raises(RemoteError, match=r"their channel is NCCL, which needs a CUDA "
                           "device in this process too"):
            channel_backend({"http://a": {"device": "cuda"}})


@pytest.mark.parametrize("require", ["any", "all"])
def test_a_server_whose_renewal_fails_does_not_stop_the_others(require, caplog):
    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1"]
    group = RemoteGroup(urls, token="t" * 32, require=require)
    group._leased = {u: {"server_id": "s"} for u in urls}
    renewed = []

    def post(url, status, route, **body):
        if url == urls[1]:
            raise ServerError(f"{url}: connection refused")
        renewed.append(url)
    group._post = post
    if require == "all":
        with pytest.raises(RemoteError, match=rf"{urls[1]}: connection refused"):
            group.renew(1.0)
        return
    group.renew(1.0)
    group.renew(1.0)  # the next renewal still reaches the live one
    assert renewed == [urls[0]] * 2 and f"{urls[1]}: connection refused" in caplog.text
    group._leased = {urls[1]: {"server_id": "s"}}
    with pytest.raises(RemoteError, match="connection refused"):  # none renewed
        group.renew(1.0)


def test_servers_that_die_one_after_the_other_are_each_dropped(monkeypatch):
    urls = [f"http://127.0.0.{i}:1" for i in (1, 2, 3)]
    group, dead, tried = RemoteGroup(urls, token="t" * 32), set(), []

    def status(among, dropped):
        return ({u: {} for u in among if u not in dead},
                {**dropped, **{u: "gone" for u in among if u in dead}})

    def prepare(weights, new, status, *rest):
        tried.append(sorted(status))
        if len(tried) < 3:  # one more server dies during each send
            dead.add(urls[len(tried)])
            raise RemoteError(f"{urls[len(tried)]}: stopped")
        return "prepared"
    monkeypatch.setattr(group, "_status", status)
    monkeypatch.setattr(group, "_prepare", prepare)
    assert group.prepare({"a": torch.zeros(2)}) == "prepared"
    assert tried == [urls, urls[::2], urls[:1]]


def test_a_server_that_refuses_to_join_is_named_not_a_rendezvous_timeout():
    def post(url, status, route, **body):
        raise ServerError(f"{url}: 409 an update is staging; join between updates")
    links = Links(master_addr="127.0.0.1", master_port=0, timeout=1.0,
                  max_round_bytes=1 << 20, post=post)
    with pytest.raises(RemoteError, match=r"^joining the channel failed on http://b:8000: "
                                          "http://b:8000: 409 an update is staging"):
        links.connect({"http://b:8000": {"server_id": "s", "channel_ranks": 1}}, "gloo")


def test_an_nccl_channel_lies_on_the_device_it_is_given(monkeypatch):
    from hotweights.remote import links as links_module

    made = []

    def channel(**kwargs):  # (an NCCL channel needs GPUs)
        made.append(kwargs)
        raise RemoteError("no GPU here")
    monkeypatch.setattr(links_module, "Channel", channel)
    links = Links(master_addr="127.0.0.1", master_port=0, timeout=1.0,
                  max_round_bytes=1 << 20, post=lambda *a, **k: {})
    with pytest.raises(RemoteError, match="no GPU here"):  # the trainer's weights on GPU 1
        links.connect({"http://b:8000": {"server_id": "s", "channel_ranks": 1}}, "nccl",
                      torch.device("cuda", 1))
    assert made[0]["backend"] == "nccl" and made[0]["device"] == torch.device("cuda", 1)


def test_the_first_update_compiles_the_encode_ahead_on_a_thread_of_its_own(monkeypatch):
    """The first `prepare` (a full sync, whatever it finds) starts compiling the loops the
    next updates encode with, for the weights' dtypes, on a thread that is not a daemon;
    once: the next updates do not start another."""
    warmed = []
    monkeypatch.setattr(packing, "warm", lambda dtypes: warmed.append(
        (threading.current_thread().name, dtypes)))
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, timeout=1)
    status = {group.urls[0]: {"server_id": "s", "n": 0, "dtypes": {
        "default": "bfloat16", "others": {"b": "float32"}}}}
    monkeypatch.setattr(group, "_status", lambda urls, dropped: (status, dropped))

    def fail(*args):
        raise RemoteError("no answer")
    monkeypatch.setattr(group, "_prepare", fail)
    weights = {"w": torch.zeros(4, 8), "b": torch.zeros(3)}  # w: sent in bf16
    with pytest.raises(RemoteError, match="no answer"):
        group.prepare(weights)
    warm = group._warm
    assert warm.name == "hotweights-jit-warm" and not warm.daemon
    with pytest.raises(RemoteError, match="no answer"):
        group.prepare(weights)
    assert group._warm is warm
    warm.join()
    assert warmed == [("hotweights-jit-warm", {torch.bfloat16, torch.float32})]


def test_a_float32_trainer_sends_bf16_servers_its_weights_as_they_hold_them(monkeypatch):
    # as vLLM's loader loads a float32 checkpoint into a bf16 model: each value rounded to
    # the nearest bf16; a tensor the servers keep in float32 stays float32, integers as
    # they are. The deltas are taken against what the servers hold.
    monkeypatch.setattr(packing, "warm", lambda dtypes: None)
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32)
    status = {group.urls[0]: {"server_id": "s", "n": 0, "device": "cpu", "dtypes": {
        "default": "bfloat16", "others": {"router": "float32", "ids": "int64"}}}}
    monkeypatch.setattr(group, "_status", lambda urls, dropped: (status, dropped))
    monkeypatch.setattr(group.links, "connect", lambda status, backend, device: None)
    sent = []

    def send(status, plans, encode, cut, mode, lease_s, meanwhile, pause_ahead):
        meanwhile()
        sent[:] = [d for plan, _ in plans for d in encode(plan)]
        return [(list(sent), 0, 0) for plan, _ in plans]
    monkeypatch.setattr(group, "_send", send)
    monkeypatch.setattr(group, "_each", lambda fn, **kw: {u: {"version": "1@s"}
                                                           for u in group.urls})
    torch.manual_seed(0)
    weights = {"w": torch.randn(8, 16), "router": torch.randn(4, 16), "ids": torch.arange(4)}
    before = {k: t.clone() for k, t in weights.items()}
    group.commit(group.prepare(weights))
    assert {d.name: (d.kind, d.dtype) for d in sent} == {
        "w": ("dense", torch.bfloat16), "router": ("dense", torch.float32),
        "ids": ("dense", torch.int64)}
    held = group.reference.tensors
    assert torch.equal(held["w"], before["w"].to(torch.bfloat16))
    assert torch.equal(held["router"], before["router"]) and held["router"].dtype == \
        torch.float32
    status[group.urls[0]]["n"] = 1  # it holds what this group sent
    weights["w"][0, 0] += 1e-6  # below bf16's resolution there: the servers hold the same
    weights["w"][5] += 1.0
    group.commit(group.prepare(weights), 2)
    assert {d.name: d.kind for d in sent} == {"w": "rows", "router": "same", "ids": "same"}
    assert torch.equal(held["w"], weights["w"].to(torch.bfloat16))
    pending = group.prepare(weights)  # a write between prepare and commit, seen on the
    weights["router"][0, 0] += 1  # trainer's own float32 tensor
    group.commit(pending, 3)
    assert group._held == {}
    weights["w"] += 1
    stepped = weights["w"].clone()
    assert not group.restore(weights)  # the servers' values would round the trainer's
    assert torch.equal(weights["w"], stepped)


def _pending(urls, *, sent=0, floor=0, new=None):
    """A prepared update as `prepare` leaves it (every server staged it)."""
    from hotweights.remote.group import Pending
    new = new or {}
    return Pending(status={u: {"server_id": "s"} for u in urls}, new=new, deltas=None,
                   full=(), from_checkpoint=(), prints=None, sent=sent, carried={},
                   started=0.0, floor=floor, frozen={}, dropped={}, lease_s=240.0,
                   written={k: (t, t._version) for k, t in new.items()})


def _posting(group):
    """Record every request the group makes: (url, route, http_timeout)."""
    posted = []

    def post(url, status, route, *, http_timeout=None, **body):
        posted.append((url, route, http_timeout))
        return {"version": f"{body.get('n')}@s"}
    group._post = post
    return posted


def _commit_breaks_on(group: RemoteGroup, url: str) -> None:
    """`group`'s commit to `url` breaks (the connection); its other requests go on."""
    answer = group._post

    def post(u, status, route, **body):
        if (u, route) == (url, "/hotweights/commit"):
            raise ServerError(f"POST {route}: the connection to {u} broke")
        return answer(u, status, route, **body)
    group._post = post


def test_a_version_number_not_above_the_servers_aborts_the_staged_update_everywhere():
    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1"]
    group = RemoteGroup(urls, token="t" * 32)
    posted = _posting(group)
    with pytest.raises(RemoteError, match="version number 3 must be above 5; the update was "
                       "aborted on every server"):
        group.commit(_pending(urls, sent=1234, floor=5), 3)
    assert sorted(posted) == [(u, "/hotweights/abort", None) for u in urls]
    assert group.bytes_sent == 1234  # sent all the same
    group.abort(_pending(urls, sent=100))
    assert group.bytes_sent == 1334


def test_a_commit_waits_for_the_servers_as_long_as_their_pause_may_take():
    urls = ["http://127.0.0.1:1"]
    group = RemoteGroup(urls, token="t" * 32, timeout=10.0)
    posted = _posting(group)
    assert group.commit(_pending(urls), 1)["servers"] == {urls[0]: "1@s"}
    assert posted == [(urls[0], "/hotweights/commit", 240.0 + 10.0 + 60)]
    group._leased = {urls[0]: {"server_id": "s"}}
    group.renew(30.0)  # a hung server answers within a third of the lease, or is named
    assert posted[-1] == (urls[0], "/hotweights/renew", 10.0)


def test_weights_changed_between_prepare_and_commit_are_synced_again(caplog):
    urls = ["http://127.0.0.1:1"]
    group = RemoteGroup(urls, token="t" * 32)
    _posting(group)
    weight = torch.zeros(4)
    group.commit(_pending(urls, new={"w": weight}), 1)
    assert group._held == {urls[0]: ("s", 1)}  # sent the delta at the next update
    pending = _pending(urls, new={"w": weight})
    weight.add_(1)  # the trainer's next step, before this commit
    group.commit(pending, 2)
    assert group._held == {} and "1 tensor(s) changed between prepare and commit" in caplog.text


def test_a_commit_whose_copy_cannot_be_kept_leaves_none_held(monkeypatch, caplog):
    # the servers committed all the same (the group counts the version and cleans up as
    # ever), but no copy says what they hold: a server still named as holding it would get
    # deltas against values the group does not have; the next update syncs them whole
    urls = ["http://127.0.0.1:1"]
    group = RemoteGroup(urls, token="t" * 32)
    _posting(group)
    group.commit(_pending(urls, new={"w": torch.zeros(4)}), 1)
    assert group._held == {urls[0]: ("s", 1)}

    def no_memory(*args):
        raise MemoryError("the host copy")
    monkeypatch.setattr(group.reference, "remember", no_memory)
    result = group.commit(_pending(urls, new={"w": torch.ones(4)}), 2)
    assert result["version"] == 2 and group.n == 2 and group._held == {}
    assert "version 2: the copy of what the servers now hold could not be kept" in caplog.text


def test_the_buffers_a_checkpoint_holds_are_weights_that_cannot_change():
    # DeepSeek-V3's router bias: a persistent buffer, which the servers map as a weight
    from hotweights.remote.group import _weights

    model = torch.nn.Linear(4, 4)
    model.register_buffer("correction", torch.zeros(4))
    model.register_buffer("table", torch.ones(2), persistent=False)  # computed, not saved
    new = _weights(model)
    assert set(new) == {"weight", "bias", "correction"}
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32)
    assert group.reference.frozen(model, new) == {"correction"}  # fingerprinted: a change
    # (aux-loss-free balancing) is sent whole, and copied from then on


def test_fused_experts_are_sent_as_views_and_a_step_on_them_undone():
    """transformers 5 fuses MoE experts ([E, 2I, H] gate_up_proj): the group sends them per
    expert under the checkpoint's names as views of the live tensors, not copies (no
    second copy of the experts on the trainer's device; a write during the encode is seen),
    so `restore` writes the old values back through them."""
    from transformers import AutoModelForCausalLM

    from hotweights.remote.group import _weights
    from hotweights.testing import tiny

    model = AutoModelForCausalLM.from_config(tiny.make_config("qwen3_moe", 300))
    live = {p.untyped_storage().data_ptr() for p in model.parameters()}
    new = _weights(model)
    gate = "model.layers.0.mlp.experts.1.gate_proj.weight"
    assert gate in new and all(t.untyped_storage().data_ptr() in live for t in new.values())
    fused = model.model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(new[gate], fused[1, :fused.shape[1] // 2])
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32)
    _update(group, model, new)
    before = {k: t.clone() for k, t in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert group.restore(model)
    assert all(torch.equal(t, before[k]) for k, t in model.state_dict().items())


def test_a_checkpoint_written_since_the_group_synced_it_is_not_what_the_servers_hold(
        checkpoint):
    # reference="checkpoint": the trainer's own save (or another program) into the
    # directory between two updates: deltas against it would skip what it changed
    ckpt, weights = checkpoint
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, checkpoint=ckpt,
                        reference="checkpoint")
    group.n = 3
    group.checkpoint.sync(weights, 3)
    assert group.checkpoint.held_at(3) is not None and group.checkpoint.held_at(2) is None
    save_file({k: t + 1 for k, t in weights.items()}, ckpt / "model.safetensors")
    assert group.checkpoint.held_at(3) is None and group.checkpoint.synced_at is None


def test_a_commit_lost_on_its_way_is_aborted_not_left_staged():
    # else the server stays staged (paused ahead) until its lease ends, and refuses the
    # next update's join meanwhile
    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1"]
    group = RemoteGroup(urls, token="t" * 32)
    posted = _posting(group)
    _commit_breaks_on(group, urls[1])
    result = group.commit(_pending(urls), 1)
    assert list(result["servers"]) == [urls[0]] and urls[1] in result["dropped"]
    aborts = [(u, t) for u, route, t in posted if route == "/hotweights/abort"]
    assert aborts == [(urls[1], 30.0)]  # bounded: the next update tries again


def test_an_update_aborts_first_what_its_last_one_left_staged(caplog):
    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1", "http://127.0.0.3:1"]
    group = RemoteGroup(urls, token="t" * 32)
    posted = _posting(group)
    group._abort_left({urls[0]: {"server_id": "s", "holder": group.holder, "state": "staging"},
                       urls[1]: {"server_id": "s", "holder": "other", "state": "staging"},
                       urls[2]: {"server_id": "s", "holder": group.holder, "state": "idle"}})
    assert posted == [(urls[0], "/hotweights/abort", None)]
    assert "still staged this group's last update" in caplog.text


def test_an_abort_that_gets_no_answer_is_named(caplog):
    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1"]
    group = RemoteGroup(urls, token="t" * 32)

    def post(url, status, route, **body):
        if url == urls[1]:
            raise ServerError(f"POST {route}: no answer from {url} within 70 s")
        raise ServerError(f"POST {route}: HTTP 409: no update in progress", 409)
    group._post = post
    group.abort(_pending(urls))
    assert f"no answer to the abort from {urls[1]}" in caplog.text
    assert urls[0] not in caplog.text  # a refusal: nothing staged there


def test_a_refused_renewal_does_not_stop_renewing_a_server_that_did_not_answer():
    # require="any": the refused server's lease is gone (it is dropped); the other's renewal
    # is tried again (`Renewer` goes on where every failure is a missing answer)
    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1"]
    group = RemoteGroup(urls, token="t" * 32)
    group._leased = {u: {"server_id": "s"} for u in urls}

    def post(url, status, route, **body):
        if url == urls[1]:
            raise ServerError("HTTP 409: the lease expired", 409)
        raise ServerError(f"no answer from {url} within 10 s")
    group._post = post
    with pytest.raises(RemoteError) as e:
        group.renew(30.0)
    assert e.value.no_answer and list(group._leased) == [urls[0]]


def test_a_server_that_answers_the_status_with_an_error_is_named_not_dropped(monkeypatch):
    from hotweights.remote import group as group_module

    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1"]

    def request(url, method, route, token, **kw):
        if url == urls[1]:
            raise ServerError(f"GET {route}: HTTP 401: missing or wrong bearer token", 401)
        return {"remote": True, "n": 0, "server_id": "s", "protocol": PROTOCOL}
    monkeypatch.setattr(group_module, "request", request)
    group = RemoteGroup(urls, token="t" * 32)  # require="any"
    with pytest.raises(RemoteError, match=rf"^{re.escape(urls[1])}: GET /hotweights/status: "
                                          "HTTP 401"):
        group._status(urls, {})


def test_a_restarted_local_server_s_new_token_file_is_read(monkeypatch, tmp_path):
    from hotweights.remote import group as group_module

    monkeypatch.delenv("HOTWEIGHTS_TOKEN", raising=False)
    monkeypatch.setattr(tokens, "token_path", lambda port: tmp_path / f"{port}.token")
    (tmp_path / "1.token").write_text("a" * 32)
    seen = []

    def request(url, method, route, token, **kw):
        seen.append(token)
        return {"remote": True, "n": 0, "server_id": "s", "protocol": PROTOCOL}
    monkeypatch.setattr(group_module, "request", request)
    group = RemoteGroup(["http://127.0.0.1:1"])
    group._status(group.urls, {})
    (tmp_path / "1.token").write_text("b" * 32)  # the server restarted
    group._status(group.urls, {})
    assert seen == ["a" * 32, "b" * 32] and group._tokens[group.urls[0]] == "b" * 32


def test_a_step_is_not_undone_to_values_no_server_took(caplog):
    urls = ["http://127.0.0.1:1"]
    group = RemoteGroup(urls, token="t" * 32)
    _posting(group)
    w = torch.zeros(4)
    group.commit(_pending(urls, new={"w": w}), 1)
    w += 1

    def broke(url, status, route, **body):
        raise ServerError(f"POST {route}: the connection to {url} broke")
    group._post = broke
    with pytest.raises(RemoteError, match="served by no server"):
        group.commit(_pending(urls, new={"w": w}), 2)
    assert not group.restore({"w": w}) and torch.equal(w, torch.ones(4))
    assert "no server holds what this group keeps" in caplog.text


def test_asking_whether_a_cast_holds_a_tensor_makes_no_copy():
    from hotweights.remote.served import Cast

    read = []

    class Counted(dict):
        def __getitem__(self, name):
            read.append(name)
            return super().__getitem__(name)
    cast = Cast(Counted(w=torch.zeros(2)), {"w": torch.bfloat16})
    assert "w" in cast and "v" not in cast and read == []
    assert cast["w"].dtype == torch.bfloat16 and read == ["w"]


def test_a_channel_s_buffers_go_on_the_weights_gpu_for_nccl_only():
    # gloo's on the CPU beside CUDA weights (its broadcasts of CUDA tensors go through host
    # memory); NCCL's on the weights' GPU, not the current device
    weights = [torch.zeros(1), types.SimpleNamespace(device=torch.device("cuda:1"))]
    assert channel_device("nccl", weights) == torch.device("cuda:1")
    assert channel_device("gloo", weights) is None
    assert channel_device("nccl", weights[:1]) is None


def test_every_try_of_an_update_carries_its_own_number_one_above_the_last(monkeypatch):
    # a server refuses a request of an earlier try or update that arrives late, and a
    # begin of a number whose lease ended (`Body.seq`)
    from hotweights.remote import group as group_module

    group = RemoteGroup(["http://127.0.0.1:1", "http://127.0.0.1:2"], token="t" * 32,
                        timeout=1, require="any")
    one, two = group.urls
    status = {u: {"server_id": "s", "n": 0, "dtypes": {"default": "float32"}}
              for u in group.urls}
    answers = iter([(status, {}), ({one: status[one]}, {two: "gone"}), (status, {})])
    monkeypatch.setattr(group, "_status", lambda urls, dropped: next(answers))
    sent, tries = [], []
    monkeypatch.setattr(group_module, "request", lambda url, method, route, token, body,
                        **kw: sent.append((url, body["seq"])))

    def prepare(weights, new, status, *args):
        group._send(status, [], encode=None, cut_bytes=0, mode="keep", lease_s=60.0)
        tries.append(len(status))
        if len(tries) == 1:
            raise RemoteError("a server died during the send")  # tried again without it
    monkeypatch.setattr(group, "_prepare", prepare)
    for _ in range(2):
        group.prepare({"w": torch.zeros(4)})
    assert sorted(sent) == [(one, 1), (one, 2), (one, 3), (two, 1), (two, 3)]


def _answering(monkeypatch, silent=(), **fields):
    """`request` answered by a `--remote` server of this version, but not by `silent` (no
    answer); returns the requests seen: (url, route, timeout)."""
    from hotweights.remote import group as group_module

    seen = []

    def request(url, method, route, token, body=None, **kw):
        seen.append((url, route, kw.get("timeout")))
        if url in silent:
            raise ServerError(f"{method} {route}: no answer from {url} within 30 s")
        return {"remote": True, "n": 0, "server_id": "s", "protocol": PROTOCOL, **fields}
    monkeypatch.setattr(group_module, "request", request)
    return seen


def test_a_server_that_does_not_answer_the_status_is_dropped_beside_those_dropped_before(
        monkeypatch):
    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1"]
    _answering(monkeypatch, silent={urls[1]})
    status, dropped = RemoteGroup(urls, token="t" * 32)._status(
        urls, {"http://127.0.0.3:1": "gone at the first try"})
    assert list(status) == [urls[0]]
    assert list(dropped) == ["http://127.0.0.3:1", urls[1]] and "no answer" in dropped[urls[1]]


def test_no_answer_from_every_server_or_with_require_all_from_one_fails_the_update(
        monkeypatch):
    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1"]
    _answering(monkeypatch, silent={urls[1]})
    with pytest.raises(RemoteError, match=rf"^no answer from {re.escape(urls[1])}: "):
        RemoteGroup(urls, token="t" * 32, require="all")._status(urls, {})
    _answering(monkeypatch, silent=set(urls))
    with pytest.raises(RemoteError, match=rf"^no answer from {re.escape(urls[0])}: .*; "
                                          rf"{re.escape(urls[1])}: "):
        RemoteGroup(urls, token="t" * 32)._status(urls, {})


def test_a_server_not_started_with_remote_is_named(monkeypatch):
    _answering(monkeypatch, remote=False)
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32)
    with pytest.raises(RemoteError, match=r"^http://127\.0\.0\.1:1: not started with "
                                          "`hotweights serve --remote`"):
        group._status(group.urls, {})


def test_the_status_asks_within_the_timeout_but_30_s_at_most(monkeypatch):
    seen = _answering(monkeypatch)
    RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, timeout=60)._status(
        ["http://127.0.0.1:1"], {})
    RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, timeout=5)._status(
        ["http://127.0.0.1:1"], {})
    assert [t for _, _, t in seen] == [30.0, 5]


def test_with_require_all_a_failed_send_is_raised_as_it_is_not_retried(monkeypatch):
    group = RemoteGroup(["http://127.0.0.1:1", "http://127.0.0.2:1"], token="t" * 32,
                        require="all")
    asked = []

    def status(urls, dropped):
        asked.append(list(urls))
        return {u: {} for u in urls}, dropped

    def prepare(*args):
        raise RemoteError("http://127.0.0.1:1: stopped")
    monkeypatch.setattr(group, "_status", status)
    monkeypatch.setattr(group, "_prepare", prepare)
    monkeypatch.setattr(group, "_abort_left", lambda status: None)
    monkeypatch.setattr(packing, "warm", lambda dtypes: None)
    with pytest.raises(RemoteError, match=r"^http://127\.0\.0\.1:1: stopped$"):
        group.prepare({"w": torch.zeros(2)})
    assert asked == [group.urls]


def test_a_retry_asks_only_the_servers_of_the_try_that_failed(monkeypatch):
    # a server down at the start of the update stays out of it (it is in `dropped`), even if
    # it answers by the time another one dies
    urls = [f"http://127.0.0.{i}:1" for i in (1, 2, 3)]
    group, asked, tries = RemoteGroup(urls, token="t" * 32), [], []

    def status(among, dropped):
        asked.append(list(among))
        if len(asked) == 1:
            return {u: {} for u in urls[:2]}, {urls[2]: "no answer"}
        return {u: {} for u in among if u != urls[1]}, {**dropped, urls[1]: "gone"}

    def prepare(weights, new, status, mode, lease_s, started, dropped, *rest):
        tries.append((sorted(status), dict(dropped)))
        if len(tries) == 1:
            raise RemoteError(f"{urls[1]}: stopped")
        return "prepared"
    monkeypatch.setattr(group, "_status", status)
    monkeypatch.setattr(group, "_prepare", prepare)
    monkeypatch.setattr(packing, "warm", lambda dtypes: None)
    assert group.prepare({"w": torch.zeros(2)}) == "prepared"
    assert asked == [urls, urls[:2]]
    assert tries[1] == ([urls[0]], {urls[2]: "no answer", urls[1]: "gone"})


def test_the_bytes_of_failed_tries_are_counted_once_per_update(monkeypatch):
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, require="all")

    def prepare(*args):
        group._lost += 100  # a send that failed
        raise RemoteError("http://127.0.0.1:1: stopped")
    monkeypatch.setattr(group, "_status", lambda urls, dropped: ({u: {} for u in urls}, {}))
    monkeypatch.setattr(group, "_prepare", prepare)
    monkeypatch.setattr(packing, "warm", lambda dtypes: None)
    for _ in range(2):
        with pytest.raises(RemoteError, match="stopped"):
            group.prepare({"w": torch.zeros(2)})
    assert group.bytes_sent == 200


def test_an_update_aborts_first_what_its_last_one_left_staged_before_it_begins(monkeypatch):
    urls = ["http://127.0.0.1:1"]
    group = RemoteGroup(urls, token="t" * 32)
    posted = _posting(group)
    status = {urls[0]: {"server_id": "s", "n": 0, "holder": group.holder, "state": "paused"}}
    monkeypatch.setattr(group, "_status", lambda urls, dropped: (status, dropped))
    monkeypatch.setattr(group, "_prepare", lambda *args: posted.append("begin"))
    monkeypatch.setattr(packing, "warm", lambda dtypes: None)
    group.prepare({"w": torch.zeros(2)})
    assert posted == [(urls[0], "/hotweights/abort", None), "begin"]


@pytest.mark.parametrize("state", ["draining", "paused"])
def test_an_update_aborts_first_what_its_last_one_left_draining_or_paused(state):
    urls = ["http://127.0.0.1:1"]
    group = RemoteGroup(urls, token="t" * 32)
    posted = _posting(group)
    group._abort_left({urls[0]: {"server_id": "s", "holder": group.holder, "state": state}})
    assert posted == [(urls[0], "/hotweights/abort", None)]


def test_the_servers_holding_what_the_group_sent_are_planned_first():
    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1"]
    group = RemoteGroup(urls, token="t" * 32)
    status = {u: {"server_id": "s", "n": 1} for u in urls}
    new = {"w": torch.zeros(2)}
    (plan,) = group._plans(status, new)  # the first update: nothing held, the whole model
    assert plan.urls == urls and plan.reference is None and not plan.held
    group.reference.tensors, group._held = {"w": torch.zeros(2)}, {urls[1]: ("s", 1)}
    held, whole = group._plans(status, new)
    assert (held.urls, held.held, whole.urls, whole.reference) == ([urls[1]], True,
                                                                    [urls[0]], None)


def test_a_full_sync_sends_the_tensors_that_cannot_change_too():
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32)
    new = {"a": torch.zeros(4), "b": torch.ones(4)}
    deltas = list(group._encode(_Plan(["u"], None, False), new, {"b"}, None))
    assert [(d.name, d.kind) for d in deltas] == [("a", "dense"), ("b", "dense")]


def test_a_stale_server_s_delta_compares_every_row_not_the_fingerprinted_ones(checkpoint):
    ckpt, weights = checkpoint
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, checkpoint=ckpt)
    new = {k: t.clone() for k, t in weights.items()}
    new["a.weight"][3] += 1
    rows = {k: torch.tensor([], dtype=torch.int64) for k in new}  # the held copy's: none
    held = group._checkpoint_for([{"checkpoint": digest(ckpt)}], new)  # a restarted server
    plan = _Plan(["u"], held, False)
    kinds = {d.name: d.kind for d in group._encode(plan, new, set(), rows)}
    assert kinds["a.weight"] != delta.SAME and kinds["b.weight"] == delta.SAME


def test_a_nan_in_a_patch_is_refused_by_name():
    from hotweights.errors import DeltaError

    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32)
    old = {"w": torch.zeros(64, 64)}
    new = {"w": old["w"].clone()}
    new["w"][3, 5] = float("nan")
    with pytest.raises(DeltaError, match=r"^`w`: the patch values hold NaN or Inf; refused$"):
        list(group._encode(_Plan(["u"], old, False), new, set(), None))


def test_a_version_number_equal_to_the_servers_is_refused():
    urls = ["http://127.0.0.1:1"]
    group = RemoteGroup(urls, token="t" * 32)
    posted = _posting(group)
    with pytest.raises(RemoteError, match="version number 5 must be above 5"):
        group.commit(_pending(urls, floor=5), 5)
    assert posted == [(urls[0], "/hotweights/abort", None)]


def test_a_commit_tells_each_server_the_id_of_its_channel_s_next_update():
    from hotweights.remote.links import Link

    urls = ["http://127.0.0.1:1"]
    group = RemoteGroup(urls, token="t" * 32)
    link = Link(channel=None, members=((urls[0], "s"),), id="c", ranks={urls[0]: range(1, 2)},
                xor=False)
    group.links._by_members[link.members] = link
    bodies = []

    def post(url, status, route, **body):
        bodies.append(body)
        return {"version": "1@s"}
    group._post = post
    group.commit(_pending(urls), 1)
    assert link.next and bodies[0]["next_update"] == link.next


def test_a_commit_keeps_the_fingerprints_prepare_took_and_counts_the_bytes():
    import dataclasses

    urls = ["http://127.0.0.1:1"]
    group = RemoteGroup(urls, token="t" * 32)
    _posting(group)
    prints = {"w": "the fingerprints of what the servers now hold"}
    group.commit(dataclasses.replace(_pending(urls, sent=1234), prints=prints), 1)
    assert group._prefilter.prints is prints and group.bytes_sent == 1234


def test_with_require_all_a_commit_lost_on_one_server_fails_the_update_by_name():
    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1"]
    group = RemoteGroup(urls, token="t" * 32, require="all")
    _posting(group)
    _commit_breaks_on(group, urls[1])
    with pytest.raises(RemoteError, match=re.escape(
            f"version 1 is served by ['{urls[0]}']; the commit failed on {urls[1]}: ")):
        group.commit(_pending(urls), 1)


def test_an_abort_ends_the_renewals_of_the_lease():
    urls = ["http://127.0.0.1:1"]
    group = RemoteGroup(urls, token="t" * 32)
    _posting(group)
    group._leased = {urls[0]: {"server_id": "s"}}
    group.abort(_pending(urls))
    assert group._leased == {}


def test_with_require_all_a_refused_renewal_stops_the_send():
    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1"]
    group = RemoteGroup(urls, token="t" * 32, require="all")
    group._leased = {u: {"server_id": "s"} for u in urls}

    def post(url, status, route, **body):
        if url == urls[1]:
            raise ServerError("HTTP 409: the lease expired", 409)
    group._post = post
    with pytest.raises(RemoteError, match="the lease expired"):
        group.renew(30.0)
    with pytest.raises(RemoteError, match=re.escape(
            f"the lease of this update was lost during its send on {urls[1]}: HTTP 409")):
        group._check_leased()


def test_a_renewal_of_a_short_lease_waits_a_second_at_least_and_a_lease_is_a_minute():
    urls = ["http://127.0.0.1:1"]
    group = RemoteGroup(urls, token="t" * 32, timeout=1.0)
    bodies = []

    def post(url, status, route, *, http_timeout=None, **body):
        bodies.append((http_timeout, body.get("lease_s")))
    group._post = post
    group._leased = {urls[0]: {"server_id": "s"}}
    group.renew(1.5)
    group.renew()
    assert bodies == [(1.0, 1.5), (1.0, 60.0)]


def test_a_step_is_not_undone_to_values_the_servers_rounded():
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32)
    weights = {"w": torch.randn(4, 8)}
    _update(group, weights, dict(weights))
    group._casts = {"w": torch.bfloat16}  # as `prepare` found the servers
    weights["w"] += 1
    stepped = weights["w"].clone()
    assert not group.restore(weights) and torch.equal(weights["w"], stepped)


def test_a_request_carries_the_number_of_the_try_it_was_made_for(monkeypatch):
    from hotweights.remote import group as group_module

    sent = []
    monkeypatch.setattr(group_module, "request", lambda url, method, route, token, body,
                        **kw: sent.append((body["seq"], kw["timeout"])))
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, timeout=10)
    group._seq = 5
    group._post(group.urls[0], {"server_id": "s"}, "/hotweights/abort", seq=3)
    group._post(group.urls[0], {"server_id": "s"}, "/hotweights/abort")
    assert sent == [(3, 70), (5, 70)]


def test_a_failed_begin_aborts_every_server_it_was_sent_to(monkeypatch):
    # one whose answer was lost may have taken the lease all the same
    from hotweights.remote import group as group_module

    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1"]
    group = RemoteGroup(urls, token="t" * 32)
    routes = []

    def request(url, method, route, token, body, **kw):
        routes.append((url, route))
        if (url, route) == (urls[1], "/hotweights/begin"):
            raise ServerError(f"POST {route}: no answer from {url} within 70 s")
        return {}
    monkeypatch.setattr(group_module, "request", request)
    status = {u: {"server_id": "s"} for u in urls}
    with pytest.raises(RemoteError, match=rf"^begin failed on {re.escape(urls[1])}: "):
        group._send(status, [], encode=None, cut_bytes=0, mode="keep", lease_s=60.0)
    assert sorted(u for u, route in routes if route == "/hotweights/abort") == urls


def test_the_bounds_of_each_argument_are_accepted():
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, timeout=21600,
                        max_round_bytes=packing.MIN_ROUND_BYTES, master_port=65535)
    assert (group.timeout, group.max_round_bytes) == (21600, packing.MIN_ROUND_BYTES)


def test_nothing_follows_the_last_of_no_rounds():
    from hotweights.remote.group import _then_last

    after = []
    assert list(_then_last(iter([]), after.append)) == [] and after == []
    assert list(_then_last(iter([1, 2]), after.append)) == [1, 2] and after == [2]


def test_a_request_that_fails_after_the_check_began_is_waited_for_and_named():
    from concurrent.futures import Future

    from hotweights.remote.group import _raise_failed

    late = Future()
    threading.Timer(0.05, late.set_exception, [ServerError("HTTP 409: busy", 409)]).start()
    with pytest.raises(RemoteError, match=r"^begin failed on http://b:1: HTTP 409: busy$"):
        _raise_failed({"http://b:1": late}, "begin")


def test_weights_that_are_not_contiguous_are_sent_as_contiguous_copies():
    from hotweights.remote.group import _weights

    t = torch.arange(32.0).view(4, 8).t()
    got = _weights({"w": t})["w"]
    assert got.is_contiguous() and torch.equal(got, t)


def test_the_floor_is_above_what_this_group_committed_too(monkeypatch):
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32)
    monkeypatch.setattr(group, "_status", lambda urls, dropped: (
        {u: {"n": 3} for u in urls}, {}))
    group.n = 7  # a server that lost its state reports less
    assert group.floor() == 7


class _Channel:
    """A channel that makes no connection (`links.Channel`'s arguments and what is done to
    it)."""

    def __init__(self, **kwargs):
        self.kwargs, self.port, self.closed, self.cancelled = kwargs, kwargs["master_port"], \
            False, []

    def close(self):
        self.closed = True

    def cancel(self, update):
        self.cancelled.append(update)


def _links(monkeypatch, xor=(), refuse=(), master_port=0):
    """`Links` on `_Channel`s; returns it and the joins asked: (url, body)."""
    from hotweights.remote import links as links_module

    monkeypatch.setattr(links_module, "Channel", _Channel)
    joins = []

    def post(url, status, route, **body):
        joins.append((url, body))
        if url in refuse:
            raise ServerError(f"POST {route}: HTTP 409: busy", 409)
        return {"xor": url in xor}
    return Links(master_addr="127.0.0.1", master_port=master_port, timeout=1.0,
                 max_round_bytes=1 << 20, post=post), joins


def test_a_channel_ranks_each_server_s_workers_after_the_sender(monkeypatch):
    links, joins = _links(monkeypatch, xor={"http://a:1", "http://b:1"})
    link = links.connect({"http://a:1": {"server_id": "a", "channel_ranks": 2},
                          "http://b:1": {"server_id": "b", "channel_ranks": 1}}, "gloo")
    assert link.ranks == {"http://a:1": range(1, 3), "http://b:1": range(3, 4)}
    assert [(u, b["rank_offset"], b["world_size"]) for u, b in joins] == [
        ("http://a:1", 1, 4), ("http://b:1", 3, 4)]
    assert link.channel.kwargs["world_size"] == 4 and link.xor


def test_values_go_xor_coded_only_where_every_server_decodes_them(monkeypatch):
    links, _ = _links(monkeypatch, xor={"http://a:1"})
    link = links.connect({"http://a:1": {"server_id": "a", "channel_ranks": 1},
                          "http://b:1": {"server_id": "b", "channel_ranks": 1}}, "gloo")
    assert not link.xor


def test_a_channel_is_built_again_when_a_member_is_on_another_one(monkeypatch):
    links, joins = _links(monkeypatch)
    status = {"http://a:1": {"server_id": "a", "channel_ranks": 1}}
    first = links.connect(status, "gloo")
    status["http://a:1"]["channel"] = first.id
    assert links.connect(status, "gloo") is first and len(joins) == 1
    status["http://a:1"]["channel"] = "another trainer's"
    second = links.connect(status, "gloo")
    assert second is not first and first.channel.closed and list(links) == [second]


def test_a_server_leaves_its_old_channel_for_a_new_one(monkeypatch):
    links, _ = _links(monkeypatch)
    both = links.connect({"http://a:1": {"server_id": "a", "channel_ranks": 1},
                          "http://b:1": {"server_id": "b", "channel_ranks": 1}}, "gloo")
    both.next = "u1"  # its servers' workers wait for that update
    alone = links.connect({"http://a:1": {"server_id": "a", "channel_ranks": 1}}, "gloo")
    assert list(links) == [alone] and both.channel.closed and both.channel.cancelled == ["u1"]


def test_a_failed_join_closes_the_channel_and_names_the_server(monkeypatch):
    links, _ = _links(monkeypatch, refuse={"http://b:1"})
    made = []
    from hotweights.remote import links as links_module
    monkeypatch.setattr(links_module, "Channel", lambda **kw: made.append(_Channel(**kw))
                        or made[-1])
    with pytest.raises(RemoteError, match=r"^joining the channel failed on http://b:1: "):
        links.connect({"http://a:1": {"server_id": "a", "channel_ranks": 1},
                       "http://b:1": {"server_id": "b", "channel_ranks": 1}}, "gloo")
    assert made[0].closed and len(links) == 0


def test_only_the_channels_none_of_whose_servers_answer_are_left(monkeypatch):
    links, _ = _links(monkeypatch)
    a = links.connect({"http://a:1": {"server_id": "a", "channel_ranks": 1}}, "gloo")
    b = links.connect({"http://b:1": {"server_id": "b", "channel_ranks": 1}}, "gloo")
    links.drop_gone({"http://a:1": {}})
    assert list(links) == [a] and b.channel.closed and not a.channel.closed


def test_a_fixed_master_port_is_not_given_to_a_second_channel_while_one_holds_it(monkeypatch):
    from hotweights.remote.hosts import free_port

    base = free_port("127.0.0.1")
    links, _ = _links(monkeypatch, master_port=base)
    first = links.connect({"http://a:1": {"server_id": "a", "channel_ranks": 1}}, "gloo")
    assert first.channel.port == base and links.port() > base  # (the fake binds nothing)


def test_the_last_port_is_a_channel_s_port():
    from hotweights.remote.hosts import free_port

    if not free_port("127.0.0.1", 65535):
        pytest.skip("port 65535 is taken here")
    links = Links(master_addr="127.0.0.1", master_port=65535, timeout=1.0,
                  max_round_bytes=1 << 20, post=None)
    assert links.port() == 65535
    with socket.socket() as taken:  # none above it to try: the error names the one tried
        taken.bind(("127.0.0.1", 65535))
        taken.listen()
        with pytest.raises(RemoteError, match=r"^no free port in 65535\.\.65535 on "):
            links.port()


def test_a_channel_s_error_names_the_server_of_each_receiver_rank_it_names():
    from hotweights.remote.links import Link

    link = Link(channel=None, members=(), id="c", xor=False,
                ranks={"http://a:1": range(1, 3), "http://b:1": range(3, 4)})
    assert link.named("rank 2 (receiver) stopped; rank 3 (receiver) stalled; reported by "
                      "rank 0 (http://b:1: relay rank 1 (receiver) stopped)") == (
        "rank 2 (receiver) = http://a:1 stopped; rank 3 (receiver) = http://b:1 stalled; "
        "reported by rank 0 (http://b:1: relay rank 1 (receiver) stopped)")


def test_a_request_s_bug_is_raised_not_taken_as_the_server_s_answer():
    from concurrent.futures import Future

    from hotweights.remote.links import outcome

    refused, bug = Future(), Future()
    refused.set_exception(ServerError("HTTP 409: busy", 409))
    bug.set_exception(KeyError("server_id"))
    assert isinstance(outcome(refused), ServerError)
    with pytest.raises(KeyError):
        outcome(bug)


def test_a_request_sent_late_carries_the_number_of_its_own_try(monkeypatch):
    # the number is bound when the try begins, not read when a starved thread sends
    from hotweights.remote import group as group_module

    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32)
    sent = []
    monkeypatch.setattr(group_module, "request", lambda url, method, route, token, body,
                        **kw: sent.append((route, body["seq"])) or {})
    post = group._post

    def late(url, status, route, **body):
        if route == "/hotweights/begin":
            group._seq += 1  # the next try began before this thread ran
        return post(url, status, route, **body)
    group._post = late
    group._send({group.urls[0]: {"server_id": "s"}}, [], encode=None, cut_bytes=0,
                mode="keep", lease_s=60.0)
    assert sent == [("/hotweights/begin", 1)]


class _Sending:
    """A channel that sends nothing: `send` reads the rounds, counts their bytes (`copies`
    of each leave this process) and fails after them if told to."""

    device, copies = None, 2

    def __init__(self, log, fail=None):
        self.log, self.fail, self.bytes_sent = log, fail, 0

    def start(self, update, check):
        pass

    def send(self, rounds, ahead):
        sent = sum(r.header["nbytes"] for r in rounds)
        self.bytes_sent += sent
        self.log.append("sent")
        if self.fail:
            raise RemoteError(self.fail)
        return sent

    def cancel(self, update):
        pass

    def close(self):
        pass


def _sending(monkeypatch, urls, fails=(), no_answer=()):
    """A group whose requests are answered (but `no_answer`'s aborts) and one channel per
    server, whose send fails where `fails` says; returns (group, plans, log of requests)."""
    from hotweights.remote import group as group_module
    from hotweights.remote.links import Link

    log = []

    def request(url, method, route, token, body, **kw):
        if body.get("pause"):
            log.append(("pause", url))
        if route == "/hotweights/abort":
            log.append(("abort", url))
            if url in no_answer:
                raise ServerError(f"POST {route}: no answer from {url} within 70 s")
        return {}
    monkeypatch.setattr(group_module, "request", request)
    group = RemoteGroup(urls, token="t" * 32, max_round_bytes=1 << 20)
    plans = [(_Plan([u], None, False), Link(_Sending(log, fail=u in fails and "rank 1 stopped"),
                                             ((u, "s"),), "c", {u: range(1, 2)}, False))
             for u in urls]
    return group, plans, log


def test_the_servers_are_told_to_pause_ahead_once_as_the_last_plan_s_last_round_goes(
        monkeypatch):
    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1"]
    group, plans, log = _sending(monkeypatch, urls)
    status = {u: {"server_id": "s"} for u in urls}
    new = {"w": torch.zeros(64)}
    group._send(status, plans, lambda plan: delta.encode_each(None, new), 1 << 20, "keep",
                60.0, pause_ahead=True)
    pauses = sorted(e for e in log if e != "sent")  # (told as the last send reads its last
    assert log[0] == "sent" and log.count("sent") == 2  # round: maybe before it returns)
    assert pauses == [("pause", u) for u in urls]


def test_a_send_that_fails_counts_every_copy_sent_and_names_the_servers_left_at_the_old_one(
        monkeypatch):
    urls = ["http://127.0.0.1:1", "http://127.0.0.2:1"]
    group, plans, log = _sending(monkeypatch, urls[:1], fails=urls[:1], no_answer=urls[1:])
    group.urls, group._tokens = urls, dict.fromkeys(urls, "t" * 32)
    status = {u: {"server_id": "s"} for u in urls}
    new = {"w": torch.zeros(64)}
    with pytest.raises(RemoteError, match=re.escape(
            f"servers at their old version: ['{urls[0]}']; no answer to the abort from "
            f"['{urls[1]}']")):
        group._send(status, plans, lambda plan: delta.encode_each(None, new), 1 << 20,
                    "keep", 60.0)
    assert group._lost == 2 * plans[0][1].channel.bytes_sent > 0


def test_a_commit_that_breaks_midway_leaves_no_server_taken_as_holding_the_copy():
    # the copy changes as the servers commit: until their answers are known, none holds it
    urls = ["http://127.0.0.1:1"]
    group = RemoteGroup(urls, token="t" * 32)
    _posting(group)
    group.commit(_pending(urls, new={"w": torch.zeros(4)}), 1)
    assert group._held == {urls[0]: ("s", 1)}

    def broken(url, status, route, **body):
        raise RuntimeError("can't start new thread")  # not a server's answer
    group._post = broken
    with pytest.raises(RuntimeError):
        group.commit(_pending(urls, new={"w": torch.ones(4)}), 2)
    assert group._held == {}


def test_a_prepared_update_counts_the_bytes_of_its_failed_tries_too(monkeypatch):
    monkeypatch.setattr(packing, "warm", lambda dtypes: None)
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32)
    status = {group.urls[0]: {"server_id": "s", "n": 0, "device": "cpu"}}
    monkeypatch.setattr(group, "_status", lambda urls, dropped: (status, dropped))
    monkeypatch.setattr(group.links, "connect", lambda status, backend, device: None)

    def send(status, plans, encode, cut, mode, lease_s, meanwhile, pause_ahead):
        meanwhile()
        group._lost += 300  # a try of this update that failed
        return [(list(encode(plan)), 100, 200) for plan, _ in plans]
    monkeypatch.setattr(group, "_send", send)
    pending = group.prepare({"w": torch.zeros(4)})
    assert pending.sent == 500 and pending.carried == {group.urls[0]: 100}

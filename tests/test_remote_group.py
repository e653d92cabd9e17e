"""`RemoteGroup`'s own decisions, without servers: when the checkpoint the servers loaded may
serve as the old values, and the update refused when it changed under the encode."""

import os

import pytest
import torch
from safetensors.torch import save_file

from hotweights import RemoteError, RemoteGroup
from hotweights.checkpoint.digest import digest
from hotweights.remote import delta


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


def test_an_encode_that_sees_the_checkpoint_written_is_refused(checkpoint, monkeypatch):
    ckpt, weights = checkpoint
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, checkpoint=ckpt)
    new = {k: t.clone() for k, t in weights.items()}
    new["a.weight"][3] += 1
    old = group._checkpoint_for([{"checkpoint": digest(ckpt)}], new)
    deltas, _, _ = group._encode(old, new, None, True, set())
    assert [d.kind for d in deltas] == ["rows", "same"]
    encode_all = delta.encode_all

    def written_meanwhile(*args, **kwargs):  # journal mode writes in place, under the map
        out = encode_all(*args, **kwargs)
        shard = ckpt / "model.safetensors"
        st = shard.stat()
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
        return out
    monkeypatch.setattr(delta, "encode_all", written_meanwhile)
    with pytest.raises(RemoteError, match=rf"^{ckpt} was written during the update; nothing "
                                          "was sent: update again$"):
        group._encode(old, new, None, True, set())


@pytest.mark.parametrize("bad", [0, 63, 4096.0, "64"])
def test_a_bad_round_budget_is_named(bad):
    with pytest.raises(RemoteError, match=r"field 'max_round_bytes' must be an int >= 64, "
                                          rf"found {bad!r}"):
        RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, max_round_bytes=bad)


def _update(group, weights, new, **kw):
    """What `prepare` encodes and `commit` remembers, without servers: the deltas."""
    frozen = group._frozen(weights, new)
    deltas, prints, frozen_prints = group._encode(group.reference, new, None, False, frozen)
    group._remember(new, deltas, group.reference is None, frozen_prints)
    group._prefilter.prints = prints
    return {d.name: d.kind for d in deltas}


def test_only_the_trainable_tensors_are_copied_the_rest_fingerprinted(checkpoint, caplog):
    _, weights = checkpoint
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, trainable=["a.*"])
    new = {k: t.clone() for k, t in weights.items()}
    assert _update(group, new, new) == {"a.weight": "dense", "b.weight": "dense"}  # full
    assert group.reference.keys() == {"a.weight"} and group._frozen_prints.keys() == {
        "b.weight"}
    new["a.weight"][3, 4] += 1
    assert _update(group, new, new) == {"a.weight": "patch"}  # b: its fingerprint, unread
    assert torch.equal(group.reference["a.weight"], new["a.weight"])
    new["b.weight"][0] += 1  # "cannot change", did: sent whole, copied from now on
    assert _update(group, new, new) == {"a.weight": "same", "b.weight": "dense"}
    assert "b.weight" in caplog.text and "sent whole, and copied from now on" in caplog.text
    assert group.reference.keys() == {"a.weight", "b.weight"} and not group._frozen_prints
    new["b.weight"][1] += 1
    assert _update(group, new, new)["b.weight"] == "patch"
    assert torch.equal(group.reference["b.weight"], new["b.weight"])


def test_trainable_defaults_to_the_parameters_that_require_grad():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    new = {k: p.detach() for k, p in model.named_parameters()}
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32)
    assert group._frozen(model, new) == {"0.weight", "0.bias"}
    assert group._frozen(new, new) == set()  # a mapping: every tensor may change
    with pytest.raises(RemoteError, match=r"field 'trainable': \['2\.\*'\] match\(es\) no "
                       "tensor"):
        RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, trainable=["0.*", "2.*"]
                    )._frozen(model, new)


def test_servers_all_synced_from_the_checkpoint_leave_the_reference_whole(checkpoint,
                                                                         monkeypatch):
    # the deltas were taken against the checkpoint, not against `reference`: patching the
    # reference with them would leave it wrong wherever it differed from the checkpoint
    from hotweights.remote.group import Pending

    ckpt, weights = checkpoint
    group = RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, checkpoint=ckpt)
    group.reference = {k: t + 1 for k, t in weights.items()}  # what a server held before
    new = {k: t.clone() for k, t in weights.items()}
    new["a.weight"][0] += 1
    deltas = delta.encode_all(weights, new)
    monkeypatch.setattr(group, "_each", lambda fn, **kw: {
        u: {"version": f"5@{u}"} for u in group.urls})
    pending = Pending({u: {"server_id": "s", "n": 4} for u in group.urls}, new, deltas, False,
                      tuple(group.urls), None, 0, 0.0, 4, {}, {})
    group.commit(pending)
    assert all(torch.equal(group.reference[k], t) for k, t in new.items())


def test_the_default_master_addr_is_this_hosts_address_on_the_route_to_the_servers():
    from hotweights.remote.group import route_address

    assert RemoteGroup(["http://127.0.0.1:1"], token="t" * 32).master_addr == "127.0.0.1"
    assert route_address("http://127.0.0.1:8000") == "127.0.0.1"  # the kernel's source
    try:  # another host: the address this one sends to it from (no packet sent)
        far = route_address("http://10.255.255.1:8000")
    except RemoteError:  # a machine without a route off itself
        far = None
    if far is not None:
        assert far != "127.0.1.1"
        assert RemoteGroup(["http://10.255.255.1:8000"], token="t" * 32).master_addr == far
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

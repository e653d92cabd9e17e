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
    deltas, _ = group._encode(old, new, None, True)
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
        group._encode(old, new, None, True)


@pytest.mark.parametrize("bad", [0, 63, 4096.0, "64"])
def test_a_bad_round_budget_is_named(bad):
    with pytest.raises(RemoteError, match=r"field 'max_round_bytes' must be an int >= 64, "
                                          rf"found {bad!r}"):
        RemoteGroup(["http://127.0.0.1:1"], token="t" * 32, max_round_bytes=bad)

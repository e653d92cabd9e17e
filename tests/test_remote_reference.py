"""`Reference`: the old values a `RemoteGroup` keeps (which tensors are frozen, what each
update's deltas leave in it) and `restore`, which puts them back."""

import logging

import torch

from hotweights.remote import delta
from hotweights.remote.reference import Reference


def test_a_frozen_buffer_the_update_does_not_hold_is_not_named_frozen():
    # the model's buffers require no grad, but only the names of `new` are asked about
    model = torch.nn.Linear(4, 4)
    model.register_buffer("scale", torch.ones(1))
    new = {k: p.detach() for k, p in model.named_parameters()}
    assert Reference().frozen(model, new) == set()


def test_a_frozen_tensor_copied_since_it_changed_is_not_warned_about_again(caplog):
    ref = Reference(trainable="a")
    new = {"a": torch.randn(4, 4), "b": torch.randn(4, 4)}
    frozen = ref.frozen(new, new)
    assert frozen == {"b"}
    kept, prints = ref.kept(new, frozen, held=False)  # a full sync
    ref.remember(new, None, prints)
    new = dict(new, b=new["b"] + 1)  # "cannot change", did: sent whole, copied
    kept, prints = ref.kept(new, frozen, held=True)
    assert kept == set() and "sent whole" in caplog.text
    ref.remember(new, delta.encode_all(ref.tensors, new), prints)
    assert torch.equal(ref.tensors["b"], new["b"])
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        kept, prints = ref.kept(new, frozen, held=True)  # nothing changed this time
    assert kept == set() and prints == {} and caplog.text == ""


def test_deltas_remembered_before_anything_was_held_copy_the_tensors_whole():
    ref, new = Reference(), {"w": torch.randn(4, 4)}
    ref.remember(new, [delta.dense("w", new["w"])], {})
    assert ref.tensors.keys() == {"w"} and torch.equal(ref.tensors["w"], new["w"])
    assert ref.tensors["w"].data_ptr() != new["w"].data_ptr()  # a copy, not the tensor


def test_a_rows_delta_of_several_runs_is_remembered_whole():
    old = torch.randn(8, 4)
    new = old.clone()
    new[1] += 1
    new[5:7] += 1  # two runs of rows
    ref = Reference()
    ref.remember({"w": old}, None, {})
    d = delta.encode("w", old, new)
    assert d.kind == delta.ROWS and len(d.ranges) == 2
    ref.remember({"w": new}, [d], {})
    assert torch.equal(ref.tensors["w"], new)


def test_a_frozen_tensor_in_the_deltas_is_not_copied(caplog):
    # its fingerprints stand for it: no host copy of a tensor that cannot change
    ref = Reference(trainable="a")
    new = {"a": torch.randn(4, 4), "b": torch.randn(4, 4)}
    _, prints = ref.kept(new, ref.frozen(new, new), held=False)
    ref.remember(new, None, prints)
    ref.remember(new, delta.encode_all({"a": new["a"]}, new), prints)  # "b": dense, frozen
    assert ref.tensors.keys() == {"a"} and ref.frozen_prints.keys() == {"b"}


def test_a_dense_delta_is_remembered():
    old, new = torch.randn(4, 4), torch.randn(4, 4)
    ref = Reference()
    ref.remember({"w": old}, None, {})
    d = delta.encode("w", old, new)
    assert d.kind == delta.DENSE
    ref.remember({"w": new}, [d], {})
    assert torch.equal(ref.tensors["w"], new)


def test_restore_without_a_frozen_tensor_in_new_says_it_cannot():
    ref = Reference(trainable="a")
    new = {"a": torch.randn(4, 4), "b": torch.randn(4, 4)}
    _, prints = ref.kept(new, ref.frozen(new, new), held=False)
    ref.remember(new, None, prints)
    assert ref.restore({"a": new["a"]}, {"a": new["a"]}) is False  # no "b" to check


def test_restore_into_a_tensor_of_another_shape_writes_nothing():
    ref = Reference()
    ref.remember({"w": torch.ones(4)}, None, {})
    live = {"w": torch.zeros(2, 4)}  # would broadcast
    assert ref.restore(live, live) is False
    assert not live["w"].any()


def test_restore_into_a_namesake_that_is_no_view_of_the_weights_says_it_cannot():
    ref = Reference()
    ref.remember({"w": torch.ones(4)}, None, {})
    live, new = {"other": torch.zeros(4)}, {"w": torch.zeros(4)}  # new["w"]: a copy, not held
    assert ref.restore(live, new) is False


def test_a_full_resync_in_another_dtype_keeps_the_new_dtype():
    ref = Reference()
    ref.remember({"w": torch.randn(4, 4)}, None, {})
    new = {"w": torch.randn(4, 4, dtype=torch.float64)}  # same shape, another dtype
    ref.remember(new, None, {})
    assert ref.tensors["w"].dtype == torch.float64 and torch.equal(ref.tensors["w"], new["w"])


def test_fingerprints_of_another_kind_or_block_are_not_the_same():
    from hotweights.remote import reference

    h = torch.arange(3).numpy().astype("uint64")
    assert reference._same((4, "xxh3_64", h), (4, "xxh3_64", h.copy()))
    assert not reference._same((4, "torch_mix64", h), (4, "xxh3_64", h))
    assert not reference._same((2, "xxh3_64", h), (4, "xxh3_64", h))


def test_one_trainable_pattern_given_as_a_string_is_one_pattern():
    ref = Reference(trainable="a.*")
    assert ref.trainable == ("a.*",)
    new = {"a.weight": torch.zeros(2), "b.weight": torch.zeros(2)}
    assert ref.frozen(new, new) == {"b.weight"}

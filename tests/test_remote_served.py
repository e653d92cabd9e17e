"""`hotweights.remote.served`: which tensors a trainer sends its servers in a narrower float."""

import pytest
import torch

from hotweights import RemoteError
from hotweights.remote.served import Cast, narrowed_to

NEW = {"w": torch.ones(2, dtype=torch.float32), "a_log": torch.ones(2),
       "half": torch.ones(2, dtype=torch.bfloat16), "ids": torch.arange(2)}


def _status(default, others=None):
    return {"dtypes": {"default": default, "others": others or {}}}


def test_only_floats_wider_than_the_servers_are_narrowed():
    status = {"a": _status("bfloat16", {"a_log": "float32", "ids": "int64"})}
    assert narrowed_to(status, NEW) == {"w": torch.bfloat16}
    out = dict(Cast(NEW, {"w": torch.bfloat16}))
    assert out["w"].dtype == torch.bfloat16 and out["a_log"] is NEW["a_log"]
    assert narrowed_to({"a": _status("float32")}, NEW) == {}  # bf16 is widened there


def test_a_server_that_names_no_dtypes_takes_what_it_is_sent():
    assert narrowed_to({"a": {"n": 0}, "b": _status("float16")}, NEW) == {
        "w": torch.float16, "a_log": torch.float16}
    assert narrowed_to({"a": _status("no_such_dtype")}, NEW) == {}


@pytest.mark.parametrize("other", ["float16", "float32"])
def test_servers_that_hold_a_tensor_in_different_dtypes_are_named(other):
    # one would get the trainer's values rounded, the other expected them otherwise
    with pytest.raises(RemoteError, match=f"`w`: a holds it in torch.bfloat16, b in torch."
                       f"{other} \\(the trainer's is torch.float32\\): serve the model in "
                       "one dtype on every server"):
        narrowed_to({"a": _status("bfloat16"), "b": _status(other)}, NEW)


def test_dtypes_a_server_names_in_a_form_this_trainer_does_not_read_are_ignored():
    # (`torch.Tensor` is an attribute of torch, not a dtype)
    assert narrowed_to({"a": _status("Tensor"), "b": _status("bfloat16"),
                        "c": {"dtypes": "bfloat16"}}, NEW) == {"w": torch.bfloat16,
                                                              "a_log": torch.bfloat16}

"""Shared-memory tensors: one file, two processes, the same bytes."""

import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from hotweights import shm
from hotweights.errors import ManifestError


@pytest.fixture
def shared(tmp_path):
    tensors = {"a": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
               "b": torch.ones(5, dtype=torch.float32), "c": torch.zeros(0, dtype=torch.int64)}
    manifest, mapped = shm.share(tensors, directory=tmp_path, model="m")
    yield tensors, manifest, mapped
    shm.release(manifest)


def test_share_copies_once_and_maps_the_file(shared):
    tensors, manifest, mapped = shared
    assert stat.S_IMODE(os.stat(manifest.path).st_mode) == 0o600
    for name, t in tensors.items():
        assert torch.equal(mapped[name], t) and mapped[name].dtype == t.dtype
    assert all(e.offset % 64 == 0 for e in manifest.tensors)
    again = shm.attach(manifest)
    mapped["a"][0, 0] = 42  # a write through one mapping is seen through the other
    assert again["a"][0, 0].item() == 42


def test_another_process_writes_the_same_bytes(shared):
    _, manifest, mapped = shared
    code = (
        "import sys, torch; from hotweights import shm\n"
        "t = shm.attach(shm.Manifest.from_json(sys.stdin.read(), source='stdin'))\n"
        "t['b'].mul_(3)\n"
    )
    subprocess.run([sys.executable, "-c", code], input=manifest.to_json(), text=True,
                   check=True)
    assert torch.equal(mapped["b"], torch.full((5,), 3.0))


def test_manifest_round_trips_through_json(shared):
    _, manifest, _ = shared
    assert shm.Manifest.from_json(manifest.to_json()) == manifest


@pytest.mark.parametrize(("change", "match"), [
    (lambda d: d.update(format=99), r"src: field 'format' is 99"),
    (lambda d: d.pop("path"), r"src: field 'path' must be a str"),
    (lambda d: d["tensors"][0].update(dtype="complex32"), r"tensors\[0\] \(a\): unknown dtype"),
    (lambda d: d["tensors"][1].update(shape=[-1]), r"tensors\[1\] \(b\): bad shape \[-1\]"),
    (lambda d: d["tensors"][1].update(offset=3), r"tensors\[1\] \(b\): bad offset 3"),
    (lambda d: d["tensors"][0].update(shape=[2, 3000]), r"tensors\[0\] \(a\): bytes .* run past"),
])
def test_bad_manifest_names_the_field(shared, change, match):
    _, manifest, _ = shared
    data = json.loads(manifest.to_json())
    change(data)
    with pytest.raises(ManifestError, match=match):
        shm.Manifest.from_dict(data, source="src")


def test_not_json_names_the_source():
    with pytest.raises(ManifestError, match=r"server\.json: not JSON"):
        shm.Manifest.from_json("{", source="server.json")


def test_attach_after_release_says_the_weights_are_gone(shared):
    _, manifest, _ = shared
    shm.release(manifest)
    with pytest.raises(ManifestError, match=r"shared weights of server .* are gone"):
        shm.attach(manifest)


def test_unsharable_tensor_leaves_no_file(tmp_path):
    with pytest.raises(ManifestError, match=r"x: cannot share a torch.complex64 tensor"):
        shm.share({"x": torch.zeros(2, dtype=torch.complex64)}, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []

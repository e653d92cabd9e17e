"""Shared-memory tensors: one file, two processes, the same bytes."""

import base64
import dataclasses
import gc
import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch

from hotweights.errors import ManifestError
from hotweights.protocol import shm


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
    again = shm.attach(manifest, directory=os.path.dirname(manifest.path))
    mapped["a"][0, 0] = 42  # a write through one mapping is seen through the other
    assert again["a"][0, 0].item() == 42


def test_each_tensor_is_handed_over_as_it_is_copied_and_its_old_bytes_let_go(tmp_path):
    # a server's host memory holds the model once: each parameter computes on its shared
    # copy, and its old bytes are freed, before the next one is copied
    from torch.multiprocessing.reductions import StorageWeakRef

    olds = {n: torch.full((64,), float(i)) for i, n in enumerate("abc")}
    alive = {n: StorageWeakRef(t.untyped_storage()) for n, t in olds.items()}
    params, seen = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in olds.items()}, []
    del olds

    def moved(name, tensor):
        seen.append((name, [n for n, r in alive.items() if not r.expired()]))
        params[name].data = tensor
    tensors = {n: p.data for n, p in params.items()}
    manifest, mapped = shm.share(tensors, directory=tmp_path, moved=moved)
    try:
        assert not tensors and [n for n, _ in seen] == ["a", "b", "c"]
        # each call: the ones not repointed yet (itself among them) still hold their bytes
        assert [left for _, left in seen] == [["a", "b", "c"], ["b", "c"], ["c"]]
        assert all(r.expired() for r in alive.values())
        assert all(params[n].data.data_ptr() == mapped[n].data_ptr() for n in "abc")
        assert [params[n][0].item() for n in "abc"] == [0.0, 1.0, 2.0]
    finally:
        shm.release(manifest)


def test_another_process_writes_the_same_bytes(shared):
    _, manifest, mapped = shared
    code = (
        "import sys, torch; from hotweights.protocol import shm\n"
        "m = shm.Manifest.from_json(sys.stdin.read(), source='stdin')\n"
        "t = shm.attach(m, directory=sys.argv[1])\n"
        "t['b'].mul_(3)\n"
    )
    subprocess.run([sys.executable, "-c", code, os.path.dirname(manifest.path)],
                   input=manifest.to_json(), text=True, check=True)
    assert torch.equal(mapped["b"], torch.full((5,), 3.0))


def test_manifest_round_trips_through_json(shared):
    _, manifest, _ = shared
    assert shm.Manifest.from_json(manifest.to_json()) == manifest


@pytest.mark.parametrize(("change", "match"), [
    (lambda d: d.update(format=99), r"src: field 'format' is 99"),
    (lambda d: d.pop("path"), r"src: field 'path' must be a str"),
    (lambda d: d["tensors"][0].update(dtype="complex32"), r"tensors\[0\] \(a\): unknown dtype"),
    (lambda d: d["tensors"][1].update(shape=[-1]), r"tensors\[1\] \(b\): bad shape \[-1\]"),
    (lambda d: d["tensors"][1].update(shape=[True]), r"tensors\[1\] \(b\): bad shape \[True\]"),
    (lambda d: d["tensors"][1].update(shape=[0, 2**64]), r"\(b\): bad shape \[0, 1844"),
    (lambda d: d["tensors"][1].update(offset=3), r"tensors\[1\] \(b\): bad offset 3"),
    (lambda d: d["tensors"][0].update(shape=[2, 3000]), r"tensors\[0\] \(a\): bytes .* run past"),
    (lambda d: d["tensors"][1].update(name="a"), r"src: tensor 'a' is listed twice"),
    (lambda d: d.update(model=5), r"src: field 'model' must be a str, found 5"),
    (lambda d: d.update(tp_size="x"), r"src: field 'tp_size' must be an int >= 1, found 'x'"),
    (lambda d: d.update(tp_rank=True), r"src: field 'tp_rank' must be an int >= 0, found True"),
    (lambda d: d.update(tp_rank=2, tp_size=2), r"src: field 'tp_rank' \(2\) must be below"),
    (lambda d: d["tensors"][1].update(offset=0), r"src: tensors 'a' \(bytes \[0, 12\)\) and 'b' "
     r"\(from byte 0\) overlap"),
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
        shm.attach(manifest, directory=os.path.dirname(manifest.path))


def test_unsharable_tensor_leaves_no_file(tmp_path):
    with pytest.raises(ManifestError, match=r"x: cannot share a torch.complex64 tensor"):
        shm.share({"x": torch.zeros(2, dtype=torch.complex64)}, directory=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_trainer_writes_reach_the_server_and_the_mapping_outlives_its_tensors(shared):
    _, manifest, server = shared
    trainer = shm.attach(manifest, directory=os.path.dirname(manifest.path))["b"]
    shm.release(manifest)  # the file is gone; both mappings stay
    gc.collect()  # nothing but the tensor keeps the trainer's mapping alive
    trainer.add_(7)
    assert torch.equal(server["b"], torch.full((5,), 8.0))
    assert trainer.untyped_storage().data_ptr() != server["b"].untyped_storage().data_ptr()


def _moved(manifest, path):
    return dataclasses.replace(manifest, path=str(path))


@pytest.mark.parametrize(("make", "match"), [
    (lambda m, d: _moved(m, d / "elsewhere" / os.path.basename(m.path)),
     r"elsewhere/hotweights-\w+-\d+: not a shared-weights file of server \w+; expected "),
    (lambda m, d: _moved(m, d / ".." / d.name / os.path.basename(m.path)),
     r"not a shared-weights file of server"),
    (lambda m, d: dataclasses.replace(m, server_id="other"),
     r"hotweights-\w+-\d+: not a shared-weights file of server other"),
    (lambda m, d: _moved(m, d / f"hotweights-{m.server_id}-x1"), r"not a shared-weights file"),
    (lambda m, d: (os.symlink(m.path, d / f"hotweights-{m.server_id}-1"),
                   _moved(m, d / f"hotweights-{m.server_id}-1"))[1],
     r"hotweights-\w+-1: is a symbolic link"),
    (lambda m, d: (os.mkfifo(d / f"hotweights-{m.server_id}-2"),
                   _moved(m, d / f"hotweights-{m.server_id}-2"))[1],
     r"hotweights-\w+-2: is not a regular file"),
    (lambda m, d: (os.chmod(m.path, 0o620), m)[1], r"has mode 620: other users may write it"),
    (lambda m, d: (os.chmod(m.path, 0o602), m)[1], r"has mode 602: other users may write it"),
    (lambda m, d: dataclasses.replace(m, nbytes=m.nbytes + 64),
     r"has \d+ bytes, the manifest says \d+; it belongs to another server"),
])
def test_attach_maps_only_the_servers_own_file(shared, tmp_path, make, match):
    _, manifest, _ = shared
    with pytest.raises(ManifestError, match=match):
        shm.attach(make(manifest, tmp_path), directory=tmp_path)


def test_attach_refuses_another_users_file(shared, monkeypatch):
    _, manifest, _ = shared
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    with pytest.raises(ManifestError, match=rf"is owned by uid {uid}, not by this user "
                                            rf"\(uid {uid + 1}\)"):
        shm.attach(manifest, directory=os.path.dirname(manifest.path))


def test_attach_refuses_the_default_directory_for_a_file_elsewhere(shared):
    _, manifest, _ = shared
    with pytest.raises(ManifestError, match=r"expected /dev/shm/hotweights-"):
        shm.attach(manifest)


HOLDER = textwrap.dedent("""
    import sys, torch
    from hotweights.protocol import shm
    manifest, _ = shm.share({"w": torch.ones(4)}, directory=sys.argv[1], server_id="live")
    print(manifest.path, flush=True)
    sys.stdin.read()  # hold the file until the test closes stdin
""")


def test_sweep_spares_a_locked_file_whatever_its_name_and_removes_unlocked_ones(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        live = holder.stdout.readline().strip()
        # as seen from another PID namespace: the name says a PID that does not exist
        dead_looking = tmp_path / "hotweights-live-999999999"
        os.rename(live, dead_looking)
        stale = tmp_path / "hotweights-stale-999999999"
        stale.write_bytes(b"x")
        unlocked_live_pid = tmp_path / f"hotweights-old-{os.getpid()}"
        unlocked_live_pid.write_bytes(b"x")
        (tmp_path / "hotweights-link-1").symlink_to(stale)

        removed = shm.sweep_stale(tmp_path)

        assert sorted(removed) == sorted([str(stale), str(unlocked_live_pid)])
        assert dead_looking.exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert shm.sweep_stale(tmp_path) == [str(dead_looking)]  # its holder is gone


def test_share_holds_its_file_until_release(tmp_path):
    manifest, _ = shm.share({"w": torch.ones(4)}, directory=tmp_path)
    assert shm.sweep_stale(tmp_path) == []
    shm.release(manifest)
    assert not os.path.exists(manifest.path) and shm.sweep_stale(tmp_path) == []


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


IPC = dict(stride=[3, 1], storage_offset=0, handle=_b64(b"h" * 64), storage_bytes=512,
           storage_offset_bytes=0, ref_counter_handle=_b64(b"r" * 8), ref_counter_offset=0,
           event_handle=None, event_sync=True)


def _cuda_manifest(ipc: dict) -> dict:
    return dict(format=shm.FORMAT, server_id="s", path="cuda:GPU-x", nbytes=0,
                gpu_uuid="GPU-x", tensors=[dict(name="w", dtype="float32", shape=[2, 3],
                                                offset=0, ipc=ipc)])


def test_cuda_ipc_fields_are_typed_and_round_trip_unchanged():
    manifest = shm.Manifest.from_dict(_cuda_manifest(dict(IPC)))
    ipc = manifest.tensors[0].ipc
    assert isinstance(ipc, shm.CudaIpc) and ipc.stride == (3, 1) and ipc.storage_bytes == 512
    assert json.loads(manifest.to_json())["tensors"][0]["ipc"] == IPC
    assert shm.Manifest.from_json(manifest.to_json()) == manifest


@pytest.mark.parametrize(("change", "match"), [
    (lambda i: i.pop("storage_bytes"), r"field 'ipc.storage_bytes' is missing"),
    (lambda i: i.update(storage_offset=-1), r"field 'ipc.storage_offset' must be an int >= 0"),
    (lambda i: i.update(event_sync="yes"), r"field 'ipc.event_sync' must be a bool"),
    (lambda i: i.update(stride="3,1"), r"field 'ipc.stride' must be a list of ints"),
    (lambda i: i.update(stride=[1]), r"field 'ipc.stride' \[1\] does not match shape \[2, 3\]"),
    (lambda i: i.update(handle="not base64!"), r"field 'ipc.handle' must be base64 text"),
    (lambda i: i.update(handle=None), r"field 'ipc.handle' is null for 512 storage bytes"),
    (lambda i: i.clear() or i.update(x=1), r"field 'ipc.stride' is missing"),
    (lambda i: i.update(storage_bytes=0, handle=None), r"field 'ipc.storage_bytes' is 0 for "
     r"shape \[2, 3\]"),
])
def test_bad_cuda_ipc_names_the_tensor_and_field(change, match):
    ipc = dict(IPC)
    change(ipc)
    with pytest.raises(ManifestError, match=r"src: tensors\[0\] \(w\): " + match):
        shm.Manifest.from_dict(_cuda_manifest(ipc), source="src")

"""The library's arguments a caller may get wrong: each is refused up front, naming the
argument or tensor, with nothing written (no server, no vLLM)."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hotweights.checkpoint import diagnose, recover, sync
from hotweights.checkpoint.journal import JOURNAL_NAME
from hotweights.cli.main import main
from hotweights.errors import CheckpointError, ConfigError, HotweightsError, RemoteError
from hotweights.protocol.http import request
from hotweights.protocol.tokens import find_token
from hotweights.remote.group import RemoteGroup
from hotweights.remote.hosts import server_urls


def _state() -> dict[str, torch.Tensor]:
    return {"a.weight": torch.arange(64, dtype=torch.float32).reshape(8, 8),
            "b.weight": torch.ones(8, dtype=torch.float32)}


@pytest.fixture
def ckpt(tmp_path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir()
    save_file(_state(), d / "model.safetensors", metadata={"format": "pt"})
    return d


def _files(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() if p.is_file() else b""
            for p in sorted(d.rglob("*"))}


@pytest.mark.parametrize(("live", "error", "match"), [
    ([torch.ones(2)], CheckpointError, "live: pass a mapping of names to tensors .* not a list"),
    (None, CheckpointError, "not a NoneType"),
    ({1: torch.ones(2)}, CheckpointError, "live: the names must be str, found 1"),
    ({"a.weight": [1.0, 2.0]}, CheckpointError,
     r"live\['a.weight'\]: a list, not a torch.Tensor"),
    ({"a.weight": torch.empty(8, 8, device="meta")}, CheckpointError,
     "a.weight: on the meta device: it holds no data to save"),
    ({"a.weight": torch.eye(8).to_sparse()}, CheckpointError,
     r"a.weight: a torch.sparse_coo tensor; safetensors holds dense ones \(pass t.to_dense"),
    ({"__metadata__": torch.ones(2)}, CheckpointError,
     r"live: the name '__metadata__' cannot name a tensor in a safetensors header"),
    ({"a\ud800": torch.ones(2)}, CheckpointError,
     r"live: the name 'a\\ud800' cannot name a tensor .* not UTF-8"),
    ({"a.weight": torch.ones(2, dtype=torch.complex64).conj()}, CheckpointError,
     r"a.weight: a lazily conjugated view, whose memory holds other values \(pass "
     r"t.resolve_conj\(\).resolve_neg\(\)\)"),
    ({"a.weight": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])},
     CheckpointError, r"a.weight: a nested tensor; safetensors holds dense ones"),
    ({"a.weight": torch.nn.LazyLinear(3).weight}, CheckpointError,
     r"a.weight: not initialized yet \(a lazy module's: run a forward pass first\)"),
    ({"a.weight": torch._to_functional_tensor(torch.ones(2))}, CheckpointError,
     r"a.weight: a Tensor that holds no memory this process can read"),
])
def test_live_that_is_no_mapping_of_tensors_is_named(ckpt, tmp_path, live, error, match):
    before = _files(ckpt)
    for target in (ckpt, tmp_path / "new"):  # a sync, and a first save
        with pytest.raises(error, match=match):
            sync(target, live)
        if live is not None:  # (diagnose without live tensors checks the directory alone)
            with pytest.raises(error, match=match):
                diagnose(ckpt, live)
    assert _files(ckpt) == before and not (tmp_path / "new").exists()


def test_a_sync_of_no_tensors_is_refused(ckpt, tmp_path):
    before = _files(ckpt)
    for target in (ckpt, tmp_path / "new"):
        with pytest.raises(CheckpointError, match=r"live holds no tensors to sync"):
            sync(target, {})
    assert _files(ckpt) == before and not (tmp_path / "new").exists()


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(mode="fast"), "mode 'fast': choose one of auto, reflink"),
    (dict(block_size=0), r"field 'block_size' must be a positive multiple of 8, found 0"),
    (dict(block_size=12), r"field 'block_size' must be a positive multiple of 8, found 12"),
    (dict(block_size="64"), r"field 'block_size' must be a positive multiple of 8, found '64'"),
    (dict(changed=5), "changed=5: pass a collection of live tensor names"),
    (dict(watch=1), r"sync: field 'watch' must be True, False or a WriteWatch, found 1"),
    (dict(convert_dtype="no"), r"field 'convert_dtype' must be True or False, found 'no'"),
    (dict(after_read=3), r"sync: field 'after_read' must be a callable or None, found 3"),
    (dict(progress="bar"), r"sync: field 'progress' must be a callable or None"),
])
def test_options_a_sync_cannot_take_are_named_before_anything_is_made(ckpt, tmp_path, kwargs,
                                                                       match):
    before = _files(ckpt)
    for target in (ckpt, tmp_path / "new"):  # the mode of a directory not made yet too
        with pytest.raises(HotweightsError, match=match):
            sync(target, _state(), **kwargs)
    assert _files(ckpt) == before and not (tmp_path / "new").exists()
    if not kwargs.keys() & {"changed", "watch", "after_read", "progress", "convert_dtype"}:
        with pytest.raises(HotweightsError, match=match):
            diagnose(ckpt, _state(), **kwargs)


@pytest.mark.parametrize(("live", "problem"), [
    ({}, "live holds no tensors to save"),
    ({"a": torch.zeros(2, dtype=torch.complex128)},
     "a: the live tensor is complex128, which has no safetensors dtype"),
])
def test_diagnose_foresees_what_a_first_save_refuses(tmp_path, live, problem):
    found = diagnose(tmp_path, live, mode="journal")
    assert found.first_save and found.write_mode == "copy"  # whole files, in any mode
    assert [p for p in found.problems if problem in p]
    with pytest.raises(CheckpointError):
        sync(tmp_path, live)


def test_diagnose_reads_a_state_dict_s_names_with_the_config_as_sync_does(tmp_path):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                            moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=8)
    model = Qwen3MoeForCausalLM(config)
    sync(tmp_path, model)
    state = model.state_dict()  # fused experts, saved per expert: the config says how
    found = diagnose(tmp_path, state, config=config)
    assert found.problems == [] and found.only_live == 0
    assert sync(tmp_path, state, config=config).missing_on_disk == ()
    with pytest.raises(CheckpointError, match="config"):
        diagnose(tmp_path, state, config=5)


def test_diagnose_of_a_first_save_cut_short_says_the_journal_completes_it(tmp_path):
    child = ("import sys, torch\nfrom hotweights.checkpoint import sync\n"
             "sync(sys.argv[1], {'a': torch.zeros(3000), 'b': torch.ones(3000)}, "
             "max_shard_size=12000)\n")
    d = tmp_path / "ck"
    subprocess.run([sys.executable, "-c", child, str(d)], timeout=120,
                   env=dict(os.environ, HOTWEIGHTS_JOURNAL_CRASH_AT="move:1"))
    found = diagnose(d)
    assert found.journal is not None and found.error.endswith(
        "(as a committed journal left it: its replay, by recover or the next sync, "
        "completes it)")
    assert sync(d, {"a": torch.zeros(3000), "b": torch.ones(3000)}).writes == {}


@pytest.mark.parametrize("model_dir", [None, b"ckpt", "", " "])
def test_a_model_dir_that_is_no_path_or_empty_is_named(tmp_path, monkeypatch, model_dir):
    monkeypatch.chdir(tmp_path)  # "" would be the current directory
    for call in (sync, diagnose):
        with pytest.raises(CheckpointError, match=rf"{call.__name__}: model_dir "):
            call(model_dir, _state())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("version", [b"v1", 5, ["v"]])
def test_a_version_that_is_no_str_is_named(ckpt, version):
    before = _files(ckpt)
    with pytest.raises(CheckpointError, match=r"sync: field 'version' must be a str"):
        sync(ckpt, _state(), version=version)
    assert _files(ckpt) == before


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(max_shard_size="10QB"), r"field 'max_shard_size' '10QB': Unit 'QB' not supported"),
    (dict(max_shard_size=0), r"field 'max_shard_size' must be bytes \(an int > 0\) or a size"),
    (dict(max_shard_size=None), r"field 'max_shard_size' .*found None"),
    (dict(max_shard_size=True), r"field 'max_shard_size' .*found True"),
    (dict(config="llama"), r"field 'config' must be a dict or a transformers PretrainedConfig"
                           r" .* found str"),
    (dict(config={"t": torch.ones(1)}), r"field 'config' .* found dict"),
    (dict(config={"model_type": ["llama"]}),
     r"field 'config.model_type' must be a str \(e.g. 'llama'\), found \['llama'\]"),
])
def test_a_first_save_refuses_bad_options_before_making_anything(tmp_path, kwargs, match):
    d = tmp_path / "new"
    with pytest.raises(CheckpointError, match=match):
        sync(d, _state(), **kwargs)
    assert not d.exists()


def test_numpy_ints_are_sizes_as_ints_are(tmp_path):
    d = tmp_path / "new"
    sync(d, _state(), max_shard_size=np.int64(200), block_size=np.int64(64))
    assert len(list(d.glob("*.safetensors"))) == 2
    assert sync(d, _state(), block_size=np.int64(64)).bytes_written == 0


def test_an_after_read_hook_that_raises_leaves_the_sync_done_not_pending(ckpt):
    live = _state()
    live["a.weight"][3] += 1.0

    def hook():
        raise RuntimeError("the caller's hook failed")
    with pytest.raises(RuntimeError, match="the caller's hook failed"):
        sync(ckpt, live, after_read=hook)
    from hotweights.checkpoint import finisher
    finisher.finish()
    assert torch.equal(load_file(ckpt / "model.safetensors")["a.weight"], live["a.weight"])
    assert not (ckpt / JOURNAL_NAME).exists() and diagnose(ckpt).problems == []


def test_a_directory_where_the_journal_belongs_is_named(ckpt, capsys):
    (ckpt / JOURNAL_NAME).mkdir()
    said = f"{JOURNAL_NAME}: a directory where a sync's journal belongs"
    for call in (recover, diagnose, lambda d: sync(d, _state())):
        with pytest.raises(CheckpointError, match=said):
            call(ckpt)
    for argv in (["recover", str(ckpt)], ["diagnose", "--model-dir", str(ckpt)]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: ") and said in err and len(err.splitlines()) == 1


def test_diagnose_names_a_directory_it_cannot_write(ckpt, monkeypatch):
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m, **kw: False if m == os.W_OK and
                        Path(p) == ckpt else real(p, m, **kw))
    d = diagnose(ckpt)
    assert d.write_mode is None and d.problems == [
        f"{ckpt}: not writable by this process: a sync cannot stage or replace its shards "
        "here"]


@pytest.mark.parametrize(("token", "match"), [
    (5, "token= must be a str, found int"),
    (b"x", "token= must be a str, found bytes"),
    ("s3cr3t\ttoken", "holds whitespace, control or non-ASCII characters inside it"),
    ("s3cr3t\x00", "holds whitespace, control or non-ASCII characters inside it"),
    ("s3cr3t\u00e9", "holds whitespace, control or non-ASCII characters inside it"),
])
def test_a_token_that_cannot_go_in_a_header_is_refused_and_never_shown(token, match):
    with pytest.raises(ConfigError, match=match) as e:
        find_token("http://10.0.0.1:8000", token)
    assert "s3cr3t" not in str(e.value)


def test_a_token_read_with_its_newline_is_taken_without_it(json_server):
    port = json_server(answer={"ok": 1})
    token = find_token(f"http://127.0.0.1:{port}", "s3cr3t\n")
    assert token == "s3cr3t"
    assert request(f"http://127.0.0.1:{port}", "GET", "/x", token) == {"ok": 1}


@pytest.mark.parametrize(("servers", "match"), [
    (None, "servers: a str or a list of str, found None"),
    (5, "servers: a str or a list of str, found 5"),
    (["a:1", 5], r"servers: each a URL, host\[:port\] or node list \(a str\), found 5"),
])
def test_servers_of_the_wrong_type_are_named(servers, match):
    with pytest.raises(ConfigError, match=match):
        server_urls(servers)


def test_a_long_node_list_with_a_server_named_twice_is_found_at_once():
    with pytest.raises(ConfigError, match="servers named twice: http://n1:8000"):
        server_urls("n[1-20000],n1")  # counted, not searched per server


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(timeout=0), r"field 'timeout' must be a number of seconds in \(0, 21600\], found 0"),
    (dict(timeout=float("nan")), "field 'timeout' must be a number of seconds in"),
    (dict(timeout=7 * 3600), r"in \(0, 21600\], found 25200"),  # a lease over the servers'
    (dict(timeout="60"), "field 'timeout'"),
    (dict(master_port=70000), "field 'master_port' must be a port"),
    (dict(master_port="x"), "field 'master_port' must be a port"),
    (dict(master_addr=5), "field 'master_addr' must be an address"),
    (dict(trainable=5), "field 'trainable' must be names or patterns"),
    (dict(trainable=[5]), "field 'trainable' must be names or patterns"),
])
def test_remote_group_arguments_are_checked_before_any_server_is_asked(kwargs, match):
    with pytest.raises(RemoteError, match=match):
        RemoteGroup("127.0.0.1:9", token="t0k3n-for-tests", **kwargs)


def test_a_remote_group_checkpoint_that_is_no_directory_is_named(tmp_path):
    with pytest.raises(RemoteError, match=f"field 'checkpoint': {tmp_path / 'nope'} is not a "
                                          "directory"):
        RemoteGroup("127.0.0.1:9", token="t0k3n-for-tests", checkpoint=tmp_path / "nope")


def test_trainable_given_as_a_generator_is_read_once():
    group = RemoteGroup("127.0.0.1:9", token="t0k3n-for-tests",
                        trainable=(n for n in ["model.layers.1.*"]))
    assert group.reference.trainable == ("model.layers.1.*",)
    group.close()


def test_a_url_that_is_no_str_is_named():
    for url in (None, 8000):
        with pytest.raises(ConfigError, match=f"{url!r} is not a server URL: a "):
            find_token(url, "t")


@pytest.mark.parametrize("answer", [{"version": "1@s"}, {"manifests": {}, "version": "1@s"},
                                    {"manifests": [], "version": 1}])
def test_a_manifest_answer_without_its_fields_is_named_not_a_key_error(json_server, answer):
    from hotweights.bridge.client import Bridge
    from hotweights.errors import ServerError

    url = f"http://127.0.0.1:{json_server(answer=answer)}"
    with pytest.raises(ServerError, match=r"/hotweights/manifest: field '(manifests|version)' "
                       r"must be a (list|str)"):
        Bridge.connect(url, token="t" * 32)

"""vllm_plugin.aliases: parameters that are views of another's bytes (MLA's W_UV, W_UK_T)."""

import torch

from hotweights.vllm_plugin.aliases import aliases, rebased


def _mla(heads=4, rank=16, nope=8, v=8):
    """vLLM's MLA layer after load: W_UK_T and W_UV are views of kv_b_proj's weight."""
    kv_b = torch.randn(heads * (nope + v), rank)
    w_uk, w_uv = kv_b.T.view(rank, heads, nope + v).split([nope, v], dim=-1)
    return {"kv_b_proj.weight": kv_b, "W_UV": w_uv.transpose(0, 1),
            "W_UK_T": w_uk.permute(1, 2, 0), "o_proj.weight": torch.randn(8, heads * v)}


def test_views_of_another_parameter_are_its_aliases():
    assert aliases(_mla()) == {"W_UV": "kv_b_proj.weight", "W_UK_T": "kv_b_proj.weight"}


def test_parameters_side_by_side_in_one_storage_are_none():
    flat = torch.zeros(100)  # one shared-memory file holds every parameter of a server
    params = {"a": flat[:40].view(4, 10), "b": flat[40:64], "c": flat[64:].view(6, 6)}
    assert aliases(params) == {}


def test_two_names_of_one_view_keep_the_first():
    w = torch.randn(4, 4)
    assert aliases({"lm_head.weight": w, "embed.weight": w.view(4, 4)}) == {
        "lm_head.weight": "embed.weight"}


def test_another_dtype_or_a_copy_is_no_alias():
    w = torch.randn(4, 4)
    assert aliases({"w": w, "as_int": w.view(torch.int32), "copy": w.clone()}) == {}


def test_rebased_views_read_and_write_the_new_bytes():
    params = _mla()
    kv_b = params["kv_b_proj.weight"]
    moved = torch.empty(7 + kv_b.numel())[7:].view(kv_b.shape)  # a shared copy, elsewhere
    for name in ("W_UV", "W_UK_T"):
        moved.copy_(kv_b)
        view = rebased(params[name], kv_b, moved)
        assert torch.equal(view, params[name])
        moved.add_(1)  # a trainer's step on the shared bytes reaches the alias
        assert torch.equal(view, params[name] + 1)


def test_a_server_shares_an_alias_as_a_view_of_its_holder_s_shared_bytes(monkeypatch):
    # the worker copies the weights into shared memory: an alias copied apart would keep
    # the old values while the trainer writes its holder
    from types import SimpleNamespace

    from vllm.distributed import parallel_state

    from hotweights.protocol import shm
    from hotweights.vllm_plugin.worker import HotweightsWorker

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    model = torch.nn.Module()
    for name, t in _mla().items():
        model.register_parameter(name.replace(".", "_"), torch.nn.Parameter(t, False))
    worker = HotweightsWorker()
    worker.model_runner = SimpleNamespace(model=model, model_config=SimpleNamespace(model="m"))
    worker.vllm_config = SimpleNamespace(speculative_config=None)
    manifest = shm.Manifest.from_dict(worker.hotweights_share("aliases-test"))
    try:
        assert [e.name for e in manifest.tensors] == ["kv_b_proj_weight", "o_proj_weight"]
        shared = shm.attach(manifest)  # what a trainer maps
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        shared["kv_b_proj_weight"].add_(1)
        assert torch.equal(model.W_UV, before["W_UV"] + 1)
        assert torch.equal(model.W_UK_T, before["W_UK_T"] + 1)
    finally:
        worker.hotweights_release()

"""The worker's load-time refusals, on fake vLLM config and modules (no GPU, no engine)."""

from types import SimpleNamespace

import pytest
import torch

from hotweights.errors import ConfigError, HotweightsError, UnsupportedModelError
from hotweights.vllm_plugin.worker import (
    _refuse_borrowed_weights,
    _refuse_drafter_copies,
    _refuse_repacked_weights,
    _refuse_unshareable_cuda_memory,
)


# Stand-ins named like vLLM's classes (vllm/model_executor/layers/linear.py): the check
# judges a layer's method by its class and base-class names.
class LinearMethodBase:
    pass


class UnquantizedLinearMethod(LinearMethodBase):
    pass


class Fp8LinearMethod(LinearMethodBase):
    pass


class PackedUnquantizedLinearMethod(UnquantizedLinearMethod):
    pass


class UnquantizedEmbeddingMethod:  # not a linear method
    pass


def _config(*, quantization=None, sleep=False, cumem=False, load_format="auto", extra=None):
    return SimpleNamespace(model_config=SimpleNamespace(
        model="/models/tiny", quantization=quantization, enable_sleep_mode=sleep,
        enable_cumem_allocator=cumem), load_config=SimpleNamespace(
        load_format=load_format, model_loader_extra_config={} if extra is None else extra))


def _model(qkv_method=UnquantizedLinearMethod) -> torch.nn.Module:
    model = torch.nn.Module()
    model.embed_tokens = torch.nn.Module()
    model.embed_tokens.quant_method = UnquantizedEmbeddingMethod()
    model.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
    for i, layer in enumerate(model.layers):
        layer.qkv_proj = torch.nn.Module()
        layer.qkv_proj.quant_method = (qkv_method if i == 1 else UnquantizedLinearMethod)()
        layer.input_layernorm = torch.nn.Module()  # no quant_method at all
    return model


def test_unquantized_model_is_accepted():
    _refuse_repacked_weights(_config(), _model())


def test_quantized_model_is_refused():
    with pytest.raises(UnsupportedModelError, match=r"/models/tiny is quantized \(fp8\)"):
        _refuse_repacked_weights(_config(quantization="fp8"), _model())


@pytest.mark.parametrize("method", [Fp8LinearMethod, PackedUnquantizedLinearMethod])
def test_layer_with_another_linear_method_is_named(method):
    with pytest.raises(UnsupportedModelError,
                       match=rf"layers\.1\.qkv_proj computes with {method.__name__}"):
        _refuse_repacked_weights(_config(), _model(method))


def test_unshareable_cuda_memory_is_a_config_error(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    _refuse_unshareable_cuda_memory(_config())
    with pytest.raises(ConfigError, match=r"--enable-sleep-mode"):
        _refuse_unshareable_cuda_memory(_config(sleep=True, cumem=True))  # (as vLLM sets it)
    with pytest.raises(ConfigError, match=r"--enable-cumem-allocator allocates the weights "
                       r"with cuMem"):
        _refuse_unshareable_cuda_memory(_config(cumem=True))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(HotweightsError, match=r"PYTORCH_CUDA_ALLOC_CONF enables expandable"):
        _refuse_unshareable_cuda_memory(_config())


@pytest.mark.parametrize(("backend", "refused"), [
    ("TRITON", False), ("BATCHED_TRITON", False), ("FLASHINFER_CUTLASS", True),
    ("FLASHINFER_TRTLLM", True), ("AITER", True)])
def test_experts_on_kernels_that_rearrange_them_are_refused(backend, refused):
    # FlashInfer CUTLASS swaps gate and up ([w3; w1]), TRTLLM permutes, AITER shuffles
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    model = _model()
    model.layers[1].experts = torch.nn.Module()
    model.layers[1].experts.quant_method = SimpleNamespace(
        unquantized_backend=UnquantizedMoeBackend[backend])
    if not refused:
        _refuse_repacked_weights(_config(), model)
        return
    with pytest.raises(UnsupportedModelError, match=r"layers.1.experts computes its experts "
                       r"with vLLM's .* MoE kernels, which rearrange .* --moe-backend triton"):
        _refuse_repacked_weights(_config(), model)


# Stand-ins named like vLLM's offloaders (vllm/model_executor/offloader/): theirs need CUDA
# streams to be made. The check judges the one the model runner set by its class name.
class PrefetchOffloader:
    pass


class UVAOffloader:
    pass


@pytest.mark.parametrize(("offloader", "sharing", "refused"), [
    (None, True, None), (PrefetchOffloader, True, r"prefetch offloading "
                         r"\(--offload-group-size\) .* overwritten at the next forward"),
    (PrefetchOffloader, False, "--offload-group-size"),
    (UVAOffloader, True, r"--cpu-offload-gb .* CUDA IPC cannot share"),
    (UVAOffloader, False, None)])
def test_offloaded_weights_are_refused_where_an_update_would_not_reach_them(
        monkeypatch, offloader, sharing, refused):
    from vllm.model_executor.offloader import base

    monkeypatch.setattr(base, "_instance", base.NoopOffloader())
    base.set_offloader(offloader and offloader())
    if refused is None:
        _refuse_borrowed_weights(_config(), sharing=sharing)
        return
    with pytest.raises(ConfigError, match=refused):
        _refuse_borrowed_weights(_config(), sharing=sharing)


@pytest.mark.parametrize("sharing", [True, False])
def test_the_preload_daemon_s_weights_are_refused_unless_copied(sharing):
    with pytest.raises(ConfigError, match=r"--load-format ipc_cache maps the weights of "
                       r"vLLM's preload daemon"):
        _refuse_borrowed_weights(_config(load_format="ipc_cache"), sharing=sharing)
    with pytest.raises(ConfigError, match="ipc_cache"):
        _refuse_borrowed_weights(_config(load_format="ipc_cache",
                                         extra={"mode": "zero_copy"}), sharing=sharing)
    _refuse_borrowed_weights(_config(load_format="ipc_cache", extra={"mode": "copy"}),
                             sharing=sharing)


def test_a_drafter_s_quantized_copy_of_the_head_is_refused():
    _refuse_drafter_copies(SimpleNamespace(speculative_config=None))  # (vLLM 0.32: no field)
    _refuse_drafter_copies(SimpleNamespace(speculative_config=SimpleNamespace(
        draft_lm_head_quantization=None)))
    with pytest.raises(ConfigError, match=r"draft_lm_head_quantization=fp8 computes with a "
                                          r"copy of lm_head"):
        _refuse_drafter_copies(SimpleNamespace(speculative_config=SimpleNamespace(
            draft_lm_head_quantization="fp8")))


@pytest.mark.parametrize(("var", "value"), [
    ("PYTORCH_ALLOC_CONF", "expandable_segments:True"),  # torch >= 2.9's name
    ("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512, expandable_segments: true")])
def test_expandable_segments_are_refused_under_either_name_and_any_spacing(
        monkeypatch, var, value):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=f"{var} enables expandable segments"):
        _refuse_unshareable_cuda_memory(_config())


def test_the_preload_daemon_s_weights_are_refused_when_the_loader_config_is_no_dict():
    # its mode is then not known: taken as vLLM's default, zero_copy
    with pytest.raises(ConfigError, match="--load-format ipc_cache"):
        _refuse_borrowed_weights(_config(load_format="ipc_cache", extra="copy"), sharing=False)

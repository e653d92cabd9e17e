"""vLLM's CPU gated-delta-net conv computes with the live checkpoint weight, on any CPU.

On AVX-512 BF16 / AMX / ARM BF16 CPUs vLLM repacks the conv1d weight [D, 1, width] for its
C++ conv kernel; with hotweights it keeps the checkpoint layout and runs its torch conv
path on it everywhere. Each case makes vLLM believe the CPU is one or the other (through
what vLLM itself reads, `torch.cpu._is_avx512_bf16_supported`) and runs a real engine on
the tiny Qwen3-Next model. The C++ kernel is never run: it may not exist on this CPU.
"""

import collections

import pytest
import torch

pytestmark = pytest.mark.vllm
PROMPT = [1, 5, 9, 20, 33, 7, 101, 250, 64, 3]
LOGPROB_TOL = 0.05  # bf16: vLLM's CPU kernels round differently from HF's eager ops


@pytest.mark.parametrize("avx512_bf16", [True, False], ids=["avx512_bf16", "avx2"])
def test_gdn_conv_computes_with_the_live_checkpoint_weight(avx512_bf16, tiny_model,
                                                           monkeypatch):
    import vllm._custom_ops  # noqa: F401  this CPU's kernels, loaded before the probe lies
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as gdn

    from hotweights.vllm_plugin.local import hf_context, live_params, start_engine, stop_engine

    model_dir = tiny_model("qwen3_next")
    # vLLM packs the conv weight at load (layers/utils.py) and runs its C++ conv kernel
    # (gdn_attention.py, `use_cpp_conv`) where this says so.
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    # vLLM sets this (to its default) on such a CPU, for good; set here, undone after.
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "SD")
    calls: collections.Counter = collections.Counter()

    def spy(name):
        real = getattr(gdn, name)

        def run(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(gdn, name, run)

    def packed_kernel(*args, **kwargs):
        raise AssertionError("vLLM's C++ conv kernel ran on a packed conv1d weight")

    spy("causal_conv1d_torch")  # prefill
    spy("causal_conv1d_update_cpu")  # decode
    for name in ("_causal_conv1d_fwd_cpu", "_causal_conv1d_update_cpu"):
        monkeypatch.setattr(gdn, name, packed_kernel)

    llm = start_engine(model_dir, dtype="bfloat16")
    try:
        def served() -> list[dict[int, float]]:
            llm.reset_prefix_cache()
            out = llm.generate({"prompt_token_ids": PROMPT},
                               SamplingParams(max_tokens=3, temperature=0.0, logprobs=5),
                               use_tqdm=False)
            return [{t: lp.logprob for t, lp in step.items()}
                    for step in out[0].outputs[0].logprobs]

        params = live_params(llm)
        convs = {n: p for n, p in params.items() if n.endswith(".conv1d.weight")}
        assert convs, sorted(params)
        checkpoint = {}
        for shard in sorted(model_dir.glob("*.safetensors")):
            checkpoint.update(load_file(shard))
        for name, weight in convs.items():
            assert weight.dim() == 3 and weight.size(1) == 1, (name, weight.shape)
            assert torch.equal(weight, checkpoint[name]), f"{name} differs from the checkpoint"
        stashed = llm.apply_model(lambda model: [
            n for n, m in model.named_modules() if hasattr(m, "_cpu_unpacked_conv_weight")])
        assert stashed == [[]]

        calls.clear()
        before = served()
        assert calls["causal_conv1d_torch"] and calls["causal_conv1d_update_cpu"], calls

        with hf_context(llm):
            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
            with torch.no_grad():
                logits = hf(torch.tensor([PROMPT])).logits[0, -1].float()
        ours = torch.log_softmax(logits, dim=-1)
        for token, logprob in before[0].items():
            assert abs(ours[token].item() - logprob) < LOGPROB_TOL, token

        name, weight = next(iter(convs.items()))
        saved = weight.clone()
        try:
            with torch.no_grad():
                weight.neg_()  # in place: the tensor the trainer's view writes
            assert served() != before, f"writing {name} in place changed nothing"
        finally:
            with torch.no_grad():
                weight.copy_(saved)
        assert served() == before
    finally:
        stop_engine(llm)

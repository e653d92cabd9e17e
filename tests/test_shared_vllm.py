"""One copy, two processes: a trainer process trains the weights a vLLM engine serves."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hotweights.protocol import shm
from hotweights.vllm_plugin.local import live_params

TRAINER = Path(__file__).with_name("trainer.py")
PROMPT = [1, 5, 9, 20, 33, 7, 101, 250, 64, 3]
# (arch, dtype, impl): the engines are the suite's `vllm_engines`, shared with the tests of
# the same key in test_views_vllm (tests/conftest.py). The custom remote-code model runs
# through `hotweights serve` (tests/test_server.py): a second Transformers-backend engine in
# one process would re-decorate Llama's classes.
CASES = [("llama_tied", "bfloat16", "auto"), ("qwen3", "bfloat16", "auto"),
         ("qwen3_moe", "bfloat16", "auto"), ("qwen3_next", "bfloat16", "auto"),
         ("qwen3_5", "bfloat16", "auto"), ("llama", "bfloat16", "transformers")]
TOL = 0.05  # bf16: vLLM's CPU kernels round differently from HF's eager ops
pytestmark = [pytest.mark.vllm, pytest.mark.parametrize(
    "engine_key", CASES, ids=["-".join(c) for c in CASES], scope="module")]


def _logprobs(llm) -> dict[int, float]:
    from vllm import SamplingParams

    llm.reset_prefix_cache()
    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(max_tokens=1, temperature=0.0, logprobs=5),
                       use_tqdm=False)
    return {t: lp.logprob for t, lp in out[0].outputs[0].logprobs[0].items()}


@pytest.fixture(scope="module")
def served(engine_key, vllm_engines, servable):
    arch, dtype, impl = engine_key
    servable(arch)
    llm = vllm_engines.get(arch, dtype, impl, unshared=True)  # a second share is a no-op
    before = _logprobs(llm)
    manifest = shm.Manifest.from_dict(vllm_engines.share())
    checkpoint = {name: t.clone() for name, t in live_params(llm).items()}
    yield llm, manifest, before
    # The trainer wrote in place: the engine's next tests get the checkpoint back.
    with torch.no_grad():
        for name, tensor in live_params(llm).items():
            tensor.copy_(checkpoint[name])
    assert _logprobs(llm) == before
    llm.collective_rpc("hotweights_release")


def test_sharing_changes_nothing_the_engine_serves(served):
    llm, manifest, before = served
    assert manifest.path.startswith("/dev/shm/hotweights-")
    assert oct(os.stat(manifest.path).st_mode & 0o777) == "0o600"
    assert llm.collective_rpc("hotweights_share")[0]["path"] == manifest.path  # idempotent
    assert _logprobs(llm) == before


def test_trainer_process_trains_the_served_weights_in_place(served, tmp_path):
    llm, manifest, before = served
    path = tmp_path / "manifest.json"
    path.write_text(manifest.to_json())
    out = subprocess.run([sys.executable, str(TRAINER), str(path), "3"], capture_output=True,
                         text=True, timeout=180)  # a hung trainer fails before the per-test limit
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["trainable"] > 0 and result["shared"] > 0
    served_now = _logprobs(llm)  # no reload, no copy: the engine computes on the same bytes
    assert served_now != before
    for token, logprob in served_now.items():
        assert abs(result["logprobs"][token] - logprob) < TOL, token

"""TRL's GRPOTrainer in colocate mode through `hotweights.integrations.trl`: vLLM runs in
the trainer's process (CPU, fp32) and the HF model TRL trains is built on vLLM's own
parameters: no weight sync, no second copy, and vLLM samples in the checkpoint's dtype
(TRL's own colocate engine would serve a float32 checkpoint in bf16)."""

import pytest
import torch

pytest.importorskip("trl")

from hotweights.errors import ConfigError  # noqa: E402
from hotweights.integrations.trl import (  # noqa: E402
    DistillationTrainer,
    GRPOTrainer,
    RLOOTrainer,
    outside_served,
)
from hotweights.testing import tiny  # noqa: E402
from test_trl_grpo import (  # noqa: E402
    _config,
    _data,
    _distill_config,
    _reward,
    _rloo_config,
    _teacher,
)

pytestmark = pytest.mark.vllm

STEPS = 3


@pytest.fixture
def colocated(tmp_path):
    trainers = []
    yield tmp_path, trainers
    for trainer in trainers:  # in-process engines cannot coexist: free this one
        trainer.close()


def _trains_vllm_s_tensors(trainer, steps: int) -> list[float]:
    """Train; every trainable parameter still a view of the engine's, the engine's tensors
    written, one version per step. Returns the sample versions logged."""
    live = trainer.weights.tensors
    before = {name: t.detach().clone() for name, t in live.items()}
    trainer.train()
    assert outside_served(trainer.model, live) == []
    assert trainer.weights.version == steps
    assert any(not torch.equal(t, before[name]) for name, t in live.items())
    return [e["hotweights/sample_version"] for e in trainer.state.log_history
            if "hotweights/sample_version" in e]


@pytest.mark.timeout(400)
def test_grpo_trains_vllm_s_own_parameters_in_this_process(colocated):
    tmp, trainers = colocated
    model_dir = tiny.build("llama", tmp / "llama", dtype="float32")
    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=_reward, train_dataset=_data(),
                          args=_config(tmp, vllm_mode="colocate", max_steps=STEPS))
    trainers.append(trainer)
    live = trainer.weights.tensors
    assert {t.dtype for t in live.values()} == {torch.float32}  # not vLLM's "auto" bf16
    assert outside_served(trainer.model, live) == []
    assert _trains_vllm_s_tensors(trainer, STEPS) == [0.0, 1.0, 2.0]
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    gaps = [entry["sampling/sampling_logp_difference/mean"] for entry in logs]
    assert max(gaps) <= 1e-4, gaps


@pytest.mark.timeout(400)
def test_a_rollout_func_calling_the_engine_itself_gets_each_sample_s_version(colocated):
    from vllm import SamplingParams

    tmp, trainers = colocated
    model_dir = tiny.build("llama", tmp / "llama", dtype="float32")
    calls = []

    def rollout(prompts, trainer):
        outs = trainer.vllm_generation.llm.generate(
            prompts, SamplingParams(max_tokens=8, logprobs=0), use_tqdm=False)
        calls.append(len(outs))
        return {"prompt_ids": [o.prompt_token_ids for o in outs],
                "completion_ids": [list(o.outputs[0].token_ids) for o in outs],
                "logprobs": [[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs]
                             for o in outs]}

    trainer = GRPOTrainer(model=str(model_dir), reward_funcs=_reward, train_dataset=_data(),
                          args=_config(tmp, vllm_mode="colocate", max_steps=2),
                          rollout_func=rollout)
    trainers.append(trainer)
    assert _trains_vllm_s_tensors(trainer, 2) == [0.0, 1.0]
    assert calls == [8, 8] and trainer.sample_versions == [1] * 8


@pytest.mark.timeout(400)
def test_rloo_trains_vllm_s_own_parameters_in_this_process(tmp_path):
    model_dir = tiny.build("llama", tmp_path / "llama", dtype="float32")
    with RLOOTrainer(model=str(model_dir), reward_funcs=_reward, train_dataset=_data(),
                     args=_rloo_config(tmp_path, vllm_mode="colocate", max_steps=2)
                     ) as trainer:
        assert _trains_vllm_s_tensors(trainer, 2) == [0.0, 1.0]


@pytest.mark.timeout(400)
def test_distillation_trains_vllm_s_own_student_in_this_process(tmp_path):
    model_dir = tiny.build("llama", tmp_path / "llama", dtype="float32")
    with DistillationTrainer(model=str(model_dir), teacher_model=_teacher(model_dir),
                             train_dataset=_data(),
                             args=_distill_config(tmp_path, vllm_mode="colocate")) as trainer:
        assert _trains_vllm_s_tensors(trainer, 2)[0] == 0.0


@pytest.mark.timeout(400)
def test_close_or_a_failed_setup_stops_the_engine_and_puts_the_environment_back(
        tmp_path):
    import os

    model_dir = tiny.build("llama", tmp_path / "llama", dtype="float32")
    before = dict(os.environ)
    with pytest.raises(TypeError, match="no_such_option"):  # TRL refuses it once the
        GRPOTrainer(model=str(model_dir), reward_funcs=_reward,  # engine runs: it is stopped
                    train_dataset=_data(), no_such_option=1,
                    args=_config(tmp_path, vllm_mode="colocate", max_steps=1))
    assert dict(os.environ) == before
    with GRPOTrainer(model=str(model_dir), reward_funcs=_reward, train_dataset=_data(),
                     args=_config(tmp_path, vllm_mode="colocate", max_steps=1)) as trainer:
        llm = trainer.weights.llm
    assert trainer.weights.llm is None and trainer.vllm_generation.llm is None
    assert dict(os.environ) == before
    with pytest.raises(ConfigError, match=r"this trainer was closed \(close\(\) stopped "):
        trainer.train()  # not an AttributeError deep in TRL
    # the engine is gone and its distributed state freed: another one starts here
    with GRPOTrainer(model=str(model_dir), reward_funcs=_reward, train_dataset=_data(),
                     args=_config(tmp_path, vllm_mode="colocate", max_steps=1)) as again:
        assert again.weights.llm is not llm
        again.train()
        assert again.weights.version == 1


def test_colocate_mode_wants_a_model_directory(tmp_path):
    from hotweights.errors import ConfigError

    with pytest.raises(ConfigError, match="local model directory"):
        GRPOTrainer(model=str(tmp_path / "nowhere"), reward_funcs=_reward,
                    train_dataset=_data(), args=_config(tmp_path, vllm_mode="colocate"))
    with pytest.raises(ConfigError, match="vllm_tensor_parallel_size"):
        GRPOTrainer(model=str(tmp_path), reward_funcs=_reward, train_dataset=_data(),
                    args=_config(tmp_path, vllm_mode="colocate", vllm_tensor_parallel_size=2))

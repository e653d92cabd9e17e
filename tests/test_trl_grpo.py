"""TRL's GRPOTrainer through `hotweights.integrations.trl` on a real `hotweights serve`
(vLLM CPU, fp32): the policy TRL trains is the server's own tensors.

Checked: no byte of the weights is copied into or out of vLLM (every trainable parameter
stays a view of the served memory, through TRL's whole setup and training); one version
per optimizer step; each sample's version is the one the server had when it generated it;
TRL's own logprob gap between the trainer and vLLM on the sampled tokens is ~0 in fp32;
what TRL would copy is refused by option name.
"""

import contextlib
import importlib.util
import json
import shutil
import subprocess
import sys
import types
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, TrainerCallback  # noqa: E402
from trl import DistillationConfig, GRPOConfig, RLOOConfig, SFTTrainer  # noqa: E402

with warnings.catch_warnings():  # "You are importing from 'trl.experimental'"
    warnings.simplefilter("ignore")
    import trl.experimental.gmpo as gmpo  # noqa: E402

from hotweights.bridge.client import Bridge  # noqa: E402
from hotweights.checkpoint import finisher  # noqa: E402
from hotweights.errors import CheckpointError, ConfigError  # noqa: E402
from hotweights.integrations.trl import (  # noqa: E402
    DistillationTrainer,
    GRPOTrainer,
    RLOOTrainer,
    on_served_weights,
    outside_served,
)
from hotweights.protocol.version import parse_version  # noqa: E402
from hotweights.server import launch  # noqa: E402
from hotweights.testing import tiny  # noqa: E402

pytestmark = pytest.mark.vllm

TOKEN = "trl-test-token"
STEPS = 4


@contextlib.contextmanager
def _serving(tmp: Path, dtype: str) -> Iterator[str]:
    """A `hotweights serve` of a tiny llama in `dtype` (processed logprobs, as TRL wants)."""
    model_dir = tiny.build("llama", tmp / "llama", dtype=dtype)
    port, log = launch.free_port(), tmp / "server.log"
    proc = launch.spawn(model_dir, port=port, token=TOKEN, log=log, vllm_args=(
        "--dtype", dtype, "--max-model-len", "256", "--enforce-eager",
        "--max-num-seqs", "16", "--logprobs-mode", "processed_logprobs",
        "--trust-request-chat-template"))  # a rollout_func's chat: the tiny model has none
    url = f"http://127.0.0.1:{port}"
    try:
        launch.wait_ready(proc, url, log=log)
        yield url
    finally:
        launch.stop(proc)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl")
    with _serving(tmp, "float32") as url:
        yield url, tmp


def _reward(completion_ids, **_) -> list[float]:
    """The share of completion tokens below 30: a random policy gets ~0.1."""
    return [sum(t < 30 for t in ids) / max(len(ids), 1) for ids in completion_ids]


_COMMON = {"use_vllm": True, "vllm_mode": "server", "max_completion_length": 8,
           "learning_rate": 1e-2, "logging_steps": 1, "report_to": "none", "use_cpu": True,
           "bf16": False, "save_strategy": "no", "seed": 0, "disable_tqdm": True}


def _config(tmp, **overrides) -> GRPOConfig:
    return GRPOConfig(**{
        **_COMMON, "output_dir": str(tmp / "out"), "per_device_train_batch_size": 8,
        "num_generations": 4, "max_steps": STEPS, "vllm_importance_sampling_correction": True,
        **overrides})


def _gmpo_config(tmp, **overrides) -> gmpo.GMPOConfig:
    return gmpo.GMPOConfig(**{
        **_COMMON, "output_dir": str(tmp / "gmpo"), "per_device_train_batch_size": 8,
        "num_generations": 4, "max_steps": STEPS, "vllm_importance_sampling_correction": True,
        **overrides})


def _rloo_config(tmp, **overrides) -> RLOOConfig:
    return RLOOConfig(**{**_COMMON, "output_dir": str(tmp / "rloo"),
                         "per_device_train_batch_size": 8, "num_generations": 4,
                         "max_steps": STEPS, **overrides})


def _distill_config(tmp, **overrides) -> DistillationConfig:
    return DistillationConfig(**{**_COMMON, "output_dir": str(tmp / "distill"),
                                 "per_device_train_batch_size": 4, "max_steps": 2,
                                 **overrides})


def _teacher(model_dir: Path) -> torch.nn.Module:
    """TRL's own teacher: the model of `model_dir`, its output embeddings doubled (a
    teacher unlike the student)."""
    teacher = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        teacher.get_output_embeddings().weight.mul_(2.0)
    return teacher


def _trains_the_served_weights(trainer, bridge: Bridge, steps: int) -> list[float]:
    """Train; one version per optimizer step, every trainable parameter still a view of
    the server's memory, the output embeddings moved, a clean commit. Returns the sample
    versions logged (one per generation)."""
    model = trainer.model
    before = parse_version(bridge.version)[0]
    lm_head = model.get_output_embeddings().weight.detach().clone()
    trainer.train()
    assert parse_version(bridge.version)[0] == before + steps
    assert outside_served(model, bridge.tensors) == []
    assert not torch.equal(model.get_output_embeddings().weight.detach(), lm_head)
    assert bridge.status()["dirty"] is False
    return [e["hotweights/sample_version"] for e in trainer.state.log_history
            if "hotweights/sample_version" in e]


def _data() -> Dataset:
    return Dataset.from_dict({"prompt": ["the quick brown", "a model of", "one copy of",
                                         "weights in place"] * 8})


GMPOTrainer = on_served_weights(gmpo.GMPOTrainer, gmpo.GMPOConfig)  # a GRPO derivative


@pytest.mark.timeout(400)  # the first use of the module's server starts it
@pytest.mark.parametrize("trainer_class, config", [(GRPOTrainer, _config),
                                                   (RLOOTrainer, _rloo_config),
                                                   (GMPOTrainer, _gmpo_config)],
                         ids=["grpo", "rloo", "gmpo"])
def test_trains_the_served_weights_in_place(served, trainer_class, config):
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    model = bridge.model()
    assert bridge.report.bytes_copied == 0
    before = parse_version(bridge.version)[0]
    trainer = trainer_class(model=model, bridge=bridge, reward_funcs=_reward,
                            args=config(tmp), train_dataset=_data())
    assert trainer.model is model
    # each batch was sampled by the weights of the step before it (steps_per_generation 1)
    assert _trains_the_served_weights(trainer, bridge, STEPS) == \
        [float(before + i) for i in range(STEPS)]
    logs = [entry for entry in trainer.state.log_history if "reward" in entry]
    assert len(logs) == STEPS
    assert all(entry["hotweights/version_lag"] == 0 for entry in logs)
    if issubclass(trainer_class, GRPOTrainer):  # RLOO asks vLLM for no logprobs
        # the trainer and vLLM agree on the sampled tokens' logprobs (fp32 both sides)
        gaps = [entry["sampling/sampling_logp_difference/mean"] for entry in logs]
        assert max(gaps) <= 1e-4, gaps


@pytest.mark.parametrize("option, value", [("cast_lm_head_to_fp32", True),
                                           ("vllm_mode", "colocate"),
                                           ("use_vllm", False),
                                           ("vllm_enable_sleep_mode", True),
                                           ("vllm_server_base_url", "http://127.0.0.1:1"),
                                           ("optim", "lomo"),  # steps inside backward
                                           ("optim", "galore_adamw_layerwise"),
                                           ("optim", "schedule_free_adamw"),  # train()/eval()
                                           ("bf16_full_eval", True),  # fp32 weights: a cast
                                           ("peft_config", "a LoRA config")])
def test_what_would_copy_the_weights_is_refused_by_option(served, option, value):
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    given = {"peft_config": value} if option == "peft_config" else {}  # TRL's, not GRPOConfig's
    with pytest.raises(ConfigError, match=option):
        GRPOTrainer(model=bridge.model(), bridge=bridge, reward_funcs=_reward,
                    args=_config(tmp, **({} if given else {option: value})),
                    train_dataset=_data(), **given)


def test_a_model_by_name_is_refused(served):
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    with pytest.raises(ConfigError, match="second copy"):
        GRPOTrainer(model="some/model", bridge=bridge, reward_funcs=_reward,
                    args=_config(tmp), train_dataset=_data())


def test_beta_accumulation_and_checkpointing_commit_once_per_optimizer_step(served):
    # beta > 0: TRL loads its reference model from the model's directory (a copy of its
    # own, by design); 2 micro-batches per optimizer step: still one version per step;
    # gradient checkpointing recomputes the forward from the same views.
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    before = parse_version(bridge.version)[0]
    trainer = GRPOTrainer(bridge=bridge, reward_funcs=_reward, train_dataset=_data(),
                          args=_config(tmp, beta=0.04, gradient_accumulation_steps=2,
                                       per_device_train_batch_size=4, max_steps=2,
                                       gradient_checkpointing=True))
    assert trainer.ref_model is not None
    trainer.train()
    assert trainer.model.is_gradient_checkpointing  # enabled by train()
    assert parse_version(bridge.version)[0] == before + 2
    assert outside_served(trainer.model, bridge.tensors) == []
    logs = [entry for entry in trainer.state.log_history if "kl" in entry]
    assert len(logs) == 2 and all(entry["kl"] >= 0 for entry in logs)


def test_the_example_script_trains_the_served_model(served):
    url, tmp = served
    path = Path(__file__).resolve().parents[1] / "examples" / "grpo.py"
    spec = importlib.util.spec_from_file_location("example_grpo", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    before = parse_version(Bridge.connect(url, token=TOKEN).version)[0]
    trainer = example.main(url, steps=2, token=TOKEN, output_dir=str(tmp / "example"))
    assert parse_version(trainer.bridge.version)[0] == before + 2


@pytest.mark.timeout(400)  # a server of its own: bf16 weights
def test_grpo_on_bf16_weights(tmp_path):
    with _serving(tmp_path, "bfloat16") as url:
        bridge = Bridge.connect(url, token=TOKEN)
        model = bridge.model()
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        trainer = GRPOTrainer(model=model, bridge=bridge, reward_funcs=_reward,
                              train_dataset=_data(), args=_config(tmp_path, bf16=True,
                                                                  max_steps=2))
        trainer.train()
        assert parse_version(bridge.version)[0] == 2
        assert outside_served(trainer.model, bridge.tensors) == []
        gaps = [entry["sampling/sampling_logp_difference/mean"]
                for entry in trainer.state.log_history if "reward" in entry]
        assert len(gaps) == 2 and max(gaps) < 0.1, gaps  # bf16 kernels round differently


def test_a_parameter_re_created_before_training_is_refused_at_the_first_step(served):
    # What accelerate's device placement did under a launcher (RANK set: `.to("cpu:0")`
    # copies every view): a parameter that is no longer the server's is caught before
    # any step writes a copy, and the server is not left paused.
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    before = bridge.version
    trainer = GRPOTrainer(bridge=bridge, reward_funcs=_reward, train_dataset=_data(),
                          args=_config(tmp, max_steps=1))
    assert trainer.accelerator.device_placement is False
    norm = trainer.model.model.norm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone())
    with pytest.raises(ConfigError, match="model.norm.weight"):
        trainer.train()
    assert bridge.version == before and bridge.status()["state"] == "idle"


def test_resuming_loads_the_checkpoint_into_the_served_tensors_as_an_update(served):
    # transformers' resume copies the checkpoint into the model's parameters, the served
    # tensors: not behind the server's back but paused, as a version of its own.
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    out = tmp / "resume"
    GRPOTrainer(bridge=bridge, reward_funcs=_reward, train_dataset=_data(), args=_config(
        tmp, max_steps=1, save_strategy="steps", save_steps=1, output_dir=str(out))).train()
    saved = bridge.model().get_output_embeddings().weight.detach().clone()
    # written by a sync (save_pretrained would first clone every view that shares its
    # memory with another: q, k, v of qkv_proj, ...), as save_pretrained names them
    ckpt = out / "checkpoint-1"
    finisher.finish()  # (the sidecars are written once the commit is durable)
    assert (ckpt / ".hotweights").is_dir() and (ckpt / "tokenizer.json").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    assert torch.equal(loaded.get_output_embeddings().weight, saved)
    with bridge.update(), torch.no_grad():  # the served weights move on (not by a GRPO step:
        bridge.model().get_output_embeddings().weight.add_(0.01)  # with equal rewards in
    assert not torch.equal(bridge.model().get_output_embeddings().weight, saved)  # a group,
    # its advantages are 0 and the step changes nothing)
    before, seen = parse_version(bridge.version)[0], []
    no_state = tmp / "no_state"  # (as a save_model() output)
    shutil.copytree(ckpt, no_state, ignore=shutil.ignore_patterns("trainer_state.json"))
    with pytest.raises(CheckpointError, match=r"no trainer_state\.json in it .* nothing loaded"):
        GRPOTrainer(bridge=bridge, reward_funcs=_reward, train_dataset=_data(),
                    args=_config(tmp, max_steps=2, output_dir=str(out))).train(
            resume_from_checkpoint=str(no_state))
    assert parse_version(bridge.version)[0] == before

    class _Begin(TrainerCallback):
        def on_train_begin(self, *args, **kwargs):  # after the resume's load
            seen.append((parse_version(bridge.version)[0], torch.equal(
                bridge.model().get_output_embeddings().weight, saved)))

    trainer = GRPOTrainer(bridge=bridge, reward_funcs=_reward, train_dataset=_data(),
                          args=_config(tmp, max_steps=2, output_dir=str(out)),
                          callbacks=[_Begin()])
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    assert seen == [(before + 1, True)]  # the load: a version of its own
    assert parse_version(bridge.version)[0] == before + 2  # then the one step left
    assert outside_served(trainer.model, bridge.tensors) == []
    assert bridge.status()["dirty"] is False


def test_an_lr_scheduler_built_on_the_optimizer_steps_inside_the_update(served):
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    trainer = GRPOTrainer(bridge=bridge, reward_funcs=_reward, train_dataset=_data(),
                          args=_config(tmp))
    optimizer = trainer.create_optimizer()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)  # patches
    for param in trainer.model.parameters():  # optimizer.step, a bound method
        param.grad = torch.zeros_like(param)
    before = parse_version(bridge.version)[0]
    optimizer.step()
    scheduler.step()
    assert parse_version(bridge.version)[0] == before + 1
    assert trainer.create_optimizer() is optimizer and optimizer.step.hotweights_update


def test_training_again_steps_once_per_update(served):
    # a retry or a resume on the same trainer: create_optimizer gets accelerate's wrapper
    # back, which steps the optimizer the first train() patched (its step was wrapped too:
    # one update inside another, whose commit the server then refused)
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    trainer = GRPOTrainer(bridge=bridge, reward_funcs=_reward, train_dataset=_data(),
                          args=_config(tmp, max_steps=1))
    before = parse_version(bridge.version)[0]
    trainer.train()
    trainer.train()
    assert parse_version(bridge.version)[0] == before + 2
    assert bridge.status()["dirty"] is False


@pytest.mark.parametrize("kwargs, field", [({"update_mode": "fast"}, "update_mode"),
                                           ({"lease_s": 0}, "lease_s"),
                                           ({"lease_s": True}, "lease_s"),
                                           ({"lease_s": 100_000}, "lease_s")])  # > 24 h
def test_update_options_are_checked_before_anything_runs(served, kwargs, field):
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    with pytest.raises(ConfigError, match=field):
        GRPOTrainer(bridge=bridge, reward_funcs=_reward, train_dataset=_data(),
                    args=_config(tmp), **kwargs)


def test_several_training_processes_are_refused(served, monkeypatch):
    url, tmp = served
    bridge, args = Bridge.connect(url, token=TOKEN), _config(tmp)
    monkeypatch.setenv("WORLD_SIZE", "2")  # as accelerate launch or torchrun set it
    for given in (args, None):  # None: the default GRPOConfig is not even built
        with pytest.raises(ConfigError, match="WORLD_SIZE=2"):
            GRPOTrainer(bridge=bridge, reward_funcs=_reward, train_dataset=_data(),
                        args=given)


@pytest.mark.parametrize("trainer, served, ok", [
    ("cpu", {"cpu"}, True), ("cpu:0", {"cpu"}, True), ("cuda:0", {"cuda:0"}, True),
    ("cuda", {"cuda:1"}, True), ("cpu", {"cuda:0"}, False), ("cuda:0", {"cuda:1"}, False),
    ("cuda:0", {"cpu"}, False)])
def test_a_trainer_on_another_device_than_the_weights_is_refused(trainer, served, ok):
    from hotweights.integrations.trl import _check_device

    args = torch.device(trainer), {torch.device(d) for d in served}, "RLOOConfig"
    if ok:
        _check_device(*args)
    else:
        with pytest.raises(ConfigError, match="set RLOOConfig.use_cpu"):
            _check_device(*args)


def test_importing_the_integration_does_not_warn_about_the_vllm_version_it_runs_on():
    done = subprocess.run([sys.executable, "-W", "default", "-c",
                           "import hotweights.integrations.trl"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "currently supports vLLM versions" not in done.stderr


class _WritesThenFails(torch.optim.SGD):
    """An optimizer whose step writes the weights, then raises (a NaN check, an OOM)."""

    def step(self, closure=None):
        super().step(closure)
        raise RuntimeError("the step failed half way")


def test_a_step_that_raises_leaves_the_weights_served_dirty_and_reraises(served):
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    model = bridge.model()
    before = parse_version(bridge.version)[0]
    trainer = GRPOTrainer(model=model, bridge=bridge, reward_funcs=_reward,
                          train_dataset=_data(), args=_config(tmp, max_steps=1),
                          optimizers=(_WritesThenFails(model.parameters(), lr=1e-2), None))
    with pytest.raises(RuntimeError, match="the step failed half way"):
        trainer.train()
    status = bridge.status()  # aborted: served again, as a version that no commit vouched for
    assert (status["n"], status["state"], status["dirty"]) == (before + 1, "idle", True)


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_steps_of_one_generation_report_their_lag_in_every_update_mode(served, mode):
    """steps_per_generation=2: the second step trains on samples of the version before the
    first, one version behind; "keep" and "abort" commit as "wait" does (TRL generates
    between steps: nothing is in flight when a step pauses the server)."""
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    before = parse_version(bridge.version)[0]
    trainer = GRPOTrainer(bridge=bridge, reward_funcs=_reward, train_dataset=_data(),
                          args=_config(tmp, max_steps=2, steps_per_generation=2),
                          update_mode=mode)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "hotweights/version_lag" in e]
    assert [e["hotweights/version_lag"] for e in logs] == [0, 1]
    assert [e["hotweights/sample_version"] for e in trainer.state.log_history
            if "hotweights/sample_version" in e] == [before]
    status = bridge.status()
    assert (status["n"], status["dirty"]) == (before + 2, False)


def test_an_evaluation_between_steps_of_one_generation_keeps_their_lag(served):
    """An evaluation generates too: its batch (sampled by the current weights) is logged,
    and the step after it still trains on, and reports the lag of, the training batch."""
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    before = parse_version(bridge.version)[0]
    trainer = GRPOTrainer(bridge=bridge, reward_funcs=_reward, train_dataset=_data(),
                          eval_dataset=_data().select(range(8)),
                          args=_config(tmp, max_steps=2, steps_per_generation=2,
                                       eval_strategy="steps", eval_steps=1,
                                       per_device_eval_batch_size=8))
    trainer.train()
    logs = [e for e in trainer.state.log_history if "hotweights/version_lag" in e]
    assert [e["hotweights/version_lag"] for e in logs] == [0, 1]
    assert trainer.sample_versions == [before] * len(trainer.sample_versions)
    assert [e["eval_hotweights/sample_version"] for e in trainer.state.log_history
            if "eval_hotweights/sample_version" in e] == [before + 1, before + 2]


def test_a_rollout_func_calling_the_client_itself_gets_each_sample_s_version(served):
    """A `rollout_func` that generates through `trainer.vllm_generation.vllm_client`
    (not TRL's generation; its `generate` and its `chat`): each of its samples still gets
    the version that sampled it."""
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    before = parse_version(bridge.version)[0]
    calls = []

    def rollout(prompts, trainer):
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": []}
        client = trainer.vllm_generation.vllm_client
        for half in (prompts[:len(prompts) // 2], prompts[len(prompts) // 2:]):
            got = client.generate(prompts=half, max_tokens=8) if half[0] is prompts[0] else \
                client.chat(messages=[[{"role": "user", "content": p}] for p in half],
                            max_tokens=8, chat_template="{{ messages[0]['content'] }}")
            out["prompt_ids"] += got["prompt_ids"]
            out["completion_ids"] += got["completion_ids"]
            out["logprobs"] += [[lp[0] for lp in seq] for seq in got["logprobs"]]
        calls.append(len(out["completion_ids"]))
        return out

    trainer = GRPOTrainer(bridge=bridge, reward_funcs=_reward, train_dataset=_data(),
                          args=_config(tmp, max_steps=2), rollout_func=rollout)
    trainer.train()
    assert calls == [8, 8]
    assert trainer.sample_versions == [before + 1] * 8  # the second batch's, after a step
    assert [e["hotweights/sample_version"] for e in trainer.state.log_history
            if "hotweights/sample_version" in e] == [before, before + 1]


def test_an_optimizer_that_moves_the_weights_outside_its_step_is_refused(served):
    class ScheduleFree(torch.optim.SGD):  # as schedulefree's: train() / eval() move weights
        def train(self):
            pass

        def eval(self):
            pass

    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    model = bridge.model()
    before = bridge.version
    with pytest.raises(ConfigError, match=r"ScheduleFree: a schedule-free optimizer moves "
                                          r"every weight in its train\(\) and eval\(\)"):
        GRPOTrainer(model=model, bridge=bridge, reward_funcs=_reward,  # refused at once:
                    train_dataset=_data(), args=_config(tmp, max_steps=1),  # evaluate()
                    optimizers=(ScheduleFree(model.parameters(), lr=0.1), None))  # first
    assert bridge.version == before  # would call its eval()


def test_an_optimizer_wrapping_another_steps_whole_inside_the_update(served):
    class Lookahead(torch.optim.Optimizer):  # its own writes after the inner step's
        def __init__(self, optimizer):
            self.optimizer, self.param_groups = optimizer, optimizer.param_groups
            self.defaults, self.state = optimizer.defaults, optimizer.state
            self.states = []

        def step(self, closure=None):
            self.optimizer.step()
            self.states.append(bridge.status()["state"])  # its slow-weight write, here

    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    model = bridge.model()
    outer = Lookahead(torch.optim.SGD(model.parameters(), lr=0.0))
    trainer = GRPOTrainer(model=model, bridge=bridge, reward_funcs=_reward,
                          train_dataset=_data(), args=_config(tmp, max_steps=1),
                          optimizers=(outer, None))
    assert trainer.create_optimizer() is outer
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    before = parse_version(bridge.version)[0]
    outer.step()
    assert outer.states == ["paused"] and parse_version(bridge.version)[0] == before + 1
    assert not getattr(outer.optimizer.step, "hotweights_update", False)  # once, outside


def test_rloo_refuses_what_grpo_refuses_and_a_grpo_config(served):
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    with pytest.raises(ConfigError, match="RLOOConfig.vllm_enable_sleep_mode"):
        RLOOTrainer(bridge=bridge, reward_funcs=_reward, train_dataset=_data(),
                    args=_rloo_config(tmp, vllm_enable_sleep_mode=True))
    with pytest.raises(ConfigError, match="GRPOConfig; RLOOTrainer takes its own config"):
        RLOOTrainer(bridge=bridge, reward_funcs=_reward, train_dataset=_data(),
                    args=_config(tmp))


def test_a_trainer_derived_from_trl_s_is_wrapped_or_refused_by_name(served):
    import trl

    assert on_served_weights(trl.GRPOTrainer) is GRPOTrainer
    assert on_served_weights(GMPOTrainer) is GMPOTrainer
    assert GMPOTrainer.__mro__[1:4] == (GRPOTrainer, GRPOTrainer.__mro__[1], gmpo.GMPOTrainer)
    with pytest.raises(ConfigError, match="SFTTrainer derives from none of TRL's "
                                          "GRPOTrainer, RLOOTrainer, DistillationTrainer"):
        on_served_weights(SFTTrainer)
    with pytest.raises(ConfigError, match="GMPOTrainer derives from TRL's GRPOTrainer; "
                                          "pass a subclass of GRPOConfig"):
        on_served_weights(gmpo.GMPOTrainer, RLOOConfig)
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    with pytest.raises(ConfigError, match="GRPOConfig; GMPOTrainer takes its own config, "
                                          "GMPOConfig"):
        GMPOTrainer(bridge=bridge, reward_funcs=_reward, train_dataset=_data(),
                    args=_config(tmp))
    # no config class named: GMPO's own default (a wider clipping) is not GRPO's
    with pytest.raises(ConfigError, match=r"args=None: pass GMPOTrainer's config as args="):
        on_served_weights(gmpo.GMPOTrainer)(bridge=bridge, reward_funcs=_reward,
                                            train_dataset=_data())


def test_on_policy_distillation_trains_the_served_student_in_place(served):
    """The student is the served model (its completions come from the server); the teacher
    is TRL's own model."""
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    model = bridge.model()
    before = parse_version(bridge.version)[0]
    trainer = DistillationTrainer(model=model, teacher_model=_teacher(tmp / "llama"),
                                  bridge=bridge, train_dataset=_data(),
                                  args=_distill_config(tmp))
    assert trainer.model is model
    versions = _trains_the_served_weights(trainer, bridge, 2)
    assert versions and versions[0] == float(before)


def test_distillation_wants_a_teacher(served):
    url, tmp = served
    bridge = Bridge.connect(url, token=TOKEN)
    with pytest.raises(ConfigError, match="teacher_model=None"):
        DistillationTrainer(bridge=bridge, train_dataset=_data())


def test_allow_missing_zeros_are_no_copy_trl_made():
    # `bridge.model(allow_missing=...)` builds those parameters as zeros of their own: by
    # design, not TRL's or accelerate's copies
    from hotweights.integrations.trl import _OnServedWeights

    served = torch.zeros(2, 2)
    model = torch.nn.Linear(2, 2)
    model.weight = torch.nn.Parameter(served)
    trainer = types.SimpleNamespace(model=model, weights=types.SimpleNamespace(
        tensors={"w": served}, missing=("bias",)))
    _OnServedWeights._check_shared(trainer, "TRL's setup")
    trainer.weights.missing = ()
    with pytest.raises(ConfigError, match=r"1 trainable parameter\(s\) no longer lie in "
                                          r"vLLM's memory after TRL's setup \(e\.g\. bias\)"):
        _OnServedWeights._check_shared(trainer, "TRL's setup")


@pytest.mark.parametrize("given, ok", [("http://localhost:8000/", True),
                                       ("http://[::1]:8000", True),
                                       ("http://127.0.0.1:8001", False),
                                       ("https://127.0.0.1:8000", False)])
def test_the_server_url_given_to_trl_may_spell_the_bridge_s_otherwise(tmp_path, given, ok):
    from hotweights.integrations.trl import _check_args

    args = _config(tmp_path, vllm_server_base_url=given)
    bridge = types.SimpleNamespace(url="http://127.0.0.1:8000")
    if not ok:
        with pytest.raises(ConfigError, match=r"vllm_server_base_url=.*: the bridge trains "
                                              r"http://127\.0\.0\.1:8000"):
            _check_args(args, bridge, None)
        return
    _check_args(args, bridge, None)
    assert args.vllm_server_base_url == bridge.url  # TRL's client reaches it as the bridge


@pytest.mark.parametrize("served", [3, None])
def test_a_step_served_here_that_remotes_missed_goes_on(served, caplog):
    # require="any": this server committed the step, the remotes catch up at the next one;
    # an update that failed here stops training
    from hotweights.errors import RemoteError
    from hotweights.integrations.trl import _OnServedWeights

    @contextlib.contextmanager
    def update():
        yield
        raise RemoteError("http://x serves version 3; the remote servers did not take it "
                          "(the next update catches them up): gpu01 is gone", served=served)
    trainer = types.SimpleNamespace(sample_versions=[], _check_shared=lambda after: None,
                                    weights=types.SimpleNamespace(update=update))
    stepped = []
    step = _OnServedWeights._step_in_update(trainer, lambda: stepped.append(1) or "loss")
    if served is None:
        with pytest.raises(RemoteError, match="gpu01 is gone"):
            step(None)
        return
    with caplog.at_level("WARNING", logger="hotweights.integrations.trl"):
        assert step(None) == "loss" and stepped == [1]
    assert "gpu01 is gone; training goes on" in caplog.text


@pytest.mark.parametrize("reset", [True, False])
def test_a_colocated_update_resets_every_cache_the_old_weights_filled(reset):
    from hotweights.errors import ServerError
    from hotweights.integrations.trl import _Colocated

    calls = []
    llm = types.SimpleNamespace(
        reset_prefix_cache=lambda **kw: calls.append(("prefix", kw)) or reset,
        llm_engine=types.SimpleNamespace(reset_encoder_cache=lambda: calls.append("encoder")))
    weights = _Colocated.__new__(_Colocated)
    weights.llm, weights.version = llm, 0
    with contextlib.ExitStack() as stack:
        if not reset:
            stack.enter_context(pytest.raises(ServerError, match="did not reset its prefix"))
        with weights.update():
            pass
    assert calls == [("prefix", dict(reset_running_requests=True, reset_connector=True)),
                     "encoder"] and weights.version == 1


def test_samples_of_a_restarted_server_are_refused_at_once():
    # its weights are not the ones the model's views map: a whole step would be wasted
    from hotweights.errors import ServerError
    from hotweights.integrations.trl import _client_for
    from hotweights.protocol.version import VERSION_HEADER

    cls = _client_for(types.SimpleNamespace(server_id="s1", cafile=None))
    client = cls.__new__(cls)  # (TRL's __init__ asks the server for its model)
    client.base_url, client.sample_versions, client._versions = "http://127.0.0.1:1", [], []

    def answered(*versions):
        def call():
            for v in versions:  # as the session's response hook sees each answer
                client._keep_version(types.SimpleNamespace(headers={VERSION_HEADER: v}))
            return {"completion_ids": [[1]] * len(versions)}
        return call
    assert client._counted(answered("4@s1", "3@s1"))["completion_ids"] == [[1], [1]]
    assert client.sample_versions == [3, 3]  # a chat's requests: the oldest version
    with pytest.raises(ServerError, match=r"^http://127\.0\.0\.1:1 restarted \(server s2, "
                                          r"not s1\)"):
        client._counted(answered("0@s2"))
    with pytest.raises(ServerError, match="carried no x-hotweights-version header"):
        client._counted(answered())


def test_the_trainer_s_saves_are_syncs_that_write_what_save_pretrained_writes(tmp_path,
                                                                             caplog):
    from hotweights.integrations.trl import save_weights

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny.make_config("llama", 300))
    save_weights(model, str(tmp_path / "new"), version="3@s")  # made, as save_pretrained
    finisher.finish()  # (the sidecars are written once the commit is durable)
    assert (tmp_path / "new" / ".hotweights").is_dir()  # a sync's first save
    tmp_path = tmp_path / "new"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in model.state_dict().items())
    with torch.no_grad():
        model.lm_head.weight[0] += 1.0
    model.config.bos_token_id = 7
    save_weights(model, str(tmp_path), version="4@s")  # a sync: the change, and the config
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert loaded.config.bos_token_id == 7
    # another model's checkpoint there (a layer fewer, sharded): replaced whole, not synced
    # into (the layer it lacks would be left out), and none of its files left to be loaded
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    deeper = AutoModelForCausalLM.from_config(tiny.make_config(
        "llama", 300, num_hidden_layers=model.config.num_hidden_layers + 1))
    with caplog.at_level("WARNING", logger="hotweights.integrations.trl"):
        save_weights(deeper, str(tmp_path), state_dict=None)  # (as transformers' _save)
    assert "holds another checkpoint than the model's" in caplog.text
    assert sorted(f.name for f in tmp_path.glob("*.safetensors*")) == ["model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in deeper.state_dict().items())
    save_weights(deeper, str(tmp_path / "sharded"), max_shard_size="200KB")
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
    # FSDP2's wrapper class (FSDP<class>): named as save_pretrained names it, by the model's
    deeper.__class__ = type(f"FSDP{type(deeper).__name__}", (type(deeper),), {})  # class
    for again in range(2):  # a first save, then a sync
        save_weights(deeper, str(tmp_path / "fsdp"))
        config = json.loads((tmp_path / "fsdp" / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLM"], again


def test_save_pretrained_s_options_at_their_defaults_keep_the_save_a_sync(tmp_path,
                                                                         monkeypatch):
    from hotweights.integrations.trl import save_weights

    model = AutoModelForCausalLM.from_config(tiny.make_config("llama", 300))
    monkeypatch.setattr(type(model), "save_pretrained",
                        lambda *a, **k: pytest.fail(f"save_pretrained{k}"))
    save_weights(model, str(tmp_path), is_main_process=True, push_to_hub=False,
                 safe_serialization=True, variant=None)
    assert (tmp_path / ".hotweights").is_dir()
    with pytest.raises(pytest.fail.Exception, match="variant"):
        save_weights(model, str(tmp_path), variant="ema")
    with pytest.raises(pytest.fail.Exception, match="some_option"):  # one it does not know
        save_weights(model, str(tmp_path), some_option=False)


def test_a_save_cut_short_between_its_moves_is_finished_by_the_next_save(tmp_path,
                                                                       monkeypatch, caplog):
    from hotweights.checkpoint import journal
    from hotweights.integrations.trl import save_weights

    class Killed(BaseException):
        pass

    real = journal._crash_point

    def killed_at_the_second_move(step, n=0):
        if step == "move" and n == 1:
            raise Killed
        real(step, n)
    model = AutoModelForCausalLM.from_config(tiny.make_config("llama", 300))
    monkeypatch.setattr(journal, "_crash_point", killed_at_the_second_move)
    with pytest.raises(Killed):
        save_weights(model, str(tmp_path), max_shard_size="200KB")
    monkeypatch.undo()
    with caplog.at_level("WARNING", logger="hotweights.integrations.trl"):
        save_weights(model, str(tmp_path), max_shard_size="200KB")
    assert "holds another checkpoint" not in caplog.text
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[n], t) for n, t in model.state_dict().items())


def test_a_save_is_whole_and_alone_when_save_weights_returns(tmp_path, monkeypatch):
    # the Trainer may upload the directory next: no journal, staged file or trash left in
    # it, however late the finisher thread runs
    import time

    from hotweights.integrations.trl import save_weights

    real = finisher.start
    monkeypatch.setattr(finisher, "start", lambda run: real(lambda: (time.sleep(0.3), run())))
    model = AutoModelForCausalLM.from_config(tiny.make_config("llama", 300))
    for _ in range(2):  # a first save, then a sync of a change
        save_weights(model, str(tmp_path))
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [".hotweights"]
        with torch.no_grad():
            model.lm_head.weight[0] += 1.0


def test_a_wrapped_schedule_free_optimizer_is_refused_as_accelerate_calls_it():
    # accelerate's train()/eval() reach `.optimizer.train()` when the wrapper has none
    from hotweights.integrations.trl import _check_optimizer

    class ScheduleFree(torch.optim.SGD):
        def train(self):
            pass

    class Wrapper:  # no train()/eval() of its own
        def __init__(self, optimizer):
            self.optimizer = optimizer

    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ConfigError, match="ScheduleFree: a schedule-free optimizer"):
        _check_optimizer(Wrapper(ScheduleFree(params, lr=0.1)))
    _check_optimizer(Wrapper(torch.optim.SGD(params, lr=0.1)))


def test_fp16_autocast_on_float16_weights_on_a_gpu_is_refused_up_front():
    from hotweights.integrations.trl import _check_dtypes

    args = types.SimpleNamespace(fp16=True, bf16=False)
    gpu = torch.empty(2, dtype=torch.float16, device="meta")  # any device but the CPU
    with pytest.raises(ConfigError, match=r"fp16=True on float16 weights: .* gradient scaler"):
        _check_dtypes(args, {"w": gpu})
    _check_dtypes(args, {"w": torch.zeros(2, dtype=torch.float16)})  # CPU: no scaler
    _check_dtypes(types.SimpleNamespace(fp16=False, bf16=False), {"w": gpu})


def test_allow_missing_zeros_are_never_saved_as_the_model_s_weights(tmp_path):
    from hotweights.errors import CheckpointError
    from hotweights.integrations.trl import _OnServedWeights

    trainer = types.SimpleNamespace(weights=types.SimpleNamespace(missing=("model.bias",)))
    with pytest.raises(CheckpointError, match=r"save_model\(\): 1 parameter\(s\) of the model "
                                              r"no vLLM tensor holds .* e\.g\. model\.bias"):
        _OnServedWeights._save(trainer, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()
    # nor at every save_steps: refused before TRL's setup (a bridge that never answers)
    bridge = types.SimpleNamespace(url="http://127.0.0.1:1", server_id="s1", cafile=None,
                                   tensors={}, report=types.SimpleNamespace(missing=("b",)))
    with pytest.raises(ConfigError, match=r"GRPOConfig\.save_strategy='steps': 1 parameter"):
        GRPOTrainer(model=torch.nn.Linear(2, 2), bridge=bridge, reward_funcs=_reward,
                    args=_config(tmp_path, save_strategy="steps"), train_dataset=_data())


def test_a_load_served_here_but_not_by_every_remote_goes_on(monkeypatch, caplog):
    # as a step: the remotes catch up at the next update; resume and the best model alike
    import hotweights.integrations.trl as trl_mod
    from hotweights.errors import RemoteError

    class Weights:
        missing = ()

        @contextlib.contextmanager
        def update(self):
            yield
            raise RemoteError("1 of 2 remote servers failed", served=7)

    loaded = []
    monkeypatch.setattr(trl_mod, "load_plan", lambda model, d: lambda: loaded.append(d))
    trainer = types.SimpleNamespace(model=None, weights=Weights(),
                                    _check_shared=lambda what: loaded.append(what))
    with caplog.at_level("WARNING", logger="hotweights.integrations.trl"):
        trl_mod._OnServedWeights._load(trainer, "ckpt", "loading the best model")
    assert loaded == ["ckpt", "loading the best model"]
    assert "1 of 2 remote servers failed; training goes on" in caplog.text


def test_calls_from_two_threads_each_count_their_own_versions():
    # a `rollout_func` calling the client from threads: the response hook runs in TRL's
    # request threads and cannot tell whose call an answer is
    import threading
    import time

    from hotweights.integrations.trl import _client_for
    from hotweights.protocol.version import VERSION_HEADER

    cls = _client_for(types.SimpleNamespace(server_id="s1", cafile=None))
    client = cls.__new__(cls)
    client.base_url, client.sample_versions, client._versions = "http://127.0.0.1:1", [], []
    answered, go = threading.Event(), threading.Event()

    def slow():
        client._keep_version(types.SimpleNamespace(headers={VERSION_HEADER: "5@s1"}))
        answered.set()
        go.wait(10)
        return {"completion_ids": [[1]]}

    def fast():
        client._keep_version(types.SimpleNamespace(headers={VERSION_HEADER: "6@s1"}))
        return {"completion_ids": [[1], [1]]}

    errors = []
    threads = [threading.Thread(target=lambda c=c: _record_errors(errors, client._counted, c))
               for c in (slow, fast)]
    threads[0].start()
    answered.wait(10)
    threads[1].start()
    time.sleep(0.2)  # (a second call that did not wait would have run by now)
    go.set()
    for t in threads:
        t.join(10)
    assert errors == [] and sorted(client.sample_versions) == [5, 6, 6]


def _record_errors(errors: list, call, *args) -> None:
    try:
        call(*args)
    except Exception as e:
        errors.append(e)

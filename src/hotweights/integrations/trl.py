"""TRL's `GRPOTrainer`, `RLOOTrainer` and `DistillationTrainer` on the served weights: the
policy (the student) TRL trains is vLLM's own copy.

Server mode, a `hotweights serve` on this machine:

    from hotweights import Bridge
    from hotweights.integrations.trl import GRPOTrainer   # instead of trl's

    bridge = Bridge.connect("http://127.0.0.1:8000")
    trainer = GRPOTrainer(bridge=bridge, reward_funcs=reward, train_dataset=data,
                          args=GRPOConfig(use_vllm=True, vllm_mode="server", ...))

Colocate mode, vLLM in this process (no bridge; the model is a local directory):

    trainer = GRPOTrainer(model="./my-model", reward_funcs=reward, train_dataset=data,
                          args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...))

`RLOOTrainer` is the same with an `RLOOConfig`; `DistillationTrainer` (on-policy
distillation: the served model is the student) with a `DistillationConfig` and
`teacher_model=` in place of the reward functions. A trainer derived from one of TRL's
three (one of your own, or TRL's experimental `GMPOTrainer`) gets the same through
`on_served_weights`:

    from trl.experimental.gmpo import GMPOConfig, GMPOTrainer
    from hotweights.integrations.trl import on_served_weights

    trainer = on_served_weights(GMPOTrainer, GMPOConfig)(bridge=bridge, reward_funcs=...)

How: the model's parameters are views into vLLM's weights (`bridge.model()`, or
`build_hf_model` over the in-process engine's parameters); every optimizer step runs
inside an update (server: `bridge.update()`: pause, write in place, commit a new version,
caches reset, resume; colocate: the step, then the prefix cache reset: nothing generates
meanwhile); TRL's weight sync moves nothing (server: the `VLLMClient` TRL builds is
`_client_for(bridge)`'s class, put in TRL's module by name while the trainer is built;
colocate: TRL is handed the engine, and its `sync_weights` does nothing). Generation is
TRL's own. The weight version that sampled each completion is kept
(`trainer.sample_versions`) and logged with TRL's metrics (`hotweights/sample_version`,
`hotweights/version_lag`: optimizer steps between the weights that sampled a batch and
the weights it updates).

What would copy, cast or re-create the shared parameters is refused naming the TRL option
at fault: most before anything runs, a few once TRL has set up (accelerate's DeepSpeed or
FSDP, the trainer's device) or, in colocate mode, once the engine runs (the eval dtype);
after TRL has set up, every trainable parameter is checked to still lie in vLLM's memory.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hotweights.checkpoint.load import load_plan
from hotweights.errors import CheckpointError, ConfigError, RemoteError, ServerError, install
from hotweights.layout.views import outside_served
from hotweights.protocol.http import CA_FILE_ENV
from hotweights.protocol.renewer import MAX_LEASE_S
from hotweights.protocol.urls import same_server
from hotweights.protocol.version import VERSION_HEADER, parse_version

# TRL 1.16 warns at every import of its vLLM modules that it supports vLLM up to 0.31; this
# integration runs and is tested on vLLM 0.32 (the CPU build's newest) with it
warnings.filterwarnings("ignore", message="TRL currently supports vLLM versions",
                        category=UserWarning)
try:
    import trl
    from trl.generation import vllm_generation
    from trl.generation.vllm_client import VLLMClient
except ImportError as e:  # an optional extra, or a TRL without this seam
    try:
        from importlib.metadata import version as _version
        _found = f"TRL {_version('trl')} is installed"
    except Exception:  # noqa: BLE001 - not installed, or unreadable metadata
        _found = "TRL is not installed"
    raise ImportError(f"hotweights.integrations.trl needs TRL 1.16 ({_found}): "
                      f"{install('trl')}") from e

if TYPE_CHECKING:
    from hotweights.bridge.client import Bridge

logger = logging.getLogger(__name__)

TESTED = "1.16."  # the TRL versions this seam was read from and tested with


def _client_for(bridge: Bridge) -> type[VLLMClient]:
    """TRL's `VLLMClient` for a `hotweights serve` that `bridge` trains in place."""

    class HotweightsClient(VLLMClient):
        """Generation as TRL does it, with each sample's weight version; no weight-transfer
        group (the trainer writes the served tensors), and the server's settings from its
        own authenticated route, not vLLM's dev-mode `/server_info`."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # one per sample of every generate or chat since the trainer's batch began:
            # TRL's generation and a `rollout_func` calling this client directly alike
            self.sample_versions: list[int] = []
            self._versions: list[str] = []  # the version headers of a call's responses
            super().__init__(*args, **kwargs)
            self.session.hooks["response"].append(self._keep_version)

        def _keep_version(self, response, *args: Any, **kwargs: Any) -> None:
            if VERSION_HEADER in response.headers:
                self._versions.append(response.headers[VERSION_HEADER])

        def generate(self, *args: Any, **kwargs: Any) -> dict:
            return self._counted(super().generate, *args, **kwargs)

        def chat(self, *args: Any, **kwargs: Any) -> dict:
            return self._counted(super().chat, *args, **kwargs)

        _counting = threading.Lock()  # one call at a time: the response hook runs in
        # TRL's request threads, which cannot tell whose call a response answers

        def _counted(self, call: Callable[..., dict], *args: Any, **kwargs: Any) -> dict:
            with self._counting:  # (a `rollout_func` may call from threads of its own)
                self._versions = []
                out = call(*args, **kwargs)
                headers, self._versions = self._versions, []
            if not headers:
                raise ServerError(f"{self.base_url}: the completion carried no "
                                  f"{VERSION_HEADER} header: is it a `hotweights serve`?")
            versions = [parse_version(v) for v in headers]
            if restarted := [server for _, server in versions if server != bridge.server_id]:
                raise ServerError(  # it generated with weights the model's views are not
                    f"{self.base_url} restarted (server {restarted[0]}, not "
                    f"{bridge.server_id}): the model's parameters map the old server's "
                    "weights, gone; reconnect (Bridge.connect) and make a new trainer")
            # a chat sends a request per conversation: the oldest version counts for all
            n = min(n for n, _ in versions)
            self.sample_versions += [n] * len(out["completion_ids"])
            return out

        def check_server(self, *args: Any, **kwargs: Any) -> None:
            # The bridge has reached the server already. TRL's own check uses a bare
            # `requests.get`, blind to the bridge's CA bundle: the session gets it instead
            # (REQUESTS_CA_BUNDLE, when set, still comes first, as requests has it).
            if cafile := bridge.cafile or os.environ.get(CA_FILE_ENV):
                self.session.verify = os.fspath(cafile)

        def init_communicator(self, device: Any = 0) -> None:
            logger.info("hotweights: no weight-transfer group: %s serves the trainer's own "
                        "tensors", self.base_url)

        def get_server_info(self) -> dict:
            return bridge.server_info()

    return HotweightsClient


@contextlib.contextmanager
def _in_trl(name: str, value: Any) -> Iterator[None]:
    """TRL's generation module uses `value` for `name` (it imports both by name)."""
    original = getattr(vllm_generation, name)
    setattr(vllm_generation, name, value)
    try:
        yield
    finally:
        setattr(vllm_generation, name, original)


class _Server:
    """The weights of a `hotweights serve` this process trains through `bridge`."""

    def __init__(self, bridge: Bridge, mode: str, lease_s: float):
        self.bridge, self.mode, self.lease_s = bridge, mode, lease_s
        self.tensors = bridge.tensors

    @property
    def missing(self) -> tuple[str, ...]:  # `allow_missing`'s zeros: copies by design
        return self.bridge.report.missing if self.bridge.report else ()

    @property
    def version(self) -> int:
        return parse_version(self.bridge.version)[0]

    @property
    def label(self) -> str:  # the version as a checkpoint records it
        return self.bridge.version

    def watch(self, generation) -> None:
        self.client = generation.vllm_client  # it counts every generate's samples

    def begin_batch(self) -> None:
        self.client.sample_versions = []

    def batch_versions(self) -> list[int]:
        return self.client.sample_versions

    def update(self):
        return self.bridge.update(mode=self.mode, lease_s=self.lease_s)


class _Colocated:
    """The weights of a vLLM engine in this process; nothing generates during a step."""

    def __init__(self, llm):
        from hotweights.vllm_plugin.local import live_params

        self.llm, self.version, self.samples = llm, 0, 0
        self.tensors = live_params(llm)
        self.missing = ()  # the model is built on every tensor vLLM holds

    def watch(self, generation) -> None:
        """Counts the samples of every generation of the engine: TRL's, and a
        `rollout_func`'s own calls of its `generate` or `chat`."""
        for name in ("generate", "chat"):
            setattr(self.llm, name, self._counted(getattr(self.llm, name)))

    def _counted(self, call: Callable[..., list]) -> Callable[..., list]:
        def counted(*args: Any, **kwargs: Any) -> list:
            outs = call(*args, **kwargs)
            self.samples += sum(len(out.outputs) for out in outs)
            return outs
        return counted

    def begin_batch(self) -> None:
        self._check_open()
        self.samples = 0

    def _check_open(self) -> None:
        if self.llm is None:
            raise ConfigError("this trainer was closed (close() stopped its vLLM engine, "
                              "whose weights the model's parameters were): make a new one")

    def batch_versions(self) -> list[int]:
        return [self.version] * self.samples  # TRL generates between steps

    @property
    def label(self) -> str:  # the version as a checkpoint records it
        return str(self.version)

    @contextlib.contextmanager
    def update(self) -> Iterator[None]:
        self._check_open()
        try:
            yield
        finally:  # also after a step that raised half way: it may have written some
            if torch.cuda.is_available():  # vLLM's streams read what the step wrote
                torch.cuda.synchronize()
            # cached KV (a KV connector's too) and encoder outputs came from the old weights
            reset = self.llm.reset_prefix_cache(reset_running_requests=True,
                                                reset_connector=True)
            self.llm.llm_engine.reset_encoder_cache()
            self.version += 1
        if not reset:
            raise ServerError("vLLM did not reset its prefix cache after the update: it "
                              "would serve KV computed with the old weights")


_Config = trl.GRPOConfig | trl.RLOOConfig | trl.DistillationConfig  # the trainers' configs


def _colocated_engine(model_dir: str, args: _Config):
    """vLLM in this process on `model_dir`, in the checkpoint's dtype (vLLM's "auto"
    would serve a float32 checkpoint in bf16: TRL would sample another policy than it
    trains), with hotweights' layout-keeping plugin; the HF model of views over it."""
    from transformers import AutoConfig

    from hotweights.bridge.loaded import check_loaded
    from hotweights.layout.views import build_hf_model
    from hotweights.vllm_plugin.local import hf_context, start_engine, stop_engine

    if not os.path.isdir(model_dir):
        raise ConfigError(f"model={model_dir!r}: colocate mode needs a local model "
                          "directory (config and safetensors)")
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=args.trust_remote_code)
    dtype = str(getattr(config, "dtype", None) or "auto").removeprefix("torch.")
    llm = start_engine(
        model_dir, dtype=dtype, logprobs_mode="processed_logprobs", seed=args.seed,
        max_model_len=args.vllm_max_model_length,  # None: the model's own
        max_num_seqs=args.per_device_train_batch_size * (  # a generation's sequences
            getattr(args, "steps_per_generation", None) or args.gradient_accumulation_steps),
        max_num_batched_tokens=4096,  # as TRL's colocate engine: a larger default misleads
        # vLLM's memory profiler on a GPU
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        model_impl=args.vllm_model_impl, trust_remote_code=args.trust_remote_code)
    try:
        weights = _Colocated(llm)
        with hf_context(llm):
            model, report = build_hf_model(model_dir, weights.tensors,
                                           trust_remote_code=args.trust_remote_code)
        check_loaded(model, model_dir, report.mapped)  # a loader that reorders: refused
    except BaseException:
        stop_engine(llm)
        raise
    return weights, model


_REFUSED = {
    "cast_lm_head_to_fp32": "replaces lm_head by a float32 copy, which vLLM never sees",
    "vllm_enable_sleep_mode": "frees vLLM's weights between generations",
    "deepspeed": "DeepSpeed partitions the parameters and steps outside the optimizer",
    "fsdp": "FSDP re-creates the parameters as shards",
}


_UPDATE_MODES = ("wait", "keep", "abort")  # `Bridge.update`'s


def _check_process(update_mode: object, lease_s: object) -> None:
    """Refuse several training processes, and the update's options where they are bad,
    before anything is built (a TRL config too: under a launcher it sets up accelerate)."""
    if (world := os.environ.get("WORLD_SIZE", "1")) != "1":
        raise ConfigError(
            f"WORLD_SIZE={world}: one training process trains the served weights; several "
            "(accelerate launch, torchrun) would each step the same tensors, and only the "
            "first has TRL's vLLM client. Run one process (scale the server, not the trainer)")
    if update_mode not in _UPDATE_MODES:
        raise ConfigError(f"update_mode={update_mode!r}: one of {_UPDATE_MODES} (how the "
                          "server treats requests in flight while a step writes)")
    if isinstance(lease_s, bool) or not isinstance(lease_s, int | float) or \
            not 0 < lease_s <= MAX_LEASE_S:
        raise ConfigError(f"lease_s={lease_s!r}: seconds (> 0, at most {MAX_LEASE_S:.0f}) "
                          "the server waits for this trainer during a step before it drops "
                          "the update")


def _check_args(args: _Config, bridge: Bridge | None, peft_config: Any) -> None:
    """Refuse, naming the option, a config that would copy or re-create the shared weights
    (or generate from another copy than the one trained); point TRL at the bridge's
    server."""
    config = type(args).__name__
    if not args.use_vllm:
        raise ConfigError(f"{config}.use_vllm=False: TRL would sample from a model of "
                          "its own, not vLLM's; set use_vllm=True")
    want = "server" if bridge is not None else "colocate"
    if args.vllm_mode != want:
        raise ConfigError(
            f"{config}.vllm_mode={args.vllm_mode!r}: " + (
                "with a Bridge the server is a `hotweights serve`; set vllm_mode='server'"
                if bridge is not None else "without a Bridge, hotweights runs vLLM in this "
                "process; set vllm_mode='colocate', or pass bridge= for a server"))
    if bridge is not None:
        url = (args.vllm_server_base_url or "").rstrip("/")
        if url and not same_server(url, bridge.url):
            raise ConfigError(f"{config}.vllm_server_base_url={url!r}: the bridge trains "
                              f"{bridge.url}; leave it unset or give that URL")
        args.vllm_server_base_url = bridge.url
    elif args.vllm_tensor_parallel_size != 1:
        raise ConfigError(f"{config}.vllm_tensor_parallel_size="
                          f"{args.vllm_tensor_parallel_size}: colocate mode trains one "
                          "unsharded copy; use 1")
    for option, why in _REFUSED.items():
        if getattr(args, option, None):
            raise ConfigError(f"{config}.{option}={getattr(args, option)!r}: {why}; "
                              f"hotweights trains vLLM's tensors in place")
    optim = getattr(args.optim, "value", args.optim)
    if optim in ("lomo", "adalomo") or str(optim).endswith("layerwise"):
        raise ConfigError(f"{config}.optim={optim!r}: it writes the weights during the "
                          "backward pass, outside the optimizer step that hotweights runs "
                          "inside an update (vLLM would serve half-written tensors); pick "
                          "an optimizer that steps in optimizer.step()")
    if str(optim).startswith("schedule_free"):
        raise ConfigError(f"{config}.optim={optim!r}: {_SCHEDULE_FREE}")
    if peft_config is not None:
        raise ConfigError("peft_config: LoRA adapters are not vLLM's weights (vLLM would "
                          "never see them); train the base weights, e.g. "
                          "bridge.model(trainable=...)")


def save_weights(model: torch.nn.Module, directory: str, *, version: str | None = None,
                 **kwargs: Any) -> None:
    """`model.save_pretrained(directory)` with the weights written by `checkpoint.sync`:
    the names and shards `save_pretrained` writes, the config (and the generation config,
    a remote code's files) beside them, and only what changed into a directory saved
    before. `save_pretrained` itself would first clone every tensor that shares its memory
    with another (q, k and v in vLLM's `qkv_proj`: most of the weights), all at once and
    on the weights' device, where vLLM left little room. A directory that holds another
    model's checkpoint (other names, shapes or dtypes) has its safetensors replaced by a
    first save. `kwargs`: save_pretrained's; other than `max_shard_size`, one given (a
    state dict, a variant; not one at its default) leaves the save to save_pretrained."""
    from transformers.dynamic_module_utils import custom_object_save

    from hotweights.checkpoint import diagnose, finish, recover, sync
    from hotweights.checkpoint.first_save import as_saved

    os.makedirs(directory, exist_ok=True)  # (as save_pretrained)
    max_shard_size = kwargs.pop("max_shard_size", "50GB")
    if options := [k for k, v in kwargs.items()  # (a state dict, a variant, ...)
                   if v is not None and (k not in _SAVE_DEFAULTS or v != _SAVE_DEFAULTS[k])]:
        logger.info("hotweights: %s: saved by transformers' save_pretrained", options)
        type(model).save_pretrained(model, directory, max_shard_size=max_shard_size, **kwargs)
        return
    recover(directory)  # a save cut short: finished first (its files, half moved, would
    found = diagnose(directory, model)  # read as another checkpoint's, and be deleted)
    if not found.first_save and (found.error or found.names_error or found.mismatches
                                 or found.only_live or found.only_disk):
        logger.warning("hotweights: %s holds another checkpoint than the model's: written "
                       "anew", directory)
        for old in Path(directory).glob("model*.safetensors*"):  # its shards and index: a
            old.unlink()  # file save_pretrained would not write again would be loaded
    sync(directory, model, version=version, max_shard_size=max_shard_size)
    finish()  # the journal and staged files gone, as the Trainer may upload the directory
    as_saved(model.config, model)  # as save_pretrained, on the model's own config
    if model.is_remote_code():
        custom_object_save(model, directory, config=model.config)
    model.config.save_pretrained(directory)
    if model.can_generate():
        model.generation_config.save_pretrained(directory)


_SAVE_DEFAULTS = dict(is_main_process=True, push_to_hub=False, save_peft_format=True,
                      save_original_format=True, distributed_checkpoint=False,
                      safe_serialization=True)  # save_pretrained's options, as if not given


_SCHEDULE_FREE = ("a schedule-free optimizer moves every weight in its train() and eval(), "
                  "which the Trainer calls at each training step and evaluation, outside "
                  "any optimizer step: vLLM would serve weights no version names; pick an "
                  "optimizer that writes the weights only in optimizer.step()")


def _own(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The trainer's optimizer inside accelerate's wrapper (which forwards `step` to it);
    any other wrapper (Lookahead's, say) is the optimizer: its whole step is the update."""
    from accelerate.optimizer import AcceleratedOptimizer

    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer with `train()` / `eval()`, or one it wraps as `.optimizer` (which
    accelerate's wrapper then calls)."""
    for opt in (optimizer, getattr(optimizer, "optimizer", None)):
        if any(callable(getattr(opt, mode, None)) for mode in ("train", "eval")):
            raise ConfigError(f"{type(opt).__name__}: {_SCHEDULE_FREE}")


def _check_dtypes(args: _Config, tensors: Mapping[str, torch.Tensor]) -> None:
    """Refuse `bf16_full_eval` / `fp16_full_eval` on weights of another dtype (evaluation
    would `.to()` the model: a copy) and `fp16` on float16 weights on a GPU (its gradient
    scaler); warn of bf16 autocast on float32 weights."""
    served = {t.dtype for t in tensors.values() if t.is_floating_point()}
    for option, dtype in (("bf16_full_eval", torch.bfloat16), ("fp16_full_eval", torch.float16)):
        if getattr(args, option, False) and served != {dtype}:
            raise ConfigError(f"{type(args).__name__}.{option}=True: evaluation would cast "
                              f"the model to {dtype} and compute with a copy of the served "
                              f"weights ({', '.join(sorted(map(str, served)))}), then training "
                              "would find its parameters gone from vLLM's memory; leave it "
                              "False")
    if getattr(args, "fp16", False) and any(t.dtype == torch.float16 and t.device.type != "cpu"
                                            for t in tensors.values()):
        raise ConfigError(f"{type(args).__name__}.fp16=True on float16 weights: the trainer "
                          "trains the served weights themselves (no float32 master copy), "
                          "and accelerate's fp16 gradient scaler refuses float16 gradients "
                          "at the first optimizer step, after a whole generation; leave it "
                          "False (the model computes in float16 already)")
    if args.bf16 and served == {torch.float32}:
        logger.warning("hotweights: %s.bf16=True on float32 weights: the trainer computes "
                       "in bf16 (autocast) while vLLM samples in float32, so their logprobs "
                       "differ by ~1e-3; set bf16=False for an exact match", type(args).__name__)


def _check_device(trainer: torch.device, served: set[torch.device], config: str) -> None:
    """Refuse a trainer whose device is not where the served tensors lie: its inputs would
    meet the weights in the first forward pass, after a whole generation."""
    def same(a: torch.device, b: torch.device) -> bool:
        return a.type == b.type and (a.type == "cpu" or a.index is None or b.index is None
                                     or a.index == b.index)
    if off := sorted(str(d) for d in served if not same(trainer, d)):
        raise ConfigError(f"the trainer computes on {trainer} and the served weights lie on "
                          f"{', '.join(off)}: set {config}.use_cpu to match the server "
                          "(use_cpu=True only for a CPU server) and CUDA_VISIBLE_DEVICES so "
                          "that the trainer's device is the server's GPU")


class _OnServedWeights:
    """What makes a TRL trainer train vLLM's own weights in place (`GRPOTrainer`,
    `RLOOTrainer`, `DistillationTrainer`: TRL's trainer after this class in the bases;
    `_config` its config). The second argument goes to TRL's as its second (the reward
    functions, or the teacher)."""

    _config: type
    _makes_config = True  # args=None: a `_config` is made (TRL's own trainers)

    def __init__(self, model: torch.nn.Module | str | None = None, reward_funcs: Any = None,
                 args: Any = None, *rest: Any, bridge: Bridge | None = None,
                 update_mode: str = "wait", lease_s: float = 120.0, **kwargs: Any) -> None:
        if not trl.__version__.startswith(TESTED):
            logger.warning("hotweights: TRL %s; this integration is tested with TRL %sx",
                           trl.__version__, TESTED)
        _check_process(update_mode, lease_s)
        if args is not None and not isinstance(args, self._config):
            raise ConfigError(f"args is a {type(args).__name__}; {type(self).__name__} "
                              f"takes its own config, {self._config.__name__}")
        if args is None and not self._makes_config:
            raise ConfigError(f"args=None: pass {type(self).__name__}'s config as args= "
                              "(hotweights cannot tell which config class it makes by "
                              f"itself), or name it: on_served_weights({type(self).__name__}, "
                              "ItsConfig)")
        if args is None:
            args = self._config(output_dir=f"hotweights-{type(self).__name__.lower()}",
                                use_vllm=True,
                                vllm_mode="server" if bridge is not None else "colocate")
        _check_args(args, bridge, kwargs.get("peft_config"))
        if bridge is not None and model is None:
            model = bridge.model()
        elif bridge is not None and not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model={model!r}: pass bridge.model(...) (or nothing): a "
                              "model loaded by name is a second copy the server never sees")
        elif bridge is None and not isinstance(model, str | os.PathLike):
            raise ConfigError(f"model={type(model).__name__}: without a bridge (colocate "
                              "mode) pass the model's local directory: hotweights starts "
                              "vLLM on it and builds the model on vLLM's weights")
        self.sample_versions: list[int] = []  # the versions that sampled the last batch
        if bridge is not None:
            self.weights = _Server(bridge, update_mode, lease_s)
            self.bridge = bridge
            setup = _in_trl("VLLMClient", _client_for(bridge))
        else:  # vLLM's and TRL's colocate setup set process-wide variables (RANK, ...)
            self._environ_before = dict(os.environ)
            self.weights, model = _colocated_engine(os.fspath(model), args)
            llm = self.weights.llm
            setup = _in_trl("LLM", lambda *a, **k: llm)  # TRL's engine is this one
        try:  # colocate mode: the engine stopped and the environment put back on failure
            _check_dtypes(args, self.weights.tensors)
            if self.weights.missing and args.save_strategy != "no":
                strategy = getattr(args.save_strategy, "value", args.save_strategy)
                raise ConfigError(_zeros_saved(self.weights.missing, f"{type(args).__name__}"
                                               f".save_strategy={strategy!r}"))
            with setup:
                super().__init__(model, reward_funcs, args, *rest, **kwargs)
            if self.is_deepspeed_enabled or self.is_fsdp_enabled:  # from accelerate's config
                raise ConfigError(f"{'DeepSpeed' if self.is_deepspeed_enabled else 'FSDP'} "
                                  "(accelerate's config): it partitions or re-creates the "
                                  "parameters; hotweights trains vLLM's tensors in place")
            # accelerate's prepare would `.to(device)` the model at train(): under a
            # launcher (RANK set) that device is `cpu:0`, and the move copies every view
            self.accelerator.device_placement = False
            _check_device(self.accelerator.device, {t.device for t in self.weights.tensors
                                                    .values()}, type(args).__name__)
            self._check_shared("TRL's setup")
            if self.optimizer is not None:  # given (`optimizers=`): an evaluation before
                _check_optimizer(_own(self.optimizer))  # train() calls its eval()
        except BaseException:
            self.close()
            raise
        self._environ_set = dict(os.environ)  # what `close` undoes: the setup's changes
        self.weights.watch(self.vllm_generation)
        # TRL's sync copies the model into vLLM: here vLLM computes with the trained tensors
        self.vllm_generation.sync_weights = lambda: None

    def close(self) -> None:
        """Colocate mode: stop the in-process vLLM engine (its distributed state and the
        memory of its cache freed, so another can start) and put back the environment
        variables its setup and TRL's changed (those set since, by the program, stay). The
        model's parameters are the engine's weights: their memory goes once the model and
        its optimizer are dropped too; training or generating after is refused. Server
        mode: nothing to free (the server keeps serving)."""
        if isinstance(self.weights, _Colocated) and self.weights.llm is not None:
            from hotweights.vllm_plugin.local import restore_environ, stop_engine

            llm, self.weights.llm = self.weights.llm, None
            if generation := getattr(self, "vllm_generation", None):  # not if TRL's setup failed
                generation.llm = None
            stop_engine(llm)
            # TRL's setup's variables too (a failed setup's: all it changed)
            restore_environ(self._environ_before, getattr(self, "_environ_set", None))

    def __enter__(self) -> _OnServedWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_shared(self, after: str) -> None:
        if outside := outside_served(self.model, self.weights.tensors, self.weights.missing):
            raise ConfigError(
                f"{len(outside)} trainable parameter(s) no longer lie in vLLM's memory "
                f"after {after} (e.g. {outside[0]}): TRL or accelerate copied them, and "
                "training them would not change what vLLM serves. Check the options that "
                "move, cast or wrap the model (device placement, dtype casts, "
                "torch_compile, PEFT)")

    def _generate(self, prompts: list):
        """TRL's generation of a batch; `sample_versions` := the versions of the weights
        that generated a training batch (one per sequence of each vLLM generation: a tool
        call's turns count each, and so do a `rollout_func`'s own calls of `generate` and
        `chat`, of the server's client or of the colocated engine); an evaluation's batch
        is only logged."""
        self.weights.begin_batch()
        try:
            return super()._generate(prompts)
        finally:
            versions = self.weights.batch_versions()
            mode = "train" if self.model.training else "eval"
            if mode == "train":  # an evaluation's batch is not what the next steps train on
                self.sample_versions = versions
            if versions:
                self._metrics[mode]["hotweights/sample_version"].append(
                    sum(versions) / len(versions))

    def _load_from_checkpoint(self, resume_from_checkpoint: str,
                              model: torch.nn.Module | None = None) -> None:
        """Resuming loads the checkpoint's weights into the served tensors, as
        `save_pretrained` named and converted them (`checkpoint.load`; transformers' own
        load leaves out fused MoE experts, saved per expert): as an update (server: paused,
        a version of its own; colocate: the prefix cache reset). A checkpoint that does not
        fit the model is refused before the pause, with nothing written, and so is a
        directory with no trainer state (transformers reads it only after this load: a
        refusal then would leave the served weights the directory's)."""
        if not os.path.isfile(os.path.join(resume_from_checkpoint, "trainer_state.json")):
            raise CheckpointError(f"resume_from_checkpoint={resume_from_checkpoint}: no "
                                  "trainer_state.json in it (a save_model() output, not a "
                                  "Trainer checkpoint): nothing loaded, the served weights "
                                  "untouched")
        self._load(resume_from_checkpoint, "loading the checkpoint")

    def _load_best_model(self) -> None:
        """`load_best_model_at_end`: as `_load_from_checkpoint`."""
        self._load(self.state.best_model_checkpoint, "loading the best model")

    def _load(self, directory: str, what: str) -> None:
        load = load_plan(self.model, directory)
        with _served_here(), self.weights.update():
            load()
        self._check_shared(what)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """transformers' save, the model's weights written by `save_weights`."""
        if state_dict is not None:  # a state dict of the caller's: transformers' save
            return super()._save(output_dir, state_dict)
        if self.weights.missing:
            raise CheckpointError(_zeros_saved(self.weights.missing, "save_model()"))
        model = self.model
        model.save_pretrained = functools.partial(  # what transformers' `_save` calls
            save_weights, model, version=self.weights.label)
        try:
            super()._save(output_dir)
        finally:
            del model.save_pretrained

    def _move_model_to_device(self, model: torch.nn.Module, device: Any) -> None:
        """Nothing to move: the views lie where vLLM keeps its weights, and `.to()` onto
        another device name (`cpu:0` for `cpu`) would copy them."""

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        inner = _own(optimizer)
        _check_optimizer(inner)
        if not getattr(inner.step, "hotweights_update", False):  # the optimizer itself:
            # a second `train()` gets accelerate's wrapper back, which steps it (one update
            # a step, not one in another); a bound method, as torch's LR schedulers expect
            inner.step = types.MethodType(self._step_in_update(inner.step), inner)
        return optimizer

    def _step_in_update(self, step):
        """`step` inside the update: the step writes vLLM's tensors in place, and vLLM
        computes with them from its next request on, as the next version."""

        @functools.wraps(step)
        def step_in_update(_optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any):
            self._check_shared("the trainer's preparation")  # before writing a copy
            if self.sample_versions:
                lag = self.weights.version - min(self.sample_versions)
                self._metrics["train"]["hotweights/version_lag"].append(lag)
            result = None
            with _served_here(), self.weights.update():
                result = step(*args, **kwargs)
            return result

        step_in_update.hotweights_update = True
        return step_in_update


@contextlib.contextmanager
def _served_here() -> Iterator[None]:
    """An update served here whose remote servers failed (`RemoteError` with `served`) is
    logged, and training goes on: the remotes catch up at the next update."""
    try:
        yield
    except RemoteError as e:
        if e.served is None:
            raise
        logger.warning("hotweights: %s; training goes on", e)


def _zeros_saved(missing: tuple[str, ...], what: str) -> str:
    return (f"{what}: {len(missing)} parameter(s) of the model no vLLM tensor holds "
            f"(bridge.model(allow_missing=...): zeros here, e.g. {missing[0]}) would be saved "
            "as its weights; save the served ones yourself (hotweights.checkpoint.sync with a "
            "state dict that leaves them out) and set save_strategy=\"no\"")


class GRPOTrainer(_OnServedWeights, trl.GRPOTrainer):
    """TRL's `GRPOTrainer` training vLLM's own weights in place.

    Takes what TRL's takes, plus:
        bridge: the `Bridge` to a `hotweights serve` (server mode). Without it, colocate
            mode: vLLM runs in this process on `model`, a local model directory.
        model: server mode: `bridge.model(...)` (default: `bridge.model()`), never a name
            or a model of its own, which would be a second copy; colocate mode: the
            model directory.
        update_mode: server mode: how the server pauses for each optimizer step
            (`Bridge.update`): "wait" (default: every response is computed with one
            version), "keep" or "abort".
        lease_s: server mode: the update lease (renewed while a step runs).
    """

    _config = trl.GRPOConfig


class RLOOTrainer(_OnServedWeights, trl.RLOOTrainer):
    """TRL's `RLOOTrainer` training vLLM's own weights in place: as `GRPOTrainer` (the same
    arguments, modes and refusals), with an `RLOOConfig`."""

    _config = trl.RLOOConfig


class DistillationTrainer(_OnServedWeights, trl.DistillationTrainer):
    """TRL's on-policy `DistillationTrainer` training vLLM's own weights in place: the
    student is the served model, and its completions come from the server; as
    `GRPOTrainer` otherwise (the same arguments, modes and refusals), with a
    `DistillationConfig`. The teacher is TRL's own (a model of its own, by design)."""

    _config = trl.DistillationConfig

    def __init__(self, model: torch.nn.Module | str | None = None, teacher_model: Any = None,
                 args: trl.DistillationConfig | None = None, *rest: Any, **kwargs: Any) -> None:
        if teacher_model is None:  # TRL would fail in the first loss, after a generation
            raise ConfigError("teacher_model=None: pass the teacher (a model or its name); "
                              "the student is the served model")
        super().__init__(model, teacher_model, args, *rest, **kwargs)


_OURS = {trl.GRPOTrainer: GRPOTrainer, trl.RLOOTrainer: RLOOTrainer,
         trl.DistillationTrainer: DistillationTrainer}  # TRL's base -> ours


def on_served_weights(trainer: type, config: type | None = None) -> type:
    """`trainer`, a subclass of TRL's `GRPOTrainer`, `RLOOTrainer` or
    `DistillationTrainer` (one of your own, or TRL's experimental `GMPOTrainer`), training
    vLLM's own weights in place: a subclass of it that takes and checks what this module's
    trainer of the same TRL base does (`bridge=`, `update_mode=`, `lease_s=`; server or
    colocate mode).

    Args:
        trainer: the trainer class. Its `__init__` must take TRL's first three arguments
            in TRL's order (the model; the reward functions or the teacher; the config)
            and pass them on to TRL's.
        config: the config class it takes: a config given to the trainer is checked to be
            one, and one is made when none is given. Default: its TRL base's (as
            `GRPOConfig`), and a config must then be given (`args=`): the trainer's own
            default (GMPO's wider clipping) is not known here.

    Raises:
        ConfigError: `trainer` derives from none of the three, or `config` is not a
            subclass of its base's config.
    """
    if not isinstance(trainer, type):
        raise ConfigError(f"on_served_weights({trainer!r}): pass a trainer class")
    if issubclass(trainer, _OnServedWeights):
        return trainer
    base = next((b for b in _OURS if issubclass(trainer, b)), None)
    if base is None:
        raise ConfigError(
            f"{trainer.__qualname__} derives from none of TRL's "
            f"{', '.join(b.__name__ for b in _OURS)}: hotweights knows where those generate "
            "with vLLM and step the optimizer, and no other trainer's")
    ours = _OURS[base]
    if config is not None and not (isinstance(config, type)
                                   and issubclass(config, ours._config)):
        raise ConfigError(f"config={config!r}: {trainer.__qualname__} derives from TRL's "
                          f"{base.__name__}; pass a subclass of {ours._config.__name__}")
    if trainer is base and config in (None, ours._config):
        return ours
    return type(trainer.__name__, (ours, trainer), {
        "_config": config or ours._config, "_makes_config": config is not None,
        "__module__": __name__,
        "__doc__": f"{trainer.__qualname__} training vLLM's own weights in place, as "
                   f"hotweights' {ours.__name__} (its arguments, modes and refusals)."})

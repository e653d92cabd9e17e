"""TRL's `GRPOTrainer` on the served weights: the policy TRL trains is the server's own copy.

    from hotweights import Bridge
    from hotweights.integrations.trl import GRPOTrainer   # instead of trl's

    bridge = Bridge.connect("http://127.0.0.1:8000")     # a `hotweights serve`
    trainer = GRPOTrainer(bridge=bridge, reward_funcs=reward, train_dataset=data,
                          args=GRPOConfig(use_vllm=True, vllm_mode="server", ...))
    trainer.train()

How: the model is `bridge.model()` (its parameters are views into the server's weights);
every optimizer step runs inside `bridge.update()` (pause, write in place, commit: a new
version, caches reset, resume); TRL's weight sync moves nothing: the `VLLMClient` TRL
builds is `_client_for(bridge)`'s class, put in TRL's module by name while the trainer is
built. Generation is TRL's own, through the server's OpenAI API. Each response's weight
version is kept per sample (`trainer.sample_versions`) and logged with TRL's metrics
(`hotweights/sample_version`, `hotweights/version_lag`: optimizer steps between the
weights that sampled a batch and the weights it updates).

What would copy, cast or re-create the shared parameters is refused before anything runs,
naming the TRL option at fault; after TRL has set up, every trainable parameter is
checked to still lie in the served memory.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from hotweights.errors import ConfigError
from hotweights.protocol.version import VERSION_HEADER, parse_version

try:
    import trl
    from trl.generation import vllm_generation
    from trl.generation.vllm_client import VLLMClient
except ImportError as e:  # an optional extra
    raise ImportError("hotweights.integrations.trl needs TRL: pip install "
                      "'hotweights[trl]'") from e

if TYPE_CHECKING:
    from hotweights.bridge.client import Bridge

logger = logging.getLogger(__name__)

TESTED = "1.16."  # the TRL versions this seam was read from and tested with


def _client_for(bridge: Bridge) -> type[VLLMClient]:
    """TRL's `VLLMClient` for a `hotweights serve` that `bridge` trains in place."""

    class HotweightsClient(VLLMClient):
        """Generation as TRL does it; weight sync moves nothing (the optimizer step wrote
        the served tensors and committed), and the server's settings come from its own
        authenticated route, not vLLM's dev-mode `/server_info`."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.sample_versions: list[str] = []  # the last generate's, one per sample
            self._version: str | None = None  # the last completion response's header
            super().__init__(*args, **kwargs)
            self.session.hooks["response"].append(self._keep_version)

        def _keep_version(self, response, *args: Any, **kwargs: Any) -> None:
            if VERSION_HEADER in response.headers:
                self._version = response.headers[VERSION_HEADER]

        def generate(self, *args: Any, **kwargs: Any) -> dict:
            self._version = None
            out = super().generate(*args, **kwargs)
            if self._version is None:
                raise ConfigError(f"{self.base_url}: the completion carried no "
                                  f"{VERSION_HEADER} header: is it a `hotweights serve`?")
            self.sample_versions = [self._version] * len(out["completion_ids"])
            return out

        def init_communicator(self, device: Any = 0) -> None:
            logger.info("hotweights: no weight-transfer group: %s serves the trainer's own "
                        "tensors", self.base_url)

        def update_named_params(self, *args: Any, **kwargs: Any) -> None:
            pass  # the optimizer step already wrote the served tensors and committed

        update_named_param = update_model_params = update_named_params

        def reset_prefix_cache(self) -> None:
            pass  # the commit reset the caches

        def close_communicator(self) -> None:
            pass

        def get_server_info(self) -> dict:
            return bridge.server_info()

    return HotweightsClient


@contextlib.contextmanager
def _client_in_trl(client: type[VLLMClient]) -> Iterator[None]:
    """TRL's generation module builds `client` instead of its `VLLMClient` (by name)."""
    original = vllm_generation.VLLMClient
    vllm_generation.VLLMClient = client
    try:
        yield
    finally:
        vllm_generation.VLLMClient = original


def _check_args(args: trl.GRPOConfig, bridge: Bridge, peft_config: Any) -> None:
    """Refuse, naming the option, a config that would copy or re-create the shared weights
    (or generate elsewhere than the served copy); point TRL at the bridge's server."""
    if not args.use_vllm:
        raise ConfigError("GRPOConfig.use_vllm=False: TRL would sample from the trainer's "
                          "model, not the server; set use_vllm=True, vllm_mode='server'")
    if args.vllm_mode != "server":
        raise ConfigError(f"GRPOConfig.vllm_mode={args.vllm_mode!r}: with a Bridge the "
                          "server is a `hotweights serve`; set vllm_mode='server'")
    url = (args.vllm_server_base_url or "").rstrip("/")
    if url and url != bridge.url:
        raise ConfigError(f"GRPOConfig.vllm_server_base_url={url!r}: the bridge trains "
                          f"{bridge.url}; leave it unset or give that URL")
    args.vllm_server_base_url = bridge.url
    refused = {
        "cast_lm_head_to_fp32": "replaces lm_head by a float32 copy, which the server "
                                "never sees",
        "vllm_enable_sleep_mode": "frees the served weights between generations",
        "deepspeed": "DeepSpeed partitions the parameters and steps outside the optimizer",
        "fsdp": "FSDP re-creates the parameters as shards",
    }
    for option, why in refused.items():
        if getattr(args, option, None):
            raise ConfigError(f"GRPOConfig.{option}={getattr(args, option)!r}: {why}; "
                              f"hotweights trains the served tensors in place")
    served = {str(t.dtype) for t in bridge.tensors.values() if t.is_floating_point()}
    if args.bf16 and served == {"torch.float32"}:
        logger.warning("hotweights: GRPOConfig.bf16=True on float32 weights: the trainer "
                       "computes in bf16 (autocast) while vLLM samples in float32, so their "
                       "logprobs differ by ~1e-3; set bf16=False for an exact match")
    if peft_config is not None:
        raise ConfigError("peft_config: LoRA adapters are not the served weights (the "
                          "server would never see them); train the base weights, "
                          "e.g. bridge.model(trainable=...)")


def outside_served(model: torch.nn.Module, bridge: Bridge) -> list[str]:
    """The trainable parameters of `model` that do not lie in the server's memory."""
    spans = sorted((t.untyped_storage().data_ptr(),
                    t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
                   for t in bridge.tensors.values())
    outside = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        start, end = param.data_ptr(), param.data_ptr() + param.nbytes
        if not any(lo <= start and end <= hi for lo, hi in spans):
            outside.append(name)
    return outside


class GRPOTrainer(trl.GRPOTrainer):
    """TRL's `GRPOTrainer` training the weights a `hotweights serve` serves, in place.

    Takes what TRL's takes, plus:
        bridge: the `Bridge` to the server (`Bridge.connect(url)`).
        model: `bridge.model(...)` (default: `bridge.model()`); never a name or a model
            of its own, which would be a second copy.
        update_mode: how the server pauses for each optimizer step (`Bridge.update`):
            "wait" (default: every response is computed with one version), "keep" or
            "abort".
        lease_s: the update lease (renewed while a step runs).
    """

    def __init__(self, model: torch.nn.Module | None = None, reward_funcs: Any = None,
                 args: trl.GRPOConfig | None = None, *rest: Any, bridge: Bridge,
                 update_mode: str = "wait", lease_s: float = 120.0, **kwargs: Any) -> None:
        if not trl.__version__.startswith(TESTED):
            logger.warning("hotweights: TRL %s; this integration is tested with TRL %sx",
                           trl.__version__, TESTED)
        if model is None:
            model = bridge.model()
        elif not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model={model!r}: pass bridge.model(...) (or nothing): a "
                              "model loaded by name is a second copy the server never sees")
        if args is None:
            args = trl.GRPOConfig(output_dir="hotweights-grpo", use_vllm=True,
                                  vllm_mode="server")
        _check_args(args, bridge, kwargs.get("peft_config"))
        self.bridge, self.update_mode, self.lease_s = bridge, update_mode, lease_s
        self.sample_versions: list[str] = []  # the version that sampled each completion
        with _client_in_trl(_client_for(bridge)):
            super().__init__(model, reward_funcs, args, *rest, **kwargs)
        if outside := outside_served(self.model, bridge):
            raise ConfigError(
                f"{len(outside)} trainable parameter(s) no longer lie in the served memory "
                f"after TRL's setup (e.g. {outside[0]}): TRL or accelerate copied them, and "
                "training them would not change what the server serves. Check the "
                "options that move, cast or wrap the model (device placement, dtype "
                "casts, torch_compile, PEFT)")
        self._vllm_generate = self.vllm_generation.generate
        self.vllm_generation.generate = self._generate_and_keep_versions

    def _generate_and_keep_versions(self, *args: Any, **kwargs: Any) -> tuple:
        out = self._vllm_generate(*args, **kwargs)
        self.sample_versions = list(self.vllm_generation.vllm_client.sample_versions)
        if self.sample_versions:
            mode = "train" if self.model.training else "eval"
            numbers = [parse_version(v)[0] for v in self.sample_versions]
            self._metrics[mode]["hotweights/sample_version"].append(sum(numbers) / len(numbers))
        return out

    def _move_model_to_device(self, model: torch.nn.Module, device: Any) -> None:
        """Nothing to move: the views lie where the server keeps its weights, and `.to()`
        onto another device name (`cpu:0` for `cpu`) would copy them."""

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        if not getattr(optimizer.step, "hotweights_update", False):
            optimizer.step = self._step_in_update(optimizer.step)
        return optimizer

    def _step_in_update(self, step):
        """`step` inside the update transaction: the server pauses, the step writes its
        tensors in place, the commit serves them as the next version."""

        @functools.wraps(step)
        def step_in_update(*args: Any, **kwargs: Any):
            if self.sample_versions:
                served = parse_version(self.bridge.version)[0]
                oldest = min(parse_version(v)[0] for v in self.sample_versions)
                self._metrics["train"]["hotweights/version_lag"].append(served - oldest)
            with self.bridge.update(mode=self.update_mode, lease_s=self.lease_s):
                return step(*args, **kwargs)

        step_in_update.hotweights_update = True
        return step_in_update

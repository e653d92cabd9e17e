"""Worker extension (`--worker-extension-cls hotweights.vllm_plugin.worker.HotweightsWorker`).

Its methods are mixed into every vLLM worker; they are reached with
`collective_rpc("hotweights_...")` and return plain JSON-able values.
"""

from __future__ import annotations

import atexit
import logging
import os

import torch

from hotweights.errors import ConfigError, UnsupportedModelError
from hotweights.protocol import shm
from hotweights.vllm_plugin.aliases import aliases, rebased

logger = logging.getLogger(__name__)


class HotweightsWorker:
    """Moves the worker's weights into shared memory and describes them."""

    def hotweights_share(self, server_id: str | None = None) -> dict:
        """Move every parameter into one shared-memory file; return its manifest.

        Idempotent: a second call returns the manifest of the first.
        """
        existing = getattr(self, "_hotweights_manifest", None)
        if existing is not None:
            return existing.to_dict()
        from vllm.distributed import parallel_state

        model = self.model_runner.model
        params = dict(model.named_parameters())  # tied parameters appear once
        _refuse_drafter_copies(self.vllm_config)
        if any(p.is_cuda for p in params.values()):
            _refuse_unshareable_cuda_memory(self.vllm_config)
            _refuse_borrowed_weights(self.vllm_config, sharing=True)
            _refuse_repacked_weights(self.vllm_config, model)
        alias_of = aliases(params)  # shared as views of what holds them, not copies
        placed = {name: (params[name].data, params[holder].data)  # (a few: views kept for
                  for name, holder in alias_of.items()}  # their place in what holds them)

        def moved(name: str, tensor: torch.Tensor) -> None:  # the old bytes go as it copies
            params[name].data = tensor
        manifest, shared = shm.share(
            {name: p.data for name, p in params.items() if name not in alias_of},
            moved=moved, server_id=server_id,
            model=str(self.model_runner.model_config.model),
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        )
        for name, holder in alias_of.items():
            params[name].data = rebased(*placed[name], shared[holder])
        for name, tensor in shared.items():
            params[name].data = tensor  # the engine now computes on the shared bytes
        atexit.register(shm.release, manifest)
        self._hotweights_manifest = manifest
        logger.info("hotweights: %d parameters in %s", len(params), manifest.path)
        return manifest.to_dict()

    def hotweights_check_in_place(self) -> None:
        """What `hotweights_share` refuses on a GPU, for a server that shares nothing
        (`--remote`: updates are written in place all the same)."""
        model = self.model_runner.model
        if any(p.is_cuda for p in model.parameters()):
            _refuse_borrowed_weights(self.vllm_config, sharing=False)
            _refuse_repacked_weights(self.vllm_config, model)

    def hotweights_after_update(self) -> None:
        """Post-update hook: re-derive anything the backend computed from the weights.

        Nothing to do yet: on CPU the plugin keeps every weight in the layout the engine
        computes on, so an in-place write is all there is.
        """

    # -- remote servers (`hotweights serve --remote`): the `hotweights` transfer engine --

    def hotweights_remote_receive(self, update: str | None = None,
                                  wait: float | None = None) -> dict:
        """Start receiving one update from the trainer's channel into the engine's staging
        (an announced one: first wait up to `wait` s for the trainer to start it), on a
        thread of its own: this worker goes on generating with the old weights meanwhile.
        `hotweights_remote_apply` waits for it."""
        if not self._weight_update_active:
            self.start_weight_update()
        self.weight_transfer_engine.start_receiving({"update": update, "wait": wait})
        return {"receiving": True}

    def hotweights_remote_received(self) -> dict:
        """Bytes this worker received since it joined the trainer's channel: ``{"trainer":
        n, "relay": m}`` (the leader receives from the trainer, the others from the relay);
        and of the last update it received, ``"staged"`` (bytes staged: its TP shard's) and
        ``"peak_staging"`` (their high-water mark, with one round's buffer)."""
        return self.weight_transfer_engine.received_bytes()

    def hotweights_remote_dtypes(self) -> dict[str, str]:
        """HF name -> the dtype this worker holds it in (`HotweightsEngine.served_dtypes`)."""
        return self.weight_transfer_engine.served_dtypes()

    def hotweights_remote_decodes_xor(self) -> bool:
        """Whether this worker can decode xor-coded values (after joining a channel)."""
        return self.weight_transfer_engine.decodes_xor()

    def hotweights_remote_apply(self, next_update: str | None = None) -> dict:
        """Apply the staged update (see the engine), then the post-update hook. With
        `next_update`, then wait for that update on a thread (the engine's `arm`), so that
        its receive needs no request to the engine. Returns ``{"applied": True, "armed":
        whether it does, "broken": whether this worker's channel broke (its acknowledgement
        failed after the trainer's had ended: the update stands, the next one needs a new
        channel)}``, or ``{"applied": False, "error": what the receive raised}`` (nothing
        applied)."""
        staged = self._weight_update_active
        engine = self.weight_transfer_engine
        if staged:
            try:
                engine.received()
            except BaseException as e:
                engine.discard()
                self.finish_weight_update()  # applies nothing: the staging is empty
                if not isinstance(e, Exception):
                    raise
                return {"applied": False, "error": repr(e)}
            self.finish_weight_update()
        self.hotweights_after_update()
        if engine.broken:
            logger.warning("hotweights: the channel to the trainer broke after this update "
                           "was staged; the next update comes on a new one")
            return {"applied": True, "armed": False, "broken": True}
        if not next_update:
            return {"applied": True, "armed": False, "broken": False}
        try:
            self.start_weight_update()
            engine.arm(next_update)
        except Exception:  # the update is applied: its receive will be requested instead
            logger.exception("hotweights: could not wait for the next update ahead")
            return {"applied": True, "armed": False, "broken": False}
        return {"applied": True, "armed": True, "broken": False}

    def hotweights_remote_discard(self) -> dict:
        """Drop a staged update, leaving the weights untouched. Returns ``{"broken":
        whether this worker's channel broke (a receive left behind)}``."""
        if (engine := getattr(self, "weight_transfer_engine", None)) is not None:
            engine.discard()
        if getattr(self, "_weight_update_active", False):
            self.finish_weight_update()  # applies nothing: the staging is empty
        return {"broken": engine is not None and engine.broken}

    def hotweights_checksum(self) -> str:
        """xxh3-64 over this worker's parameters (names and bytes, in name order).

        Equal on two servers of the same model, dtype, TP size and platform when their
        weights are bit-identical."""
        import xxhash

        h = xxhash.xxh3_64()
        for name, p in sorted(self.model_runner.model.named_parameters()):
            h.update(name.encode())
            h.update(p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().data)
        return h.hexdigest()

    def hotweights_release(self) -> None:
        """Remove the shared file (the engine keeps its mapping)."""
        manifest = getattr(self, "_hotweights_manifest", None)
        if manifest is not None:
            shm.release(manifest)

    def destroy_worker_extension(self) -> None:
        """vLLM >= 0.33 calls this at worker shutdown (0.32: the atexit hook does it)."""
        self.hotweights_release()


def _refuse_unshareable_cuda_memory(vllm_config) -> None:
    # Legacy CUDA IPC (cudaIpcGetMemHandle) cannot export memory that comes from cuMem
    # allocations: vLLM's sleep mode and PyTorch's expandable segments both use them.
    if vllm_config.model_config.enable_sleep_mode:
        raise ConfigError("hotweights: vLLM's --enable-sleep-mode allocates the weights "
                          "with cuMem, which CUDA IPC cannot share; start without it")
    if vllm_config.model_config.enable_cumem_allocator:
        raise ConfigError("hotweights: vLLM's --enable-cumem-allocator allocates the weights "
                          "with cuMem, which CUDA IPC cannot share; start without it")
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if "expandable_segments:true" in os.environ.get(var, "").replace(" ", "").lower():
            raise ConfigError(f"hotweights: {var} enables expandable segments, whose memory "
                              "CUDA IPC cannot share; unset expandable_segments")


def _refuse_drafter_copies(vllm_config) -> None:
    # vLLM >= 0.33: a speculative drafter may compute with a quantized copy of the target's
    # lm_head, which vLLM re-derives only in its own weight transfer (finish_weight_update:
    # a --remote server's path), not after a write in place
    spec = getattr(vllm_config, "speculative_config", None)
    if quantized := getattr(spec, "draft_lm_head_quantization", None):
        raise ConfigError(
            f"hotweights: the speculative drafter's draft_lm_head_quantization={quantized} "
            "computes with a copy of lm_head that an update in place leaves stale; start "
            "without it (a --remote server takes it)")


def _refuse_borrowed_weights(vllm_config, *, sharing: bool) -> None:
    # Weights the engine computes with but does not hold in GPU memory of its own: an
    # update in place would be lost, or would change memory that is not this server's.
    from vllm.model_executor.offloader.base import get_offloader

    offloader = type(get_offloader()).__name__  # set by the model runner at load
    if offloader == "PrefetchOffloader":
        raise ConfigError(
            "hotweights: vLLM's prefetch offloading (--offload-group-size) keeps the "
            "offloaded layers' weights in CPU memory and copies them before each use into "
            "GPU buffers that layers share: an update in place would be overwritten at the "
            "next forward; start without it")
    if offloader == "UVAOffloader" and sharing:
        raise ConfigError(
            "hotweights: vLLM's --cpu-offload-gb keeps the offloaded weights in pinned CPU "
            "memory, which CUDA IPC cannot share; start without it (a --remote server, "
            "which shares nothing, takes it)")
    load = vllm_config.load_config
    extra = load.model_loader_extra_config
    if load.load_format == "ipc_cache" and (
            extra.get("mode", "zero_copy") if isinstance(extra, dict) else "zero_copy"
    ) == "zero_copy":
        raise ConfigError(
            "hotweights: --load-format ipc_cache maps the weights of vLLM's preload daemon "
            "(its zero_copy mode): an update in place would change that cache, which "
            "outlives this server and serves other engines; load a copy "
            "(--model-loader-extra-config '{\"mode\": \"copy\"}') or another format")


def _refuse_repacked_weights(vllm_config, model) -> None:
    # A backend that repacks weights at load (quantized kernels, packed GEMM layouts)
    # computes on its own copy, which an in-place update would leave stale. On GPU vLLM's
    # UnquantizedLinearMethod computes on the checkpoint layout itself; anything else is
    # refused. (On CPU the hotweights plugin keeps the checkpoint layout: cpu_keep_weights.)
    model_config = vllm_config.model_config
    if model_config.quantization is not None:
        raise UnsupportedModelError(
            f"hotweights: {model_config.model} is quantized ({model_config.quantization}); "
            "its kernels compute on a packed copy of the weights that an in-place update "
            "would leave stale; serve an unquantized checkpoint")
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        kinds = [c.__name__ for c in type(method).__mro__]
        if "LinearMethodBase" in kinds and kinds[0] != "UnquantizedLinearMethod":
            raise UnsupportedModelError(
                f"hotweights: {name} computes with {kinds[0]}, which may repack its weights "
                "at load, so an in-place update would not reach it; hotweights trains only "
                "layers on vLLM's UnquantizedLinearMethod")
        backend = getattr(method, "unquantized_backend", None)  # FusedMoE's kernels
        if backend is not None and backend.name not in ("TRITON", "BATCHED_TRITON"):
            raise UnsupportedModelError(
                f"hotweights: {name} computes its experts with vLLM's {backend.value} MoE "
                "kernels, which rearrange the expert weights at load (gate and up swapped, "
                "permuted or shuffled): an in-place update would write the wrong rows; "
                "start the server with --moe-backend triton")

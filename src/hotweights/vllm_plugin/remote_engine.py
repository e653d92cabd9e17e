"""The `hotweights` weight-transfer engine: a vLLM worker receives delta rounds from a trainer.

vLLM builds it in each worker when the server runs with ``--weight-transfer-config
'{"backend": "hotweights"}'`` (`hotweights serve --remote` passes it; the general plugin
registers the name). Our authenticated routes drive it through the worker's own methods
(`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`) and the worker extension's `hotweights_remote_*`; vLLM's RL routes
and ``VLLM_SERVER_DEV_MODE`` are never needed.

- init: the server's first worker (its leader) joins the trainer's `Channel` as rank
  ``rank_offset``, on Gloo (CPU) or NCCL (CUDA): one rank per server, so each server
  receives each byte once. With more than one worker (TP), every worker also joins the
  server's relay, a `Channel` of its own on 127.0.0.1 (never vLLM's TP group, which the
  model uses meanwhile on the main thread), the leader as its rank 0.
- update: the leader receives every round of one update and hands it on to the relay as
  it arrives; every worker stages it into a `Staged` (checked against the checkpoint's
  names, shapes and the served dtype; nothing is applied yet), keeping in host memory
  (pinned on CUDA) only what its TP shard holds (`remote.shards`); the trainer's `send`
  returns only when every worker of every server has staged all of it. Our routes
  receive on a thread of its own (`start_receiving`): vLLM runs the model on the worker's
  main thread, which an RPC holds until it returns, so generation goes on meanwhile.
- finish: applies what was staged, tensor by tensor, straight into the parameter slabs
  that hold each HF tensor's shard (`layout.plan` at this worker's tp_size and tp_rank:
  O(what changed)); what the plan cannot map goes through
  ``load_checkpoint_weight_patches``, i.e. the model's own ``load_weights`` (merging qkv /
  gate_up / experts, slicing for TP).
- discard: drops what was staged (an aborted update leaves the weights untouched).
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.model_executor.model_loader.checkpoint_weight_patch import (
    CheckpointWeightPatch,
    load_checkpoint_weight_patches,
)

from hotweights.checkpoint.dtypes import TORCH
from hotweights.checkpoint.hub import local_dir
from hotweights.checkpoint.shards import read_dir
from hotweights.errors import ConfigError, HotweightsError, RemoteError, UnsupportedModelError
from hotweights.layout.plan import hf_params, plan
from hotweights.remote import delta_apply, jit, shards
from hotweights.remote.channel import Channel
from hotweights.remote.delta import dtype_name
from hotweights.remote.staging import Staged

logger = logging.getLogger(__name__)

_DROP_WAIT_S = 10.0  # how long a dropped receive may go without a round (an interrupted
# wait ends within one slice, `announce._WAIT_SLICE_S`) before it is left behind
PATCH_CHUNK = 1 << 24  # values per load_checkpoint_weight_patches call (one tensor's more)


@dataclass
class RemoteInit(WeightTransferInitInfo):
    """What a worker needs to join the trainer's channel (sent by our /remote/join route):
    the leader joins it as rank `rank_offset`; with more than one worker, every worker joins
    the relay at 127.0.0.1:`relay_port` (with `relay_token`). Every receiver refuses a round
    over the trainer's `max_round_bytes`."""

    master_addr: str
    master_port: int
    rank_offset: int
    world_size: int
    token: str
    timeout: float = 60.0
    relay_port: int = 0
    relay_token: str = ""
    max_round_bytes: int = 64 << 20


@dataclass
class RemoteUpdate(WeightTransferUpdateInfo):
    """One update (everything else travels on the channel): its id if the trainer announced
    it, and how long to wait for the trainer to start it."""

    update: str | None = None
    wait: float | None = None


class HotweightsEngine(WeightTransferEngine[RemoteInit, RemoteUpdate]):
    init_info_cls = RemoteInit
    update_info_cls = RemoteUpdate

    def __init__(self, config, vllm_config, device, model) -> None:
        super().__init__(config, vllm_config, device, model)
        self.channel: Channel | None = None  # the trainer's (the leader only)
        self.relay: Channel | None = None  # the server's own workers' (more than one)
        self.staged: Staged | None = None
        self.last_staged = {"staged": 0, "peak_staging": 0}  # the last update's bytes
        self._shards: dict[str, shards.Shard] | None = None
        self._spec_map: dict[str, torch.Tensor] | None = None  # (`_specs`)
        self._receiving: _Receiving | None = None
        self._gave_up = False  # a receive was left behind with the channels
        self.model_dir = _local_dir(self.model_config, vllm_config.load_config.download_dir)

    def _specs(self) -> dict[str, torch.Tensor]:
        """HF name -> meta tensor of its shape and the served dtype, from the checkpoint; a
        tensor whose slabs vLLM keeps in a wider float (GDN's A_log, some routers: float32)
        in theirs (values in the served dtype are widened to it, exactly). Read once (at
        the server's start, for its status's `served_dtypes`)."""
        if self._spec_map is not None:
            return self._spec_map
        found = read_dir(self.model_dir)
        if not found:
            raise ConfigError(f"hotweights: no safetensors in {self.model_dir}; the remote engine "
                              "checks updates against the checkpoint's tensor names and shapes")
        served = self.model_config.dtype

        def dtype(name: str, header: str) -> torch.dtype:  # FP8 (quantized weights) is
            if (stored := TORCH.get(header)) is None:  # served as stored
                raise UnsupportedModelError(
                    f"{name}: dtype {header} in {self.model_dir} has no torch form: "
                    "--remote cannot check updates of it (quantized checkpoints are not "
                    "supported)")
            return served if stored.is_floating_point and stored.itemsize > 1 else stored
        specs = {name: torch.empty(info.shape, device="meta", dtype=dtype(name, info.dtype))
                 for name, (_, info) in found.items()}
        for name, shard in self._held().items():
            spec = specs.get(name)
            if spec is not None and shard.dtype is not None and \
                    delta_apply.widens(spec.dtype, shard.dtype):
                specs[name] = torch.empty(spec.shape, device="meta", dtype=shard.dtype)
        self._spec_map = specs
        return specs

    def served_dtypes(self) -> dict[str, str]:
        """HF name -> the dtype (torch's name) this worker holds it in: an update's values
        come in it, or in a narrower float it widens exactly."""
        return {name: dtype_name(t.dtype) for name, t in self._specs().items()}

    def init_transfer_engine(self, init_info: RemoteInit) -> None:
        self.shutdown()
        self._gave_up = False
        pc = self.parallel_config
        index = pc.data_parallel_index * pc.world_size + pc.rank  # this worker in its server
        cuda = self.device.type == "cuda"
        kw = {"timeout": init_info.timeout, "backend": "nccl" if cuda else "gloo",
              "device": self.device if cuda else "cpu"}
        try:
            if init_info.relay_port:  # first: the followers wait for the leader, not the
                self.relay = Channel(  # trainer
                    master_addr="127.0.0.1", master_port=init_info.relay_port, rank=index,
                    world_size=pc.world_size_across_dp, token=init_info.relay_token,
                    name="relay", max_round_bytes=init_info.max_round_bytes, **kw)
            if index == 0:
                self.channel = Channel(
                    master_addr=init_info.master_addr, master_port=init_info.master_port,
                    rank=init_info.rank_offset, world_size=init_info.world_size,
                    token=init_info.token, max_round_bytes=init_info.max_round_bytes, **kw)
        except BaseException:  # not half joined: a leader with a relay only would receive
            self.shutdown()  # from it as a follower
            raise
        if self.staged is None:  # xor-coded values decode against the live weights' views
            self.staged = Staged(self._specs(), old=self._old(), shards=self._held(),
                                 pin=cuda)
            # compiled now (~1 s a value size, then cached on disk), not in the first update
            jit.warm({t.dtype.itemsize for t in self.staged.specs.values()})

    def decodes_xor(self) -> bool:
        """Whether this worker can read the old value of every checkpoint tensor it holds
        part of (whole, or one run of it in one slab at TP > 1), so it can decode xor-coded
        values (`packing.pack(values="xor")`) against its live weights."""
        return self.staged is not None and set(self.staged.specs) <= set(self._old())

    def start_weight_update(self) -> None:
        self._require()
        self.staged.clear()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # vLLM's version ends with torch.accelerator.synchronize(), which raises on CPU torch
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @property
    def broken(self) -> bool:
        """Whether this worker's channel (the trainer's, or its server's relay) broke or
        was given up: its next receive would fail; the trainer opens a new one when the
        status says none."""
        return self._gave_up or any(c is not None and c.broken
                                    for c in (self.channel, self.relay))

    def start_receiving(self, update_info: dict[str, Any]) -> None:
        """`update_weights` on a thread of its own; `received` waits for it."""
        self._drop_receiving()  # an update armed for (`arm`) that is not this one
        self._require()  # (after the drop: it gives the channels up if that one is stuck)
        self.staged.clear()
        self._receiving = _Receiving(self, self.parse_update_info(update_info))
        self._receiving.start()

    def arm(self, update: str) -> None:
        """Wait for the trainer's next update, announced ahead (its id came with the
        commit), on a thread of its own and without a time bound: that update then needs
        no request to this engine, which vLLM would serve only between two engine steps.
        `discard`, `start_receiving` (of another update) and a new channel drop it."""
        if self.broken:  # its receive would fail at once
            raise RemoteError(f"hotweights: not waiting for update {update}: the channel is "
                              "broken; the trainer opens a new one")
        self.start_receiving({"update": update, "wait": math.inf})

    def _drop_receiving(self) -> None:
        """Stop a receive still waiting for its update's start, and wait for it while it
        receives rounds; what it raised is logged, not raised (the update is dropped). One
        that receives none for `_DROP_WAIT_S` (a store or broadcast whose peer's host
        vanished without a reset: TCP gives up after ~15 min) is left behind with a
        staging of its own and the channels it reads, given up: the trainer opens a new
        one."""
        source, receiving = self.channel if self.channel is not None else self.relay, \
            self._receiving
        # (one that ended, its sender gone say, has nothing to interrupt)
        if receiving is not None and receiving.is_alive() and receiving.info.update and \
                source is not None:
            source.interrupt(receiving.info.update)
        if receiving is not None and self._stuck(receiving, source):
            self._receiving = None
            self.staged = self.staged.fresh()  # what it may still stage goes to the old one
            # its channels go with it, closed once it ends (closing a group under a
            # collective in flight waits for the collective)
            receiving.closes = [c for c in (self.channel, self.relay) if c is not None]
            for channel in receiving.closes:
                channel.give_up("a receive on it was left behind")
            self.channel = self.relay = None
            self._gave_up = True
            if not receiving.is_alive():  # it ended meanwhile, before it could close them
                receiving.close_channels()
            logger.warning("hotweights: the dropped update's receive made no progress for "
                           "%.0f s (is the trainer's host gone?); left behind, its channel "
                           "given up: the next update comes on a new one", _DROP_WAIT_S)
            return
        try:
            self.received()
        except Exception as e:  # dropped anyway
            logger.info("hotweights: the dropped update's receive failed: %r", e)

    @staticmethod
    def _stuck(receiving: _Receiving, source: Channel | None) -> bool:
        """Wait for `receiving` to end while it receives: whether it went `_DROP_WAIT_S`
        without receiving a round."""
        seen = None if source is None else source.bytes_received
        while receiving.join(_DROP_WAIT_S) or receiving.is_alive():
            if (now := None if source is None else source.bytes_received) == seen:
                return True
            seen = now
        return False

    def received(self) -> None:
        """Wait for the receive started by `start_receiving`, if any; raise what it raised."""
        receiving, self._receiving = self._receiving, None
        if receiving is not None:
            receiving.join()  # bounded: the channel's timeout, the update's wait
            if receiving.error is not None:
                raise receiving.error

    def receive_weights(self, update_info: RemoteUpdate) -> None:
        self._require()
        staged = self.staged  # (one left behind keeps its own: `_drop_receiving`)
        staged.clear()
        source, relay = ((self.channel, self.relay) if self.channel is not None else
                         (self.relay, None))
        try:
            source.receive(staged, update=update_info.update, wait=update_info.wait,
                           relay=relay)
        except BaseException:
            staged.clear()
            raise
        if staged is not self.staged:  # left behind meanwhile: dropped
            return
        self.last_staged = {"staged": staged.nbytes, "peak_staging": staged.peak}
        logger.info("hotweights: staged %d rounds, %d bytes (peak %d)", staged.rounds,
                    staged.nbytes, staged.peak)

    def _held(self) -> dict[str, shards.Shard]:
        """HF name -> what this worker's parameters hold of it (`layout.plan` at its TP
        rank, as the bridge maps a local server); {} where the plan cannot map the model."""
        if self._shards is None:
            from vllm.distributed import parallel_state

            from hotweights.vllm_plugin.aliases import owned

            # aliases (MLA's W_UV) are written through what holds them
            params = owned(dict(self.model.named_parameters()))
            trust = self.model_config.trust_remote_code
            try:
                shapes, ties = hf_params(str(self.model_dir), trust_remote_code=trust)
                layout = plan(str(self.model_dir),
                              {n: tuple(p.shape) for n, p in params.items()}, strict=False,
                              tp_size=parallel_state.get_tensor_model_parallel_world_size(),
                              tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                              hf_shapes=(shapes, ties), trust_remote_code=trust)
                self._shards = shards.of(layout, params, shapes | {
                    alias: shapes[target] for alias, target in ties.items()})
            except HotweightsError as e:
                logger.info("hotweights: no map of the weights (%s); updates go through "
                            "the model's loader", e)
                self._shards = {}
        return self._shards

    def _old(self) -> dict[str, torch.Tensor | shards.Shard]:
        """HF name -> what xor-coded values decode against: a view of the live slab that
        holds the tensor whole (tp=1), else its shard (a rank of vocabulary padding only: a
        shard holding nothing); none for the loader's tensors."""
        return {name: s.dests[0][0] if s.whole else s for name, s in self._held().items()}

    def finish_weight_update(self) -> None:
        """Apply what was staged (nothing after `discard`): tensor by tensor into the slabs
        of the live weights that hold each one's shard (O(what changed)), else through the
        model's loader (``load_checkpoint_weight_patches``)."""
        if self.staged is None:
            return
        direct = self.staged.apply_in_place()
        chunk, size, loaded = [], 0, Counter()
        for p in self.staged.patches():  # made, and on the device, a chunk at a time
            if chunk and (size >= PATCH_CHUNK or (p.indices is None) != (
                    chunk[0].indices is None)):  # (one call takes one kind)
                self._load(chunk)
                chunk, size = [], 0
            chunk.append(self._vllm(p))
            size += p.values.numel()
            loaded["dense" if p.indices is None else "sparse"] += 1
        if chunk:
            self._load(chunk)
        logger.info("hotweights: applied %d tensor updates in place, %d dense and %d sparse "
                    "through the loader", len(direct), loaded["dense"], loaded["sparse"])
        self.staged.clear()

    def _load(self, patches: list[CheckpointWeightPatch]) -> None:
        # our indices are increasing, so unique: skip vLLM's sort
        load_checkpoint_weight_patches(self.model, patches, validate_unique_indices=False)

    def discard(self) -> None:
        self._drop_receiving()
        if self.staged is not None:
            self.staged.clear()

    def _vllm(self, p) -> CheckpointWeightPatch:
        """A staged (host) patch as vLLM's, on this worker's device."""
        return CheckpointWeightPatch(p.name, p.shape, p.dtype, p.values.to(self.device),
                                     None if p.indices is None else p.indices.to(self.device))

    def received_bytes(self) -> dict[str, int]:
        """Bytes this worker received since it joined: from the trainer (the leader) and
        from the relay (the other workers); and the last update's staging: bytes staged
        (`staged`) and its high-water mark (`peak_staging`, see `Staged.peak`)."""
        return {"trainer": self.channel.bytes_received if self.channel else 0,
                "relay": self.relay.bytes_received if self.relay else 0, **self.last_staged}

    def shutdown(self) -> None:
        self._drop_receiving()
        for channel in (self.channel, self.relay):
            if channel is not None:
                channel.close()
        self.channel = self.relay = None

    def _require(self) -> None:
        if self._gave_up:
            raise RemoteError("hotweights: this server gave its channel up (a receive on it "
                              "made no progress); the trainer opens a new one")
        if self.channel is None and self.relay is None:
            raise ConfigError("hotweights: this server has not joined a trainer's channel "
                              "(POST /hotweights/remote/join first)")


class _Receiving(threading.Thread):
    """One update's receive, off the worker's main thread; keeps what it raised."""

    def __init__(self, engine: HotweightsEngine, info: RemoteUpdate):
        super().__init__(name="hotweights-receive", daemon=True)
        self.engine, self.info = engine, info
        self.error: BaseException | None = None
        self.closes: list[Channel] = []  # left behind: the channels it closes at its end

    def run(self) -> None:
        try:
            self.engine.receive_weights(self.info)
            if self.engine.device.type == "cuda":
                torch.cuda.synchronize(self.engine.device)
        except BaseException as e:  # raised where the commit or abort waits for it
            self.error = e
        finally:
            self.close_channels()

    def close_channels(self) -> None:
        closes, self.closes = self.closes, []
        for channel in closes:
            channel.close()


def _local_dir(model_config, download_dir: str | None) -> Path:
    """The directory vLLM loaded the weights from: the model's, or its hub snapshot at its
    revision in `download_dir` (vLLM downloaded it before any worker builds this engine)."""
    found = local_dir(str(model_config.model), model_config.revision, download_dir)
    if found is None:
        raise ConfigError(f"hotweights: no local copy of {model_config.model} (revision "
                          f"{model_config.revision}); the remote engine reads the "
                          "checkpoint's tensor names and shapes from it")
    return Path(found)

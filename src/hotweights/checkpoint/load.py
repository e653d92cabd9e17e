"""Load a safetensors checkpoint into a model's own tensors, in place: the reverse of
`sync`, through the same name conversions (`save_pretrained`'s: transformers 5 saves
fused MoE experts per expert, which `load_state_dict` does not match and leaves as
they were, with a warning only).

`load_plan` checks everything first and returns the load: a trainer runs it inside an
update, so that nothing is written, and no server paused, for a checkpoint that does not
fit the model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from hotweights.checkpoint import journal
from hotweights.checkpoint.names import NameMap, _few, to_disk, unpack
from hotweights.checkpoint.source import Tensors, open_dir
from hotweights.errors import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["load_plan"]


def load_plan(model: torch.nn.Module, model_dir: str | os.PathLike) -> Callable[[], int]:
    """Check that the safetensors in `model_dir` fill every tensor of `model`'s state dict
    (under the names and in the layout `save_pretrained` gives them), and return the load:
    it copies each stored tensor into the model's own bytes and returns the bytes it
    copied. Nothing is written until it runs.

    Raises:
        CheckpointError: no safetensors in `model_dir`, a tensor of the model the
            checkpoint lacks or stores in another shape or dtype (another model's
            checkpoint?), or one a conversion gives as a copy (the load would not reach
            the model).
    """
    if journal.pending(model_dir) is not None:  # a sync cut short after its commit: its
        journal.recover(model_dir)  # shards may be half written until it is finished
    disk = open_dir(model_dir, strict=True)  # (a tensor in two shards: which loaders take?)
    try:
        live, inner, _ = unpack(model)  # (the model inside a torch.compile or DDP wrapper)
        try:
            names = to_disk(live, disk.keys(), model=inner)
        except CheckpointError as e:  # (a name conversion that does not fit)
            raise CheckpointError(f"{model_dir}: {e} Nothing was loaded") from None
        _check(model_dir, names, disk, {t.untyped_storage().data_ptr() for t in live.values()})
    except BaseException:
        disk.close()
        raise

    def load() -> int:
        try:
            with torch.no_grad():
                for name, t in names.tensors.items():
                    t.copy_(disk[name])
        finally:
            disk.close()
        return sum(t.numel() * t.element_size() for t in names.tensors.values())

    return load


def _check(model_dir: str | os.PathLike, names: NameMap, disk: Tensors, own: set[int]
           ) -> None:
    """Refuse what a load of `disk` into the model's `names` cannot do in place (see
    `load_plan`); `own`: the model's storages."""
    if names.only_live:
        raise CheckpointError(
            f"{model_dir}: holds no tensor for {len(names.only_live)} of the model's "
            f"({_few(names.only_live)}): is it this model's checkpoint? Nothing was loaded")
    if names.only_disk:
        logger.warning("%s: %d tensor(s) no tensor of the model takes, not loaded: %s",
                       model_dir, len(names.only_disk), _few(names.only_disk))
    tied: dict[tuple, str] = {}  # the model's bytes -> the first stored name loaded there
    for name, t in names.tensors.items():
        stored = disk[name]
        if (tuple(t.shape), t.dtype) != (tuple(stored.shape), stored.dtype):
            raise CheckpointError(
                f"{name} in {model_dir}: {_form(stored)}, the model's {_form(t)}: is it this "
                "model's checkpoint? Nothing was loaded")
        first = tied.setdefault((t.data_ptr(), t.shape, t.stride()), name)
        if first != name and not torch.equal(disk[first], stored):  # tied in the model
            raise CheckpointError(
                f"{first} and {name} in {model_dir}: stored with different values, tied in "
                "the model (one tensor): a load would keep only one; is it this model's "
                "checkpoint (saved untied)? Nothing was loaded")
        if t.untyped_storage().data_ptr() not in own:
            raise CheckpointError(
                f"{name} in {model_dir}: transformers' conversion of the model's tensor is "
                "a copy, which a load cannot write back through; nothing was loaded")


def _form(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"

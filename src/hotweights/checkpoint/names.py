"""Live tensor names (a transformers model in memory) onto the names a checkpoint stores.

transformers 5 converts some tensors on load (MoE experts stacked into
`mlp.experts.gate_up_proj` [E, 2I, H], modules renamed) and undoes it on save. We undo it
with the very function `save_pretrained` calls,
`transformers.core_model_loading.revert_weight_conversion`, fed the conversions transformers
registers (`transformers.conversion_mapping`): the ones `from_pretrained` recorded on the
model (`model._weight_conversions`), else `get_checkpoint_conversion_mapping(model_type)`,
else `get_model_conversion_mapping(model, add_legacy=False)` less `PrefixChange`, as
`revert_weight_conversion` itself picks them. So a tensor produced here equals what
`save_pretrained` writes. Names on disk rule: a live name found on disk maps to itself
and no conversion runs (most dense models never reach transformers at all).
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from hotweights.errors import CheckpointError

_GLOB = re.compile(r"[*?[]")  # what makes a name an fnmatch pattern


@dataclass(frozen=True)
class NameMap:
    tensors: dict[str, torch.Tensor]  # disk name -> its bytes (a view of live where possible)
    tied: dict[str, str]              # live alias not on disk -> live name on disk, same storage
    only_live: tuple[str, ...]        # live names with no place on disk, sorted
    only_disk: tuple[str, ...]        # disk names no live tensor fills, sorted

    def unplaced(self, where: object) -> str | None:
        """Why a sync into the checkpoint `where` refuses these live tensors: most have no
        place in it (another model's, or names changed by a wrapper not undone here), and a
        sync of the few that match would report success having left the rest out. None
        when it takes them."""
        placed = len(self.tensors) + len(self.tied)
        if len(self.only_live) <= placed:
            return None
        return (f"{where}: {len(self.only_live)} of {len(self.only_live) + placed} live "
                f"tensors have no place in the checkpoint (e.g. {_few(self.only_live)}; on "
                f"disk, not filled: {_few(self.only_disk) or 'none'}). Is it the same model, "
                "or are its names changed by a wrapper?")

    def check_placed(self, where: object) -> None:
        """Raise `unplaced`'s reason, if any."""
        if reason := self.unplaced(where):
            raise CheckpointError(f"{reason} Nothing was written.")


def _few(names: tuple[str, ...], n: int = 3) -> str:
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def to_disk(
    live: Mapping[str, torch.Tensor],
    disk_names: Collection[str],
    *,
    model_type: str | None = None,
    model: torch.nn.Module | None = None,
) -> NameMap:
    """Map live tensors onto the checkpoint's names, converting as `save_pretrained` does.

    Args:
        live: live name -> tensor, e.g. `model.state_dict()` of a transformers model.
        disk_names: every tensor name in the checkpoint's shards.
        model_type: picks transformers' conversions (`"qwen3_moe"`, ...) when given.
        model: the live model; without `model_type` its conversions are used, as on save.
            Some conversions read it (config fields, parameter shapes).

    Returns:
        A `NameMap`. Tensors keep the live dtype; converted ones are views of the live
        tensors where transformers' ops allow (`reverted(views=True)`), some not contiguous.

    Raises:
        CheckpointError: a conversion fails, gives a name the checkpoint lacks for a live
            tensor that has others on disk, or fills a disk name twice.
    """
    disk = disk_names if isinstance(disk_names, (set, frozenset)) else set(disk_names)
    if isinstance(live, _Unwrapped) and len(disk.intersection(live.wrapped)) > len(
            disk.intersection(live)):
        live = live.wrapped  # names on disk rule: a wrapped model's state dict saved as is
    tensors = {n: t for n, t in live.items() if n in disk}
    rest = {n: t for n, t in live.items() if n not in disk}
    tied: dict[str, str] = {}
    if rest:
        owners = {k: n for n, t in tensors.items() if (k := storage_key(t)) is not None}
        for n, t in list(rest.items()):
            if (owner := owners.get(storage_key(t))) is not None:
                tied[n] = owner
                del rest[n]
    only_live: list[str] = []
    if rest:
        saved = _Saved(model_type, model)
        placed = {}
        for n, t in rest.items():
            try:  # names only: on meta tensors the conversion moves no byte
                names = _revert(saved, {n: t.to("meta")}).keys()
            except CheckpointError:
                names = None  # needs its group (many live tensors to one): placed below
            if names is not None and disk.isdisjoint(names):
                only_live.append(n)
            else:
                placed[n] = t
        for name, t in _revert(saved, placed, views=True).items():
            if name not in disk:
                ptr = t.untyped_storage().data_ptr()  # its live tensor's storage
                source = sorted(n for n, p in placed.items()
                                if p.untyped_storage().data_ptr() == ptr) or sorted(placed)
                raise CheckpointError(
                    f"{name}: converted from live {_few(tuple(source))} by transformers, but "
                    "the checkpoint has no such tensor; is it the same model?")
            if name in tensors:
                raise CheckpointError(f"{name}: filled twice, as itself and by a conversion")
            tensors[name] = t
    return NameMap(tensors, tied, tuple(sorted(only_live)),
                   tuple(sorted(n for n in disk if n not in tensors)))


def reverted(
    live: Mapping[str, torch.Tensor],
    *,
    model_type: str | None = None,
    model: torch.nn.Module | None = None,
    views: bool = False,
) -> dict[str, torch.Tensor]:
    """Live tensors under the names `save_pretrained` writes, converted as it converts them.

    For a checkpoint that does not exist yet (a first save): every tensor goes through the
    conversions `to_disk` would pick, with no disk names to match. Tied aliases should be
    dropped first, as `save_pretrained` drops them before it converts.

    Args:
        live: live name -> tensor.
        model_type: picks transformers' conversions when given (as in `to_disk`).
        model: the live model; without `model_type` its conversions are used.
        views: views of `live` where the conversion's ops allow, not contiguous copies
            (transformers' `Chunk` copies the gate and up halves of fused experts apart;
            split per expert, as the merging conversions of Qwen3-MoE, Mixtral or DeepSeek
            do, the views are contiguous and share the live tensor's bytes and version).

    Returns:
        Checkpoint name -> tensor, in the order `save_pretrained` shards them; with no
        conversion registered, `live` unchanged. Some tensors are copies or views, and
        with `views` some views may not be contiguous.

    Raises:
        CheckpointError: transformers' conversion fails.
    """
    if model_type is None and model is None:
        return dict(live)  # nothing to pick conversions by (and no transformers import)
    return _revert(_Saved(model_type, model), dict(live), views=views)


class _ContiguousAsIs(TorchFunctionMode):
    """`Tensor.contiguous()` returns the tensor as it is: a view stays a view."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous:
            return args[0]
        return func(*args, **(kwargs or {}))


# What wrappers put into the names of the model they wrap: torch.compile (`_orig_mod`),
# FSDP (`_fsdp_wrapped_module`, FSDP2 none), activation checkpointing
# (`_checkpoint_wrapped_module`), anywhere in a name; DDP and DataParallel (`module`),
# in front of every name.
WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
WRAPPER_PREFIX = "module."
WRAPPERS = frozenset({"OptimizedModule", "DistributedDataParallel", "DataParallel",
                      "FullyShardedDataParallel"})  # the classes, by name (no imports)


class _Unwrapped(dict):
    """Tensors under the names inside the wrappers, and `wrapped`: the same under the
    names as they were."""

    def __init__(self, tensors: dict[str, torch.Tensor],
                 wrapped: Mapping[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.wrapped = wrapped


def unwrapped(live: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """`live` under the names of the model inside its wrappers (`module.` of DDP in front
    of every name, `_orig_mod.` of torch.compile, FSDP's and activation checkpointing's
    parts anywhere): the names its checkpoint stores. Unchanged when nothing is wrapped.
    `to_disk` keeps the names as they were where the checkpoint holds more of them (a
    wrapped model's state dict saved as it is)."""
    def strip(name: str) -> str:
        return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)

    names = {n: strip(n) for n in live}
    while names and all(n.startswith(WRAPPER_PREFIX) for n in names.values()):
        names = {k: n.removeprefix(WRAPPER_PREFIX) for k, n in names.items()}
    if all(k == n for k, n in names.items()):
        return live
    if len(set(names.values())) < len(names):
        seen: dict[str, str] = {}
        for k, n in names.items():
            if n in seen:
                raise CheckpointError(f"{seen[n]} and {k}: both name {n} once the wrappers' "
                                      "parts are removed; pass the wrapped model's own "
                                      "state dict")
            seen[n] = k
    return _Unwrapped({names[k]: t for k, t in live.items()}, live)


def matching(live: Mapping[str, torch.Tensor], patterns: Iterable[str],
             what: str = "changed") -> set[str]:
    """The names of `live` (what `unpack` returned) that `patterns` match: each a name
    and, where it holds ``*``, ``?`` or ``[``, also an `fnmatch` pattern, of a wrapped
    model's names or of those inside the wrappers (every reading counts: a name that
    reads two ways selects both), as `RemoteGroup(trainable=)` takes them.

    Raises:
        CheckpointError: a pattern (or name) that matches no live name, named as `what`
            gave it.
    """
    inside = list(live)
    outside = list(live.wrapped) if isinstance(live, _Unwrapped) else inside
    to_inside = dict(zip(outside, inside, strict=True))
    out: set[str] = set()
    for pattern in patterns:
        hits = {n for n in (pattern if pattern in live else None, to_inside.get(pattern))
                if n is not None}  # as a name, inside the wrappers or not ("a[0]" too)
        if _GLOB.search(pattern):  # as a pattern; a name alone is looked up, not matched
            hits.update(to_inside[n] for n in fnmatch.filter(outside, pattern))
            if outside is not inside:
                hits.update(fnmatch.filter(inside, pattern))
        if not hits:
            raise CheckpointError(f"{what} {pattern!r} matches none of the {len(inside)} live "
                                  f"tensor names (e.g. {inside[:3]}); nothing was written")
        out |= hits
    return out


def unpack(live: Mapping[str, torch.Tensor] | torch.nn.Module, config: object = None
           ) -> tuple[Mapping[str, torch.Tensor], torch.nn.Module | None, str | None]:
    """(tensors, model, model_type) of a state dict or a transformers model, wrapped or
    not (DDP, torch.compile, FSDP: the names and model inside); the model type from
    `config` (a config or a dict), else the model's config."""
    model = live if isinstance(live, torch.nn.Module) else None
    tensors = unwrapped(_tensors(live.state_dict() if model is not None else live))
    while type(model).__name__ in WRAPPERS:  # the model it runs: its config, conversions
        model = getattr(model, "_orig_mod", None) or model.module
    config = config if config is not None else getattr(model, "config", None)
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(
        config, "model_type", None)
    return tensors, model, model_type


def _tensors(live: object) -> Mapping[str, torch.Tensor]:
    """`live`, once it is a mapping of names to tensors that hold data.

    Raises:
        CheckpointError: not a mapping, a name not a str or not one a header can hold, a
            value not a tensor, a tensor on the meta device or not dense (named).
    """
    if not isinstance(live, Mapping):
        raise CheckpointError(f"live: pass a mapping of names to tensors (e.g. "
                              f"model.state_dict()) or a torch.nn.Module, not a "
                              f"{type(live).__name__}")
    for name, t in live.items():
        if not isinstance(name, str):
            raise CheckpointError(f"live: the names must be str, found {name!r}")
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"live[{name!r}]: a {type(t).__name__}, not a torch.Tensor")
        if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
            raise CheckpointError(f"{name}: not initialized yet (a lazy module's: run a "
                                  "forward pass first)")
        if t.is_meta:
            raise CheckpointError(f"{name}: on the meta device: it holds no data to save "
                                  "(load or materialize the weights first)")
        if t.layout != torch.strided or t.is_nested:
            raise CheckpointError(f"{name}: a {'nested' if t.is_nested else t.layout} tensor; "
                                  "safetensors holds dense ones (pass t.to_dense())")
        if t.is_conj() or t.is_neg():
            raise CheckpointError(f"{name}: a lazily {'conjugated' if t.is_conj() else 'negated'}"
                                  " view, whose memory holds other values (pass "
                                  "t.resolve_conj().resolve_neg())")
        if not _readable(t):
            raise CheckpointError(f"{name}: a {type(t).__name__} that holds no memory this "
                                  "process can read (a fake, functional or distributed "
                                  "tensor? pass the full tensor)")
        if name == "__metadata__" or _unencodable(name):
            raise CheckpointError(f"live: the name {name!r} cannot name a tensor in a "
                                  "safetensors header (reserved for its metadata, or not "
                                  "UTF-8)")
    return live


def _readable(t: torch.Tensor) -> bool:
    """Whether `t`'s elements lie in a storage this process can read."""
    try:
        return t.untyped_storage().data_ptr() != 0 or t.numel() == 0
    except RuntimeError:  # a functional tensor's: "invalid python storage"
        return False


def _unencodable(name: str) -> bool:
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return True
    return False


def storage_key(t: torch.Tensor) -> tuple | None:
    """What two names of one tied tensor share; None for a tensor with no storage."""
    ptr = t.untyped_storage().data_ptr()
    if ptr == 0:  # meta or empty: no storage to share
        return None
    return ptr, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


class _Saved:
    """What `revert_weight_conversion` reads from a model, with the conversions picked once."""

    def __init__(self, model_type: str | None, model: torch.nn.Module | None) -> None:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            get_model_conversion_mapping,
        )
        from transformers.core_model_loading import PrefixChange

        convs = getattr(model, "_weight_conversions", None)
        if convs is None:  # the model's own, as save_pretrained's (keyed by its class
            if model is not None:  # first: GPT-NeoX's embed_out), else its type's
                convs = get_model_conversion_mapping(model, add_legacy=False)
            elif model_type is not None:
                convs = get_checkpoint_conversion_mapping(model_type) or []
            else:
                convs = []
            convs = [c for c in convs if not isinstance(c, PrefixChange)]
        self._weight_conversions = convs
        self.config = getattr(model, "config", None)
        self._model = model
        self.what = model_type or (type(model).__name__ if model is not None else None)

    def get_parameter(self, name: str) -> torch.nn.Parameter:
        # Transpose(check_dims=True) compares with the live parameter's shape.
        if self._model is None:
            raise CheckpointError(f"{name}: transformers' conversion needs the model (model=)")
        return self._model.get_parameter(name)


def _revert(saved: _Saved, live: dict[str, torch.Tensor], *, views: bool = False
            ) -> dict[str, torch.Tensor]:
    if not saved._weight_conversions or not live:
        return dict(live)  # nothing registered: names pass through unchanged
    from transformers.core_model_loading import revert_weight_conversion

    try:
        with _ContiguousAsIs() if views else contextlib.nullcontext():
            return revert_weight_conversion(saved, live)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(
            f"{sorted(live)[0]}: transformers' reverse conversion for {saved.what} failed "
            f"({type(e).__name__}: {e}); pass model= if it reads the config or shapes") from e

"""An HF model whose parameters are views into vLLM's tensors: zero bytes copied."""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hotweights.errors import LayoutError
from hotweights.layout.plan import Layout, hf_params, load_config, meta_model, plan

logger = logging.getLogger(__name__)

# Which HF parameters: all/none, a regex searched in the name, names, or a predicate.
Selection = bool | str | Iterable[str] | Callable[[str], bool]


@dataclass(frozen=True)
class ViewReport:
    """What `build_hf_model` did."""

    mapped: tuple[str, ...]  # HF parameters that are views into vLLM tensors
    missing: tuple[str, ...]  # HF parameters no vLLM tensor holds (allowed by the caller)
    unused: tuple[str, ...]  # vLLM tensors that hold no HF parameter
    trainable: tuple[str, ...]  # HF parameters with requires_grad (every name of a tied one)
    bytes_copied: int  # bytes of parameter data not shared with vLLM (0 unless missing)


def _selector(selection: Selection) -> Callable[[str], bool]:
    if isinstance(selection, bool):
        return lambda name: selection
    if isinstance(selection, str):
        pattern = re.compile(selection)
        return lambda name: pattern.search(name) is not None
    if callable(selection):
        return selection
    names = set(selection)
    return lambda name: name in names


def _listed(selection: Selection) -> Selection:
    """Names given as an iterator (a generator, `filter`) as a tuple: read more than once."""
    if isinstance(selection, bool | str) or callable(selection) or \
            not isinstance(selection, Iterable):
        return selection
    return tuple(selection)


def _check_selection(trainable: Selection, model: torch.nn.Module) -> None:
    """Refuse a `trainable` that selects nothing it was meant to: a regex that matches no
    HF parameter, names that are no HF parameter (a buffer, a vLLM name): it would train
    nothing, silently."""
    if isinstance(trainable, bool) or callable(trainable):
        return
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    if isinstance(trainable, str):
        if not any(re.search(trainable, n) for n in names):
            raise LayoutError(f"trainable={trainable!r} matches no HF parameter (they are "
                              f"named like {names[0]!r})")
        return
    if not isinstance(trainable, Iterable):
        raise LayoutError(f"trainable={trainable!r}: a bool, a regex, HF parameter names or "
                          "a predicate")
    known, buffers = set(names), {n for n, _ in model.named_buffers()}
    if unknown := [n for n in trainable if n not in known]:
        what = ", ".join(f"{n!r}" + (" (a buffer)" if n in buffers else "") for n in unknown[:5])
        raise LayoutError(f"trainable names no HF parameter: {what}"
                          + (" ..." if len(unknown) > 5 else "")
                          + f" (they are named like {names[0]!r})")


def _owner(model: torch.nn.Module, name: str) -> tuple[torch.nn.Module, str]:
    """The module of `model` that holds the tensor `name`, and its name there."""
    module_name, _, leaf = name.rpartition(".")
    return model.get_submodule(module_name), leaf


def _set_param(model: torch.nn.Module, name: str, param: torch.nn.Parameter) -> None:
    module, leaf = _owner(model, name)
    if leaf in module._buffers:  # a persistent buffer (`hf_params`): the same bytes
        module._buffers[leaf] = param.detach()
    else:
        module._parameters[leaf] = param


def _tensor_of(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The parameter, or persistent buffer, `name` of `model`."""
    module, leaf = _owner(model, name)
    return module._buffers[leaf] if leaf in module._buffers else module.get_parameter(leaf)


def view_of(tensor: torch.Tensor, piece) -> torch.Tensor:
    """The slab of `tensor` that `piece` names, as a view (never a copy)."""
    if not piece.whole:
        raise LayoutError(
            f"{piece.hf_name}: this rank holds only a shard of it (rows {piece.rows} on its "
            f"dim {piece.hf_dim}); views need tp=1"
        )
    out = slab_of(tensor, piece)
    if tuple(out.shape) != piece.hf_shape:
        if out.numel() != math.prod(piece.hf_shape):
            raise LayoutError(f"{piece.hf_name}: rows {piece.rows} of its vLLM tensor "
                              f"{tuple(tensor.shape)} are {tuple(out.shape)}, not the HF "
                              f"shape {piece.hf_shape} (a layout of another model?)")
        out = out.view(piece.hf_shape)
    return out


def slab_of(tensor: torch.Tensor, piece) -> torch.Tensor:
    """The rows of `tensor` that `piece` holds, as a view in the HF order of dims (its last
    two swapped for a `transposed` piece)."""
    if tensor.dim() == 0:
        return tensor
    out = tensor.narrow(piece.dim, piece.rows[0], piece.rows[1] - piece.rows[0])
    return out.transpose(-2, -1) if piece.transposed else out


def build_hf_model(
    config: Any,
    vllm_params: Mapping[str, torch.Tensor],
    *,
    trainable: Selection = True,
    allow_missing: Selection = False,
    allow_unused: bool = True,
    layout: Layout | None = None,
    model: torch.nn.Module | None = None,
    trust_remote_code: bool = False,
) -> tuple[torch.nn.Module, ViewReport]:
    """Build the HF causal-LM of `config` with parameters that are views into `vllm_params`.

    The model is created on `meta` (no parameter memory), then every parameter is replaced
    by a view of the vLLM tensor slab that holds it, so the model trains vLLM's weights
    in place; so is every buffer a checkpoint holds (DeepSeek-V3's router bias). The
    buffers the model computes (rotary tables) are real and follow the device of the vLLM
    tensors.

    Args:
        config: a transformers config or a model directory.
        vllm_params: vLLM parameter name -> live tensor (tp=1).
        trainable: which HF parameters get `requires_grad`: a bool, a regex searched in
            the HF name, a collection of names, or a predicate. A tied parameter is
            trainable if the selection names any of its names (`lm_head.weight` trains
            the tied `model.embed_tokens.weight`).
        allow_missing: HF parameters that may have no vLLM source (True for any); they
            are materialised as zeros and reported. Otherwise a missing one is an error.
        allow_unused: tolerate vLLM tensors that hold no HF parameter (reported).
        layout: a precomputed `plan(config, vllm_params)`.
        model: the HF model to fill, if the caller built it (`layout.meta_model`); its
            parameters are replaced by views.
        trust_remote_code: let the model directory's own code (`auto_map`) run here.

    Returns:
        (model, report).

    Raises:
        LayoutError: a missing HF parameter not allowed, or shapes that disagree.
    """
    trainable, allow_missing = _listed(trainable), _listed(allow_missing)
    if not vllm_params:
        raise LayoutError("vllm_params is empty: no vLLM tensor to view")
    config = load_config(config, trust_remote_code=trust_remote_code)
    dtypes = [t.dtype for t in vllm_params.values() if t.is_floating_point()]
    dtype = max(sorted(set(dtypes), key=str), key=dtypes.count) if dtypes else None  # (a
    # tie is broken the same way every run)
    if model is None:
        model = meta_model(config, dtype=dtype, trust_remote_code=trust_remote_code)
    planned = plan(config, vllm_params, strict=False, hf_shapes=hf_params(model),
                   tp_size=layout.tp_size if layout else 1,
                   tp_rank=layout.tp_rank if layout else 0)
    if layout is not None and (differs := _differs(layout, planned)):
        raise LayoutError(f"layout= is not the plan of these vLLM tensors for this model "
                          f"(plan(config, vllm_params)): {differs}; of another model or "
                          "other tensors?")
    layout = planned
    if layout.unused and not allow_unused:
        raise LayoutError(f"vLLM parameters hold no HF parameter: {', '.join(layout.unused)}")
    allowed = _selector(allow_missing)  # the same forms: bool, regex, names
    refused = [n for n in layout.missing if not allowed(n)]
    if refused:
        raise LayoutError(
            f"HF parameter(s) held by no vLLM tensor: {', '.join(refused[:8])}"
            + (" ..." if len(refused) > 8 else "")
            + "; pass allow_missing to accept them as zeros"
        )

    device = next(iter(vllm_params.values())).device
    _check_selection(trainable, model)
    wants_grad = _selector(trainable)

    made: dict[str, torch.nn.Parameter] = {}
    for vname, pieces in layout.pieces.items():
        tensor = vllm_params[vname]
        for piece in pieces:
            canonical = layout.ties.get(piece.hf_name, piece.hf_name)
            if canonical not in made:
                view = view_of(tensor.detach(), piece)
                made[canonical] = torch.nn.Parameter(view, requires_grad=False)
            _set_param(model, piece.hf_name, made[canonical])

    bytes_copied = 0
    for name in layout.missing:
        canonical = layout.ties.get(name, name)
        if canonical not in made:
            meta = _tensor_of(model, name)
            made[canonical] = torch.nn.Parameter(
                torch.zeros(meta.shape, dtype=meta.dtype, device=device), requires_grad=False
            )
            bytes_copied += made[canonical].numel() * made[canonical].element_size()
            logger.warning("HF parameter %s has no vLLM source: zeros", name)
        _set_param(model, name, made[canonical])

    # A tied parameter has several names (lm_head.weight is model.embed_tokens.weight) and
    # named_parameters() yields only the first: the selection may name any of them.
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    for param in model.parameters():
        param.requires_grad_(any(wants_grad(n) for n in names[id(param)]))
    for module in model.modules():
        for bname, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[bname] = buf.to(device)

    report = ViewReport(
        mapped=tuple(n for n, _ in model.named_parameters(remove_duplicate=False)
                     if n not in layout.missing),
        missing=layout.missing,
        unused=layout.unused,
        trainable=tuple(n for n, p in model.named_parameters(remove_duplicate=False)
                        if p.requires_grad),
        bytes_copied=bytes_copied,
    )
    logger.info("built HF model on views: %d parameters mapped, %d missing, %d unused",
                len(report.mapped), len(report.missing), len(report.unused))
    return model, report


def _differs(given: Layout, planned: Layout) -> str | None:
    """What of `given` is not `planned` (the order of names aside), or None."""
    if vname := next((v for v in [*planned.pieces, *given.pieces]
                      if given.pieces.get(v) != planned.pieces.get(v)), None):
        return f"the pieces of vLLM {vname} differ"
    for field in ("missing", "unused"):
        if set(getattr(given, field)) != set(getattr(planned, field)):
            return f"its {field} names differ"
    if (given.ties, given.tp_size, given.tp_rank) != (planned.ties, planned.tp_size,
                                                      planned.tp_rank):
        return "its ties or tensor-parallel rank differ"
    return None


def verify_shared(model: torch.nn.Module, vllm_params: Mapping[str, torch.Tensor],
                  layout: Layout) -> int:
    """Check that every mapped HF parameter shares memory with its vLLM tensor.

    Returns the number of parameters checked. Raises LayoutError naming the first one
    that does not lie inside its vLLM tensor's memory at the planned offset.
    """
    checked = 0
    for vname, pieces in layout.pieces.items():
        if (tensor := vllm_params.get(vname)) is None:
            raise LayoutError(f"vLLM {vname}: in the layout, not among the vLLM tensors")
        for piece in pieces:
            param = _tensor_of(model, piece.hf_name)
            want = view_of(tensor.detach(), piece)
            if (param.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
                    or param.data_ptr() != want.data_ptr() or param.stride() != want.stride()
                    or param.shape != want.shape or param.dtype != want.dtype):
                raise LayoutError(
                    f"{piece.hf_name}: not a view of vLLM {vname} rows {piece.rows} "
                    f"(data_ptr {param.data_ptr():#x}, {tuple(param.shape)} {param.dtype}; "
                    f"expected {want.data_ptr():#x}, {tuple(want.shape)} {want.dtype})"
                )
            checked += 1
    return checked


def outside_served(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor],
                   missing: Collection[str] = ()) -> list[str]:
    """The trainable parameters of `model` that are not views of `tensors` (vLLM's
    weights): a copy has a storage of its own (a `.float()`, `.to(...)` of the model).
    `missing`: names built as copies by design (`allow_missing`'s zeros), left out."""
    served = {(t.device, t.untyped_storage().data_ptr()) for t in tensors.values()}
    return [name for name, param in model.named_parameters() if param.requires_grad
            and (param.device, param.untyped_storage().data_ptr()) not in served
            and name not in missing]

"""Map vLLM's merged parameters to Hugging Face parameters: names and shapes in, plan out.

Nothing here imports vLLM or touches tensor data. The split points come from the HF
model's own parameter shapes (the model is built on the `meta` device from its config),
so no model dimension is written down anywhere in this file; only naming rules are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from hotweights.errors import LayoutError

logger = logging.getLogger(__name__)

Shape = tuple[int, ...]

# vLLM name prefix -> HF name prefix (multimodal checkpoints keep the text model elsewhere).
_PREFIXES = (
    ("language_model.model.", "model.language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("visual.", "model.visual."),
)
# vLLM leaf -> HF leaf. FusedMoE keeps gate and up in one tensor, like transformers >= 5.
_RENAMES = tuple(
    (f".experts.{routed}{v_leaf}", f".experts.{hf_leaf}")
    for routed in ("routed_experts.", "")
    for v_leaf, hf_leaf in (("w13_weight", "gate_up_proj"), ("w2_weight", "down_proj"),
                            ("w13_bias", "gate_up_proj_bias"), ("w2_bias", "down_proj_bias"))
)
# vLLM part -> HF part, tried when a name is found neither as it is nor under transformers'
# renames: models whose vLLM module names differ from the checkpoint's (GPT-OSS, GraniteMoE)
_VLLM_RENAMES = ((".attn.", ".self_attn."), ("model.embedding.", "model.embed_tokens."),
                 (".block_sparse_moe.gate.", ".block_sparse_moe.router."))
# Model types whose transformers experts are [E, in, out] (`x @ w`), vLLM's [E, out, in]:
# the HF tensor is vLLM's with its last two dims swapped. GPT-OSS keeps gate and up
# interleaved, as vLLM's swigluoai reads them, so only the order of the dims differs.
_TRANSPOSED_EXPERTS = {"gpt_oss"}
# model types no map can serve, and why
_REFUSED = dict.fromkeys(("llama4", "llama4_text"), (
    "Llama 4 is not supported: transformers keeps its experts transposed (gate and up "
    "apart), and vLLM reorders its q/k rows for its rotary at load, which no view of "
    "vLLM's qkv_proj can present in transformers' order"))
_REGROUPED = ("vLLM regroups its fused query_key_value from per-head [q, k, v] blocks into "
              "[all q; all k; all v] at load, keeping its name and shape: no view of it can "
              "present transformers' order")
_REFUSED |= {"bloom": f"Bloom is not supported: {_REGROUPED}",
             "falcon": f"Falcon is not supported (but for its multi-query form): {_REGROUPED}"}


def _refused(config: Any) -> str | None:
    """Why no map can serve a model of `config`, or None."""
    for c in (config, getattr(config, "text_config", None)):
        if (quant := getattr(c, "quantization_config", None)) is not None:
            method = quant.get("quant_method") if isinstance(quant, dict) else getattr(
                quant, "quant_method", None)
            return (f"{type(c).__name__}: quantized (field quantization_config, quant_method "
                    f"{method!r}): its weights are packed or scaled for its kernels, and "
                    "hotweights trains unquantized weights only; serve an unquantized "
                    "checkpoint")
    kind = getattr(config, "model_type", None)
    if kind == "falcon" and getattr(config, "multi_query", False) and not getattr(
            config, "new_decoder_architecture", False):  # one k and v head: [q; k; v] as is
        return None
    return _REFUSED.get(kind)


# A vLLM module that packs several HF modules, concatenated on dim 0 in this order.
PACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvz": ("in_proj_qkv", "in_proj_z"),
    "in_proj_ba": ("in_proj_b", "in_proj_a"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),  # MLA with a q_lora_rank
}
# How tensor parallelism cuts a parameter, by the name of its module.
_COLUMN = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj_qkvz", "in_proj_ba",
           "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "q_b_proj", "kv_b_proj"}
_ROW = {"o_proj", "down_proj", "out_proj"}
_REPLICATED = {"q_a_proj", "kv_a_proj_with_mqa"}  # whole on every rank (packed or not)
_VOCAB = {"embed_tokens", "lm_head"}
_KV = {"k_proj", "v_proj"}
_ATTENTION = {"q_proj", *_KV}  # split by heads


@dataclass(frozen=True)
class Piece:
    """A slab of a vLLM parameter that holds (a slab of) one HF parameter.

    On `dim` of the vLLM parameter, indices `[rows[0], rows[1])` hold the HF indices
    `[hf_start, hf_start + rows[1] - rows[0])` of `hf_name` on the same dim (`hf_dim`, for a
    `transposed` piece: the HF tensor is the slab with its last two dims swapped); every
    other dim is whole. At tp=1 a piece always covers its whole HF tensor.
    """

    hf_name: str  # "model.layers.3.self_attn.k_proj.weight"
    hf_shape: Shape  # full shape of the HF parameter
    rows: tuple[int, int]  # [start, stop) on `dim` of the vLLM parameter
    dim: int = 0
    hf_start: int = 0
    transposed: bool = False  # the HF tensor is the slab with its last two dims swapped

    @property
    def hf_dim(self) -> int:
        """The HF tensor's dim that `dim` of the vLLM parameter is."""
        if self.transposed and self.dim >= len(self.hf_shape) - 2:
            return 2 * len(self.hf_shape) - 3 - self.dim
        return self.dim

    @property
    def whole(self) -> bool:
        """True when the piece is the entire HF tensor (a view can stand in for it)."""
        if not self.hf_shape:  # a scalar (0-d) parameter: rows (0, 1)
            return True
        return self.hf_start == 0 and self.rows[1] - self.rows[0] == self.hf_shape[self.hf_dim]


@dataclass(frozen=True)
class Layout:
    """For every vLLM parameter, the HF parameters it holds; plus what matched nothing."""

    pieces: dict[str, tuple[Piece, ...]]  # vLLM name -> pieces
    missing: tuple[str, ...] = ()  # HF parameters that no vLLM parameter holds
    unused: tuple[str, ...] = ()  # vLLM parameters that hold no HF parameter
    tp_size: int = 1
    tp_rank: int = 0
    ties: dict[str, str] = field(default_factory=dict)  # HF alias -> HF name it is tied to

    def inverse(self) -> dict[str, list[tuple[str, Piece]]]:
        """HF name -> [(vLLM name, piece)], the slabs that hold it on this rank."""
        out: dict[str, list[tuple[str, Piece]]] = {}
        for vname, pieces in self.pieces.items():
            for piece in pieces:
                out.setdefault(piece.hf_name, []).append((vname, piece))
        return out

    @property
    def num_mapped(self) -> int:
        return sum(len(p) for p in self.pieces.values())


def load_config(config_or_dir: Any, *, trust_remote_code: bool = False):
    """A transformers config from a config object, a model directory or a config.json.

    `trust_remote_code` lets a model directory's own code (its `auto_map`) run here.
    """
    if not isinstance(config_or_dir, str | os.PathLike):
        return config_or_dir
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(os.fspath(config_or_dir),
                                          trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers' field checks raise their own kinds
        raise LayoutError(f"{config_or_dir}: cannot read a transformers config "
                          f"({type(e).__name__}: {e})") from e


_building = threading.local()  # `depth`: the `_params_on_meta` this thread is inside
_builds = 0  # threads' `_params_on_meta` open now, all told
_builds_lock = threading.Lock()
_register_parameter = torch.nn.Module.register_parameter  # as it was before the first build


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Create this thread's parameters on `meta` while buffers (rotary tables) stay real.
    `Module.register_parameter` is wrapped while any thread builds, and the wrapper acts
    only in the threads that build: a module made meanwhile in another thread (a reward
    model) keeps its parameters."""
    global _builds, _register_parameter
    with _builds_lock:
        if _builds == 0:
            _register_parameter = torch.nn.Module.register_parameter
            torch.nn.Module.register_parameter = _register_on_meta
        _builds += 1
    depth = getattr(_building, "depth", 0)
    _building.depth = depth + 1
    try:
        yield
    finally:
        _building.depth = depth
        with _builds_lock:
            _builds -= 1
            if _builds == 0:
                torch.nn.Module.register_parameter = _register_parameter


def _register_on_meta(module: torch.nn.Module, name: str, param) -> None:
    _register_parameter(module, name, param)
    if getattr(_building, "depth", 0) and param is not None and param.device.type != "meta":
        module._parameters[name] = type(param)(param.to("meta"),
                                               requires_grad=param.requires_grad)


class _FillersOnMeta(TorchFunctionMode):
    """`torch.empty`/`zeros`/`ones`/`full` without a device make `meta` tensors: the
    parameters of nn.Linear, nn.Embedding and fused experts are made so, and are never
    allocated, not even as untouched memory (a DeepSeek-V3 `gate_up_proj` would ask for
    30 GB). The buffers a model computes (rotary tables) come from `arange` and stay real."""

    _FILLERS = frozenset((torch.empty, torch.zeros, torch.ones, torch.full))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._FILLERS and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def meta_model(config: Any, *, dtype: torch.dtype | None = None,
               trust_remote_code: bool = False) -> torch.nn.Module:
    """The HF model of `config` with every parameter on `meta` (no memory).

    A causal LM; for a multimodal config (text + vision), the image-text-to-text model
    that a checkpoint of it loads into (`model.language_model.*`, `model.visual.*`).
    """
    import transformers

    config = load_config(config, trust_remote_code=trust_remote_code)
    auto = transformers.AutoModelForCausalLM
    if hasattr(config, "vision_config") and hasattr(config, "text_config"):
        auto = transformers.AutoModelForImageTextToText

    def build() -> torch.nn.Module:
        with _params_on_meta():
            return auto.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)

    try:  # the model's own code may compute a buffer from a filler, or read one's value
        with _FillersOnMeta():
            model = build()
        if not any(t.is_meta for t in _computed_tensors(model)):
            return model
    except Exception as e:  # noqa: BLE001 - built the plain way below, which says why
        logger.debug("%s: building on meta failed (%s); building parameter by parameter",
                     type(config).__name__, e)
    try:
        return build()
    except Exception as e:  # a field out of range: heads 0, a negative size, ...
        where = getattr(config, "_name_or_path", "") or type(config).__name__
        raise LayoutError(f"{where}: transformers cannot build the model of this config "
                          f"({type(e).__name__}: {e}); check its fields") from e


def hf_params(config: Any, *, trust_remote_code: bool = False
              ) -> tuple[dict[str, Shape], dict[str, str]]:
    """HF parameter shapes by name, and the tied aliases (alias -> name it shares). Persistent
    buffers count as parameters: the checkpoint holds them, vLLM keeps them as parameters
    (DeepSeek-V3's router `e_score_correction_bias`), and the HF model computes with them."""
    model = config if isinstance(config, torch.nn.Module) else meta_model(
        config, trust_remote_code=trust_remote_code)
    shapes: dict[str, Shape] = {}
    ties: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            ties[name] = first[id(param)]
        else:
            first[id(param)] = name
            shapes[name] = tuple(param.shape)
    shapes.update((name, tuple(buf.shape)) for name, buf in persistent_buffers(model).items())
    return shapes, ties


def model_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint of `model` holds, by live name: its parameters (a tied one once)
    and its persistent buffers."""
    return dict(model.named_parameters()) | persistent_buffers(model)


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers of `model` its checkpoint holds (DeepSeek-V3's router bias), by name;
    not the ones it computes (rotary tables)."""
    return {f"{prefix}.{leaf}" if prefix else leaf: buf
            for prefix, module in model.named_modules()
            for leaf, buf in module._buffers.items()
            if buf is not None and leaf not in module._non_persistent_buffers_set}


def _computed_tensors(model: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The tensors of `model` its checkpoint does not hold: buffers it computes (rotary
    tables), and tensors kept as plain attributes (a remote code's `self.scale`)."""
    for module in model.modules():
        yield from (buf for leaf, buf in module._buffers.items()
                    if buf is not None and leaf in module._non_persistent_buffers_set)
        yield from (t for t in vars(module).values() if isinstance(t, torch.Tensor))


def renamings(config: Any, *, trust_remote_code: bool = False) -> list:
    """transformers' renames of checkpoint names for `config`'s model type (Mixtral's
    `.block_sparse_moe.` -> `.mlp.`), the pure renames only: vLLM mostly keeps the names on
    disk (`plan` tries a name as it is first), and its fused experts are matched by
    `_RENAMES`. None for a model of its own code (`auto_map`), as transformers has it."""
    if trust_remote_code and getattr(config, "auto_map", None):
        return []
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # a transformers without conversions: names as on disk
        return []
    found = get_checkpoint_conversion_mapping(getattr(config, "model_type", None)) or []
    return [t for t in found if type(t) is WeightRenaming]


def hf_name_candidates(vname: str, renames: Sequence = (), *, vllm_renames: bool = False
                       ) -> tuple[str, list[str] | None]:
    """The HF name a vLLM name stands for, and the HF parts if its module is packed
    (`renames`: `renamings(config)`; `vllm_renames`: vLLM's own module names undone)."""
    name = vname
    for v_prefix, hf_prefix in _PREFIXES:
        if name.startswith(v_prefix):
            name = hf_prefix + name[len(v_prefix) :]
            break
    for rename in renames:
        name = rename.rename_source_key(name)[0]
    if vllm_renames:
        for v_part, hf_part in _VLLM_RENAMES:
            name = name.replace(v_part, hf_part)
    for v_leaf, hf_leaf in _RENAMES:
        if name.endswith(v_leaf):
            name = name[: -len(v_leaf)] + hf_leaf
            break
    module, _, leaf = name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in PACKED:
        return name, [f"{parent}.{part}.{leaf}" for part in PACKED[last]]
    return name, None


def text_config(config: Any) -> Any:
    """The config of the text model: a multimodal config's text config, else `config`."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _module_of(hf_name: str) -> tuple[str, str]:
    """("k_proj", "weight") for "model.layers.0.self_attn.k_proj.weight"."""
    module, _, leaf = hf_name.rpartition(".")
    return module.rpartition(".")[2], leaf


def plan(
    config: Any,
    params: Mapping[str, Any],
    *,
    tp_size: int = 1,
    tp_rank: int = 0,
    strict: bool = True,
    hf_shapes: tuple[dict[str, Shape], dict[str, str]] | None = None,
    trust_remote_code: bool = False,
) -> Layout:
    """Map every (rank-local) vLLM parameter to the HF parameters it holds.

    Args:
        config: a transformers config, or a model directory.
        params: vLLM parameter name -> tensor or shape, as the rank holds them.
        tp_size, tp_rank: the tensor-parallel group the parameters come from.
        strict: raise on a vLLM parameter with no HF home or an HF parameter with no
            vLLM source; otherwise list them in `Layout.unused` / `Layout.missing`.
        hf_shapes: `hf_params(config)`, when the caller already has it.
        trust_remote_code: let the model directory's own code (`auto_map`) run.

    Returns:
        The `Layout`.

    Raises:
        LayoutError: shapes that disagree (naming both parameters and shapes), or, when
            `strict`, anything left unmapped.
    """
    if not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank={tp_rank} is outside tp_size={tp_size}")
    config = load_config(config, trust_remote_code=trust_remote_code)
    if why := _refused(config):
        raise LayoutError(why)
    shapes, ties = hf_shapes if hf_shapes is not None else hf_params(
        config, trust_remote_code=trust_remote_code)
    aliases: dict[str, list[str]] = {}
    for alias, target in ties.items():
        aliases.setdefault(target, []).append(alias)

    renames = renamings(config, trust_remote_code=trust_remote_code)
    pieces: dict[str, tuple[Piece, ...]] = {}
    owner: dict[str, str] = {}  # HF name -> the vLLM parameter that holds it
    unused: list[str] = []
    for vname, value in params.items():
        live = tuple(value.shape) if hasattr(value, "shape") else tuple(value)
        for kwargs in ({}, {"renames": renames}, {"renames": renames, "vllm_renames": True}):
            name, parts = hf_name_candidates(vname, **kwargs)
            if name in shapes or (parts and all(p in shapes for p in parts)):
                break
        if name in ties:  # vLLM keeps apart what the config ties: training one would
            raise LayoutError(  # leave the other, which vLLM computes with, behind
                f"{vname}: vLLM holds it as a tensor of its own, but the config ties "
                f"{name} to {ties[name]}; build the model from the config the server loaded "
                "(tie_word_embeddings)")
        if name in shapes:
            parts = [name]
        elif parts is None or not all(p in shapes for p in parts):
            unused.append(vname)
            continue
        if held := [p for p in parts if p in owner]:  # (one may hold several of its slabs)
            raise LayoutError(f"{vname}: HF {held[0]} is held by vLLM {owner[held[0]]} "
                              "already: one HF parameter cannot be two vLLM tensors")
        owner.update(dict.fromkeys([*parts, *(a for p in parts for a in aliases.get(p, ()))],
                                   vname))
        found = _pieces(vname, live, [(p, shapes[p]) for p in parts], config, tp_size, tp_rank)
        found += [
            dataclasses.replace(p, hf_name=alias)
            for p in found
            for alias in aliases.get(p.hf_name, ())
        ]
        pieces[vname] = tuple(found)

    missing = [n for n in [*shapes, *ties] if n not in owner]  # (some ranks may hold no
    # rows of an HF parameter that has a vLLM home: it is not missing)
    if strict and (unused or missing):
        raise LayoutError(_unmapped_message(unused, missing))
    for vname in unused:
        logger.warning("vLLM parameter %s holds no HF parameter", vname)
    return Layout(pieces, tuple(missing), tuple(unused), tp_size, tp_rank, dict(ties))


# vLLM parameters computed from others at load: views of them are left out of the map
# (`vllm_plugin.aliases`); a copy cannot be reached by training in place
_DERIVED = {
    "W_UV": "vLLM's multi-head latent attention (DeepSeek-V2/V3, Kimi) derived W_UV and "
            "W_UK_T from kv_b_proj at load as a copy, not as views of it (a quantized "
            "kv_b_proj, or one cast to another dtype), which training kv_b_proj in place "
            "would leave behind; serve it unquantized, in its own dtype",
}


def _unmapped_message(unused: list[str], missing: list[str]) -> str:
    lines = [why for leaf, why in _DERIVED.items()
             if any(n.rpartition(".")[2] == leaf for n in unused)]
    if unused:
        lines.append(
            f"{len(unused)} vLLM parameter(s) match no HF parameter (unknown name or packing,"
            f" or a layer the config does not have): {', '.join(unused[:8])}"
            + (" ..." if len(unused) > 8 else "")
        )
    if missing:
        lines.append(
            f"{len(missing)} HF parameter(s) are held by no vLLM parameter (a layer vLLM "
            f"does not have?): {', '.join(missing[:8])}" + (" ..." if len(missing) > 8 else "")
        )
    return "; ".join(lines)


def _pieces(
    vname: str,
    live: Shape,
    parts: list[tuple[str, Shape]],
    config: Any,
    tp: int,
    rank: int,
) -> list[Piece]:
    """The pieces of one vLLM parameter of shape `live` holding `parts` on this rank."""
    hf_name, hf_shape = parts[0]
    if len(live) != len(hf_shape):
        raise LayoutError(
            f"{vname}: vLLM shape {live} and HF {hf_name} shape {hf_shape} differ in rank"
        )
    module, leaf = _module_of(hf_name)
    if tp > 1 and ".linear_attn." in hf_name:
        # vLLM shards each of q, k, v, z (and the conv channels) by key-head group.
        raise LayoutError(
            f"{vname}: tensor parallelism over gated-delta-net (linear attention) layers "
            f"is not mapped yet (HF {hf_name}); use tp=1"
        )
    if module in _VOCAB:
        return _vocab_pieces(vname, live, parts[0], tp, rank)
    if module == "experts" and getattr(config, "model_type", None) in _TRANSPOSED_EXPERTS:
        return _transposed_pieces(vname, live, parts[0], tp, rank)
    if module == "experts" and leaf == "gate_up_proj":  # [E, 2I, H]: gate then up on dim 1
        halves = [(hf_name, hf_shape, 0, hf_shape[1], "gate_up")]
        if tp > 1:  # each rank holds its chunk of gate, then its chunk of up
            half = hf_shape[1] // 2
            halves = [(hf_name, hf_shape, 0, half, "gate"), (hf_name, hf_shape, half, half, "up")]
        return _column_pieces(vname, live, halves, config, tp, rank, dim=1)
    if module == "experts" and leaf == "down_proj":  # [E, H, I]
        return _row_pieces(vname, live, parts[0], tp, rank, dim=2)
    if module in PACKED and len(parts) == 1 and tp > 1:  # the checkpoint holds it packed
        return _column_pieces(vname, live, _packed_parts(vname, parts[0], config), config,
                              tp, rank, dim=0)
    if module in _COLUMN or module in _REPLICATED or leaf == "sinks":  # GPT-OSS's: by head
        subparts = [(n, s, 0, s[0], _module_of(n)[0]) for n, s in parts]
        if module in _REPLICATED:
            tp, rank = 1, 0
        return _column_pieces(vname, live, subparts, config, tp, rank, dim=0)
    if module in _ROW and leaf == "weight":
        return _row_pieces(vname, live, parts[0], tp, rank, dim=1)
    if len(parts) == 1 and _padded_vocabulary(live, hf_shape, config, tp):
        return _vocab_pieces(vname, live, parts[0], tp, rank)
    if len(parts) > 1 or live != hf_shape:
        raise LayoutError(
            f"{vname}: vLLM shape {live} does not match HF {hf_name} shape {hf_shape}"
        )
    return [Piece(hf_name, hf_shape, (0, hf_shape[0] if hf_shape else 1))]


def _packed_parts(vname: str, part: tuple[str, Shape], config: Any) -> list[tuple]:
    """The subparts of an HF tensor that already holds vLLM's packing (Phi-3's `qkv_proj`
    and `gate_up_proj`, GLM-4's `gate_up_proj`): vLLM's loader cuts it into its parts by
    their sizes and shards each as it would apart."""
    hf_name, hf_shape = part
    module, rows = _module_of(hf_name)[0], hf_shape[0]
    if module == "qkv_proj":
        text = text_config(config)
        heads = getattr(text, "num_attention_heads", None)
        kv = getattr(text, "num_key_value_heads", None) or heads
        head_dim, rest = divmod(rows, heads + 2 * kv) if heads else (0, 1)
        if rest or not head_dim:
            raise LayoutError(
                f"{vname}: HF {hf_name} shape {hf_shape} does not hold num_attention_heads="
                f"{heads} + 2 x num_key_value_heads={kv} heads of one size")
        sizes = [heads * head_dim, kv * head_dim, kv * head_dim]
    elif module == "gate_up_proj" and rows % 2 == 0:
        sizes = [rows // 2] * 2
    else:
        raise LayoutError(f"{vname}: HF {hf_name} shape {hf_shape} packs "
                          f"{' + '.join(PACKED[module])}; its cut is not mapped at tp > 1")
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(hf_name, hf_shape, start, n, label)
            for start, n, label in zip(starts, sizes, PACKED[module], strict=True)]


# GPT-OSS's expert tensors: the HF dim vLLM cuts among the ranks (the down bias: none, it is
# whole on the first rank and zero on the others, so that the reduce adds it once)
_TRANSPOSED_SPLIT = {"gate_up_proj": 2, "down_proj": 1, "gate_up_proj_bias": 1}


def _transposed_pieces(vname: str, live: Shape, part: tuple[str, Shape], tp: int, rank: int
                       ) -> list[Piece]:
    """An expert tensor of a `_TRANSPOSED_EXPERTS` model: the HF weight [E, in, out] is
    vLLM's [E, out, in] with its last two dims swapped (vLLM's dim 1 is HF's 2, and back);
    a bias is held as it is. Each rank holds its equal run of gate/up columns (interleaved:
    the run holds both) and of down rows."""
    hf_name, hf_shape = part
    leaf = hf_name.rpartition(".")[2]
    transposed = len(hf_shape) == 3
    want = [hf_shape[0], hf_shape[2], hf_shape[1]] if transposed else list(hf_shape)
    split = _TRANSPOSED_SPLIT.get(leaf) if tp > 1 else None
    dim = 3 - split if transposed and split else split
    if split is not None:
        want[dim] = _split(vname, hf_name, hf_shape, split, tp)
    if live != tuple(want):
        raise LayoutError(f"{vname}: vLLM shape {live} does not hold HF {hf_name} shape "
                          f"{hf_shape}" + (" transposed" if transposed else "")
                          + (f" split over tp={tp} on dim {split}" if split else ""))
    if split is not None:
        return [Piece(hf_name, hf_shape, (0, live[dim]), dim, rank * live[dim], transposed)]
    if tp > 1 and leaf == "down_proj_bias" and rank:
        return []  # zero here: what the checkpoint holds is on the first rank
    return [Piece(hf_name, hf_shape, (0, live[0]), transposed=transposed)]


def _check_other_dims(vname: str, live: Shape, hf_name: str, hf_shape: Shape, dim: int):
    for d, (a, b) in enumerate(zip(live, hf_shape, strict=True)):
        if d != dim and a != b:
            transposed = len(live) == 3 and live == (hf_shape[0], hf_shape[2], hf_shape[1])
            raise LayoutError(
                f"{vname}: vLLM shape {live} does not hold HF {hf_name} shape {hf_shape} "
                f"(dim {d}: {a} != {b})" + (
                    "; it holds it transposed: transformers keeps this model type's experts "
                    f"[E, in, out], and only {', '.join(sorted(_TRANSPOSED_EXPERTS))}'s are "
                    "mapped so" if transposed else "")
            )


_VOCAB_PADDING = 64  # vLLM pads the vocabulary rows to a multiple of this (its
# DEFAULT_VOCAB_PADDING_SIZE), then splits them evenly among the ranks


def _padded_vocabulary(live: Shape, hf_shape: Shape, config: Any, tp: int) -> bool:
    """Whether `live` holds an HF tensor of `vocab_size` rows as vLLM pads a vocabulary,
    under a name other than `_VOCAB`'s (Falcon's `word_embeddings`; vLLM's Transformers
    backend pads every embedding of `vocab_size` rows)."""
    vocab = getattr(text_config(config), "vocab_size", None)
    return bool(hf_shape) and hf_shape[0] == vocab and live[1:] == hf_shape[1:] and \
        0 <= live[0] * tp - vocab < _VOCAB_PADDING


def _vocab_pieces(vname, live, part, tp, rank) -> list[Piece]:
    # vLLM pads the vocabulary (to a multiple of 64) and gives each rank an equal run of
    # padded rows; the HF tensor is the first `vocab_size` of them.
    hf_name, hf_shape = part
    _check_other_dims(vname, live, hf_name, hf_shape, 0)
    per_rank = live[0]
    if per_rank * tp < hf_shape[0]:
        raise LayoutError(
            f"{vname}: vLLM shape {live} x tp={tp} has fewer rows than HF {hf_name} "
            f"shape {hf_shape} (vocab_size)"
        )
    if per_rank * tp - hf_shape[0] >= _VOCAB_PADDING:  # more than vLLM's padding: the
        raise LayoutError(  # server loaded a larger vocabulary than this config says
            f"{vname}: vLLM holds {per_rank * tp} rows (x tp={tp}), more than HF {hf_name}'s "
            f"{hf_shape[0]} (vocab_size) padded to a multiple of {_VOCAB_PADDING}: build the "
            "model from the config the server loaded")
    lo = rank * per_rank
    hi = min(lo + per_rank, hf_shape[0])
    return [Piece(hf_name, hf_shape, (0, hi - lo), 0, lo)] if hi > lo else []


def _row_pieces(vname, live, part, tp, rank, *, dim) -> list[Piece]:
    hf_name, hf_shape = part
    _check_other_dims(vname, live, hf_name, hf_shape, dim)
    size = _split(vname, hf_name, hf_shape, dim, tp)
    if live[dim] != size:
        raise LayoutError(
            f"{vname}: vLLM shape {live} does not match HF {hf_name} shape {hf_shape} "
            f"split over tp={tp} on dim {dim} (expected {size})"
        )
    return [Piece(hf_name, hf_shape, (0, size), dim, rank * size)]


_VISION = ("visual.", "vision_tower.", "vision_model.")  # an image encoder's module names


def _column_pieces(vname, live, subparts, config, tp, rank, *, dim) -> list[Piece]:
    # `subparts`: (hf_name, hf_shape, base, n, label): rows [base, base + n) of an HF
    # tensor on `dim`, stacked in this order in the unsharded vLLM parameter. Rank r holds
    # its 1/tp chunk of each, stacked in the same order.
    pieces, at, want = [], 0, []
    # a multimodal config keeps its heads in its text config; a vision tower has as many
    # KV heads as heads (split as any rows)
    config = text_config(config)
    kv_heads = None if any(v in vname for v in _VISION) else \
        getattr(config, "num_key_value_heads", None)
    for hf_name, hf_shape, base, n, label in subparts:
        _check_other_dims(vname, live, hf_name, hf_shape, dim)
        if label in _KV and kv_heads and tp > kv_heads:
            # Fewer KV heads than ranks: each rank holds one whole head, replicated.
            if tp % kv_heads:
                raise LayoutError(
                    f"{vname}: tp={tp} is not a multiple of num_key_value_heads={kv_heads}"
                )
            size = n // kv_heads
            start = base + rank // (tp // kv_heads) * size
        else:
            if n % tp:
                raise LayoutError(
                    f"{vname}: HF {hf_name} shape {hf_shape} cannot be split over tp={tp} "
                    f"on dim {dim}"
                )
            size = n // tp
            start = base + rank * size
        pieces.append(Piece(hf_name, hf_shape, (at, at + size), dim, start))
        want.append(f"{label} {size}")
        at += size
    if live[dim] != at:
        attention = any(label in _ATTENTION for *_, label in subparts)
        raise LayoutError(
            f"{vname}: expected {at} rows on dim {dim} ({' + '.join(want)}), found "
            f"{live[dim]} (vLLM shape {live}); " + (
                f"num_attention_heads={getattr(config, 'num_attention_heads', None)}, "
                f"num_key_value_heads={kv_heads}, " if attention else "") + f"tp={tp}"
        )
    return pieces


def _split(vname: str, hf_name: str, hf_shape: Shape, dim: int, tp: int) -> int:
    if hf_shape[dim] % tp:
        raise LayoutError(
            f"{vname}: HF {hf_name} shape {hf_shape} cannot be split over tp={tp} on dim {dim}"
        )
    return hf_shape[dim] // tp

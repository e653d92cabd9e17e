"""The receiving side of `remote.packing`: check a round against its targets, apply it in place.

`check` validates a round's header alone (names, dtypes, shapes, segment bounds); `apply`
checks the header and the buffer's contents (indices and row ranges in range, no NaN or Inf
in a dense float update) for the whole round before it writes anything. A compressed round
is decompressed, and compact patches decoded (`hotweights.remote.codec`), on the CPU while
checked: the views of such a piece are then decoded tensors, not views of the buffer.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Collection, Mapping

import numpy as np
import torch

from hotweights.errors import DeltaError
from hotweights.remote import codec, delta, jit, packing
from hotweights.remote.delta import (
    _BITS,
    _CHUNK,
    _NP_BITS,
    _RANGE,
    DENSE,
    INT64_INDEX_FROM,
    PATCH,
    ROWS,
    _row_index,
    dtype_name,
)
from hotweights.remote.packing import FORMAT, Round, _al

__all__ = ["apply", "check", "checked", "finite", "host", "write", "writer"]

logger = logging.getLogger(__name__)

_FORMATS = (1, 2, 3, FORMAT)  # 1: no compact patches, no compression; 2: `codec`'s high
# bytes; 3: no unary bit lengths
_INDEX = {"int32": torch.int32, "int64": torch.int64}
_FEW_RUNS = 64  # row runs written one slice each; more: through one index_copy_


def _nat(e: dict, key: str, bad) -> int:
    v = e.get(key)
    if type(v) is not int or v < 0:
        raise bad(key, f"must be an int >= 0, found {v!r}")
    return v


def _parse(header: object, targets: Mapping[str, torch.Tensor]) -> list[tuple[dict, torch.Tensor]]:
    if not isinstance(header, dict):
        raise DeltaError(f"round: header must be a JSON object, found {type(header).__name__}")
    where = f"round {header.get('round')!r}"
    if header.get("format") not in _FORMATS:
        raise DeltaError(f"{where}: field 'format' must be one of {list(_FORMATS)}, found "
                         f"{header.get('format')!r}")
    total = header.get("nbytes")
    if type(total) is not int or total < 0 or not isinstance(header.get("entries"), list):
        raise DeltaError(f"{where}: fields 'nbytes' (an int >= 0) and 'entries' (a list) are "
                         f"needed, found {total!r} and {type(header.get('entries')).__name__}")
    if "compress" in header:
        if header["compress"] not in packing.COMPRESS[1:]:
            raise DeltaError(f"{where}: field 'compress' must be one of "
                             f"{list(packing.COMPRESS[1:])}, found {header['compress']!r}")
        total = header.get("raw_nbytes")  # the segments are in the decompressed buffer
        if type(total) is not int or total < 0:
            raise DeltaError(f"{where}: field 'raw_nbytes' must be an int >= 0, found "
                             f"{total!r}")
    out = []
    for i, e in enumerate(header["entries"]):
        name = e.get("name") if isinstance(e, dict) else None
        if not isinstance(name, str):
            raise DeltaError(f"{where} entry {i}: field 'name' must be a string, found {name!r}")
        if name not in targets:
            raise DeltaError(f"{where}: unknown tensor `{name}` (field 'name' of entry {i}); "
                             f"the targets hold {len(targets)} tensors")

        def bad(field: str, msg: str, name=name) -> DeltaError:
            return DeltaError(f"{where}: `{name}`: field '{field}' {msg}")
        t, kind = targets[name], e.get("kind")
        if kind not in (PATCH, ROWS, DENSE):
            raise bad("kind", f"must be one of {[PATCH, ROWS, DENSE]}, found {kind!r}")
        if e.get("dtype") != dtype_name(t.dtype):
            t = _widened(e.get("dtype"), t)
            if t is None:
                raise bad("dtype", f"is {e.get('dtype')!r}, the target's is "
                          f"{dtype_name(targets[name].dtype)!r}")
        if e.get("shape") != list(t.shape):
            raise bad("shape", f"is {e.get('shape')!r}, the target's is {list(t.shape)}")
        if not t.is_contiguous():
            raise bad("shape", f"the target is not contiguous (stride {t.stride()}); "
                      "apply to contiguous tensors")
        off, nb, s = _nat(e, "offset", bad), _nat(e, "nbytes", bad), t.dtype.itemsize
        if off % 8 or off + nb > total:
            raise bad("offset", f"[{off}, {off + nb}) is not an 8-aligned segment of the "
                      f"{total}-byte buffer")
        if kind == DENSE:
            a, b = _nat(e, "start", bad), _nat(e, "stop", bad)
            if not a <= b <= t.numel():
                raise bad("stop", f"[{a}, {b}) is out of the {t.numel()} elements")
            want = _al((b - a) * s)
        elif kind == PATCH and "sections" in e:  # compact
            try:
                want = _al(codec.check_fields(e, t.numel(), s))
            except codec.CodecError as err:
                raise bad(err.field, err.msg) from None
        elif kind == PATCH:
            if e.get("index_dtype") not in _INDEX:
                raise bad("index_dtype", f"must be one of {list(_INDEX)}, found "
                          f"{e.get('index_dtype')!r}")
            k = _nat(e, "count", bad)
            want = _al(k * _INDEX[e["index_dtype"]].itemsize) + _al(k * s)
        else:
            if t.dim() < 2:
                raise bad("kind", f"rows needs a tensor of 2 dims or more, found {t.dim()}")
            k, m = _nat(e, "nranges", bad), _nat(e, "nrows", bad)
            want = _al(_RANGE * k + m * math.prod(t.shape[1:]) * s)
        if nb != want:
            raise bad("nbytes", f"is {nb}, its other fields make {want}")
        out.append((e, t))
    if "compress" in header and sum(e["nbytes"] for e, _ in out) != total:
        raise DeltaError(f"{where}: field 'raw_nbytes' is {total}, the entries make "
                         f"{sum(e['nbytes'] for e, _ in out)}")
    return out


def _widened(name: object, t: torch.Tensor) -> torch.Tensor | None:
    """A meta tensor of `t`'s shape and strides in the dtype `name` if `widens` it to `t`'s
    (bf16 values for a slab vLLM keeps in float32), else None."""
    dtype = next((d for d in _WIDER if dtype_name(d) == name), None)
    if dtype is None or not widens(dtype, t.dtype):
        return None
    return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")


def widens(narrow: torch.dtype, wide: torch.dtype) -> bool:
    """Whether `wide` holds every value of `narrow` exactly: a receiver of `wide` takes
    values in `narrow` (widened as staged)."""
    return wide in _WIDER.get(narrow, ())


_WIDER = {torch.bfloat16: (torch.float32, torch.float64),  # dtype -> those holding it exactly
          torch.float16: (torch.float32, torch.float64), torch.float32: (torch.float64,)}


def check(header: dict, targets: Mapping[str, torch.Tensor]) -> None:
    """Check a round's header against the targets, without its buffer.

    A receiver can check every round's header before any buffer arrives; `apply` checks the
    header again and the buffer's contents.

    Args:
        header: a `Round`'s header (decoded JSON).
        targets: name -> the tensor each entry would be written to.
    Raises:
        DeltaError: naming the tensor and the field: unknown name, dtype or shape mismatch,
            a segment outside the buffer or of the wrong size, a malformed field.
    """
    _parse(header, targets)


def finite(v: torch.Tensor) -> bool:
    """No NaN and no Inf in `v` (checked in bounded chunks)."""
    flat = v.reshape(-1)  # chunks of elements (a view: the staged pieces are contiguous)
    for lo in range(0, flat.numel(), _CHUNK):
        c = flat[lo:lo + _CHUNK] if flat.numel() > _CHUNK else flat
        if c.dtype.itemsize == 1:
            c = c.float()  # no float8 kernels
        # aminmax propagates NaN and shows an Inf, with no temporary: ~20x isfinite(c).all()
        if c.numel() and not all(map(math.isfinite, (x.item() for x in torch.aminmax(c)))):
            return False
    return True


def host(t: torch.Tensor) -> np.ndarray | torch.Tensor:
    """A CPU tensor's numpy view (no copy: ops on small arrays cost ~10x less than torch's),
    else the tensor; the checks here read the same on both."""
    return t.numpy() if t.device.type == "cpu" else t


def narrow(name: str, t: torch.Tensor, bare: Collection[str]) -> bool:
    """Whether the patches of `t` (`name`) keep int32 indices: a tensor in `bare` (its xors
    applied by the commit's compiled loop, which takes them) whose elements they number."""
    return name in bare and t.numel() < INT64_INDEX_FROM


def _decoded(e: dict, t: torch.Tensor, buf: torch.Tensor, nb, old, bad,
             bare: Collection[str] = ()) -> tuple:
    """(indices, values) of a compact patch piece, decoded on the CPU, on `buf`'s device;
    xor values of a tensor in `bare` come as the xors themselves, with int32 indices where
    they fit (what the commit's compiled loop takes), else int64."""
    s, name, xor = t.dtype.itemsize, e["name"], e["values"] == codec.XOR
    src = None if old is None else old.get(name)
    if xor and name in bare:
        src = None
    elif xor and src is None:
        raise DeltaError(f"`{name}`: this receiver cannot decode xor values for `{name}` "
                         "(it was given no old value for it); refused")
    if xor and src is not None and (tuple(src.shape) != tuple(t.shape) or src.dtype not in (
            t.dtype, None) and not (src.dtype.is_floating_point and t.dtype.is_floating_point)):
        raise bad("values", f"xor against an old value of {src.dtype} {tuple(src.shape)}, "
                  f"the target is {t.dtype} {tuple(t.shape)}")
    data = nb[e["offset"]:e["offset"] + sum(e["sections"])]
    data = data if isinstance(data, np.ndarray) else data.cpu().numpy()

    def old_bits(idx: np.ndarray) -> np.ndarray:
        if isinstance(src, torch.Tensor):  # where it lies (GPT-OSS's experts: transposed)
            got = delta.values_at(src.detach(), torch.from_numpy(idx).to(src.device))
        else:  # a TP worker's `shards.Shard`: 0 where it holds none (cut away later)
            got = src.gather(torch.from_numpy(idx), t.dtype)
        # a float slab vLLM keeps in another dtype (float32 A_log): the sender's xors are
        # of its values in the update's dtype, as the loader last wrote them
        return got.to(t.dtype).view(_BITS[s]).cpu().numpy().view(codec.UINT[s])
    on_cpu = isinstance(src, torch.Tensor) and src.device.type == "cpu" and \
        src.is_contiguous() and src.dtype == t.dtype  # read whole; else only the values decoded
    try:
        idx, bits = codec.decode(e, data, numel=t.numel(), itemsize=s,
                                 floating=t.dtype.is_floating_point,
                                 old=None if src is None else _unsigned(
                                     src.detach().reshape(-1)) if on_cpu else old_bits,
                                 index=np.int32 if narrow(name, t, bare) else np.int64)
    except codec.CodecError as err:
        raise bad(err.field, err.msg) from None
    values = torch.from_numpy(bits.view(_NP_BITS[s])).view(t.dtype)
    return torch.from_numpy(idx).to(buf.device), values.to(buf.device)


def _views(e: dict, t: torch.Tensor, buf: torch.Tensor, nb, check_finite: bool, bad,
           old=None, bare: Collection[str] = ()) -> tuple:
    # nb: the buffer's numpy view on the CPU (its index checks cost a fraction of torch's),
    # else the buffer itself
    off, s, kind = e["offset"], t.dtype.itemsize, e["kind"]
    if kind == PATCH and "sections" in e:
        return _decoded(e, t, buf, nb, old, bad, bare)
    if kind == DENSE:
        v = buf[off:off + (e["stop"] - e["start"]) * s].view(t.dtype)
        if check_finite and t.dtype.is_floating_point and not finite(v):
            raise bad("values", f"holds NaN or Inf (a dense update of elements "
                      f"[{e['start']}, {e['stop']})); refused")
        return (v,)
    if kind == PATCH:
        k, idt = e["count"], _INDEX[e["index_dtype"]]
        ni = k * idt.itemsize
        idx = buf[off:off + ni].view(idt)
        vals = buf[off + _al(ni):off + _al(ni) + k * s].view(t.dtype)
        for lo in range(0, k, _CHUNK):
            c = host(idx[lo:lo + _CHUNK])
            if int(c.min()) < 0 or int(c.max()) >= t.numel():
                raise bad("indices", f"hold [{int(c.min())}, {int(c.max())}], out of the "
                          f"{t.numel()} elements")
        return idx, vals
    k, m, nr = e["nranges"], e["nrows"], _RANGE * e["nranges"]
    r = nb[off:off + nr].view(np.int64 if isinstance(nb, np.ndarray) else torch.int64)
    if k:  # [start, stop) pairs, flat: each run non-empty and inside the rows
        lens = r[1::2] - r[0::2]
        if not (int(r.min()) >= 0 and int(r.max()) <= t.shape[0] and int(lens.min()) > 0):
            raise bad("ranges", f"hold a run outside [0, {t.shape[0]}) or empty")
    if (got := int(lens.sum()) if k else 0) != m:
        raise bad("nrows", f"is {m}, the ranges cover {got} rows")
    return (buf[off:off + nr].view(torch.int64).view(k, 2),
            buf[off + nr:off + nr + m * math.prod(t.shape[1:]) * s].view(t.dtype).view(
                m, *t.shape[1:]))


def checked(round: Round, targets: Mapping[str, torch.Tensor], *,
            check_finite: bool = True, old: Mapping[str, torch.Tensor] | None = None,
            bare: Collection[str] = ()) -> list[tuple[dict, torch.Tensor, tuple]]:
    """Check a whole round against its targets and view its pieces, writing nothing.

    Args:
        round, targets, check_finite: as for `apply`; the targets may be meta tensors (only
            their dtype and shape are read).
        old: name -> the receiver's current value of a tensor (any device), read to decode
            ``values="xor"`` patch pieces into new values; a piece of a tensor it lacks is
            refused.
        bare: names whose ``values="xor"`` patch pieces keep the xors themselves (``old ^
            new`` bit patterns: a `writer` of an entry marked ``"xor"`` applies them in
            place), `old` unread.
    Returns:
        (entry, target, views) per header entry: dense ``(values,)``, patch ``(indices,
        values)``, rows ``(ranges (k, 2) int64, rows)``; the views are of the round's buffer
        (of its decompressed copy if compressed), or decoded tensors for a compact patch.
    Raises:
        DeltaError: as for `apply`; and xor values for a tensor `old` does not hold.
    """
    entries, buf, h = _parse(round.header, targets), round.buffer, round.header
    where = f"round {h.get('round')!r}"
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != h["nbytes"]:
        raise DeltaError(f"{where}: field 'nbytes' is {h['nbytes']}, the "
                         f"buffer holds {buf.numel()} {buf.dtype} in shape {tuple(buf.shape)}")
    if "compress" in h:
        try:
            raw = codec.zstd_decompress(buf.cpu().numpy().tobytes(), h["raw_nbytes"])
        except codec.CodecError as err:
            raise DeltaError(f"{where}: field '{err.field}' {err.msg}") from None
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else \
            torch.empty(0, dtype=torch.uint8)
        buf = buf.to(round.buffer.device)
    out, nb = [], host(buf)
    for e, t in entries:
        def bad(field: str, msg: str, name=e["name"]) -> DeltaError:
            return DeltaError(f"{where}: `{name}`: field '{field}' {msg}")
        target = targets[e["name"]]
        if t.dtype == target.dtype:
            out.append((e, t, _views(e, t, buf, nb, check_finite, bad, old, bare)))
            continue
        # values of a narrower float (`_widened`): decoded whole, then cast, exactly
        *index, values = _views(e, t, buf, nb, check_finite, bad, old)
        e = {**e, "dtype": dtype_name(target.dtype)} | ({"values": codec.RAW}
                                                          if "values" in e else {})
        out.append((e, target, (*index, values.to(target.dtype))))
    return out


def write(entry: dict, target: torch.Tensor, views: tuple) -> None:
    """Write one checked piece (`checked`'s entry and views) into its contiguous target."""
    writer(entry, target, views)()


def writer(entry: dict, target: torch.Tensor, views: tuple) -> Callable[[], None]:
    """`write`, made ready now (the checks, the numpy views of a CPU piece and target), done
    when called: a commit that writes many pieces then spends its time in the copies."""
    flat = target.detach().view(-1)
    if entry["kind"] == DENSE:
        return functools.partial(flat[entry["start"]:entry["stop"]].copy_, views[0])
    if entry["kind"] == PATCH:
        idx, vals = views
        compiled = flat.device.type == idx.device.type == vals.device.type == "cpu" and \
            idx.dtype in (torch.int32, torch.int64) and idx.is_contiguous() and \
            vals.is_contiguous() and jit.enabled()  # one compiled loop
        args = (_unsigned(flat), idx.numpy(), _unsigned(vals)) if compiled else ()
        if entry.get("xor"):  # bare xors (`checked`'s `bare`): applied to the old values
            if not compiled:
                raise DeltaError(f"`{entry['name']}`: xor values need a CPU target and the "
                                 "compiled loops")

            def xors() -> None:
                if not jit.xor_scatter(*args):
                    raise DeltaError(f"`{entry['name']}`: a patch index is outside the "
                                     "tensor; nothing of the piece was written")
            return xors
        if compiled:
            return lambda: jit.scatter(*args) or _index_copy(flat, idx, vals)
        return functools.partial(_index_copy, flat, idx, vals)
    if delta._NUMPY and target.device.type == views[1].device.type == "cpu" and \
            len(views[0]) <= _FEW_RUNS:  # numpy slice copies: a fraction of an index's cost
        bits = _BITS[target.dtype.itemsize]
        t, rows = target.detach().view(bits).numpy(), views[1].view(bits).numpy()
        runs = host(views[0]).tolist()

        def copy_runs() -> None:
            at = 0
            for a, b in runs:
                t[a:b] = rows[at:at + b - a]
                at += b - a
        return copy_runs
    return lambda: delta.index_copy(target.detach(), _row_index(views[0].to(target.device)),
                                    views[1].to(target.device))


def _index_copy(flat: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> None:
    # bounded chunks: the indices cross to the target's device a chunk at a time
    for lo in range(0, idx.numel(), _CHUNK):
        delta.index_copy(flat, idx[lo:lo + _CHUNK].to(flat.device, torch.int64),
                         vals[lo:lo + _CHUNK].to(flat.device))


def _unsigned(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bit patterns as unsigned numpy (no copy)."""
    return t.view(_BITS[t.dtype.itemsize]).numpy().view(codec.UINT[t.dtype.itemsize])


def _refuse_tied_xors(staged: list[tuple[dict, torch.Tensor, tuple]],
                      targets: Mapping[str, torch.Tensor]) -> None:
    """xor values decode against their target's bytes as they are: where another name of
    `targets` is the same tensor (a tied weight sent under both names), a round that wrote
    that name before has changed them, and the xors would write the old values back."""
    names: dict[tuple, list[str]] = {}
    for n, t in targets.items():
        names.setdefault((str(t.device), t.data_ptr(), t.nbytes), []).append(n)
    for e, _, _ in staged:
        t = targets[e["name"]]
        tied = [n for n in names[(str(t.device), t.data_ptr(), t.nbytes)] if n != e["name"]]
        if e.get("values") == codec.XOR and tied:
            raise DeltaError(f"`{e['name']}`: xor values, and `{tied[0]}` is the same tensor "
                             "in targets (tied): a round that wrote it before would have "
                             "changed the old values they decode against; name each tensor "
                             "once, or pack with values='raw'; nothing was written")


def apply(round: Round, targets: Mapping[str, torch.Tensor], *,
          check_finite: bool = True) -> list[str]:
    """Check a whole round against its targets, then write it into them in place.

    Nothing is written unless every entry passes. The targets may be the receiver's own
    tensors or HF-named copies to hand on to a loader afterwards (vLLM:
    ``model.load_weights((n, targets[n]) for n in apply(r, targets))``).

    Args:
        round: a `Round` from `pack` (or rebuilt from its header JSON and buffer).
        targets: name -> contiguous tensor; the buffer may be on another device. They hold
            the old values (a patch writes only what changed), so xor values decode
            against them.
        check_finite: refuse NaN or Inf in a dense update of a float tensor (patches and rows
            carry exact bit patterns and are not checked).
    Returns:
        The names written, in the round's order, each once.
    Raises:
        DeltaError: naming the tensor and the field (see `check`; also indices or row
            ranges out of range, a non-finite dense update, a buffer of the wrong length).
    """
    staged = checked(round, targets, check_finite=check_finite, old=targets)
    _refuse_tied_xors(staged, targets)
    names = {}
    for e, t, v in staged:  # everything checked: write
        write(e, t, v)
        names[e["name"]] = None
    logger.debug("round %s: applied %d entries to %d tensors", round.header.get("round"),
                 len(staged), len(names))
    return list(names)

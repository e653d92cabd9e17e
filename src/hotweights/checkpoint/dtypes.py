"""The safetensors dtypes, one table: each header name's bits per element and torch dtype.

Every module that reads or writes a header takes its dtypes from here. A dtype torch has no
equivalent for (F6_*) is known to the header reader, never synced; so is F4, whose torch
form (`float4_e2m1fn_x2`) packs two values per element and so has another shape than the
header's.
"""

from __future__ import annotations

import torch

# (header name, bits per element of the header's shape, torch dtype or None)
_TABLE = (
    ("BOOL", 8, torch.bool),
    ("U8", 8, torch.uint8),
    ("I8", 8, torch.int8),
    ("F8_E5M2", 8, torch.float8_e5m2),
    ("F8_E4M3", 8, torch.float8_e4m3fn),
    ("F8_E5M2FNUZ", 8, torch.float8_e5m2fnuz),
    ("F8_E4M3FNUZ", 8, torch.float8_e4m3fnuz),
    ("F8_E8M0", 8, getattr(torch, "float8_e8m0fnu", None)),  # torch 2.7+
    ("F4", 4, None),
    ("F6_E2M3", 6, None),
    ("F6_E3M2", 6, None),
    ("I16", 16, torch.int16),
    ("U16", 16, torch.uint16),
    ("F16", 16, torch.float16),
    ("BF16", 16, torch.bfloat16),
    ("I32", 32, torch.int32),
    ("U32", 32, torch.uint32),
    ("F32", 32, torch.float32),
    ("I64", 64, torch.int64),
    ("U64", 64, torch.uint64),
    ("F64", 64, torch.float64),
    ("C64", 64, torch.complex64),
)

BITS: dict[str, int] = {name: bits for name, bits, _ in _TABLE}
TORCH: dict[str, torch.dtype] = {name: dt for name, _, dt in _TABLE if dt is not None}
NAMES: dict[torch.dtype, str] = {dt: name for name, dt in TORCH.items()}

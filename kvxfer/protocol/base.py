"""What every message is built from: the ``_Msg`` base (array-like, so fields are positional)
and the constrained field types the messages share.

No I/O; never imports NIXL, ZMQ, torch or vLLM (see ``kvxfer.protocol``).
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

NonNeg = Annotated[int, Meta(ge=0)]
Positive = Annotated[int, Meta(gt=0)]
BlockIds = list[NonNeg]
GroupBlockIds = Annotated[list[BlockIds], Meta(max_length=64)]  # one list per KV cache group
ReqId = Annotated[str, Meta(min_length=1, max_length=512)]
Token = Annotated[str, Meta(max_length=128)]  # a lease capability (kvxfer.auth.new_token)

# dtype name -> item size in bytes (names as torch spells them, without "torch.")
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}


class _Msg(Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    pass


EngineId = Annotated[str, Meta(max_length=256)]

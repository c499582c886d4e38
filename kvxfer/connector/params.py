"""kv_transfer_params as vLLM's P/D routers pass them, validated. vLLM-free, no I/O.

Field names are vLLM's (``do_remote_prefill``, ``do_remote_decode``, ``remote_engine_id``,
``remote_request_id``, ``remote_block_ids``, ``remote_host``, ``remote_port``, ``tp_size``),
so vLLM's toy proxy and llm-d's routing sidecar pass them through unchanged. Host and port
name the prefill *sidecar's* handshake endpoint. kvxfer adds ``remote_generation`` (the
prefill sidecar's registration generation when the blocks were held; optional) and
``remote_lease_token`` (the hold's capability: only whoever has it can read or release it) and
``remote_block_size`` (the prefill's tokens per block: a decode whose blocks hold another
number pairs the two lists by token; without it they are taken to be the same).

Push mode (the router sends the request to both engines at once): both get ``transfer_id``
(unguessable, at most 128 characters: it is the request's capability too); the decode also
gets the prefill sidecar's ``remote_host`` / ``remote_port`` (and ``remote_engine_id`` and
``tp_size`` when the router knows them), never ``remote_block_ids``: ``parse_push``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvxfer.client import RemoteBlocks
from kvxfer.connector.groups import held_blocks

# Bounds on integers a client's kv_transfer_params give: each goes into a message, and one
# that msgpack cannot encode raised out of vLLM's scheduler and killed its engine core
# (found by a review: remote_block_size, tp_size or a block id of 2**64)
MAX_ID = 1 << 63
MAX_RANKS = 4096  # (kvxfer.topology.MAX_TP_SIZE)
MAX_BLOCK_SIZE = 1 << 24


class InvalidTransferParams(ValueError):
    """kv_transfer_params from a client that cannot be used; the request is recomputed."""


def _int(params: Mapping[str, Any], key: str, lo: int, hi: int | None = None) -> int:
    value = params.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTransferParams(f"{key} must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        raise InvalidTransferParams(f"{key}={value} out of range")
    return value


def _ids(value: Any) -> list[int]:
    out = []
    for b in value:
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < MAX_ID:
            raise InvalidTransferParams(f"remote_block_ids holds {b!r}, not a block id")
        out.append(b)
    return out


def _block_ids(value: Any) -> tuple[list[int], tuple[tuple[int, ...], ...]]:
    """A flat list, or vLLM's per-KV-cache-group list of lists: (the blocks, the groups when
    there are several; a single group is its flat list)."""
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise InvalidTransferParams(f"remote_block_ids must be a list, got {type(value).__name__}")
    if value and all(isinstance(g, Sequence) and not isinstance(g, str | bytes) for g in value):
        if len(value) > 1:  # a hybrid model: one list per group, positions matter
            groups = tuple(tuple(_ids(g)) for g in value)
            return held_blocks(groups), groups
        value = value[0]
    return _ids(value), ()


def parse_remote(params: Mapping[str, Any]) -> RemoteBlocks:
    """The prefill side's blocks and sidecar endpoint, or InvalidTransferParams."""
    missing = [k for k in ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids")
               if params.get(k) is None]
    if missing:
        raise InvalidTransferParams(f"kv_transfer_params lacks {', '.join(missing)}")
    for key in ("remote_engine_id", "remote_host"):
        if not isinstance(params[key], str) or not params[key]:
            raise InvalidTransferParams(f"{key} must be a non-empty string")
    req_id = params.get("remote_request_id") or ""
    if not isinstance(req_id, str):
        raise InvalidTransferParams("remote_request_id must be a string")
    generation = params.get("remote_generation") or ""
    if not isinstance(generation, str):
        raise InvalidTransferParams("remote_generation must be a string")
    token = params.get("remote_lease_token") or ""
    if not isinstance(token, str) or len(token) > 128:
        raise InvalidTransferParams("remote_lease_token must be a string of at most 128 characters")
    block_ids, groups = _block_ids(params["remote_block_ids"])
    return RemoteBlocks(
        engine_id=params["remote_engine_id"],
        host=params["remote_host"],
        port=_int(params, "remote_port", 1, 65535),
        block_ids=block_ids,
        groups=groups,
        tp_size=_int(params, "tp_size", 1, MAX_RANKS) if "tp_size" in params else 1,
        req_id=req_id,
        generation=generation,
        token=token,
        block_size=(_int(params, "remote_block_size", 1, MAX_BLOCK_SIZE)
                    if params.get("remote_block_size") is not None else 0),
    )


def transfer_id_of(params: Mapping[str, Any] | None) -> str:
    """A push-mode request's transfer id ("": none, or not usable)."""
    tid = (params or {}).get("transfer_id")
    return tid if isinstance(tid, str) and 0 < len(tid) <= 128 else ""


def parse_push(params: Mapping[str, Any]) -> RemoteBlocks:
    """A push-mode decode request's prefill (its sidecar endpoint and the transfer id, which
    names the request there and is its capability), or InvalidTransferParams."""
    tid = transfer_id_of(params)
    if not tid:
        raise InvalidTransferParams("transfer_id must be a string of 1 to 128 characters")
    host = params.get("remote_host")
    if not isinstance(host, str) or not host:
        raise InvalidTransferParams("remote_host must be a non-empty string")
    engine = params.get("remote_engine_id") or ""
    if not isinstance(engine, str):
        raise InvalidTransferParams("remote_engine_id must be a string")
    tp_size = _int(params, "tp_size", 1, MAX_RANKS) if "tp_size" in params else 1
    return RemoteBlocks(engine_id=engine, host=host, port=_int(params, "remote_port", 1, 65535), block_ids=[],
                        tp_size=tp_size, req_id=tid, token=tid)

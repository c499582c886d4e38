"""The kvxfer error tree, and the error codes that travel on the wire.

    KvxferError                 root of everything kvxfer raises
    ├── ConfigError             bad flag, env variable or TOML value (fatal at start-up)
    ├── ProtocolError           a message that does not decode or validate
    ├── SidecarUnavailable      the engine client got no answer from its sidecar in time
    └── RequestError            one request failed; carries an ErrorCode and the request id
        └── TransferFailed      a NIXL transfer failed, timed out or was refused

On the wire an error is never a pickled exception: it is an ``Error`` or ``Failed``
message (see ``kvxfer.protocol``) with an ``ErrorCode`` string and a readable reason.
Recoverable errors concern one request (the engine recomputes); fatal ones stop start-up.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Stable error codes. Append only: operators and scripts match on these strings."""

    MALFORMED = "malformed"  # message did not decode or failed schema validation
    UNKNOWN_MESSAGE = "unknown_message"  # decodes as msgpack but names no known kind
    NOT_REGISTERED = "not_registered"  # no KV registration for that tp rank
    INVALID_LAYOUT = "invalid_layout"  # registration layout/regions inconsistent
    INVALID_MEMORY = "invalid_memory"  # registration names memory that is not provably the engine's
    MEMORY_MAP_FAILED = "memory_map_failed"  # shm file / CUDA IPC handle could not be opened
    BLOCK_OUT_OF_RANGE = "block_out_of_range"  # a block id outside [0, num_blocks)
    DUPLICATE_REQUEST = "duplicate_request"  # request id already held / in flight
    UNKNOWN_REQUEST = "unknown_request"  # release of a request the sidecar does not hold
    UNKNOWN_PEER = "unknown_peer"  # the endpoint answered with another engine id
    HANDSHAKE_FAILED = "handshake_failed"  # peer unreachable or handshake timed out
    INCOMPATIBLE = "incompatible"  # version / compatibility hash / layout mismatch
    PEER_DISCONNECTED = "peer_disconnected"  # NIXL reported the remote gone mid-transfer
    DEADLINE = "deadline"  # the transfer did not finish before its deadline
    TRANSFER_ERROR = "transfer_error"  # any other NIXL failure
    DRAINING = "draining"  # the sidecar is shutting down and takes no new work
    UNAUTHORIZED = "unauthorized"  # handshake without (or with a wrong) shared-secret proof
    CANCELLED = "cancelled"  # an operator cancelled the transfer (gRPC CancelTransfer / drain)
    INTERNAL = "internal"  # a bug in kvxfer; logged with a traceback
    INTEGRITY = "integrity"  # the bytes received differ from the bytes the prefill holds (--verify-sample)
    EXPIRED = "expired"  # the request reached the sidecar after the engine gave up on it
    RANK_TAKEN = "rank_taken"  # another live engine process registered that (engine, dp, pp, tp) rank
    OUT_OF_MEMORY = "out_of_memory"  # a KV pool larger than the memory available (or --max-pool-bytes)
    UNSUPPORTED = "unsupported"  # not possible on this sidecar (a GPU pool without cuda-bindings or VMM)
    PEER_STALLED = "peer_stalled"  # the peer owed an answer, silent for --peer-stall-s: reads stopped
    BUSY = "busy"  # the peer's listener had as many requests waiting as it serves at once: try again


class KvxferError(Exception):
    """Root of all kvxfer exceptions."""


class ConfigError(KvxferError):
    """A configuration value is invalid."""


class ListenError(ConfigError):
    """A listener (engine socket, handshake, control, metrics) cannot be had: which and where."""


class ProtocolError(KvxferError):
    """A message did not decode or validate."""


class SidecarUnavailable(KvxferError):
    """The local sidecar did not answer in time."""


class RequestError(KvxferError):
    """One request failed; the engine should recompute it."""

    def __init__(self, code: ErrorCode | str, reason: str, req_id: str = "") -> None:
        super().__init__(f"[{code}] {reason}" + (f" (request {req_id})" if req_id else ""))
        self.code = ErrorCode(code)
        self.reason = reason
        self.req_id = req_id


class TransferFailed(RequestError):
    """A NIXL transfer failed, timed out, or was refused."""

from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Identity(_message.Message):
    __slots__ = ("engine_id", "role", "version", "nixl_backends", "handshake_endpoint", "agent_name", "protocol_version", "ucx_error_mode")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NIXL_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    UCX_ERROR_MODE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    role: str
    version: str
    nixl_backends: _containers.RepeatedScalarFieldContainer[str]
    handshake_endpoint: str
    agent_name: str
    protocol_version: int
    ucx_error_mode: str
    def __init__(self, engine_id: _Optional[str] = ..., role: _Optional[str] = ..., version: _Optional[str] = ..., nixl_backends: _Optional[_Iterable[str]] = ..., handshake_endpoint: _Optional[str] = ..., agent_name: _Optional[str] = ..., protocol_version: _Optional[int] = ..., ucx_error_mode: _Optional[str] = ...) -> None: ...

class KVCacheGroup(_message.Message):
    __slots__ = ("kind", "block_size", "num_layers", "window", "state_bytes", "state_kind")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_KIND_FIELD_NUMBER: _ClassVar[int]
    kind: str
    block_size: int
    num_layers: int
    window: int
    state_bytes: int
    state_kind: str
    def __init__(self, kind: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., window: _Optional[int] = ..., state_bytes: _Optional[int] = ..., state_kind: _Optional[str] = ...) -> None: ...

class RankRegistration(_message.Message):
    __slots__ = ("tp_rank", "tp_size", "num_layers", "num_blocks", "block_size", "num_kv_heads", "local_kv_heads", "head_dim", "dtype", "kv_parts", "mla", "head_layout", "bytes_registered", "mem_type", "engine_id", "dp_rank", "pp_rank", "pp_size", "first_layer", "pid", "groups", "state_regions", "state_bytes", "state_splits")
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_PARTS_FIELD_NUMBER: _ClassVar[int]
    MLA_FIELD_NUMBER: _ClassVar[int]
    HEAD_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BYTES_REGISTERED_FIELD_NUMBER: _ClassVar[int]
    MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    FIRST_LAYER_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    STATE_REGIONS_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_SPLITS_FIELD_NUMBER: _ClassVar[int]
    tp_rank: int
    tp_size: int
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    local_kv_heads: int
    head_dim: int
    dtype: str
    kv_parts: int
    mla: bool
    head_layout: str
    bytes_registered: int
    mem_type: str
    engine_id: str
    dp_rank: int
    pp_rank: int
    pp_size: int
    first_layer: int
    pid: int
    groups: _containers.RepeatedCompositeFieldContainer[KVCacheGroup]
    state_regions: int
    state_bytes: int
    state_splits: bool
    def __init__(self, tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., local_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., kv_parts: _Optional[int] = ..., mla: _Optional[bool] = ..., head_layout: _Optional[str] = ..., bytes_registered: _Optional[int] = ..., mem_type: _Optional[str] = ..., engine_id: _Optional[str] = ..., dp_rank: _Optional[int] = ..., pp_rank: _Optional[int] = ..., pp_size: _Optional[int] = ..., first_layer: _Optional[int] = ..., pid: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[KVCacheGroup, _Mapping]]] = ..., state_regions: _Optional[int] = ..., state_bytes: _Optional[int] = ..., state_splits: _Optional[bool] = ...) -> None: ...

class Peer(_message.Message):
    __slots__ = ("endpoint", "engine_id", "agent_name", "state", "last_handshake_unix", "handshake_ms", "tp_size", "reads", "bytes", "failures")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_HANDSHAKE_UNIX_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKE_MS_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    engine_id: str
    agent_name: str
    state: str
    last_handshake_unix: float
    handshake_ms: float
    tp_size: int
    reads: int
    bytes: int
    failures: int
    def __init__(self, endpoint: _Optional[str] = ..., engine_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., state: _Optional[str] = ..., last_handshake_unix: _Optional[float] = ..., handshake_ms: _Optional[float] = ..., tp_size: _Optional[int] = ..., reads: _Optional[int] = ..., bytes: _Optional[int] = ..., failures: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("request_id", "num_blocks", "age_s", "expires_in_s", "reads_seen", "reads_expected", "engine_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    READS_SEEN_FIELD_NUMBER: _ClassVar[int]
    READS_EXPECTED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_blocks: int
    age_s: float
    expires_in_s: float
    reads_seen: int
    reads_expected: int
    engine_id: str
    def __init__(self, request_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., age_s: _Optional[float] = ..., expires_in_s: _Optional[float] = ..., reads_seen: _Optional[int] = ..., reads_expected: _Optional[int] = ..., engine_id: _Optional[str] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("request_id", "tp_rank", "peer", "state", "num_blocks", "bytes", "age_s", "deadline_in_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_IN_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tp_rank: int
    peer: str
    state: str
    num_blocks: int
    bytes: int
    age_s: float
    deadline_in_s: float
    def __init__(self, request_id: _Optional[str] = ..., tp_rank: _Optional[int] = ..., peer: _Optional[str] = ..., state: _Optional[str] = ..., num_blocks: _Optional[int] = ..., bytes: _Optional[int] = ..., age_s: _Optional[float] = ..., deadline_in_s: _Optional[float] = ...) -> None: ...

class Totals(_message.Message):
    __slots__ = ("bytes", "transfers_ok", "transfers_failed", "leases_released", "leases_expired", "handshakes", "handshake_failures", "bad_messages", "control_denied", "loop_stalls", "loop_lag_worst_s")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_OK_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FAILED_FIELD_NUMBER: _ClassVar[int]
    LEASES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKES_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    BAD_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    CONTROL_DENIED_FIELD_NUMBER: _ClassVar[int]
    LOOP_STALLS_FIELD_NUMBER: _ClassVar[int]
    LOOP_LAG_WORST_S_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    transfers_ok: int
    transfers_failed: int
    leases_released: int
    leases_expired: int
    handshakes: int
    handshake_failures: int
    bad_messages: int
    control_denied: int
    loop_stalls: int
    loop_lag_worst_s: float
    def __init__(self, bytes: _Optional[int] = ..., transfers_ok: _Optional[int] = ..., transfers_failed: _Optional[int] = ..., leases_released: _Optional[int] = ..., leases_expired: _Optional[int] = ..., handshakes: _Optional[int] = ..., handshake_failures: _Optional[int] = ..., bad_messages: _Optional[int] = ..., control_denied: _Optional[int] = ..., loop_stalls: _Optional[int] = ..., loop_lag_worst_s: _Optional[float] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("identity", "ranks", "peers", "leases", "transfers", "totals", "uptime_s", "ready", "draining", "insecure", "authenticated", "encrypted", "host_key", "redacted", "host_key_file", "redacted_why")
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    INSECURE_FIELD_NUMBER: _ClassVar[int]
    AUTHENTICATED_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTED_FIELD_NUMBER: _ClassVar[int]
    HOST_KEY_FIELD_NUMBER: _ClassVar[int]
    REDACTED_FIELD_NUMBER: _ClassVar[int]
    HOST_KEY_FILE_FIELD_NUMBER: _ClassVar[int]
    REDACTED_WHY_FIELD_NUMBER: _ClassVar[int]
    identity: Identity
    ranks: _containers.RepeatedCompositeFieldContainer[RankRegistration]
    peers: _containers.RepeatedCompositeFieldContainer[Peer]
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    transfers: _containers.RepeatedCompositeFieldContainer[Transfer]
    totals: Totals
    uptime_s: float
    ready: bool
    draining: bool
    insecure: bool
    authenticated: bool
    encrypted: bool
    host_key: bool
    redacted: bool
    host_key_file: str
    redacted_why: str
    def __init__(self, identity: _Optional[_Union[Identity, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[RankRegistration, _Mapping]]] = ..., peers: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ..., leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., transfers: _Optional[_Iterable[_Union[Transfer, _Mapping]]] = ..., totals: _Optional[_Union[Totals, _Mapping]] = ..., uptime_s: _Optional[float] = ..., ready: _Optional[bool] = ..., draining: _Optional[bool] = ..., insecure: _Optional[bool] = ..., authenticated: _Optional[bool] = ..., encrypted: _Optional[bool] = ..., host_key: _Optional[bool] = ..., redacted: _Optional[bool] = ..., host_key_file: _Optional[str] = ..., redacted_why: _Optional[str] = ...) -> None: ...

class Load(_message.Message):
    __slots__ = ("queued_requests", "queued_bytes", "inflight_requests", "inflight_bytes", "held_requests", "held_blocks", "draining")
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HELD_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    HELD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    queued_requests: int
    queued_bytes: int
    inflight_requests: int
    inflight_bytes: int
    held_requests: int
    held_blocks: int
    draining: bool
    def __init__(self, queued_requests: _Optional[int] = ..., queued_bytes: _Optional[int] = ..., inflight_requests: _Optional[int] = ..., inflight_bytes: _Optional[int] = ..., held_requests: _Optional[int] = ..., held_blocks: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("time_unix", "kind", "request_id", "peer", "code", "reason", "bytes", "seconds", "tp_rank")
    TIME_UNIX_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    time_unix: float
    kind: str
    request_id: str
    peer: str
    code: str
    reason: str
    bytes: int
    seconds: float
    tp_rank: int
    def __init__(self, time_unix: _Optional[float] = ..., kind: _Optional[str] = ..., request_id: _Optional[str] = ..., peer: _Optional[str] = ..., code: _Optional[str] = ..., reason: _Optional[str] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., tp_rank: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPeersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListPeersResponse(_message.Message):
    __slots__ = ("peers",)
    PEERS_FIELD_NUMBER: _ClassVar[int]
    peers: _containers.RepeatedCompositeFieldContainer[Peer]
    def __init__(self, peers: _Optional[_Iterable[_Union[Peer, _Mapping]]] = ...) -> None: ...

class ConnectPeerRequest(_message.Message):
    __slots__ = ("host", "port")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class DisconnectPeerRequest(_message.Message):
    __slots__ = ("endpoint",)
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    def __init__(self, endpoint: _Optional[str] = ...) -> None: ...

class DisconnectPeerResponse(_message.Message):
    __slots__ = ("disconnected",)
    DISCONNECTED_FIELD_NUMBER: _ClassVar[int]
    disconnected: bool
    def __init__(self, disconnected: _Optional[bool] = ...) -> None: ...

class ListTransfersRequest(_message.Message):
    __slots__ = ("request_id", "state")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: str
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[str] = ...) -> None: ...

class ListTransfersResponse(_message.Message):
    __slots__ = ("transfers",)
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    transfers: _containers.RepeatedCompositeFieldContainer[Transfer]
    def __init__(self, transfers: _Optional[_Iterable[_Union[Transfer, _Mapping]]] = ...) -> None: ...

class CancelTransferRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CancelTransferResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: int
    def __init__(self, cancelled: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("drained", "failed", "released", "seconds")
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    failed: int
    released: int
    seconds: float
    def __init__(self, drained: _Optional[bool] = ..., failed: _Optional[int] = ..., released: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("kinds",)
    KINDS_FIELD_NUMBER: _ClassVar[int]
    kinds: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kinds: _Optional[_Iterable[str]] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ("resumed",)
    RESUMED_FIELD_NUMBER: _ClassVar[int]
    resumed: bool
    def __init__(self, resumed: _Optional[bool] = ...) -> None: ...

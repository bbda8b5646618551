from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JoinRequest(_message.Message):
    __slots__ = ("island", "fingerprint_json", "params_checksum", "round", "ready", "reconnect", "replaying")
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_JSON_FIELD_NUMBER: _ClassVar[int]
    PARAMS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    RECONNECT_FIELD_NUMBER: _ClassVar[int]
    REPLAYING_FIELD_NUMBER: _ClassVar[int]
    island: str
    fingerprint_json: str
    params_checksum: str
    round: int
    ready: bool
    reconnect: bool
    replaying: bool
    def __init__(self, island: _Optional[str] = ..., fingerprint_json: _Optional[str] = ..., params_checksum: _Optional[str] = ..., round: _Optional[int] = ..., ready: _Optional[bool] = ..., reconnect: _Optional[bool] = ..., replaying: _Optional[bool] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("round", "params_checksum", "payload_bytes", "layout", "view_bytes", "view_chunk_offsets", "fragments", "incarnation", "rejoin", "kept_json")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARAMS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    VIEW_BYTES_FIELD_NUMBER: _ClassVar[int]
    VIEW_CHUNK_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    KEPT_JSON_FIELD_NUMBER: _ClassVar[int]
    round: int
    params_checksum: str
    payload_bytes: int
    layout: str
    view_bytes: int
    view_chunk_offsets: _containers.RepeatedScalarFieldContainer[int]
    fragments: _containers.RepeatedCompositeFieldContainer[FragmentPlan]
    incarnation: str
    rejoin: bool
    kept_json: str
    def __init__(self, round: _Optional[int] = ..., params_checksum: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., layout: _Optional[str] = ..., view_bytes: _Optional[int] = ..., view_chunk_offsets: _Optional[_Iterable[int]] = ..., fragments: _Optional[_Iterable[_Union[FragmentPlan, _Mapping]]] = ..., incarnation: _Optional[str] = ..., rejoin: _Optional[bool] = ..., kept_json: _Optional[str] = ...) -> None: ...

class FragmentPlan(_message.Message):
    __slots__ = ("payload_bytes", "layout", "chunk_offsets", "update_payload_bytes", "update_chunk_offsets")
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPDATE_CHUNK_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    payload_bytes: int
    layout: str
    chunk_offsets: _containers.RepeatedScalarFieldContainer[int]
    update_payload_bytes: int
    update_chunk_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, payload_bytes: _Optional[int] = ..., layout: _Optional[str] = ..., chunk_offsets: _Optional[_Iterable[int]] = ..., update_payload_bytes: _Optional[int] = ..., update_chunk_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class PayloadHeader(_message.Message):
    __slots__ = ("round", "island", "tokens", "total_bytes", "crc32", "layout", "params_checksum", "step_seconds", "inner_steps", "streams", "fragment", "attempt", "fragment_rounds", "incarnation", "part", "parts", "share", "overlap_steps", "routed_counts", "routing_probe", "post_sync_loss_change", "unrouted_tokens")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_STEPS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_COUNTS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_PROBE_FIELD_NUMBER: _ClassVar[int]
    POST_SYNC_LOSS_CHANGE_FIELD_NUMBER: _ClassVar[int]
    UNROUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    round: int
    island: str
    tokens: int
    total_bytes: int
    crc32: int
    layout: str
    params_checksum: str
    step_seconds: float
    inner_steps: int
    streams: int
    fragment: int
    attempt: int
    fragment_rounds: _containers.RepeatedScalarFieldContainer[int]
    incarnation: str
    part: int
    parts: int
    share: bytes
    overlap_steps: int
    routed_counts: _containers.RepeatedScalarFieldContainer[int]
    routing_probe: bytes
    post_sync_loss_change: float
    unrouted_tokens: int
    def __init__(self, round: _Optional[int] = ..., island: _Optional[str] = ..., tokens: _Optional[int] = ..., total_bytes: _Optional[int] = ..., crc32: _Optional[int] = ..., layout: _Optional[str] = ..., params_checksum: _Optional[str] = ..., step_seconds: _Optional[float] = ..., inner_steps: _Optional[int] = ..., streams: _Optional[int] = ..., fragment: _Optional[int] = ..., attempt: _Optional[int] = ..., fragment_rounds: _Optional[_Iterable[int]] = ..., incarnation: _Optional[str] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ..., share: _Optional[bytes] = ..., overlap_steps: _Optional[int] = ..., routed_counts: _Optional[_Iterable[int]] = ..., routing_probe: _Optional[bytes] = ..., post_sync_loss_change: _Optional[float] = ..., unrouted_tokens: _Optional[int] = ...) -> None: ...

class RawFrame(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ContributeReply(_message.Message):
    __slots__ = ("round", "bytes_received", "crc32", "discarded", "duplicate")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    round: int
    bytes_received: int
    crc32: int
    discarded: bool
    duplicate: bool
    def __init__(self, round: _Optional[int] = ..., bytes_received: _Optional[int] = ..., crc32: _Optional[int] = ..., discarded: _Optional[bool] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("round", "island", "connection", "connections", "fragment", "min_round", "incarnation", "part", "parts", "share")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ISLAND_FIELD_NUMBER: _ClassVar[int]
    CONNECTION_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    FRAGMENT_FIELD_NUMBER: _ClassVar[int]
    MIN_ROUND_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    round: int
    island: str
    connection: int
    connections: int
    fragment: int
    min_round: int
    incarnation: str
    part: int
    parts: int
    share: bytes
    def __init__(self, round: _Optional[int] = ..., island: _Optional[str] = ..., connection: _Optional[int] = ..., connections: _Optional[int] = ..., fragment: _Optional[int] = ..., min_round: _Optional[int] = ..., incarnation: _Optional[str] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ..., share: _Optional[bytes] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BlockLocation(_message.Message):
    __slots__ = ("key", "node_id", "data_address", "slot", "length", "checksum", "control_address", "head_checksums")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEAD_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    node_id: str
    data_address: str
    slot: int
    length: int
    checksum: int
    control_address: str
    head_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[bytes] = ..., node_id: _Optional[str] = ..., data_address: _Optional[str] = ..., slot: _Optional[int] = ..., length: _Optional[int] = ..., checksum: _Optional[int] = ..., control_address: _Optional[str] = ..., head_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class PartialRef(_message.Message):
    __slots__ = ("request_id", "index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("keys", "partials", "lease", "lease_ttl_s", "map_pool")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARTIALS_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    MAP_POOL_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    partials: _containers.RepeatedCompositeFieldContainer[PartialRef]
    lease: bool
    lease_ttl_s: float
    map_pool: bool
    def __init__(self, keys: _Optional[_Iterable[bytes]] = ..., partials: _Optional[_Iterable[_Union[PartialRef, _Mapping]]] = ..., lease: _Optional[bool] = ..., lease_ttl_s: _Optional[float] = ..., map_pool: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("blocks", "partials", "lease_id", "lease_token", "node_id", "pool_id", "pool_map")
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PARTIALS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_MAP_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    partials: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    lease_id: int
    lease_token: bytes
    node_id: str
    pool_id: bytes
    pool_map: bytes
    def __init__(self, blocks: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ..., partials: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ..., lease_id: _Optional[int] = ..., lease_token: _Optional[bytes] = ..., node_id: _Optional[str] = ..., pool_id: _Optional[bytes] = ..., pool_map: _Optional[bytes] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("num_blocks", "ttl_s")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    ttl_s: float
    def __init__(self, num_blocks: _Optional[int] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("reservation_id", "slots", "node_id", "data_address", "block_bytes", "token")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    slots: _containers.RepeatedScalarFieldContainer[int]
    node_id: str
    data_address: str
    block_bytes: int
    token: bytes
    def __init__(self, reservation_id: _Optional[int] = ..., slots: _Optional[_Iterable[int]] = ..., node_id: _Optional[str] = ..., data_address: _Optional[str] = ..., block_bytes: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class CommitBlock(_message.Message):
    __slots__ = ("slot", "key", "partial", "length", "checksum", "head_checksums")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    HEAD_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    slot: int
    key: bytes
    partial: PartialRef
    length: int
    checksum: int
    head_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slot: _Optional[int] = ..., key: _Optional[bytes] = ..., partial: _Optional[_Union[PartialRef, _Mapping]] = ..., length: _Optional[int] = ..., checksum: _Optional[int] = ..., head_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reservation_id", "blocks")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[CommitBlock]
    def __init__(self, reservation_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[CommitBlock, _Mapping]]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("committed", "rejected")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    rejected: int
    def __init__(self, committed: _Optional[int] = ..., rejected: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "reservation_id", "drop_partials_of")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    DROP_PARTIALS_OF_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    reservation_id: int
    drop_partials_of: str
    def __init__(self, lease_id: _Optional[int] = ..., reservation_id: _Optional[int] = ..., drop_partials_of: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("node_id", "block_bytes", "capacity_blocks", "stored_blocks", "free_blocks", "reserved_blocks", "leased_blocks", "active_leases", "active_reservations", "evictions", "lookups", "hit_blocks", "miss_blocks", "bytes_in", "bytes_out", "partial_blocks", "refused_transfers")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    block_bytes: int
    capacity_blocks: int
    stored_blocks: int
    free_blocks: int
    reserved_blocks: int
    leased_blocks: int
    active_leases: int
    active_reservations: int
    evictions: int
    lookups: int
    hit_blocks: int
    miss_blocks: int
    bytes_in: int
    bytes_out: int
    partial_blocks: int
    refused_transfers: int
    def __init__(self, node_id: _Optional[str] = ..., block_bytes: _Optional[int] = ..., capacity_blocks: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., reserved_blocks: _Optional[int] = ..., leased_blocks: _Optional[int] = ..., active_leases: _Optional[int] = ..., active_reservations: _Optional[int] = ..., evictions: _Optional[int] = ..., lookups: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., miss_blocks: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., partial_blocks: _Optional[int] = ..., refused_transfers: _Optional[int] = ...) -> None: ...

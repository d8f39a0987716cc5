"""ckptdrain client: hand checkpoint shards to the node's daemon (standard library only)."""

from ckptdrain.client.client import Client
from ckptdrain.client.errors import (
    AlreadyCommitted,
    Backpressure,
    DaemonUnavailable,
    DestinationError,
    DrainError,
    DuplicateShard,
    GenerationFailed,
    InvalidName,
    NodeDraining,
    NotFound,
    PermissionDenied,
    RejectedInput,
    SizeMismatch,
    Timeout,
    UnsupportedVersion,
)
from ckptdrain.client.generation import Generation

__all__ = [
    "AlreadyCommitted",
    "Backpressure",
    "Client",
    "DaemonUnavailable",
    "DestinationError",
    "DrainError",
    "DuplicateShard",
    "Generation",
    "GenerationFailed",
    "InvalidName",
    "NodeDraining",
    "NotFound",
    "PermissionDenied",
    "RejectedInput",
    "SizeMismatch",
    "Timeout",
    "UnsupportedVersion",
]

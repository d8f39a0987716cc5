"""Typed errors a training process can catch, all under one root: :class:`DrainError`.

Each class is named for what the caller should do about it. The daemon sends an error
``code`` over the wire; :func:`error_for_code` turns it back into the matching class.
"""

from __future__ import annotations

from typing import Any


class DrainError(Exception):
    """Root of every error the ckptdrain client raises."""

    code = "internal"

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = dict(details or {})


class DaemonUnavailable(DrainError):
    """The daemon's socket cannot be reached: start the daemon or check the socket path."""

    code = "unavailable"


class Backpressure(DrainError):
    """The daemon is full; retry after ``retry_after_s`` or slow the checkpoint cadence."""

    code = "backpressure"

    @property
    def retry_after_s(self) -> float:
        value = self.details.get("retry_after_s", 1.0)
        return float(value) if isinstance(value, int | float) else 1.0


class NodeDraining(Backpressure):
    """The node is being drained for maintenance (``ckptdrain drain``) and takes no new
    generation; save through another node, or retry once it is resumed."""

    code = "draining"


class RejectedInput(DrainError):
    """The request itself is wrong (bad name, size mismatch, duplicate): fix the caller."""

    code = "bad_request"


class InvalidName(RejectedInput):
    """A job name or shard path is not acceptable."""

    code = "invalid_name"


class DuplicateShard(RejectedInput):
    """The shard path was already handed off in this generation."""

    code = "duplicate"


class AlreadyCommitted(RejectedInput):
    """The step is committed at the destination; nothing may overwrite it: save a new step."""

    code = "committed"


class DestinationError(DrainError):
    """The daemon could not read the destination, or found it damaged (a malformed manifest):
    check the destination (``ckptdrain verify``) and retry."""

    code = "destination"


class SizeMismatch(RejectedInput):
    """The declared size does not match the bytes sent."""

    code = "size_mismatch"


class UnsupportedVersion(RejectedInput):
    """Client and daemon speak different protocol versions: upgrade one of them."""

    code = "unsupported_version"


class PermissionDenied(DrainError):
    """This uid/gid may not use the daemon or this job: ask the operator to allow it."""

    code = "permission_denied"


class GenerationFailed(DrainError):
    """The generation cannot commit (aborted, failed drain, conflict): save a new one."""

    code = "generation_failed"


class NotFound(DrainError):
    """The job or generation is unknown to the daemon."""

    code = "not_found"


class Timeout(DrainError, TimeoutError):
    """The wait ran out before the operation finished; it may still finish later."""

    code = "timeout"


_BY_CODE: dict[str, type[DrainError]] = {
    cls.code: cls
    for cls in (
        DrainError,
        DaemonUnavailable,
        Backpressure,
        NodeDraining,
        RejectedInput,
        InvalidName,
        DuplicateShard,
        AlreadyCommitted,
        DestinationError,
        SizeMismatch,
        UnsupportedVersion,
        PermissionDenied,
        GenerationFailed,
        NotFound,
        Timeout,
    )
}


def error_for_code(code: str, message: str, details: dict[str, Any] | None = None) -> DrainError:
    """The client-side exception for an error ``code`` sent by the daemon."""
    return _BY_CODE.get(code, DrainError)(message, details=details)

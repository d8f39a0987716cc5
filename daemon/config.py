"""The daemon's configuration: one frozen, validated model per section.

The config is validated once, at load (configload.py), into these frozen models; nothing later
re-reads the file or the environment. A field's checks say what is wrong in the operator's
terms; configload.py turns them into a :class:`ConfigError` naming the dotted key.

This module is the configuration's one import: the destination and drain sections live in
configdestination.py and the field types every section shares in configfields.py, and both
sections are importable from here with the rest.
"""

from __future__ import annotations

import os
import re
import typing
from pathlib import Path
from socket import gethostname
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, Field, field_validator, model_validator

from ckptdrain.client.keys import MAX_NODE_BYTES
from ckptdrain.client.names import MAX_WORLD_SIZE
from ckptdrain.daemon.configdestination import DestinationConfig, DrainConfig
from ckptdrain.daemon.configfields import MODEL_CONFIG, AbsPath, ByteSize, cross_field
from ckptdrain.daemon.errors import ConfigError
from ckptdrain.daemon.sizes import GiB, KiB, TiB, as_written

__all__ = [
    "AccessConfig",
    "Config",
    "ConfigError",
    "DestinationConfig",
    "DrainConfig",
    "LimitsConfig",
    "MetricsConfig",
    "RetentionConfig",
]

# sun_path is 108 bytes on Linux, one of which is the terminating NUL.
_MAX_SOCKET_PATH_BYTES = 107


# ---------------------------------------------------------------------------------------------
# Sections


class LimitsConfig(BaseModel):
    """What the daemon may hold at once, and what it does when full."""

    model_config = MODEL_CONFIG

    max_staged_bytes: ByteSize = Field(default=800 * GiB, ge=1)
    max_memory_bytes: ByteSize = Field(default=64 * GiB, ge=0)
    max_queued_shards: int = Field(default=100_000, ge=1)
    max_generations_in_flight: int = Field(default=2, ge=1)
    on_full: Literal["block", "reject", "supersede"] = "block"
    block_timeout_s: float = Field(default=300.0, ge=0)
    client_idle_timeout_s: float = Field(default=120.0, gt=0)
    open_rank_idle_timeout_s: float = Field(default=3600.0, gt=0)
    max_clients: int = Field(default=1024, ge=1)
    # Shares of the node one uid may take, so one user cannot starve the others.
    # max_clients_per_uid 0 = half of max_clients (512 of the default 1024): a share still
    # where max_clients alone is lowered (a fixed 512 let one uid take all 256 of a node set
    # so: found attacking a shared node). Read it as clients_per_uid.
    max_clients_per_uid: int = Field(default=0, ge=0)
    max_generations_per_uid: int = Field(default=16, ge=1)
    max_jobs: int = Field(default=1000, ge=1)  # jobs tracked on this node at once
    max_reserved_bytes_per_uid: ByteSize = Field(default=0, ge=0)  # 0 = no per-uid cap
    max_queued_shards_per_uid: int = Field(default=0, ge=0)  # 0 = no per-uid cap
    # A frame, or a shard's bytes, that arrives slower than this on average (after the
    # grace period) is cut off and what it reserved is freed: a trickle cannot hold room.
    client_min_bytes_per_s: ByteSize = Field(default=256 * KiB, ge=1)
    client_rate_grace_s: float = Field(default=10.0, gt=0)
    # Errors one uid's clients may cause (allowance.py): a burst, then this many a
    # second; past it the uid's next frames wait (ratelimit.ErrorAllowance). 0 = no limit.
    client_errors_per_s: float = Field(default=20.0, ge=0)
    client_error_burst: int = Field(default=100, ge=1)
    max_shard_bytes: ByteSize = Field(default=1 * TiB, ge=1)
    # Ranks in one generation; every generation's state and status grow with it.
    max_world_size: int = Field(default=65_536, ge=1, le=MAX_WORLD_SIZE)
    # The data plane: threads that move hand-off bytes (socket or fd to staging, fsync,
    # unlink), so hand-offs use the node's cores and never the event loop's thread.
    # 0 = one per core, at least 4 and at most 64.
    io_threads: int = Field(default=0, ge=0, le=1024)
    # One blocking step of a hand-off (copying from a client's fd, an fsync) that takes
    # longer fails that hand-off; its thread is counted as stuck until the call returns.
    io_timeout_s: float = Field(default=600.0, ge=0.1)  # less failed start-up itself (exit 1)
    # Offer clients a pipe for a put's bytes (one copy instead of two). A client can hold its
    # pipe's kernel lock and so wedge the thread that reads it (given up on, counted as
    # stuck, and it keeps a stopping daemon's process from exiting until the client lets
    # go): where local users are not trusted that far, turn it off.
    pipe_handoff: bool = True

    @property
    def clients_per_uid(self) -> int:
        """``max_clients_per_uid``, with 0 resolved: half of ``max_clients``, at least 1."""
        return self.max_clients_per_uid or max(1, self.max_clients // 2)

    @model_validator(mode="after")
    def _check_clients_per_uid(self) -> LimitsConfig:
        if self.max_clients_per_uid > self.max_clients:
            raise cross_field(
                "max_clients_per_uid",
                f"{self.max_clients_per_uid} is more than max_clients ({self.max_clients}): "
                "one uid could take every connection; set it lower, or to 0 (half of "
                "max_clients)",
            )
        return self


class RetentionConfig(BaseModel):
    """Which committed generations are kept."""

    model_config = MODEL_CONFIG

    keep_last: int = Field(default=3, ge=1)
    keep_local_copy: bool = True
    abandoned_grace_s: float = Field(default=3600.0, ge=0)
    # This node forgets failed and cancelled generations this long after they began, and a
    # job (its generations here, its owner, its metric series) once it has begun none for
    # this long. The destination is not touched.
    forget_after_s: float = Field(default=86400.0, gt=0)
    # Failed and cancelled generations kept per job (for retry and status); older ones are
    # forgotten at once.
    keep_failed: int = Field(default=16, ge=1)


_HOST_RE = re.compile(r"^[A-Za-z0-9._-]+$")


def _split_listen(listen: str) -> tuple[str, int] | None:
    if listen == "":
        return None
    example = 'write e.g. "127.0.0.1:9464" or "[::1]:9464", or "" to disable'
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"{as_written(listen)} is not host:port; {example}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not host or not re.match(r"^[0-9A-Fa-f:.]+$", host):
            raise ValueError(f"{as_written(listen)} has a bad IPv6 address; {example}")
    elif not _HOST_RE.match(host):
        raise ValueError(f"{as_written(listen)} has a bad host; {example}")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"{as_written(listen)}: port {port} is above 65535; {example}")
    return host, port


class MetricsConfig(BaseModel):
    """The Prometheus endpoint. Loopback by default; ``""`` disables it; port 0 = any free port."""

    model_config = MODEL_CONFIG

    listen: str = "127.0.0.1:9464"

    @field_validator("listen")
    @classmethod
    def _check_listen(cls, listen: str) -> str:
        _split_listen(listen)
        return listen

    @property
    def enabled(self) -> bool:
        return self.listen != ""

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) to bind, or None when disabled."""
        return _split_listen(self.listen)

    @property
    def host(self) -> str:
        """The bind host ("" when disabled: check ``enabled`` first)."""
        address = self.address
        return address[0] if address else ""

    @property
    def port(self) -> int:
        """The bind port, 0 = any free port (also 0 when disabled: check ``enabled`` first)."""
        address = self.address
        return address[1] if address else 0


_GROUP_RE = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?|\d+)$")
_ID_MAX = 2**32 - 2  # (uid_t)-1 is "no id"


class AccessConfig(BaseModel):
    """Who may use the socket: file mode and group, then a peer-credential allow list."""

    model_config = MODEL_CONFIG

    socket_mode: str = "0660"
    socket_group: str = ""
    allowed_uids: list[int] = Field(default_factory=list)
    allowed_gids: list[int] = Field(default_factory=list)
    # A job's owner is also the uid its newest committed generation names at the destination
    # (owners.py); off only where one user's uid differs between clusters sharing it.
    check_destination_owner: bool = True

    @field_validator("socket_mode", mode="before")
    @classmethod
    def _check_mode(cls, mode: Any) -> Any:
        if isinstance(mode, int) and not isinstance(mode, bool):
            # A TOML integer is decimal unless written 0o660; a quoted string is unambiguous.
            raise ValueError(f"{mode} is a number; write the mode as an octal string, e.g. \"0660\"")
        if isinstance(mode, str):
            text = mode[2:] if mode.lower().startswith("0o") else mode
            if not re.match(r"^[0-7]{1,4}$", text) or int(text, 8) > 0o777:
                raise ValueError(
                    f"{as_written(mode)} is not a permission mode (octal, at most 0777); "
                    "write e.g. \"0660\""
                )
        return mode

    @field_validator("socket_group")
    @classmethod
    def _check_group(cls, group: str) -> str:
        if group and not _GROUP_RE.match(group):
            raise ValueError(f"{as_written(group)} is not a group name or numeric gid")
        # A number past gid_t failed chown at start-up (exit 1), and 4294967295 (-1) meant
        # "leave the group as it is" to chown, silently.
        if group.isdigit() and not 0 <= int(group) <= _ID_MAX:
            raise ValueError(f"{group} is not a valid gid (0 to {_ID_MAX})")
        return group

    @field_validator("allowed_uids", "allowed_gids")
    @classmethod
    def _check_ids(cls, ids: list[int]) -> list[int]:
        for value in ids:
            if not 0 <= value <= _ID_MAX:
                raise ValueError(f"{value} is not a valid uid/gid (0 to {_ID_MAX})")
        return ids

    @property
    def mode_int(self) -> int:
        text = self.socket_mode
        return int(text[2:] if text.lower().startswith("0o") else text, 8)


# As long as a manifest takes (client/manifest.py): a longer one passed `config check`, and
# `serve` then died with a traceback writing its first record.
_NODE_ID_RE = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{MAX_NODE_BYTES - 1}}}$")


class Config(BaseModel):
    """The whole configuration, frozen. Build it with :func:`load_config`."""

    model_config = MODEL_CONFIG

    # Validated even when defaulted: a hostname we cannot use must be reported, not trusted.
    node_id: str = Field(default_factory=lambda: gethostname(), validate_default=True)
    socket: AbsPath = Path("/run/ckptdrain.sock")
    staging_dir: AbsPath = Path("/var/lib/ckptdrain/staging")
    ack: Literal["local", "memory"] = "local"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    destination: DestinationConfig = Field(default_factory=DestinationConfig)
    drain: DrainConfig = Field(default_factory=DrainConfig)
    retention: RetentionConfig = Field(default_factory=RetentionConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    access: AccessConfig = Field(default_factory=AccessConfig)

    @field_validator("node_id")
    @classmethod
    def _check_node_id(cls, node_id: str) -> str:
        if not _NODE_ID_RE.match(node_id):
            raise ValueError(
                f"{as_written(node_id)} is not a valid node id (letters, digits, '.', '_', '-', "
                f"starting with a letter or digit, at most {MAX_NODE_BYTES}); set node_id explicitly"
            )
        return node_id

    @field_validator("socket")
    @classmethod
    def _check_socket(cls, path: Path) -> Path:
        if not path.is_absolute():
            raise ValueError(f"{as_written(str(path))} is relative; give an absolute path")
        if len(os.fsencode(path)) > _MAX_SOCKET_PATH_BYTES:
            raise ValueError(
                f"{as_written(str(path))} is longer than {_MAX_SOCKET_PATH_BYTES} bytes, the limit "
                "for a Unix socket path; choose a shorter path"
            )
        return path

    @field_validator("staging_dir")
    @classmethod
    def _check_staging(cls, path: Path) -> Path:
        if not path.is_absolute():
            raise ValueError(f"{as_written(str(path))} is relative; give an absolute path")
        return path

    @model_validator(mode="after")
    def _check_memory_tier(self) -> Config:
        if self.ack == "memory" and self.limits.max_memory_bytes == 0:
            raise cross_field(
                "ack",
                '"memory" needs a RAM tier, but limits.max_memory_bytes is 0; '
                'raise it or use ack = "local"',
            )
        return self

    @model_validator(mode="after")
    def _check_destination_apart(self) -> Config:
        """A ``file://`` destination neither inside ``staging_dir`` nor around it. Inside, the
        node's own disk held the "shared" copy, and staging's room counted the destination's
        bytes as staged (found as a new operator: `config check` said OK). Around it, the
        destination's listing met the daemon's own files."""
        if self.destination.scheme != "file":
            return self
        root = Path(os.path.normpath(self.destination.root_path))
        staging = Path(os.path.normpath(self.staging_dir))
        if root.is_relative_to(staging) or staging.is_relative_to(root):
            where = "inside" if root.is_relative_to(staging) else "around"
            raise cross_field(
                "destination.uri",
                f"{as_written(self.destination.uri)} is {where} staging_dir ({staging}): the "
                "destination is the shared filesystem, staging the node's own disk; put each "
                "outside the other")
        return self

    @property
    def journal_path(self) -> Path:
        return self.staging_dir / "journal.sqlite3"

    @property
    def root_devices_path(self) -> Path:
        """Which filesystem the destination root was on (beneath.RootDevices)."""
        return self.staging_dir / "destination-roots.json"

    def redacted_dict(self) -> dict[str, Any]:
        """JSON-ready dict for logging and ``status``, with credentials masked."""
        data = self.model_dump(mode="json")
        return typing.cast(dict[str, Any], _redact(data))


_SECRET_KEY_RE = re.compile(r"secret|token|password|passwd|credential|^aws_.*key", re.I)


def _redact(value: Any, key: str = "") -> Any:
    if key and _SECRET_KEY_RE.search(key):
        return "***"
    if isinstance(value, dict):
        return {k: _redact(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v) for v in value]
    if isinstance(value, str) and "@" in value and "://" in value:
        parts = urlsplit(value)
        if parts.password is not None or parts.username is not None:
            host = parts.hostname or ""
            if parts.port is not None:
                host = f"{host}:{parts.port}"
            return urlunsplit(parts._replace(netloc=f"***@{host}"))
    return value

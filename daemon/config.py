"""The daemon's configuration: TOML file, embedded default, environment overrides.

The config is validated once, at load, into frozen models; nothing later re-reads the file or
the environment. Every problem becomes a :class:`ConfigError` that names the dotted key and says
how to fix it; pydantic's own error text never reaches an operator (the CLI maps ConfigError to
exit code 78, ``EX_CONFIG``).

Precedence, lowest first: field defaults (the systemd install: ``/run/ckptdrain.sock``,
``/var/lib/ckptdrain``), then either the TOML file (``--config PATH`` or ``$CKPTDRAIN_CONFIG``)
or, when there is no file, the embedded default (per-user directories, no root needed), then
``CKPTDRAIN_<KEY>`` / ``CKPTDRAIN_<SECTION>__<KEY>`` environment variables.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation, localcontext
from pathlib import Path
from socket import gethostname
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ckptdrain.client.manifest import MAX_NODE_BYTES
from ckptdrain.client.names import MAX_WORLD_SIZE
from ckptdrain.daemon.errors import ConfigError
from ckptdrain.daemon.uris import split_uri

__all__ = [
    "ENV_IGNORED",
    "ENV_IGNORED_PREFIXES",
    "ENV_PREFIX",
    "AccessConfig",
    "Config",
    "ConfigError",
    "DestinationConfig",
    "DrainConfig",
    "LimitsConfig",
    "MetricsConfig",
    "RetentionConfig",
    "default_socket_path",
    "embedded_default",
    "load_config",
    "parse_size",
]

ENV_PREFIX = "CKPTDRAIN_"
# Variables in our namespace that are not config keys: where the config lives, and names that
# tests and tooling use for themselves.
ENV_IGNORED = frozenset({"CKPTDRAIN_CONFIG", "CKPTDRAIN_HOME"})
ENV_IGNORED_PREFIXES = ("CKPTDRAIN_TEST_",)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

# sun_path is 108 bytes on Linux, one of which is the terminating NUL.
_MAX_SOCKET_PATH_BYTES = 107


# ---------------------------------------------------------------------------------------------
# Sizes


_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": KiB,
    "MiB": MiB,
    "GiB": GiB,
    "TiB": TiB,
}
_MAX_SIZE = 2**63 - 1  # off_t
_SIZE_RE = re.compile(r"^\s*([+-]?(?:\d[\d_]*)?(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string such as ``"800GiB"``, ``"1.5GB"``, ``"4096"`` or ``"0"``.

    Units are binary (KiB MiB GiB TiB), decimal (KB MB GB TB) or ``B``. Raises ValueError with
    an operator-facing message for anything else, for negative sizes and for fractions of a byte.
    """
    if isinstance(value, bool):  # bool is an int subclass; `true` is never a size
        raise ValueError(f"{_show(value)} is not a size; write e.g. \"800GiB\"")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value} is negative; a size must be 0 or more bytes")
        if value > _MAX_SIZE:
            raise ValueError(f"{value} is too large for a size (at most 2^63-1 bytes)")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{_show(value)} is not a size; write e.g. \"800GiB\"")
    match = _SIZE_RE.match(value)
    number_text = match.group(1) if match else ""
    if not match or not any(ch.isdigit() for ch in number_text):
        raise ValueError(f"{_show(value)} is not a size; write e.g. \"800GiB\"")
    unit = match.group(2)
    if unit not in _SIZE_UNITS:
        raise ValueError(
            f"{_show(value)} is not a size; write e.g. \"800GiB\" (units: B, KiB, MiB, GiB, "
            "TiB, KB, MB, GB, TB)"
        )
    try:
        number = Decimal(number_text.replace("_", ""))
    except InvalidOperation:
        raise ValueError(f"{_show(value)} is not a size; write e.g. \"800GiB\"") from None
    if number < 0:
        raise ValueError(f"{_show(value)} is negative; a size must be 0 or more bytes")
    if number.adjusted() > 30:
        raise ValueError(f"{_show(value)} is too large for a size (at most 2^63-1 bytes)")
    with localcontext() as ctx:
        ctx.prec = 80  # exact for any number that passed the check above
        total = number * _SIZE_UNITS[unit]
    if total > _MAX_SIZE:
        # Checked before int(): "1e999999999" must not build a billion-digit integer.
        raise ValueError(f"{_show(value)} is too large for a size (at most 2^63-1 bytes)")
    if total != total.to_integral_value():
        raise ValueError(f"{_show(value)} is not a whole number of bytes")
    return int(total)


def _size(value: Any) -> Any:
    return parse_size(value)


def _show(value: Any) -> str:
    """A value as the operator wrote it: strings in double quotes, like TOML."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _path(value: Any) -> Any:
    if isinstance(value, str):
        if not value:
            raise ValueError("is empty; give an absolute path")
        return Path(value).expanduser()
    return value


ByteSize = Annotated[int, BeforeValidator(_size)]
AbsPath = Annotated[Path, BeforeValidator(_path)]

_MODEL_CONFIG = ConfigDict(extra="forbid", frozen=True, strict=True)


def _cross_field(field: str, message: str) -> PydanticCustomError:
    # The field name rides in ctx so the error is reported against the right dotted key.
    return PydanticCustomError("cross_field", message, {"field": field})


# ---------------------------------------------------------------------------------------------
# Sections


class LimitsConfig(BaseModel):
    """What the daemon may hold at once, and what it does when full."""

    model_config = _MODEL_CONFIG

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
    max_clients_per_uid: int = Field(default=512, ge=1)
    max_generations_per_uid: int = Field(default=16, ge=1)
    max_jobs: int = Field(default=1000, ge=1)  # jobs tracked on this node at once
    max_reserved_bytes_per_uid: ByteSize = Field(default=0, ge=0)  # 0 = no per-uid cap
    max_queued_shards_per_uid: int = Field(default=0, ge=0)  # 0 = no per-uid cap
    # A frame, or a shard's bytes, that arrives slower than this on average (after the
    # grace period) is cut off and what it reserved is freed: a trickle cannot hold room.
    client_min_bytes_per_s: ByteSize = Field(default=256 * KiB, ge=1)
    client_rate_grace_s: float = Field(default=10.0, gt=0)
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


class DestinationConfig(BaseModel):
    """Where generations are committed: ``file:///abs/path`` (POSIX, Lustre) or
    ``s3://bucket[/prefix]``. ``memory://name`` selects the in-process test backend."""

    model_config = _MODEL_CONFIG

    uri: str = "file:///var/lib/ckptdrain/destination"
    endpoint_url: str | None = None
    region: str = Field(default="us-east-1", min_length=1)
    addressing_style: Literal["auto", "path", "virtual"] = "path"
    # Who sends single-request uploads and the commit's HEADs: botocore, or the AWS common
    # runtime's S3 client (backends/s3crt.py). Everything else is botocore's either way.
    engine: Literal["aiobotocore", "crt"] = "aiobotocore"
    # The commit proves the shards this daemon created from one listing of their directory
    # (size and ETag) instead of a HEAD each. Off for a store whose listings may still show
    # an object after it was deleted or overwritten (backends/s3proof.py).
    prove_by_listing: bool = True
    checksum: Literal["when_required", "when_supported"] = "when_required"
    retry_mode: Literal["standard", "adaptive", "legacy"] = "standard"
    max_attempts: int = Field(default=5, ge=1, le=100)
    part_size_bytes: ByteSize = Field(default=64 * MiB, ge=5 * MiB, le=5 * GiB)
    multipart_threshold_bytes: ByteSize = Field(default=64 * MiB, ge=0, le=5 * GiB)
    max_concurrency: int = Field(default=8, ge=1, le=1024)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    read_timeout_s: float = Field(default=120.0, gt=0)
    orphan_grace_s: float = Field(default=3600.0, ge=0)
    stripe_count: int = Field(default=-1, ge=-1)
    stripe_size_bytes: ByteSize = Field(default=4 * MiB, ge=0)

    @field_validator("uri")
    @classmethod
    def _check_uri(cls, uri: str) -> str:
        split_uri(uri)
        return uri

    @field_validator("endpoint_url")
    @classmethod
    def _check_endpoint(cls, url: str | None) -> str | None:
        if url is None:
            return None
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"{_show(url)} is not an http(s) URL; write e.g. \"http://127.0.0.1:8333\""
            )
        return url

    @field_validator("stripe_size_bytes")
    @classmethod
    def _check_stripe_size(cls, size: int) -> int:
        # Lustre refuses stripe sizes that are not a multiple of 64 KiB; say so at load time
        # rather than at the first `lfs setstripe`.
        if size % (64 * KiB):
            raise ValueError(f"{size} is not a multiple of 64KiB; write e.g. \"4MiB\"")
        return size

    @property
    def scheme(self) -> str:
        """``"file"``, ``"s3"`` or ``"memory"``."""
        return split_uri(self.uri)[0]

    @property
    def root_path(self) -> Path:
        """The destination directory of a ``file://`` URI."""
        scheme, location, _ = split_uri(self.uri)
        if scheme != "file":
            raise ValueError(f"{self.uri} is not a file:// destination")
        return Path(location)

    @property
    def bucket(self) -> str:
        """The bucket of an ``s3://`` URI."""
        scheme, location, _ = split_uri(self.uri)
        if scheme != "s3":
            raise ValueError(f"{self.uri} is not an s3:// destination")
        return location

    @property
    def prefix(self) -> str:
        """The key prefix of an ``s3://`` URI without leading or trailing ``/`` ("" for none):
        object keys are ``f"{prefix}/{key}"``, or ``key`` when the prefix is empty."""
        scheme, _, prefix = split_uri(self.uri)
        if scheme != "s3":
            raise ValueError(f"{self.uri} is not an s3:// destination")
        return prefix


class DrainConfig(BaseModel):
    """How shards move from staging to the destination."""

    model_config = _MODEL_CONFIG

    max_bandwidth_bytes_per_s: ByteSize = Field(default=0, ge=0)
    retry_budget_s: float = Field(default=300.0, ge=0)
    retry_initial_backoff_s: float = Field(default=0.5, gt=0)
    retry_max_backoff_s: float = Field(default=30.0, gt=0)
    commit_poll_interval_s: float = Field(default=1.0, gt=0)
    # How long a generation waits for the other nodes after this node recorded its part; then
    # it fails and frees its max_generations_in_flight slot (a node that never comes back
    # must not block the job for good).
    commit_wait_s: float = Field(default=3600.0, gt=0)
    # Processes that send S3 part bodies (each its own event loop and S3 client), so the S3
    # drain scales with the node's cores instead of one event-loop thread. -1: from the core
    # count; 0: on the daemon's own event loop. POSIX destinations do not use them.
    workers: int = Field(default=-1, ge=-1, le=64)
    # While a hand-off to local storage is in flight (a rank waits on it), the drain starts no
    # new copied range or part for up to this long: training waits on hand-offs, nobody waits
    # on the drain second by second. 0: the drain never waits.
    yield_to_handoffs_s: float = Field(default=2.0, ge=0, le=60)

    @property
    def worker_count(self) -> int:
        """``workers``, with -1 resolved: a quarter of the cores, 1 to 8."""
        if self.workers >= 0:
            return self.workers
        return max(1, min(8, (os.cpu_count() or 1) // 4))

    @model_validator(mode="after")
    def _check_backoff(self) -> DrainConfig:
        if self.retry_max_backoff_s < self.retry_initial_backoff_s:
            raise _cross_field(
                "retry_max_backoff_s",
                f"{self.retry_max_backoff_s:g} is below retry_initial_backoff_s "
                f"({self.retry_initial_backoff_s:g}); raise it or lower the initial backoff",
            )
        return self


class RetentionConfig(BaseModel):
    """Which committed generations are kept."""

    model_config = _MODEL_CONFIG

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
        raise ValueError(f"{_show(listen)} is not host:port; {example}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if not host or not re.match(r"^[0-9A-Fa-f:.]+$", host):
            raise ValueError(f"{_show(listen)} has a bad IPv6 address; {example}")
    elif not _HOST_RE.match(host):
        raise ValueError(f"{_show(listen)} has a bad host; {example}")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"{_show(listen)}: port {port} is above 65535; {example}")
    return host, port


class MetricsConfig(BaseModel):
    """The Prometheus endpoint. Loopback by default; ``""`` disables it; port 0 = any free port."""

    model_config = _MODEL_CONFIG

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

    model_config = _MODEL_CONFIG

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
                    f"{_show(mode)} is not a permission mode (octal, at most 0777); "
                    "write e.g. \"0660\""
                )
        return mode

    @field_validator("socket_group")
    @classmethod
    def _check_group(cls, group: str) -> str:
        if group and not _GROUP_RE.match(group):
            raise ValueError(f"{_show(group)} is not a group name or numeric gid")
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

    model_config = _MODEL_CONFIG

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
                f"{_show(node_id)} is not a valid node id (letters, digits, '.', '_', '-', "
                f"starting with a letter or digit, at most {MAX_NODE_BYTES}); set node_id explicitly"
            )
        return node_id

    @field_validator("socket")
    @classmethod
    def _check_socket(cls, path: Path) -> Path:
        if not path.is_absolute():
            raise ValueError(f"{_show(str(path))} is relative; give an absolute path")
        if len(os.fsencode(path)) > _MAX_SOCKET_PATH_BYTES:
            raise ValueError(
                f"{_show(str(path))} is longer than {_MAX_SOCKET_PATH_BYTES} bytes, the limit "
                "for a Unix socket path; choose a shorter path"
            )
        return path

    @field_validator("staging_dir")
    @classmethod
    def _check_staging(cls, path: Path) -> Path:
        if not path.is_absolute():
            raise ValueError(f"{_show(str(path))} is relative; give an absolute path")
        return path

    @model_validator(mode="after")
    def _check_memory_tier(self) -> Config:
        if self.ack == "memory" and self.limits.max_memory_bytes == 0:
            raise _cross_field(
                "ack",
                '"memory" needs a RAM tier, but limits.max_memory_bytes is 0; '
                'raise it or use ack = "local"',
            )
        return self

    @property
    def journal_path(self) -> Path:
        return self.staging_dir / "journal.sqlite3"

    def with_limits_from(self, other: Config) -> Config:
        """This config with ``limits`` (but ``io_threads`` and ``io_timeout_s``) and
        ``log_level`` taken from ``other`` (SIGHUP reload: everything else needs a restart, so
        a reload never changes it)."""
        merged = self.model_dump()
        # Except the data plane's size and timeout, fixed when it was built (a restart).
        merged["limits"] = {**other.limits.model_dump(),
                            "io_threads": self.limits.io_threads,
                            "io_timeout_s": self.limits.io_timeout_s}
        merged["log_level"] = other.log_level
        return _validate(merged, sources={})

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


# ---------------------------------------------------------------------------------------------
# Loading


def default_socket_path(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_RUNTIME_DIR/ckptdrain-<uid>.sock``, else ``/tmp/ckptdrain-<uid>.sock``: the same
    fallback the client uses when neither ``socket_path=`` nor ``$CKPTDRAIN_SOCKET`` is given."""
    env = os.environ if env is None else env
    runtime_dir = env.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(runtime_dir) / f"ckptdrain-{os.getuid()}.sock"


def _state_home(env: Mapping[str, str]) -> Path:
    state = env.get("XDG_STATE_HOME")
    if state:
        return Path(state)
    home = env.get("HOME")
    return (Path(home) if home else Path.home()) / ".local" / "state"


def embedded_default(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The config used when no file is given: per-user directories, a ``file://`` destination
    and loopback metrics, so ``ckptdrain serve`` works without root and without a file."""
    env = os.environ if env is None else env
    state = _state_home(env) / "ckptdrain"
    return {
        "socket": str(default_socket_path(env)),
        "staging_dir": str(state / "staging"),
        "destination": {"uri": (state / "destination").as_uri()},
        "metrics": {"listen": "127.0.0.1:9464"},
    }


def load_config(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> Config:
    """Load, merge and validate the config; raises :class:`ConfigError` for every problem.

    ``path`` is the TOML file; without it ``env["CKPTDRAIN_CONFIG"]`` names one; without that
    the embedded default is used. ``env`` (default ``os.environ``) supplies the overrides.
    """
    env = os.environ if env is None else env
    if path is None and env.get("CKPTDRAIN_CONFIG"):
        path = env["CKPTDRAIN_CONFIG"]
    if path is not None:
        data = _read_toml(Path(path))
        origin = f"in {os.fspath(path)}"
    else:
        data = embedded_default(env)
        origin = "in the embedded default"
    sources: dict[str, str] = {}
    for key, (dotted, value) in _env_overrides(env).items():
        section, _, name = dotted.partition(".")
        if name:
            target = data.setdefault(section, {})
            if not isinstance(target, dict):
                raise ConfigError(section, f"is a section; write it as [{section}] {origin}")
            target[name] = value
        else:
            data[section] = value
        sources[dotted] = f"set by {key}"
    return _validate(data, sources=sources, default_source=origin)


def _read_toml(path: Path) -> dict[str, Any]:
    where = os.fspath(path)
    hint = "pass --config PATH with an existing file, or unset CKPTDRAIN_CONFIG"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(where, f"no such config file; {hint}") from None
    except IsADirectoryError:
        raise ConfigError(where, f"is a directory, not a config file; {hint}") from None
    except OSError as exc:
        raise ConfigError(
            where, f"cannot read the config file ({exc.strerror}); fix its permissions"
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            where, f"is not UTF-8 text (byte {exc.start}); save it as UTF-8"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(where, f"TOML syntax error: {exc}; fix the file") from None


_SECTIONS: dict[str, type[BaseModel]] = {
    "limits": LimitsConfig,
    "destination": DestinationConfig,
    "drain": DrainConfig,
    "retention": RetentionConfig,
    "metrics": MetricsConfig,
    "access": AccessConfig,
}


def _env_overrides(env: Mapping[str, str]) -> dict[str, tuple[str, Any]]:
    """``{VARIABLE: (dotted key, typed value)}`` for every ``CKPTDRAIN_*`` override."""
    top_fields = {k: f for k, f in Config.model_fields.items() if k not in _SECTIONS}
    known = sorted(
        [ENV_PREFIX + k.upper() for k in top_fields]
        + [
            f"{ENV_PREFIX}{section.upper()}__{name.upper()}"
            for section, model in _SECTIONS.items()
            for name in model.model_fields
        ]
    )
    found: dict[str, tuple[str, Any]] = {}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in ENV_IGNORED:
            continue
        if var.startswith(ENV_IGNORED_PREFIXES):
            continue
        rest = var[len(ENV_PREFIX) :].lower()
        section, sep, name = rest.partition("__")
        if sep and section in _SECTIONS and name in _SECTIONS[section].model_fields:
            annotation = _SECTIONS[section].model_fields[name].annotation
            found[var] = (f"{section}.{name}", _from_env(env[var], annotation))
        elif not sep and rest in top_fields:
            found[var] = (rest, _from_env(env[var], top_fields[rest].annotation))
        elif not sep and rest not in _SECTIONS:
            # Not config-shaped: the client's own variables (CKPTDRAIN_ATTEMPT, ...) and
            # other tools' share the prefix. Only CKPTDRAIN_<KEY> for a top-level key and
            # CKPTDRAIN_<SECTION>__<KEY> are config; a typo in the latter is still reported.
            continue
        else:
            if not sep:
                reason = f"names a section; set {var}__<KEY> for one of its keys"
            else:
                reason = "is not a ckptdrain setting; remove it or fix the spelling"
                close = difflib.get_close_matches(var, known, n=1)
                if close:
                    reason += f" (did you mean {close[0]}?)"
            raise ConfigError(var, reason)
    return found


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _from_env(text: str, annotation: Any) -> Any:
    """An environment string as the field's type; left a string when it does not parse, so
    validation reports it against the key like any other wrong value."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        if text == "":
            return None
        annotation = next(a for a in args if a is not type(None))
        origin = typing.get_origin(annotation)
    if annotation is bool:
        low = text.strip().lower()
        return True if low in _TRUE else False if low in _FALSE else text
    if annotation is int:
        try:
            return int(text)
        except ValueError:
            return text  # sizes like "64MiB" are parsed by the field itself
    if annotation is float:
        try:
            return float(text)
        except ValueError:
            return text
    if origin is list:
        stripped = text.strip()
        if stripped.startswith("["):
            try:
                return json.loads(stripped)
            except (json.JSONDecodeError, RecursionError):
                return text
        items = [item.strip() for item in stripped.split(",") if item.strip()]
        (item_type,) = typing.get_args(annotation) or (str,)
        return [_from_env(item, item_type) for item in items]
    return text


def _validate(
    data: dict[str, Any], *, sources: Mapping[str, str], default_source: str = ""
) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        key = _dotted(first)
        reason = _reason(first, key)
        source = sources.get(key) or sources.get(key.split("[")[0]) or default_source
        if source:
            reason += f" ({source})"
        if len(errors) > 1:
            reason += f"; {len(errors) - 1} more problem(s) after this one"
        raise ConfigError(key, reason) from None


def _dotted(error: Mapping[str, Any]) -> str:
    key = ""
    for part in error["loc"]:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    field = (error.get("ctx") or {}).get("field")
    if field:
        key = f"{key}.{field}" if key else str(field)
    return key or "config"


_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "model_type": "a table (a [section])",
    "dict_type": "a table (a [section])",
    "path_type": "a path string",
    "is_instance_of": "a path string",
}


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__


def _reason(error: Mapping[str, Any], key: str) -> str:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    value = error.get("input")
    if kind == "extra_forbidden":
        parent, _, name = key.rpartition(".")
        model = _SECTIONS.get(parent, Config if not parent else None)
        reason = "unknown key; remove it or fix the spelling"
        if model is not None:
            close = difflib.get_close_matches(name, list(model.model_fields), n=1)
            if close:
                reason += f" (did you mean {close[0]}?)"
        return reason
    if kind == "value_error":
        message = str(ctx.get("error", error["msg"]))
        return message
    if kind == "cross_field":
        return str(error["msg"])
    if kind in _TYPE_WORDS:
        return f"expected {_TYPE_WORDS[kind]}, got {_show(value)} ({_type_name(value)})"
    if kind == "literal_error":
        return f"{_show(value)} is not one of {ctx.get('expected', '')}".replace("'", '"')
    bounds = {
        "greater_than_equal": (">=", "ge"),
        "greater_than": (">", "gt"),
        "less_than_equal": ("<=", "le"),
        "less_than": ("<", "lt"),
    }
    if kind in bounds:
        symbol, ctx_key = bounds[kind]
        limit = ctx.get(ctx_key)
        if key.endswith("_bytes"):
            return f"must be {symbol} {_human_bytes(limit)} (got {_human_bytes(value)})"
        return f"must be {symbol} {limit} (got {_show(value)})"
    if kind == "string_too_short":
        return "must not be empty"
    return f"{_show(value)} is not valid: {error['msg']}"


def _human_bytes(value: Any) -> str:
    if not isinstance(value, int):
        return str(value)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value >= size and value % size == 0:
            return f"{value // size}{unit}"
    return f"{value}B"

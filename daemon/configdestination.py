"""The destination and drain sections: where committed generations go, and how shards get there.

Apart from config.py because these two are what the backends and the drain read (every backend
is built from a :class:`DestinationConfig`), and together they are the largest part of the
configuration. config.py's :class:`Config` holds them and re-exports both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, field_validator, model_validator

from ckptdrain.daemon.configfields import MODEL_CONFIG, ByteSize, cross_field
from ckptdrain.daemon.sizes import GiB, KiB, MiB, as_written
from ckptdrain.daemon.uris import split_uri

__all__ = ["DestinationConfig", "DrainConfig"]


class DestinationConfig(BaseModel):
    """Where generations are committed: ``file:///abs/path`` (POSIX, Lustre) or
    ``s3://bucket[/prefix]``. ``memory://name`` selects the in-process test backend."""

    model_config = MODEL_CONFIG

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
        try:
            if parts.port == 0:  # (raises ValueError for a port past 65535)
                raise ValueError
        except ValueError:
            raise ValueError(f"{as_written(url)} has no valid port (1 to 65535); write e.g. "
                             "\"http://127.0.0.1:8333\"") from None
        if (parts.scheme not in ("http", "https") or not parts.hostname
                or not url.isprintable() or any(ch.isspace() for ch in url)):
            raise ValueError(
                f"{as_written(url)} is not an http(s) URL; write e.g. \"http://127.0.0.1:8333\""
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

    model_config = MODEL_CONFIG

    max_bandwidth_bytes_per_s: ByteSize = Field(default=0, ge=0)
    retry_budget_s: float = Field(default=300.0, ge=0)
    retry_initial_backoff_s: float = Field(default=0.5, gt=0)
    retry_max_backoff_s: float = Field(default=30.0, gt=0)
    # At least 10 ms: a poll interval of 1e-300 s spun the event loop.
    commit_poll_interval_s: float = Field(default=1.0, ge=0.01)
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
            raise cross_field(
                "retry_max_backoff_s",
                f"{self.retry_max_backoff_s:g} is below retry_initial_backoff_s "
                f"({self.retry_initial_backoff_s:g}); raise it or lower the initial backoff",
            )
        return self

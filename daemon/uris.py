"""Destination URIs (``file:///path``, ``s3://bucket/prefix``, ``memory://name``): their parts,
and one sentence saying how to fix one that is wrong.

Apart from config.py (pydantic, and its models) so that the commands that only read a
destination can check the URI they are given without loading the configuration.
"""

from __future__ import annotations

import json
import os
import re
from urllib.parse import unquote, urlsplit


def _quoted(uri: str) -> str:
    # As the operator wrote it, in TOML's quotes (sizes.as_written does the same for any value).
    return json.dumps(uri)


_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_PREFIX_SEGMENT_RE = re.compile(r"^[A-Za-z0-9!_.*'()=+,;:@ -]+$")


def split_uri(uri: str) -> tuple[str, str, str]:
    """(scheme, root path or bucket or name, s3 prefix); ValueError says how to fix the URI."""
    example = 'write e.g. "file:///lustre/proj/ckpt" or "s3://bucket/prefix"'
    if not uri.startswith(("file://", "s3://", "memory://")):
        # urlsplit takes "FILE:///p" and "file:/p" too, which the backends (matched on the
        # text) then refused with a traceback (found attacking the URI checks).
        raise ValueError(f"{_quoted(uri)} is not a supported destination (the scheme in lower "
                         f"case, then \"://\"); {example}")
    parts = urlsplit(uri)
    if parts.query or parts.fragment:
        raise ValueError(f"{_quoted(uri)} has a query or fragment; {example}")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"{_quoted(uri)} is not an absolute file:// URI; {example}")
        path = unquote(parts.path)
        if "\x00" in path or any(seg == ".." for seg in path.split("/")):
            raise ValueError(f"{_quoted(uri)} must not contain \"..\" or NUL; {example}")
        return "file", os.path.normpath(path), ""
    if parts.scheme == "s3":
        bucket = parts.netloc
        if not _BUCKET_RE.match(bucket) or ".." in bucket:
            raise ValueError(
                f"{_quoted(uri)} does not name a valid bucket (3-63 characters of a-z 0-9 . -); "
                f"{example}"
            )
        prefix = parts.path.strip("/")
        segments = prefix.split("/") if prefix else []
        for seg in segments:
            if not seg or seg in (".", "..") or not _PREFIX_SEGMENT_RE.match(seg):
                raise ValueError(
                    f"{_quoted(uri)} has an unsafe prefix segment {seg!r}; {example}"
                )
        return "s3", bucket, prefix
    if parts.scheme == "memory":
        if not parts.netloc and not parts.path:
            raise ValueError(f"{_quoted(uri)} needs a name, e.g. \"memory://test\"")
        return "memory", parts.netloc + parts.path, ""
    raise ValueError(f"{_quoted(uri)} is not a supported destination; {example}")

"""The typed fields of an on-storage record (pure): how each is read and checked, and the
:class:`ManifestError` a bad one raises.

Part records and manifests (``manifest.py``) read every field through these, so a field is
checked the same way in both: typed, bounded, and named in the message. A checksum is a field
too: ``"<algo>:<hex>"``, as on storage and on the wire. Apart from ``manifest.py`` because they
know no record, only fields; ``keys.py`` and ``shardentries.py`` use them as well.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ckptdrain.client.errors import RejectedInput

# What new shards get: the value S3 validates as the object's full-object checksum.
CHECKSUM_ALGO = "crc64nvme"
_HEX_DIGITS = {"sha256": 64, "crc64nvme": 16}
_HEX_RE = re.compile(r"[0-9a-f]+")
# A checksum parse_checksum accepts, in one match (see is_plain_checksum).
_PLAIN_CHECKSUM = re.compile("|".join(f"{algo}:[0-9a-f]{{{digits}}}"
                                      for algo, digits in _HEX_DIGITS.items()))

_T = TypeVar("_T")


class ManifestError(ValueError):
    """A part record or manifest is malformed or inconsistent; the message names the field."""


def checked(fn: Callable[..., _T], value: object, *args: object) -> _T:
    """Run a names.py validator, turning its client-facing error into a ManifestError."""
    try:
        return fn(value, *args)
    except RejectedInput as exc:
        raise ManifestError(exc.message) from exc


# --- checksums ------------------------------------------------------------------------------


def format_checksum(algo: str, digest_hex: str) -> str:
    """``"<algo>:<hex>"``, the form every checksum takes on storage and on the wire."""
    return _checksum_string(algo, digest_hex, "checksum")


def parse_checksum(checksum: str) -> tuple[str, str]:
    """Split ``"crc64nvme:<16 hex>"`` (or format 1's ``"sha256:<64 hex>"``) into
    ``(algo, hex)``; anything else is a ManifestError."""
    if not isinstance(checksum, str) or ":" not in checksum:
        raise ManifestError(f"checksum {checksum!r} is not of the form '{CHECKSUM_ALGO}:<hex>'")
    algo, _, digest = checksum.partition(":")
    _checksum_string(algo, digest, "checksum")
    return algo, digest


def is_plain_checksum(checksum: object) -> bool:
    """Whether parse_checksum accepts ``checksum``, by one match: every shard entry of every
    record read checks one. False says only that parse_checksum must say what is wrong."""
    return type(checksum) is str and _PLAIN_CHECKSUM.fullmatch(checksum) is not None


def _checksum_string(algo: str, digest_hex: str, what: str) -> str:
    expected = _HEX_DIGITS.get(algo)
    if expected is None:
        raise ManifestError(f"{what} algorithm {algo!r} is not supported; use {CHECKSUM_ALGO!r}")
    if len(digest_hex) != expected or not _HEX_RE.fullmatch(digest_hex):
        raise ManifestError(
            f"{what} digest {digest_hex!r} is not {expected} lowercase hex digits for {algo}"
        )
    return f"{algo}:{digest_hex}"


# --- typed field readers (shared by both formats) -------------------------------------------


# No field of a record is larger (a step, a size in bytes, a uid); past it, a number a hostile
# writer planted (10**400) crashed every reader that did arithmetic with it (found attacking).
MAX_FIELD_INT = 2**63 - 1
# The last second of year 9999: later, a clock is no time a reader can show (found attacking:
# 1e20 crashed `ls`).
MAX_CLOCK = 253402300799.0


def shown(number: int | float) -> str:
    """``number`` for a message, short whatever its size (str() of a 5,000-digit int raises)."""
    if isinstance(number, int) and abs(number) > MAX_FIELD_INT:
        return f"an integer of {number.bit_length()} bits"
    return f"{number:.6g}" if isinstance(number, float) else str(number)


def int_field(value: object, what: str, *, minimum: int = 0) -> int:
    # bool is an int subclass; ``true`` in a size field is corruption, not 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError(f"{what} must be an integer, not {type(value).__name__}")
    if not minimum <= value <= MAX_FIELD_INT:
        raise ManifestError(f"{what} is {shown(value)}; it must be {minimum}..{MAX_FIELD_INT}")
    return value


def str_field(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ManifestError(f"{what} must be a string, not {type(value).__name__}")
    return value


def list_field(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise ManifestError(f"{what} must be a list, not {type(value).__name__}")
    return value


def object_field(
    value: object, what: str, fields: frozenset[str], optional: frozenset[str] = frozenset()
) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ManifestError(f"{what} must be an object, not {type(value).__name__}")
    missing = sorted(fields - value.keys())
    if missing:
        raise ManifestError(f"{what} lacks {', '.join(missing)}")
    # Strict: an unknown field means a newer or foreign writer; format_version is how the
    # format grows, so guessing past an unknown field could hide a changed meaning.
    unknown = sorted(value.keys() - fields - optional)
    if unknown:
        raise ManifestError(f"{what} has unknown field(s) {', '.join(unknown)}")
    return value


def clocks_field(value: object, names: tuple[str, ...], what: str) -> dict[str, float]:
    if not isinstance(value, Mapping):
        raise ManifestError(f"{what} clocks must be an object, not {type(value).__name__}")
    if set(value.keys()) != set(names):
        raise ManifestError(
            f"{what} clocks are {sorted(value.keys())}; expected exactly {list(names)}"
        )
    clocks: dict[str, float] = {}
    for name in names:
        raw = value[name]
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise ManifestError(f"{what} clock {name!r} must be a number of unix seconds")
        if not 0 <= raw <= MAX_CLOCK:  # (compared before float(): 10**400 is no float)
            raise ManifestError(f"{what} clock {name!r} is {shown(raw)}; it must be a unix time "
                                f"from 0 to {MAX_CLOCK:.0f}")
        number = float(raw)
        clocks[name] = number
    return clocks


def load_json(data: bytes, what: str) -> object:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestError(f"{what} is not valid JSON: {exc}") from exc
    except RecursionError:
        # Arrays nested a few thousand deep exhaust the decoder's stack: what a hostile
        # writer at the destination leaves; every reader must skip it, not crash on it.
        raise ManifestError(f"{what} is not valid JSON: nested too deeply") from None

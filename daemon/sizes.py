"""Sizes as an operator writes them (``"800GiB"``, ``"1.5GB"``, ``4096``) and back.

One parser for every ``*_bytes`` key of the configuration and every size a command takes, so a
size means the same thing wherever it is written; a value that is not a size is refused with a
message that says how to write one.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal, InvalidOperation, localcontext
from typing import Any

__all__ = ["GiB", "KiB", "MiB", "TiB", "as_written", "human_bytes", "parse_size"]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

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
        raise ValueError(f"{as_written(value)} is not a size; write e.g. \"800GiB\"")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value} is negative; a size must be 0 or more bytes")
        if value > _MAX_SIZE:
            raise ValueError(f"{value} is too large for a size (at most 2^63-1 bytes)")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{as_written(value)} is not a size; write e.g. \"800GiB\"")
    match = _SIZE_RE.match(value)
    number_text = match.group(1) if match else ""
    if not match or not any(ch.isdigit() for ch in number_text):
        raise ValueError(f"{as_written(value)} is not a size; write e.g. \"800GiB\"")
    unit = match.group(2)
    if unit not in _SIZE_UNITS:
        raise ValueError(
            f"{as_written(value)} is not a size; write e.g. \"800GiB\" (units: B, KiB, MiB, GiB, "
            "TiB, KB, MB, GB, TB)"
        )
    try:
        number = Decimal(number_text.replace("_", ""))
    except InvalidOperation:
        raise ValueError(f"{as_written(value)} is not a size; write e.g. \"800GiB\"") from None
    if number < 0:
        raise ValueError(f"{as_written(value)} is negative; a size must be 0 or more bytes")
    if number.adjusted() > 30:
        raise ValueError(f"{as_written(value)} is too large for a size (at most 2^63-1 bytes)")
    with localcontext() as ctx:
        ctx.prec = 80  # exact for any number that passed the check above
        total = number * _SIZE_UNITS[unit]
    if total > _MAX_SIZE:
        # Checked before int(): "1e999999999" must not build a billion-digit integer.
        raise ValueError(f"{as_written(value)} is too large for a size (at most 2^63-1 bytes)")
    if total != total.to_integral_value():
        raise ValueError(f"{as_written(value)} is not a whole number of bytes")
    return int(total)


def as_written(value: Any) -> str:
    """A value as the operator wrote it: strings in double quotes, like TOML."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def human_bytes(value: Any) -> str:
    if not isinstance(value, int):
        return str(value)
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value >= size and value % size == 0:
            return f"{value // size}{unit}"
    return f"{value}B"


def human_amount(n: float) -> str:
    """``n`` bytes as a person reads them: ``512 B``, ``16.0 KiB``, ``1.5 GiB`` (a rate adds
    ``/s``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"

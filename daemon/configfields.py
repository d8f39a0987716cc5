"""The field types and the model settings every configuration section shares.

Apart from config.py so that the sections kept in other modules (configdestination.py) and
config.py itself build on the same strict, frozen settings and the same size and path parsing
without importing one another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError

from ckptdrain.daemon.sizes import as_written, parse_size

__all__ = ["MODEL_CONFIG", "AbsPath", "ByteSize", "cross_field"]


def _path(value: Any) -> Any:
    if isinstance(value, str):
        if not value:
            raise ValueError("is empty; give an absolute path")
        if "\0" in value:  # no path holds one: the first system call would raise ValueError
            raise ValueError(f"{as_written(value)} holds a NUL character; give an absolute path")
        try:
            return Path(value).expanduser()
        except RuntimeError:  # "~nosuchuser/...", or "~" with neither $HOME nor a passwd entry
            head = value.split("/", 1)[0]
            raise ValueError(f"{as_written(value)}: {head!r} names no home directory here; give "
                             "an absolute path") from None
    return value


ByteSize = Annotated[int, BeforeValidator(parse_size)]
AbsPath = Annotated[Path, BeforeValidator(_path)]

# No float setting means anything as inf or nan (an infinite poll interval polls never).
MODEL_CONFIG = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def cross_field(field: str, message: str) -> PydanticCustomError:
    # The field name rides in ctx so the error is reported against the right dotted key.
    return PydanticCustomError("cross_field", message, {"field": field})

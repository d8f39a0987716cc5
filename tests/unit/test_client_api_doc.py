"""docs/client-api.md names every public name of ckptdrain.client and every public member of
Client and Generation (with each argument of Client.generation): the reference cannot fall
behind the code."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import ckptdrain.client as api
from ckptdrain.client import Client, Generation

DOC = (Path(__file__).resolve().parents[2] / "docs" / "client-api.md").read_text()


def public_members(cls: type) -> list[str]:
    return [n for n, v in vars(cls).items()
            if not n.startswith("_") and (callable(v) or isinstance(v, property))]


def test_every_public_name_is_documented() -> None:
    missing = [n for n in api.__all__ if not re.search(rf"`{n}\b", DOC)]
    assert missing == [], missing


def test_every_member_and_argument_is_documented() -> None:
    for cls in (Client, Generation):
        missing = [m for m in public_members(cls) if f"`{m}" not in DOC]
        assert missing == [], (cls.__name__, missing)
    for name in inspect.signature(Client.generation).parameters:
        if name != "self":
            assert f"`{name}`" in DOC, name
    for name in inspect.signature(Client).parameters:
        assert name in DOC, name

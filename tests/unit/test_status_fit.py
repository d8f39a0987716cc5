"""status replies fit one wire frame whatever the lists in them hold."""

from __future__ import annotations

import json
from typing import Any

from ckptdrain.client import wire
from ckptdrain.daemon.status import REPLY_BYTES, _fit


def test_long_paths_in_every_list_still_fit_one_frame() -> None:
    path = "p/" * 500  # a 1,000-byte shard path, within the names' limit
    reply = {
        "node_id": "n",
        "uploads_open": [{"job": "j", "path": path, "upload_id": "u" * 100} for _ in range(50)],
        "uploads_open_count": 50,
        "shards_draining": [{"job": "j", "path": path, "size": 1} for _ in range(32)],
        "generations": [{"job": "j" * 128, "step": i, "error": "\U0001F600" * 300}
                        for i in range(100)],
        "generations_omitted": 0,
    }
    assert len(json.dumps(reply, ensure_ascii=False).encode()) > 3 * wire.MAX_HEADER_BYTES
    fitted = _fit(reply, {})
    size = len(wire.encode_message("ok", fitted))
    assert size <= wire.MAX_HEADER_BYTES + wire.PREFIX_BYTES
    assert len(json.dumps(fitted, ensure_ascii=False).encode()) <= REPLY_BYTES
    # Generations are cut last, and counted.
    assert fitted["uploads_open"] == [] and fitted["shards_draining"] == []
    assert fitted["generations"] and fitted["generations_omitted"] == 100 - len(fitted["generations"])


def test_a_small_reply_is_left_whole() -> None:
    reply = {"uploads_open": [{"a": 1}], "shards_draining": [{"b": 2}],
             "generations": [{"c": 3}], "generations_omitted": 0}
    assert _fit(dict(reply), {}) == reply


def test_a_list_measured_before_fit_is_cut_as_one_measured_there() -> None:
    """status encodes the generations it picked once, as a list; _fit takes that size
    instead of encoding the list again, and cuts exactly as it would have."""
    def reply() -> dict[str, Any]:
        return {"node_id": "n", "uploads_open": [], "shards_draining": [],
                "generations": [{"job": "j" * 100, "step": i, "error": "e" * (500 + i)}
                                for i in range(150)],
                "generations_omitted": 0}

    measured = reply()
    size = len(json.dumps(measured["generations"], ensure_ascii=False).encode())
    assert _fit(measured, {"generations": size}) == _fit(reply(), {})
    assert measured["generations_omitted"] > 0

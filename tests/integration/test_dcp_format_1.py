"""DrainReader loads a generation whose manifest is format 1 (sha256), as a version before
CRC64NVME committed it: from this node's checked local copy, then from the destination."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import pytest

from ckptdrain.client.keys import manifest_key, shard_key
from ckptdrain.client.manifest import Manifest
from tests.conftest import DaemonProcess
from tests.integration.test_dcp import compare
from tests.integration.test_dcp_reader import JOB, load, save, saved_state, staged_files

pytestmark = pytest.mark.torch


def as_format_1(daemon: DaemonProcess, step: int) -> None:
    key = daemon.dest / manifest_key(JOB, step)
    body = json.loads(key.read_bytes())
    for shard in body["shards"]:
        path = daemon.dest / shard_key(JOB, step, shard["path"])
        shard["checksum"] = f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
        os.setxattr(path, "user.ckptdrain.checksum", shard["checksum"].encode())
    body["format_version"] = 1
    manifest = Manifest.from_json(json.dumps(body).encode())
    assert manifest.format_version == 1
    key.write_bytes(manifest.to_json())


def test_a_format_1_generation_loads_from_the_local_copy_and_the_destination(
        make_daemon: Any) -> None:
    daemon: DaemonProcess = make_daemon()
    save(daemon, 8, seed=8)
    as_format_1(daemon, 8)
    loaded, sources = load(daemon)
    assert compare(saved_state(8), loaded) == 7
    assert sources == {".metadata": "local", "__0_0.distcp": "local"}
    for path in staged_files(daemon):
        path.unlink()
    loaded, sources = load(daemon, step=8)
    assert compare(saved_state(8), loaded) == 7
    assert set(sources.values()) == {"destination"}

"""The client is imported by training code: it must load with the standard library alone."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("pydantic", "aiobotocore", "botocore", "aiohttp", "prometheus_client", "uvloop",
         "aiofiles", "torch", "ckptdrain.daemon")


def test_client_imports_only_the_standard_library() -> None:
    code = (
        "import sys, json\n"
        "import ckptdrain.client, ckptdrain.client.wire, ckptdrain.client.manifest\n"
        "from ckptdrain.client import Client\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    offenders = sorted(m for m in loaded if m.split(".")[0] in HEAVY or m.startswith("ckptdrain.daemon"))
    assert offenders == []
    # Everything else loaded is the standard library or ckptdrain.client itself.
    third_party = sorted(
        m for m in loaded
        if m.split(".")[0] not in sys.stdlib_module_names
        and not m.startswith("ckptdrain")
        and m.split(".")[0] != "__main__" and not m.startswith(("__editable__", "_distutils_hack"))
    )
    assert third_party == []

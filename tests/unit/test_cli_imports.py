"""What a command loads before it runs: loading is most of a short command's time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _loaded_by(argv: list[str], tmp_path: Path) -> set[str]:
    code = (
        "import json, sys\n"
        "from ckptdrain.daemon.cli import main\n"
        f"code = main({argv!r})\n"
        "print(json.dumps([code, sorted(sys.modules)]))\n"
    )
    env = {"PATH": "/usr/bin:/bin", "XDG_STATE_HOME": str(tmp_path / "state"),
           "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=env, cwd=tmp_path)
    code_seen, modules = json.loads(out.stdout.splitlines()[-1])
    assert code_seen == 0, out
    return set(modules)


@pytest.mark.parametrize("argv", [["ls", "DEST"], ["gc", "--dry-run", "DEST"]],
                         ids=["ls", "gc"])
def test_commands_that_checksum_nothing_do_not_load_the_checksum_library(
    argv: list[str], tmp_path: Path
) -> None:
    # awscrt takes ~70 ms to load (its TLS library gathers CPU jitter entropy at load), a
    # fifth of `ckptdrain ls`; it was loaded by every command, through the error types the
    # CLI catches (startup -> staging -> checksums).
    dest = tmp_path / "dest"
    dest.mkdir()
    loaded = _loaded_by([f"file://{dest}" if a == "DEST" else a for a in argv], tmp_path)
    assert "ckptdrain.daemon.checksums" in loaded  # the code is there, the library is not
    assert not {m for m in loaded if m.split(".")[0] in ("awscrt", "_awscrt")}


def test_a_command_that_checksums_loads_it_when_it_first_checksums(tmp_path: Path) -> None:
    from ckptdrain.daemon import checksums

    assert checksums.of_bytes(b"abc").startswith("crc64nvme:")
    assert checksums.crt() is sys.modules["awscrt.checksums"]

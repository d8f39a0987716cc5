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


def _committed(tmp_path: Path) -> Path:
    """A file:// destination holding generation 100 of test_catalog's job."""
    import asyncio

    from ckptdrain.daemon.backends.posix import PosixBackend, ReadSettings
    from tests.functional.test_catalog import commit

    dest = tmp_path / "dest"
    dest.mkdir()

    async def make() -> None:
        backend = PosixBackend(ReadSettings(f"file://{dest}", dest), "gpu1")
        try:
            await commit(backend, tmp_path, 100)
        finally:
            await backend.aclose()

    asyncio.run(make())
    return dest


@pytest.mark.parametrize("command", ["ls", "verify", "restore"])
def test_reading_a_file_destination_loads_no_configuration(command: str, tmp_path: Path) -> None:
    # pydantic and the configuration's models were two thirds of `ckptdrain restore`'s
    # start-up (70 of 110 ms), which at 1 GiB made it 0.63 x `cp -r`; nothing in the
    # configuration changes how a directory is read.
    from tests.functional.test_catalog import JOB

    uri = f"file://{_committed(tmp_path)}"
    argv = {"ls": ["ls", uri],
            "verify": ["verify", uri, "--job", JOB, "--generation", "latest"],
            "restore": ["restore", uri, "--job", JOB, "--to", str(tmp_path / "out")]}[command]
    loaded = _loaded_by(argv, tmp_path)
    assert "ckptdrain.daemon.backends.posix" in loaded  # it did read the destination
    assert not {m for m in loaded if m.split(".")[0] in ("pydantic", "pydantic_core")}
    assert "ckptdrain.daemon.config" not in loaded
    if command == "restore":
        assert (tmp_path / "out" / "MANIFEST.json").is_file()


@pytest.mark.parametrize("named", ["--config", "CKPTDRAIN_CONFIG", "a section key"])
def test_a_configuration_named_for_a_file_destination_is_still_checked(
    named: str, tmp_path: Path
) -> None:
    # Named, it is read as before: a broken one is the operator's to hear about (exit 78).
    uri = f"file://{_committed(tmp_path)}"
    bad = tmp_path / "bad.toml"
    bad.write_text("[limits]\nmax_staged_bytes = 0\n")
    env = {"PATH": "/usr/bin:/bin", "XDG_STATE_HOME": str(tmp_path / "state"),
           "XDG_RUNTIME_DIR": str(tmp_path / "run")}
    argv = [sys.executable, "-m", "ckptdrain.daemon.cli", "ls", uri]
    if named == "--config":
        argv += ["--config", str(bad)]
    elif named == "CKPTDRAIN_CONFIG":
        env["CKPTDRAIN_CONFIG"] = str(bad)
    else:
        env["CKPTDRAIN_LIMITS__MAX_STAGD_BYTES"] = "1"  # a typo is an error, as for any command
    out = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=60)
    assert out.returncode == 78, out
    assert "MAX_STAGED_BYTES" in out.stderr.upper() and "Traceback" not in out.stderr

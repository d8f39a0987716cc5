"""Packaging that meets its users: ``pip install ckptdrain`` is the stdlib-only client with no
dependencies (a training image keeps its own boto3), ``ckptdrain[daemon]`` adds the daemon's,
and the CLI says which to install when they are missing. The wheel is built from a copy of
this tree and installed into a fresh venv of the system Python, offline."""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptdrain.daemon.cli import DAEMON_DEPENDENCIES

ROOT = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = shutil.which("python3.11", path="/usr/bin") or shutil.which("python3",
                                                                              path="/usr/bin")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("client", "daemon"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel",
                    "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
                   check=True, capture_output=True, timeout=300)
    [built] = out.glob("ckptdrain-*.whl")
    return built


def test_the_wheel_requires_nothing_without_an_extra(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        [meta] = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(zf.read(meta))
    requires = metadata.get_all("Requires-Dist") or []
    assert requires, "the daemon extra is declared"
    unconditional = [r for r in requires if "extra ==" not in r]
    assert unconditional == [], unconditional
    daemon = {r.split(";")[0].split("=")[0].split(">")[0].strip().lower().replace("-", "_")
              for r in requires if 'extra == "daemon"' in r}
    assert set(DAEMON_DEPENDENCIES) <= daemon | {"prometheus_client"}, daemon
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    # `make test` / `make demo` install '.[test]': it must bring the daemon with it.
    assert "ckptdrain[daemon]" in extras["test"]


@pytest.fixture(scope="module")
def client_only(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    if SYSTEM_PYTHON is None:
        pytest.skip("no /usr/bin/python3 to make a clean venv with")
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", str(venv)], check=True, timeout=300)
    subprocess.run([str(venv / "bin" / "pip"), "--disable-pip-version-check", "-q", "install",
                    "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    yield venv


def clean_env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8"}


def test_the_client_alone_works_with_the_standard_library(client_only: Path,
                                                          tmp_path: Path) -> None:
    freeze = subprocess.run([str(client_only / "bin" / "pip"), "freeze", "--all"],
                            capture_output=True, text=True, check=True, env=clean_env()).stdout
    installed = {line.split("==")[0].split(" @ ")[0].strip().lower()
                 for line in freeze.splitlines() if line.strip()}
    assert installed - {"pip", "setuptools", "wheel"} == {"ckptdrain"}, installed
    probe = (
        "from ckptdrain.client import Client, DaemonUnavailable\n"
        f"c = Client({str(tmp_path / 'none.sock')!r}, connect_timeout_s=1)\n"
        "try:\n    c.status()\nexcept DaemonUnavailable as e:\n    print('unavailable:', e.message)\n"
    )
    out = subprocess.run([str(client_only / "bin" / "python"), "-c", probe], capture_output=True,
                         text=True, env=clean_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("unavailable:")


def test_the_cli_names_the_extra_when_the_daemon_deps_are_missing(client_only: Path) -> None:
    out = subprocess.run([str(client_only / "bin" / "ckptdrain"), "status"], capture_output=True,
                         text=True, env=clean_env(), timeout=60)
    assert out.returncode == 78, out.stderr
    assert "Traceback" not in out.stderr
    [line] = out.stderr.splitlines()
    assert "pip install 'ckptdrain[daemon]'" in line and "pydantic" in line
    # The sizing worksheet needs nothing else.
    plan = subprocess.run([str(client_only / "bin" / "ckptdrain"), "plan", "--help"],
                          capture_output=True, text=True, env=clean_env(), timeout=60)
    assert plan.returncode == 0, plan.stderr
